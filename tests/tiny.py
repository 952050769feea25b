"""A model and run small enough for a test on two CPU cores; also a config file for the CLI.

``python -m dynjax.train --config tests/tiny.py --config.moe.every=2`` runs it as a subprocess.
"""

from pathlib import Path

from dynjax.config import default_config
from dynjax.dynamism import BUILTIN

# The tests' corpus, pinned: the default (the running interpreter's standard library) differs by
# Python version, and so would every loss a test compares. See data/README.md.
CORPUS = Path(__file__).parent / "data" / "corpus.txt"


def tiny_config(schemes=BUILTIN, **overrides):
    """The tiny config (with a section per scheme of ``schemes``) and ``section__key=value``
    overrides."""
    c = default_config(schemes)
    c.train.steps = 12
    c.train.batch_size = 8
    c.train.learning_rate = 3e-3
    c.train.warmup_steps = 2
    c.train.log_every = 1
    c.train.eval_every = 6
    c.train.eval_batches = 1
    c.train.checkpoint_every = 6
    c.data.path = str(CORPUS)
    c.data.seq_len = 32
    c.data.max_tokens = 200_000  # the whole of CORPUS
    c.model.num_layers = 2
    c.model.d_model = 32
    c.model.num_heads = 2
    c.model.mlp_dim = 64
    c.moe.num_experts = 4
    c.moe.top_k = 2
    # The suite's MoE tests were written against the static path (compiles per capacity
    # change, slot-padded costs); the ragged path (the library default) has its own tests,
    # which set moe.dispatch="ragged"
    c.moe.dispatch = "static"
    c.checkpoint.async_save = False
    for dotted, value in overrides.items():
        node = c
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return c


def dotted_config(overrides: dict):
    """`tiny_config` with the command line's ``section.key`` overrides (the multi-process
    tests pass the same dict to both)."""
    return tiny_config(**{k.replace(".", "__"): v for k, v in overrides.items()})


def get_config():
    return tiny_config()
