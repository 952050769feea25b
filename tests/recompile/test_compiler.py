"""Compiler: lowers on the calling thread, compiles on its worker, caches executables (LRU)."""

import os
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dynjax.recompile.compiler import Compiler
from dynjax.recompile.plan import Plan

from ..helpers import ROOT

SPEC = jax.ShapeDtypeStruct((4,), jnp.float32)


class Recorder:
    """A lower_fn for a toy step `x * microbatches` that records calls and threads."""

    def __init__(self, compile_delay: float = 0.0, fail_compiles: int = 0):
        self.lowered: list[Plan] = []
        self.lower_threads: list[str] = []
        self.compile_threads: list[str] = []
        self.compile_delay = compile_delay
        self.fail_compiles = fail_compiles

    def __call__(self, plan: Plan):
        self.lowered.append(plan)
        self.lower_threads.append(threading.current_thread().name)
        lowered = jax.jit(lambda x: x * plan.microbatches).lower(SPEC)
        recorder = self

        class Slow:
            def compile(self):
                recorder.compile_threads.append(threading.current_thread().name)
                time.sleep(recorder.compile_delay)
                if recorder.fail_compiles:
                    recorder.fail_compiles -= 1
                    raise RuntimeError("XLA says no")
                return lowered.compile()

        return Slow()


@pytest.fixture
def make_compiler():
    made = []

    def make(lower_fn, **kwargs):
        made.append(Compiler(lower_fn, **kwargs))
        return made[-1]

    yield make
    for c in made:
        c.shutdown()


def test_equal_plan_hits_the_cache_without_a_second_compile(make_compiler):
    rec = Recorder()
    compiler = make_compiler(rec)
    first = compiler.get(Plan(microbatches=3))
    again = compiler.submit(Plan(microbatches=3))
    assert again.done()  # a hit is ready at once
    hit = again.result()
    assert len(rec.lowered) == 1 and len(rec.compile_threads) == 1
    assert not first.cache_hit and hit.cache_hit
    assert hit.executable is first.executable
    assert hit.lower_seconds == hit.compile_seconds == 0.0
    assert first.lower_seconds > 0 and first.compile_seconds > 0
    assert (compiler.hits, compiler.misses) == (1, 1)
    np.testing.assert_allclose(first.executable(jnp.ones(4)), 3.0)


def test_lower_on_calling_thread_compile_on_worker(make_compiler):
    rec = Recorder(compile_delay=0.3)
    compiler = make_compiler(rec)
    t0 = time.perf_counter()
    future = compiler.submit(Plan(microbatches=2))
    assert time.perf_counter() - t0 < 0.3 and not future.done()  # submit did not wait
    result = future.result()
    assert rec.lower_threads == [threading.current_thread().name]
    assert rec.compile_threads[0].startswith("dynjax-compile")
    assert result.compile_seconds >= 0.3


def test_key_fn_shares_executables_between_plans_with_the_same_key(make_compiler):
    rec = Recorder()
    compiler = make_compiler(rec, key_fn=lambda p: p.microbatches)
    compiler.get(Plan(microbatches=2))
    assert compiler.get(Plan(microbatches=2, dtype="bfloat16")).cache_hit
    assert len(rec.lowered) == 1


def test_lru_evicts_the_least_recently_used(make_compiler):
    rec = Recorder()
    compiler = make_compiler(rec, max_entries=2)
    a, b, c = (Plan(microbatches=m) for m in (1, 2, 4))
    compiler.get(a)
    compiler.get(b)
    assert compiler.get(a).cache_hit  # a is now the most recent
    compiler.get(c)  # evicts b
    assert not compiler.get(b).cache_hit  # compiled again; evicts a
    assert compiler.get(c).cache_hit
    assert rec.lowered == [a, b, c, b]


def test_hit_on_a_compile_in_flight_shares_it(make_compiler):
    rec = Recorder(compile_delay=0.3)
    compiler = make_compiler(rec)
    first = compiler.submit(Plan(microbatches=2))
    second = compiler.submit(Plan(microbatches=2))
    assert not second.done()
    assert second.result().cache_hit and second.result().executable is first.result().executable
    assert len(rec.compile_threads) == 1


def test_a_failed_compile_is_not_cached(make_compiler):
    rec = Recorder(fail_compiles=1)
    compiler = make_compiler(rec)
    with pytest.raises(RuntimeError, match="XLA says no"):
        compiler.get(Plan())
    assert not compiler.get(Plan()).cache_hit
    assert len(rec.lowered) == 2


def test_lowering_errors_surface_on_the_calling_thread(make_compiler):
    def lower_fn(plan):
        raise TypeError("bad trace")

    with pytest.raises(TypeError, match="bad trace"):
        make_compiler(lower_fn).submit(Plan())


def test_persistent_cache_writes_even_small_cpu_programs(tmp_path):
    script = (
        "import jax, jax.numpy as jnp, sys\n"
        "from dynjax.recompile.compiler import enable_persistent_cache\n"
        "enable_persistent_cache(sys.argv[1])\n"
        "jax.jit(lambda x: x * 2 + 1).lower(jnp.ones(3)).compile()\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], check=True, cwd=ROOT, env=env, timeout=120
    )
    assert any(tmp_path.iterdir())
