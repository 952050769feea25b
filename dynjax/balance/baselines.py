"""Static layouts of production frameworks: DynMo's baselines (seed 000 §1, §5)."""

from collections.abc import Sequence

import numpy as np

from dynjax.balance._checks import check_stage_count, even_bounds
from dynjax.balance.partition import partition


def uniform(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Equal layer counts per stage (Megatron-LM; DeepSpeed ``partition_method='uniform'``).

    When the split is uneven the first stages take the extra layer, as DeepSpeed's
    ``partition_uniform`` does.

    >>> uniform(10, 4)
    (3, 3, 2, 2)
    """
    check_stage_count(num_layers, num_stages)
    return tuple(int(n) for n in np.diff(even_bounds(num_layers, num_stages)))


def by_param(param_counts: Sequence[float] | np.ndarray, num_stages: int) -> tuple[int, ...]:
    """Balance parameter counts (DeepSpeed ``partition_method='parameters'``).

    DeepSpeed bisects on the bottleneck with linear probing, i.e. min-max partitioning with
    parameter counts as weights; here that is :func:`partition` fed with parameter counts.

    >>> by_param([4, 1, 1, 1, 1], 2)
    (1, 4)
    """
    return partition(param_counts, num_stages)
