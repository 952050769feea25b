"""Gradual global magnitude pruning (seed 000 §2.2, §3.2.1): a 4-layer GPT pruned from dense to
80% sparsity in five events on Zhu & Gupta's cubic schedule (targets 0, 0.4625, 0.7, 0.7875, 0.8
at steps 50, 100, 150, 200, 250), the weights of all layers ranked together so that layers end up
with different densities.

About 2 minutes on two loaded CPU cores (measured: 113 s; 39 s on idle ones), loss 3.12 at step 20
-> 1.85 at step 300, eval 1.95.
events.jsonl has a `prune` event per pruning step (target sparsity, kept weights, each layer's
density); metrics.jsonl the loss and `pruning/density` per layer; layer_costs.jsonl each layer's
cost (its density, seed 000 §2.2). On a pipeline (about 3 minutes), each event is followed by a
profiled step and the balancer decides on the profiled layer times:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m dynjax.train \
        --config configs/pruning.py --config.mesh.stage=4 --config.mesh.data=2 \
        --config.balance.enabled=True

Block granularity, with the block-sparse matmul switched in by recompiles once few blocks
remain (about 1 minute): add ``--config.pruning.granularity=block
--config.pruning.block_size=16 --config.pruning.sparse_below=0.5``.
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
