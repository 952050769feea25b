"""Decoding tokens/s with and without early exit (`dynjax.model.decode`; CALM, Schuster et al.
2022), on one small model, in one process.

The model is randomly initialised (its LM head scaled up, so confidences spread out as a
trained model's do) with exit points after layers ``--first``, ``--first + --every``, ...; the
threshold is the ``--exit-share`` quantile of the first exit point's confidences on a random
sequence, so about that share of tokens leaves there (and some of the rest at later points).
What it measures is the decoder: how much a step saves when it skips the layers no token
needs, against the same model decoded at full depth, not a trained model's exit rate. Each
setting generates ``--new`` tokens greedily after a ``--prompt``-token prompt (batch 1),
compiled first, then timed in interleaved rounds (the machine is shared): medians.

    PYTHONPATH=. python3 benchmarks/generate.py [--layers 8 --d-model 256 --new 256 --rounds 5]
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dynjax.model import GPT, GPTConfig, fresh_params
from dynjax.model import early_exit as ee
from dynjax.model.decode import Decoder, mean_depth
from dynjax.model.hooks import Hooks, layer_options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--first", type=int, default=2, help="the first exit point's layer")
    parser.add_argument("--every", type=int, default=2, help="layers between exit points")
    parser.add_argument("--exit-share", type=float, default=0.5,
                        help="about this share of tokens exits at the first point")
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new", type=int, default=256, help="new tokens per generation")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    cfg = GPTConfig(vocab_size=args.vocab, num_layers=args.layers, d_model=args.d_model,
                    num_heads=args.heads, mlp_dim=4 * args.d_model,
                    max_len=args.prompt + args.new, hooks=Hooks((ee.HOOKS,)))
    params = fresh_params(cfg, 0)
    params["head"]["kernel"] = params["head"]["kernel"] * 30.0
    model = nnx.merge(nnx.graphdef(GPT(cfg, rngs=nnx.Rngs(0))), params)
    rng = np.random.default_rng(0)
    probe = jnp.asarray(rng.integers(0, args.vocab, (1, 64)), jnp.int32)
    x = model.embed(probe)
    for block in list(model.layers)[: args.first]:
        x = block(x)[0]
    conf = np.asarray(jnp.max(jax.nn.softmax(model.readout(x), -1), -1))
    threshold = float(np.quantile(conf, 1 - args.exit_share))
    points = range(args.first - 1, args.layers - 1, args.every)
    options = [
        layer_options({ee.NAME: ee.ExitLayer(
            cfg.max_len, 0.5 if i in points else 0.0, "softmax_max", threshold, active=True
        )}) if i >= args.first - 1 else ()
        for i in range(args.layers)
    ]
    decoders = {
        "full depth": Decoder(cfg, options, exits=False),
        "early exit": Decoder(cfg, options),
    }
    prompt = rng.integers(0, args.vocab, (1, args.prompt)).astype(np.int32)
    run = lambda d: d.generate(params, prompt, max_new_tokens=args.new)
    depths = {name: mean_depth(run(d)) for name, d in decoders.items()}  # compiles
    rates: dict[str, list[float]] = {name: [] for name in decoders}
    for _ in range(args.rounds):
        for name, d in decoders.items():
            rates[name].append(args.new / run(d).seconds)
    full = statistics.median(rates["full depth"])
    print(f"\ngreedy decoding, {args.layers} layers x d_model {args.d_model}, exit points after "
          f"layers {[p + 1 for p in points]}, batch 1, {args.prompt}-token prompt + {args.new} "
          f"new; tokens/s median of {args.rounds} rounds ({jax.devices()[0].platform})")
    print(f"{'decoder':<14}{'mean layers':>12}{'tokens/s':>11}{'vs full':>9}")
    for name in decoders:
        rate = statistics.median(rates[name])
        print(f"{name:<14}{depths[name]:>12.2f}{rate:>11,.0f}{rate / full:>8.2f}x")


if __name__ == "__main__":
    main()
