"""Swapping Plans in a pipeline: a change that keeps the state layout (capacities, cached routing,
schedule) moves nothing and waits for nothing, and the profile of a swapped-in Plan compiles
nothing on the training thread (its one-unit programs compiled with it, in the background)."""

import functools
import threading

import jax
import numpy as np
import pytest

import dynjax.parallel.executable as executable_module
from dynjax.experiment import Experiment
from dynjax.model.moe import MOE, static_options
from dynjax.parallel.pipeline import Pipeline, host_metrics
from dynjax.parallel.profile import unit_spec
from dynjax.parallel.stage_state import state_layout
from dynjax.parallel.stages import PipelineSpec, stage_specs
from dynjax.parallel.step_inputs import InputSignature
from dynjax.recompile import Compiler

from ..tiny import tiny_config

# Stage 0: layers 0 and 1 (MoE), stage 1: layer 2. One MoE layer of 4 experts.
RUN = dict(
    model__num_layers=3, moe__every=2, mesh__stage=2, mesh__data=2, train__microbatches=2,
    pipeline__stage_layers="(2,1)",
)
NEW_CAPACITIES = ((12, 20, 28, 16),)  # uneven, some below the initial 20: tokens are dropped


@pytest.fixture(scope="module")
def exp():
    return Experiment.from_config(tiny_config(**RUN))


def refuse(*_args, **_kwargs):
    raise AssertionError("the swap waited for the device or migrated")


def loss(runtime, executable, batch) -> float:
    hooks = executable.spec.stages[0] and runtime.pipeline.programs.setup.parts.cfg.hooks
    metrics = jax.device_get(runtime.step(executable, batch, None))
    return float(host_metrics(metrics, hooks)["loss"])


def spec(layers=(2, 1), *, frozen=(), capacities=((20,) * 4,), cached=False, schedule="1f1b"):
    routes = (InputSignature("routes", (1,), (8, 2), "int32"),) if cached else ()
    stages = stage_specs(
        layers, frozen_layers=frozen, microbatches=2, batch_size=8, dtype="float32",
        options=static_options(3, (1,), capacities), batch_inputs=routes,
    )
    return PipelineSpec(stages, schedule, ())


def test_only_moved_or_frozen_layers_change_the_state_layout():
    base = state_layout(spec())
    assert state_layout(spec(capacities=NEW_CAPACITIES)) == base
    assert state_layout(spec(cached=True)) == base
    assert state_layout(spec(schedule="gpipe")) == base
    assert state_layout(spec(layers=(1, 2))) != base
    assert state_layout(spec(frozen=(2,))) != base
    assert state_layout(spec(frozen=(0,))) != base  # the embedding freezes with layer 0


@pytest.mark.slow
def test_a_capacity_change_swaps_without_migrating_or_waiting(exp, monkeypatch):
    old = exp.initial_plan()
    new = old.with_part("moe", capacities=NEW_CAPACITIES)
    new.validate(exp.ctx)
    cached = new.with_part("moe", cached_routing=True)
    before, after, after_cached = (
        exp.lower_train_step(p).compile() for p in (old, new, cached)
    )
    batches = [exp.order.batch(t) for t in range(3)]
    runtime = exp.runtime(old)
    for batch in batches[:2]:
        runtime.step(before, batch, None)  # in flight at the swap
    held = jax.tree.leaves(runtime.pipeline.state)
    with monkeypatch.context() as patch:
        patch.setattr(jax, "block_until_ready", refuse)
        patch.setattr(Pipeline, "migrate", refuse)
        assert runtime.swap(new, after) is None
        assert runtime.swap(cached, after_cached) is None
        assert runtime.swap(new, after) is None
    assert runtime.pipeline.spec == after.spec
    assert all(a is b for a, b in zip(held, jax.tree.leaves(runtime.pipeline.state), strict=True))
    # Training goes on as a run that starts from the same state on the new Plan, and the new
    # capacities count: the old Plan's step differs.
    host_state = runtime.pipeline.host_state()
    expected = loss(exp.runtime(new, host_state), after, batches[2])
    old_step = loss(exp.runtime(old, host_state), before, batches[2])
    got = loss(runtime, after, batches[2])
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert abs(old_step - expected) > 1e-6 * expected


def test_profiling_a_swapped_in_plan_compiles_nothing_on_the_training_thread(exp, monkeypatch):
    compiler = Compiler(functools.partial(exp.lower_train_step, profiling=True))
    old = exp.initial_plan()
    new = old.with_part("moe", capacities=NEW_CAPACITIES)
    try:
        runtime = exp.runtime(old)
        runtime.profile_step(compiler.get(old).executable, exp.order.batch(0), None)
        after = compiler.get(new).executable
    finally:
        compiler.shutdown()
    runtime.swap(new, after)
    me = threading.get_ident()
    here = []

    def spy_lower(kind, setup, stage, mesh, shapes):
        if threading.get_ident() == me:
            here.append(("lowered", kind, stage.layers))
        return lower_stage(kind, setup, stage, mesh, shapes)

    def on_compile_event(event, seconds, **_):  # tracing, lowering to MLIR, XLA's compile
        if event.startswith("/jax/core/compile/") and threading.get_ident() == me:
            here.append((event, seconds))

    lower_stage = executable_module.lower_stage
    monkeypatch.setattr(executable_module, "lower_stage", spy_lower)
    jax.monitoring.register_event_duration_secs_listener(on_compile_event)
    try:
        metrics, profile = runtime.profile_step(after, exp.order.batch(1), None)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_compile_event)
    assert here == []
    # The MoE layer's one-layer programs of the new capacities are the ones that ran.
    moe_layer = unit_spec(after.spec.stages[0], ("layers", 1))
    assert (dict(moe_layer.options[0])[MOE].capacities,) == NEW_CAPACITIES
    assert {("fwd", moe_layer), ("bwd", moe_layer)} <= set(after.profiling)
    assert min(profile.units.layer_forward + profile.units.layer_backward) > 0
    assert "profile/layer_forward_seconds" in metrics


def test_profiling_needs_the_programs_lowered_with_the_plan(exp):
    plan = exp.initial_plan()
    runtime = exp.runtime(plan)
    plain = exp.lower_train_step(plan).compile()
    with pytest.raises(ValueError, match="profiling=True"):
        runtime.profile_step(plain, exp.order.batch(0), None)
