"""Hash-based sparse attention against dense causal attention (seed 000 §2.4; Pagliardini et al.
2023 report 2.0x at 8k tokens with no perplexity loss).

Table 1, one attention layer (projections, RoPE, attention, output) forward + backward at
``--seq`` tokens on CPU: for 8 and 16 buckets, the budget the policy would pick from this
layer's own needed-block counts (overflow <= 1%, no headroom), that budget's share of key
blocks, the needed (query block, key block) pair fraction, the compiled FLOPs from
``cost_analysis()`` and the time (median of ``--rounds``) against dense causal attention.

Table 2, training ``configs/sparse_attention.py`` at ``--seq`` tokens for ``--steps`` steps with
the plugin on (budgets from its policy) and off: tokens/s (median of the run's logged
intervals), final train loss and eval loss.

    PYTHONPATH=. python3 benchmarks/sparse_attention.py [--seq 2048 --steps 80]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dynjax.config import load_config
from dynjax.dynamism.histograms import smallest_budget
from dynjax.dynamism.sparse_attention import bucket_budget
from dynjax.model.attention import CausalSelfAttention
from dynjax.model.hashed_attention import NEEDED_HIST, PAIR_FRACTION, HashedAttention
from dynjax.train import train
from dynjax.writers import read_jsonl


def layer_table(seq: int, block: int, rounds: int, batch: int = 2, d: int = 128) -> None:
    attn = CausalSelfAttention(d, 4, rope=True, out_std=0.02, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(attn)
    x = jax.random.normal(jax.random.key(1), (batch, seq, d))
    nb = seq // block

    def program(hashed):
        def loss(params, x):
            y, metrics = nnx.merge(graphdef, params)(x, hashed=hashed)
            return jnp.sum(y**2), metrics
        return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))

    def timed(fn):
        jax.block_until_ready(fn(params, x))
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(params, x))
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    dense = program(None)
    base_flops = dense.lower(params, x).compile().cost_analysis()["flops"]
    base_time = timed(dense)
    print(f"\nattention layer forward + backward, batch {batch} x {seq} tokens, d_model {d}, "
          f"4 heads, blocks of {block} ({jax.devices()[0].platform}, median of {rounds})")
    print(f"{'attention':<22}{'budget':>8}{'pairs':>8}{'FLOPs':>8}{'time ms':>9}{'speedup':>9}")
    print(f"{'dense causal':<22}{nb:>5}/{nb:<2}{1.0:>8.3f}{1.0:>8.3f}{1e3 * base_time:>9.1f}"
          f"{1.0:>8.2f}x")
    for buckets in (8, 16):
        full = HashedAttention(buckets, block, nb, seed=0, layer=0)
        _, metrics = program(full)(params, x)
        budget = bucket_budget(smallest_budget(np.asarray(metrics[NEEDED_HIST]), 0.01), nb)
        hashed = program(HashedAttention(buckets, block, budget, seed=0, layer=0))
        flops = hashed.lower(params, x).compile().cost_analysis()["flops"]
        t = timed(hashed)
        print(f"{f'{buckets} buckets':<22}{budget:>5}/{nb:<2}"
              f"{float(metrics[PAIR_FRACTION]):>8.3f}{flops / base_flops:>8.3f}"
              f"{1e3 * t:>9.1f}{base_time / t:>8.2f}x")


def training_table(seq: int, steps: int) -> None:
    rows = {}
    for name, on in (("dense attention", False), ("hashed, 8 buckets", True)):
        cfg = load_config("configs/sparse_attention.py", [
            f"data.seq_len={seq}", f"train.steps={steps}", f"train.eval_every={steps}",
            "train.checkpoint_every=100000", f"sparse_attention.enabled={on}",
        ])
        with tempfile.TemporaryDirectory() as workdir:
            summary = train(cfg, workdir, progress=False)
            events = read_jsonl(f"{workdir}/events.jsonl")
        budgets = [e["new"] for e in events if e["event"] == "attention_budget"]
        rows[name] = (summary, budgets[-1] if budgets else None)
    base = rows["dense attention"][0].tokens_per_sec
    print(f"\ntraining configs/sparse_attention.py at {seq} tokens, {steps} steps")
    print(f"{'attention':<20}{'tokens/s':>10}{'speedup':>9}{'train loss':>12}{'eval loss':>11}"
          "  last budgets")
    for name, (s, budgets) in rows.items():
        print(f"{name:<20}{s.tokens_per_sec:>10,.0f}{s.tokens_per_sec / base:>8.2f}x"
              f"{s.final_loss:>12.4f}{s.eval_loss:>11.4f}  {budgets or '-'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=80, help="0 skips the training table")
    args = parser.parse_args()
    layer_table(args.seq, args.block, args.rounds)
    if args.steps:
        training_table(args.seq, args.steps)


if __name__ == "__main__":
    main()
