"""Small dense GPT on the embedded corpus: about a minute on two CPU cores; loss visibly falls.

The model (4 layers, d_model 128, 4 heads, byte vocabulary) and batch (16 x 128 tokens) are the
defaults of ``dynjax/config.py``; this file only sets the run length and cadence.
"""

from dynjax.config import default_config


def get_config():
    c = default_config()
    c.train.steps = 300
    c.train.log_every = 20
    return c
