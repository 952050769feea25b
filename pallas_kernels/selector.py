"""Dense or block-sparse matmul, decided by sparsity against a crossover measured per device.

A sparse kernel only pays off past some sparsity (Sputnik beat cuBLAS from about 75% on an A100,
003 §C), and that point depends on the device. ``CrossoverCache`` measures it once per
``device_kind`` and keeps it in memory and in a small JSON file (``$DYNJAX_CACHE_DIR`` or
``~/.cache/dynjax``), so later processes on the same kind of device skip the measurement. The
decision itself, ``prefer_sparse``, is a pure function: the Plan can record it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.block_sparse_matrix import BlockSparseMatrix
from pallas_kernels.spmm import block_sparse_matmul
from pallas_kernels.timing import median_seconds

CACHE_ENV = "DYNJAX_CACHE_DIR"
SPARSITIES = (0.5, 0.75, 0.9, 0.95)


def default_cache_path() -> Path:
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dynjax"
    return Path(root) / "spmm_crossover.json"


def prefer_sparse(sparsity: float, crossover: float | None) -> bool:
    """Use the sparse kernel at or past the crossover; ``None`` means sparse never won."""
    return crossover is not None and sparsity >= crossover


def crossover_from_timings(
    sparsities: Sequence[float], dense_seconds: float, sparse_seconds: Sequence[float]
) -> float | None:
    """Smallest measured sparsity from which the sparse kernel is faster at every larger one."""
    crossover = None
    for sparsity, seconds in sorted(zip(sparsities, sparse_seconds, strict=True), reverse=True):
        if seconds >= dense_seconds:
            break
        crossover = sparsity
    return crossover


def random_block_mask(grid: tuple[int, int], sparsity: float, seed: int = 0) -> np.ndarray:
    """A block mask with exactly ``round((1 - sparsity) * blocks)`` present blocks."""
    total = grid[0] * grid[1]
    present = np.random.default_rng(seed).permutation(total) < round((1 - sparsity) * total)
    return present.reshape(grid)


def measure_crossover(
    *,
    size: int | None = None,
    block_size: int | None = None,
    dtype: jnp.dtype | None = None,
    sparsities: Sequence[float] = SPARSITIES,
    repeats: int = 5,
) -> float | None:
    """Time ``x @ w`` dense and block-sparse for square ``size`` matrices at each sparsity.

    Defaults: 4096, 128-blocks, bf16 on GPU (the 003 §C shape); 64, 16-blocks, fp32 elsewhere,
    where the interpreted kernel is expected to lose (so the result is ``None``) and the run
    stays short. Call it outside any trace (``CrossoverCache`` does).
    """
    on_gpu = jax.default_backend() == "gpu"
    size = size or (4096 if on_gpu else 64)
    block_size = block_size or (128 if on_gpu else 16)
    dtype = dtype or (jnp.bfloat16 if on_gpu else jnp.float32)
    keys = jax.random.split(jax.random.key(0))
    x = jax.random.normal(keys[0], (size, size), dtype)
    dense = jax.random.normal(keys[1], (size, size), dtype)
    dense_seconds = median_seconds(jax.jit(jnp.dot), x, dense, repeats=repeats)
    sparse_seconds = []
    for sparsity in sparsities:
        mask = random_block_mask((size // block_size,) * 2, sparsity)
        w = BlockSparseMatrix.from_dense(dense, block_size, mask)
        sparse_seconds.append(median_seconds(block_sparse_matmul, x, w, repeats=repeats))
    return crossover_from_timings(sparsities, dense_seconds, sparse_seconds)


@dataclasses.dataclass
class CrossoverCache:
    """Crossover sparsity per device kind: in memory, then the JSON file, then ``measure()``.

    ``measure`` runs on a worker thread: JAX traces are per thread, so a first call from inside
    ``jax.jit`` (a model's forward) still times real computations.
    """

    path: Path = dataclasses.field(default_factory=default_cache_path)
    measure: Callable[[], float | None] = measure_crossover
    _memo: dict[str, float | None] = dataclasses.field(default_factory=dict, repr=False)

    def get(self, device_kind: str | None = None) -> float | None:
        kind = device_kind or jax.devices()[0].device_kind
        if kind not in self._memo:
            stored = self._read()
            if kind not in stored:
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    stored[kind] = pool.submit(self.measure).result()
                self._write(stored)
            self._memo[kind] = stored[kind]
        return self._memo[kind]

    def _read(self) -> dict[str, float | None]:
        try:
            stored = json.loads(self.path.read_text())
        except (OSError, ValueError):  # missing or corrupt: measure again
            return {}
        return stored if isinstance(stored, dict) else {}

    def _write(self, stored: dict[str, float | None]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(stored, indent=1, sort_keys=True))
        tmp.replace(self.path)  # atomic: concurrent processes never read half a file


@functools.cache
def default_cache() -> CrossoverCache:
    """The process-wide cache at ``default_cache_path()``."""
    return CrossoverCache()


def sparse_or_dense_matmul(
    x: jax.Array,
    w: BlockSparseMatrix,
    *,
    cache: CrossoverCache | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """``x @ w`` through ``block_sparse_matmul`` past this device's crossover, else ``jnp.dot``.

    The choice is static (``w.sparsity`` is fixed by its shapes), so it is made at trace time.
    """
    crossover = (cache or default_cache()).get()
    if prefer_sparse(w.sparsity, crossover):
        return block_sparse_matmul(x, w, interpret=interpret)
    return jnp.dot(x, w.to_dense())
