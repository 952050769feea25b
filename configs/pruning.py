"""Gradual global magnitude pruning (seed 000 §2.2, §3.2.1): a GPT pruned from dense to 80%
sparsity in five events on Zhu & Gupta's cubic schedule, the weights of all layers ranked together
so that layers end up with different densities.

About 2 minutes on two CPU cores. events.jsonl has a `prune` event per pruning step (target
sparsity, kept weights, each layer's density); metrics.jsonl the loss, which keeps falling;
layer_costs.jsonl each layer's cost (its density, seed 000 §2.2). On a pipeline, the balancer
rebalances on the profiled layer times:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m dynjax.train \\
        --config configs/pruning.py --config.mesh.stage=4 --config.mesh.data=2 \\
        --config.balance.enabled=True
"""

from dynjax.config import default_config


def get_config():
    c = default_config()
    c.train.steps = 300
    c.train.log_every = 20
    c.pruning.enabled = True
    c.pruning.initial_sparsity = 0.0
    c.pruning.final_sparsity = 0.8
    c.pruning.start_step = 50
    c.pruning.every = 50
    c.pruning.steps = 4  # events at steps 50, 100, 150, 200, 250
    return c
