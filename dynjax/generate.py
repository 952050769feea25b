"""``python -m dynjax.generate --workdir W --prompt TEXT [--max-new-tokens N --temperature T
--top-p P --seed S]``: continue a prompt with a run's newest trained parameters
(docs/models.md#generation).

The run is opened as training or an export opens it (its ``config.py`` or ``config.json``, the
newest checkpoint and its Plan, `dynjax.train.newest_checkpoint`), so the layer options under
that Plan decide how each scheme decodes (`dynjax.model.decode`). The prompt is encoded as the
run's data is (`dynjax.data.text_codec`: ``data.tokenizer``, else UTF-8 bytes); the
continuation, cut at the tokenizer's end-of-text token, goes to stdout, the timing to stderr.
A model with exit points is also timed at full depth, for its mean exit layer against it.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from pathlib import Path

import jax
import numpy as np

from dynjax.data import TokenizerSpec, text_codec
from dynjax.errors import ConfigError
from dynjax.hf.convert import workdir_config
from dynjax.model.decode import Decoder, mean_depth
from dynjax.model.early_exit import NAME as EXIT
from dynjax.train import newest_checkpoint

ROUNDS = 5  # timed runs of each decoder when early exit is compared with full depth


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse bad input before any work, naming the flag and the fix."""
    if not Path(args.workdir).is_dir():
        raise ConfigError(f"--workdir={args.workdir}: no such directory; give the workdir of a "
                          "training run")
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens={args.max_new_tokens} must be >= 1")
    if not args.temperature >= 0:  # NaN too
        raise ConfigError(f"--temperature={args.temperature} must be >= 0 (0: greedy)")
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p={args.top_p} must be in (0, 1] (1: no nucleus cut)")


def generate(args: argparse.Namespace) -> tuple[str, list[str]]:
    """(the continuation, the report's lines) of ``args`` (`main`'s flags)."""
    check_arguments(args)
    workdir = Path(args.workdir)
    cfg, schemes = workdir_config(workdir)
    with contextlib.redirect_stdout(sys.stderr):  # the restore's messages are not the text
        params, plan, exp = newest_checkpoint(cfg, workdir, schemes)
    if plan.stage_layers:  # a pipeline's stages sit on their own sub-meshes: gather them
        params = jax.device_get(params)
    data = exp.settings.data
    codec = text_codec(data.path, TokenizerSpec(data.tokenizer, data.eos_token, data.token_cache))
    prompt = codec.encode(args.prompt)
    if not prompt:
        raise ConfigError("--prompt encodes to no tokens: give some text to continue")
    vocab = exp.model_cfg.vocab_size
    if max(prompt) >= vocab:
        raise ConfigError(f"--prompt holds token {max(prompt)}, past the model's vocabulary "
                          f"(model.vocab_size={vocab}): use only text the run's data had")
    options = exp.layer_options(plan)
    decoder = Decoder(exp.model_cfg, options)
    run = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
               top_p=args.top_p, seed=args.seed)
    # with exits, both decoders are timed as the median of a few runs: one is too short to tell
    rounds = ROUNDS if decoder.spec.exits else 1
    out = decoder.generate(params, np.asarray([prompt]), **run, rounds=rounds)
    tokens = out.tokens[0].tolist()
    if codec.eos is not None and codec.eos in tokens:
        tokens = tokens[: tokens.index(codec.eos)]
    n, layers = args.max_new_tokens, exp.model_cfg.num_layers
    lines = [f"{n} new tokens in {out.seconds:.3f} s: {n / out.seconds:.1f} tokens/s "
             f"(prompt {len(prompt)} tokens)"]
    if decoder.spec.exits:
        full = Decoder(exp.model_cfg, options, exits=False).generate(
            params, np.asarray([prompt]), **run, rounds=ROUNDS
        )
        depth = mean_depth(out)
        exit_layer = "n/a (one new token)" if math.isnan(depth) else f"{depth:.2f}"
        lines.append(
            f"early exit: mean exit layer {exit_layer} of {layers}; {n / out.seconds:.1f} "
            f"tokens/s against {n / full.seconds:.1f} at full depth "
            f"({full.seconds / out.seconds:.2f}x, medians of {ROUNDS} runs)"
        )
    elif any(name == EXIT for opts in options for name, _ in opts):
        lines.append("early exit: no exit point is active at this checkpoint (before "
                     "early_exit.start_step): every token ran all layers")
    return codec.decode(tokens), lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dynjax.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, help="a training run's directory")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="nucleus sampling: draw from the most likely tokens holding this "
                        "much probability (1: all)")
    parser.add_argument("--seed", type=int, default=0, help="the sampling's random seed")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        text, lines = generate(args)
    except (ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(text)
    for line in lines:
        print(line, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
