"""Hash-based dynamic sparse attention (Pagliardini et al. 2023; seed 000 §2.4): a 4-layer GPT on
1,024-token sequences whose attention runs within 8 LSH buckets per head, on a key-block budget
per layer that a policy shrinks from what the steps need.

A few minutes on two CPU cores. events.jsonl shows each `attention_budget` decision (needed
blocks of 16) and the background `recompile` that applied it; metrics.jsonl each layer's
`sparse_attention/overflow` (needed blocks beyond the budget, kept <= 1%) and
`sparse_attention/pair_fraction`; layer_costs.jsonl the cheaper layers. On a pipeline:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m dynjax.train \\
        --config configs/sparse_attention.py --config.mesh.stage=4 --config.mesh.data=2 \\
        --config.model.num_layers=8 --config.train.microbatches=4 --config.train.batch_size=8 \\
        --config.balance.enabled=True

(batch 8 = 2 data replicas x 4 microbatches of one sequence; batch 4 does not divide.)

On a GPU, ``--config.sparse_attention.kernel=pallas`` runs the Pallas kernel (every needed block,
no budget) instead of the budgeted XLA path.
"""

from dynjax.config import default_config


def get_config():
    c = default_config()
    c.data.seq_len = 1024
    c.train.batch_size = 4
    c.train.steps = 200
    c.train.log_every = 10
    c.sparse_attention.enabled = True
    c.sparse_attention.buckets = 8
    c.sparse_attention.block = 64
    return c
