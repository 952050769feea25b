"""Load balancing for pipelines of dynamic models: pure Python + NumPy, no JAX.

DynMo (seed 000) in pieces a controller can call between steps:

* :func:`imbalance`, :func:`stage_costs` -- how unbalanced a layout is (eq. 2; network-aware §D.2).
* :func:`partition` -- exact min-max layout under memory caps, moving as few layers as possible.
* :func:`diffusion` -- decentralised neighbour-to-neighbour balancing (seed 003 Alg. 2).
* :func:`repack` -- merge neighbouring stages onto fewer workers (seed 000 Alg. 2).
* :func:`uniform`, :func:`by_param` -- the static Megatron-LM / DeepSpeed baselines.
* :func:`simulate` over :func:`schedule_tasks` -- iteration time and bubbles of GPipe / 1F1B.
"""

from dynjax.balance.baselines import by_param, uniform
from dynjax.balance.diffusion import DiffusionResult, diffusion, diffusion_with_info
from dynjax.balance.errors import InfeasibleError
from dynjax.balance.metrics import imbalance, stage_costs
from dynjax.balance.partition import partition
from dynjax.balance.repack import repack
from dynjax.balance.schedules import SCHEDULES, Task, peak_in_flight, schedule_tasks
from dynjax.balance.simulate import Event, Simulation, simulate

__all__ = [
    "SCHEDULES",
    "DiffusionResult",
    "Event",
    "InfeasibleError",
    "Simulation",
    "Task",
    "by_param",
    "diffusion",
    "diffusion_with_info",
    "imbalance",
    "partition",
    "peak_in_flight",
    "repack",
    "schedule_tasks",
    "simulate",
    "stage_costs",
    "uniform",
]
