"""Small dense GPT on the embedded corpus: about a minute on two CPU cores; loss visibly falls."""

from dynjax.config import default_config


def get_config():
    c = default_config()
    c.train.steps = 300
    c.train.batch_size = 16
    c.train.learning_rate = 3e-3
    c.train.log_every = 20
    c.train.eval_every = 100
    c.train.checkpoint_every = 100
    c.data.seq_len = 128
    c.model.num_layers = 4
    c.model.d_model = 128
    c.model.num_heads = 4
    c.model.mlp_dim = 512
    return c
