"""``python -m dynjax.hf import DIR --workdir W [--config FILE] [--config.a.b=v ...]`` and
``python -m dynjax.hf export --workdir W --out DIR`` (docs/models.md#hugging-face-checkpoints)."""

from __future__ import annotations

import argparse
import sys

from dynjax.errors import ConfigError
from dynjax.hf.convert import export_model, import_model

DEFAULT_BASE = "configs/finetune.py"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dynjax.hf", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    imp = commands.add_parser("import", help="a Hugging Face model directory into a workdir")
    imp.add_argument("source", help="a directory with config.json and *.safetensors")
    imp.add_argument("--workdir", required=True, help="the new run directory")
    imp.add_argument("--config", default=DEFAULT_BASE,
                     help=f"the base config the model's keys go into (default {DEFAULT_BASE})")
    exp = commands.add_parser("export", help="a workdir's newest checkpoint as a HF directory")
    exp.add_argument("--workdir", required=True)
    exp.add_argument("--out", required=True, help="the directory to write")
    known, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    overrides = []
    for arg in rest:
        if known.command != "import" or not arg.startswith("--config.") or "=" not in arg:
            parser.error(f"unrecognised argument {arg!r}: import takes --config.a.b=VALUE")
        overrides.append(arg[len("--config."):])
    try:
        if known.command == "import":
            path = import_model(known.source, known.workdir, known.config, overrides)
            print(f"imported {known.source} into {known.workdir} (step 0, {path}); fine-tune "
                  f"with: python -m dynjax.train --workdir {known.workdir}")
        else:
            out = export_model(known.workdir, known.out)
            print(f"exported the newest checkpoint of {known.workdir} to {out}")
    except (ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
