"""Layer freezing (AutoFreeze's gradient rule, seed 000 §2.3): an 8-layer GPT whose converged
front layers freeze as it trains, so the step gets cheaper (a frozen prefix runs no backward).

About 3 minutes on two CPU cores. events.jsonl shows each `freeze` decision and the
`recompile` that applied it; layer_costs.jsonl the cheaper frozen layers. On a pipeline the
balancer then moves layers towards the frozen stages:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m dynjax.train \\
        --config configs/freezing.py --config.mesh.stage=4 --config.mesh.data=2 \\
        --config.balance.enabled=True
"""

from dynjax.config import default_config


def get_config():
    c = default_config()
    c.model.num_layers = 8
    c.train.steps = 400
    c.train.log_every = 20
    c.freezing.enabled = True
    c.freezing.every = 25
    c.freezing.start_step = 100
    c.freezing.percentile = 50.0
    c.freezing.max_fraction = 0.5
    return c
