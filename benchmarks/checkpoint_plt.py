"""Proportion of lost tokens (PLT, seed 004 eq. 7) after 1, 2 and 4 injected faults, with a
fixed K and with dynamic K (§5.3), on a tiny 16-expert model trained on CPU.

One run per setting trains the config from scratch with partial expert checkpoints (K = 1 of 16
experts per MoE layer at the start, sequential selection, a save every step) and is interrupted
after each step of ``--faults`` (a fault: the loop stops at once, as if the process died), and
resumed from its workdir each time. Eq. 7 divides the tokens lost by all faults by the tokens
the whole training routes, ``L * I * k``, the same for every trajectory (routed pairs before
capacity drops: ``steps * batch * seq * top_k`` per MoE layer); the first n faults of the run
are those of a run with only those n faults (same seed, same batches until the next fault), so
the PLT of n faults is their lost tokens over that total. The last row checks it against the
run's own ``checkpoint/plt`` at the end of training. Between faults an expert waits E/K saves
for its next copy: the paper's training runs thousands of steps per fault, this one 50, so a
fault costs more here; the shape to compare is Fig. 15b's: with a fixed K PLT grows with every
fault, dynamic K doubles K after a recovery above ``checkpoint.plt_limit`` (3.75%) and the later
faults lose less.

    PYTHONPATH=. python3 benchmarks/checkpoint_plt.py [--steps 200 --faults 50,100,140,180]
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

from dynjax.config import default_config
from dynjax.recompile import Monitor
from dynjax.train import train
from dynjax.writers import read_jsonl

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "data" / "corpus.txt"


class Fault(Exception):
    """The injected fault: raised from the loop once the chosen step is dispatched."""


def config(steps: int, dynamic_k: bool):
    c = default_config()
    c.train.steps, c.train.batch_size, c.train.warmup_steps = steps, 8, 4
    c.train.log_every, c.train.eval_every, c.train.checkpoint_every = 10, 10_000, 1
    c.data.path, c.data.seq_len, c.data.max_tokens = str(CORPUS), 32, 200_000
    c.model.num_layers, c.model.d_model, c.model.num_heads, c.model.mlp_dim = 4, 32, 2, 64
    c.moe.every, c.moe.num_experts, c.moe.top_k = 2, 16, 2  # MoE layers 1 and 3
    c.checkpoint.async_save = False
    c.checkpoint.experts_per_save = 1
    c.checkpoint.dynamic_k = dynamic_k
    return c


def run(steps: int, faults: list[int], dynamic_k: bool, workdir: Path) -> dict:
    """Train with a fault after each step of ``faults``; the recoveries and the final PLT."""
    push = Monitor.push
    for fault in [*faults, None]:

        def push_or_fail(self, step, metrics, fault=fault):
            push(self, step, metrics)
            if step + 1 == fault:
                raise Fault(step + 1)

        Monitor.push = push_or_fail
        try:
            train(config(steps, dynamic_k), workdir, progress=False)
        except Fault:
            pass
        finally:
            Monitor.push = push
    events = read_jsonl(workdir / "events.jsonl")
    events = [e for e in events if e["event"] == "checkpoint_recovery"]
    last = [r for r in read_jsonl(workdir / "metrics.jsonl") if "loss" in r][-1]  # not eval
    return {"recoveries": events, "final_plt": last["checkpoint/plt"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--faults", default="50,100,140,180", help="steps a fault hits after")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    faults = [int(f) for f in args.faults.split(",")]
    c = config(args.steps, False)
    moe_layers = c.model.num_layers // c.moe.every
    routed = args.steps * c.train.batch_size * c.data.seq_len * c.moe.top_k * moe_layers
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for dynamic in (False, True):
            results[dynamic] = run(args.steps, faults, dynamic, Path(tmp) / str(dynamic))
    print(
        f"PLT (eq. 7) of a training with n faults: 16 experts, K = 1 at the start, a save every "
        f"step, {args.steps} steps, faults after steps {faults}, plt_limit 0.0375"
    )
    print(f"{'faults':>6} | {'fixed K: PLT':>12} {'K after':>7} | {'dynamic K: PLT':>14} "
          f"{'K after':>7} | dynamic / fixed")
    plt = {}
    for n in range(1, len(faults) + 1):
        for d in (False, True):
            lost = sum(r["lost_tokens"] for r in results[d]["recoveries"][:n])
            plt[d] = (lost / routed, results[d]["recoveries"][n - 1]["experts_per_save"])
        print(f"{n:>6} | {plt[False][0]:>12.4f} {plt[False][1]:>7} | {plt[True][0]:>14.4f} "
              f"{plt[True][1]:>7} | {plt[True][0] / plt[False][0]:.2f}")
    print(f"{'logged':>6} | {results[False]['final_plt']:>12.4f} {'':>7} | "
          f"{results[True]['final_plt']:>14.4f} {'':>7} | (checkpoint/plt at step {args.steps})")


if __name__ == "__main__":
    main()
