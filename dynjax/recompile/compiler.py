"""Ahead-of-time compilation of Plans, off the training thread, with an LRU cache of executables.

Seed 001 §3 requires that computing the new graph's hardware mapping overlaps with training on the
current one. In JAX, tracing and lowering hold the GIL but XLA's `compile()` releases it, so
`Compiler.submit` lowers on the calling thread and compiles on a single worker thread while the
training thread keeps dispatching steps (docs/architecture.md, "Compiler").
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Protocol

import jax

from dynjax.recompile.plan import Plan


class Lowerable(Protocol):
    """What `lower_fn` returns: a `jax.stages.Lowered`, or anything with its `compile()`."""

    def compile(self) -> Any: ...


@dataclass(frozen=True)
class CompileResult:
    """An executable for a Plan and what it cost; a cache hit cost nothing (times are 0)."""

    executable: Any  # jax.stages.Compiled
    lower_seconds: float
    compile_seconds: float
    cache_hit: bool


class Compiler:
    """Builds executables for Plans ahead of time and keeps the last `max_entries` of them.

    `lower_fn(plan)` traces and lowers the step for a Plan (it runs on the thread that calls
    `submit`, so it should lower from abstract values, e.g. `jax.ShapeDtypeStruct`, not from
    buffers the training thread may donate). Executables are cached under `key_fn(plan)`, the
    part of the Plan they depend on, so returning to an earlier Plan costs nothing. A failed
    compile is not reused: the next submit of its Plan compiles again.
    """

    def __init__(
        self,
        lower_fn: Callable[[Plan], Lowerable],
        *,
        key_fn: Callable[[Plan], Hashable] = lambda p: p,
        max_entries: int = 8,
    ) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries = {max_entries} must be at least 1")
        self._lower_fn = lower_fn
        self._key_fn = key_fn
        self._max_entries = max_entries
        self._cache: OrderedDict[Hashable, Future[CompileResult]] = OrderedDict()
        self._lock = threading.Lock()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dynjax-compile")
        self.hits = 0
        self.misses = 0

    def submit(self, plan: Plan) -> Future[CompileResult]:
        """Start building `plan`; returns at once with a future of its `CompileResult`.

        Raises whatever `lower_fn` raises (tracing errors surface on the calling thread).
        A hit on a compile still in flight shares it.
        """
        key = self._key_fn(plan)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None and not (cached.done() and cached.exception() is not None):
                self._cache.move_to_end(key)
                self.hits += 1
                return _as_hit(cached)
        t0 = time.perf_counter()
        lowered = self._lower_fn(plan)
        lower_seconds = time.perf_counter() - t0

        def compile_() -> CompileResult:
            t1 = time.perf_counter()
            executable = lowered.compile()
            return CompileResult(executable, lower_seconds, time.perf_counter() - t1, False)

        future = self._worker.submit(compile_)
        with self._lock:
            self.misses += 1
            self._cache[key] = future
            self._cache.move_to_end(key)  # a failed entry for this key kept its old place
            while len(self._cache) > self._max_entries:
                self._cache.popitem(last=False)
        return future

    def same_program(self, a: Plan, b: Plan) -> bool:
        """Whether Plans `a` and `b` share one executable (they differ only in runtime inputs,
        e.g. per-expert capacities on the ragged MoE path)."""
        return self._key_fn(a) == self._key_fn(b)

    def forget(self, drop: Callable[[Hashable], bool]) -> None:
        """Drop the cached executables whose key ``drop`` selects, e.g. those of Plans that run
        on devices given back after a re-pack (their programs hold memory there)."""
        with self._lock:
            for key in [k for k in self._cache if drop(k)]:
                del self._cache[key]

    def get(self, plan: Plan) -> CompileResult:
        """Synchronous `submit`: the `CompileResult` for `plan`."""
        return self.submit(plan).result()

    def shutdown(self) -> None:
        """Wait for the compile in flight, if any, and stop the worker thread."""
        self._worker.shutdown(wait=True)


def _as_hit(source: Future[CompileResult]) -> Future[CompileResult]:
    """A future resolving to `source`'s executable, marked as a free cache hit."""
    hit: Future[CompileResult] = Future()

    def relay(f: Future[CompileResult]) -> None:
        if f.exception() is not None:
            hit.set_exception(f.exception())
        else:
            free = replace(f.result(), lower_seconds=0.0, compile_seconds=0.0, cache_hit=True)
            hit.set_result(free)

    source.add_done_callback(relay)  # runs at once when `source` is already done
    return hit


def default_cache_dir() -> str:
    """Where JAX's persistent compilation cache lives unless configured otherwise.

    JAX's own ``JAX_COMPILATION_CACHE_DIR`` wins (CI points it at a temporary directory).
    """
    return os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "dynjax", "jax_compilation_cache"
    )


def enable_persistent_cache(directory: str | None = None) -> str:
    """Turn on JAX's persistent compilation cache in `directory` (default `default_cache_dir()`).

    Every executable is written, however small or fast to compile, so that a restarted run and
    the small CPU programs of tests hit it too. Compiles before the call are not written.
    Returns the directory used.
    """
    directory = directory or default_cache_dir()
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return directory
