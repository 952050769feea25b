"""Input checks shared by the balancers: validate user sequences once, at the edge."""

from collections.abc import Sequence

import numpy as np

from dynjax.balance.errors import InfeasibleError


def as_nonneg(values: Sequence[float] | np.ndarray, name: str) -> np.ndarray:
    """A 1-D float64 array of finite, non-negative values."""
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite")
    if np.any(arr < 0):
        raise ValueError(f"{name} must be non-negative")
    return arr


def per_stage(value: float | Sequence[float], length: int, name: str) -> np.ndarray:
    """Broadcast a scalar, or check a sequence, to ``length`` non-negative values."""
    if np.ndim(value) == 0:
        arr = as_nonneg([float(value)], name)  # type: ignore[arg-type]
        return np.full(length, arr[0])
    arr = as_nonneg(value, name)  # type: ignore[arg-type]
    if arr.size != length:
        raise ValueError(f"{name} has {arr.size} entries, expected {length}")
    return arr


def hop_costs(comm: float | Sequence[float], num_stages: int) -> np.ndarray:
    """Per-stage cost of sending activations onward: ``comm[s]`` for s < S-1, 0 for the last.

    ``comm`` is a scalar (every hop alike) or one value per stage boundary (``S - 1`` values).
    """
    hops = per_stage(comm, max(num_stages - 1, 0), "comm")
    return np.append(hops, 0.0)


def as_counts(counts: Sequence[int], num_layers: int, name: str = "counts") -> np.ndarray:
    """Layers per stage: positive integers summing to ``num_layers``."""
    arr = np.asarray(counts)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D sequence of layer counts")
    if not np.issubdtype(arr.dtype, np.integer):
        if not np.all(np.equal(np.mod(arr, 1), 0)):
            raise ValueError(f"{name} must hold integers, got {list(counts)}")
        arr = arr.astype(np.int64)
    if np.any(arr < 1):
        raise ValueError(f"every stage needs at least one layer, {name}={list(map(int, arr))}")
    if int(arr.sum()) != num_layers:
        raise ValueError(f"{name} sum to {int(arr.sum())}, expected {num_layers} layers")
    return arr.astype(np.int64)


def memory_and_capacity(
    memory: Sequence[float] | np.ndarray | None,
    capacity: float | Sequence[float] | None,
    num_layers: int,
    num_stages: int,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Validated (per-layer memory, per-stage capacity), or ``None`` when unconstrained."""
    if memory is None and capacity is None:
        return None
    if memory is None or capacity is None:
        raise ValueError("memory and capacity must be given together")
    mem = as_nonneg(memory, "memory")
    if mem.size != num_layers:
        raise ValueError(f"memory has {mem.size} entries, expected {num_layers} (one per layer)")
    return mem, per_stage(capacity, num_stages, "capacity")


def check_stage_count(num_layers: int, num_stages: int) -> None:
    """Every stage needs a layer: ``1 <= num_stages <= num_layers``."""
    if num_stages < 1:
        raise InfeasibleError(f"num_stages must be >= 1, got {num_stages}")
    if num_stages > num_layers:
        raise InfeasibleError(
            f"cannot give each of {num_stages} stages a layer: only {num_layers} layers"
        )


def even_bounds(num_layers: int, num_stages: int) -> np.ndarray:
    """Boundaries ``[S+1]`` of the even split; the first ``L % S`` stages get one more layer."""
    base, extra = divmod(num_layers, num_stages)
    sizes = np.full(num_stages, base, dtype=np.int64)
    sizes[:extra] += 1
    return np.concatenate(([0], np.cumsum(sizes)))
