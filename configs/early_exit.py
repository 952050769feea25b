"""Early exit (CALM, Schuster et al. 2022; seed 000 §2.5): an 8-layer GPT with exit points after
layers 2, 4 and 6, where tokens whose prediction is confident enough stop.

A few minutes on two CPU cores. Until step 100 the exits only learn (their weighted losses);
then tokens exit. metrics.jsonl shows, per exit point, the share of tokens that exit there
(`early_exit/exited`), its loss and mean confidence, and per layer the share of tokens it
computed (`early_exit/processed`); events.jsonl shows the policy shrinking each later layer's
token bucket (a background recompile each), and layer_costs.jsonl the layers getting cheaper.
On a pipeline (exit points in every stage; the balancer moves layers as they get cheaper):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m dynjax.train \\
        --config configs/early_exit.py --config.mesh.stage=4 --config.mesh.data=2 \\
        --config.balance.enabled=True --config.pipeline.profile_every=10 --config.balance.every=20
"""

from dynjax.config import default_config


def get_config():
    c = default_config()
    c.model.num_layers = 8
    c.data.seq_len = 256
    c.train.batch_size = 8
    c.train.steps = 300
    c.train.log_every = 20
    c.early_exit.enabled = True
    c.early_exit.first = 2
    c.early_exit.every = 2
    c.early_exit.threshold = 0.4
    c.early_exit.start_step = 100
    return c
