"""Mixture of depths (Raposo et al. 2024; seed 000 §2.6): an 8-layer GPT whose every other block
computes only the router's top 1/8 of each sequence's tokens; the others skip it.

About a minute on two CPU cores. metrics.jsonl shows, per routed layer, the mean router weight
and how well the causal predictor tells the routed tokens (`mod/predictor_accuracy`; the base
rate of always saying "skipped" is 0.875); layer_costs.jsonl the routed layers at cost 0.125.
The eval loss routes by that predictor (causal, as sampling would; `mod.eval_routing`). On
a pipeline the balancer sees the routed layers as that much cheaper:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m dynjax.train \\
        --config configs/mod.py --config.mesh.stage=4 --config.mesh.data=2 \\
        --config.balance.enabled=True
"""

from dynjax.config import default_config


def get_config():
    c = default_config()
    c.model.num_layers = 8
    c.data.seq_len = 256
    c.train.batch_size = 8
    c.train.steps = 300
    c.train.log_every = 20
    c.mod.enabled = True
    c.mod.every = 2
    c.mod.capacity = 0.125
    return c
