"""Early exit on the MPMD pipeline equals the single-program step: the carry (which tokens
remain) crosses stages, earlier stages read the last stage's readout and targets, and their
readout gradient reaches the one optimizer update of the shared head; evaluation and profiling
run the same context."""

import functools
import math

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from dynjax.balance import schedule_tasks
from dynjax.balance.schedules import Task
from dynjax.model import GPT, GPTConfig, ModelParts
from dynjax.model.early_exit import (
    EXIT_CE,
    EXITED,
    FORCED,
    HOOKS,
    LOSS,
    NAME,
    PROCESSED,
    ExitLayer,
)
from dynjax.model.hooks import Hooks
from dynjax.parallel import expert_parallel, make_mesh, make_train_step, whole_model
from dynjax.parallel.executable import PipelinePrograms
from dynjax.parallel.pipeline import Pipeline, host_metrics
from dynjax.parallel.stage import StageSetup
from dynjax.parallel.stages import PipelineSpec, stage_specs
from dynjax.parallel.step import make_eval_step
from dynjax.parallel.step_run import StepRunner
from dynjax.parallel.timeline import _READY, _timeline
from dynjax.parallel.transport import Transport
from dynjax.train import train

from ..helpers import assert_close, logged, stage_setup
from ..tiny import tiny_config

S, L, M, B, STEPS, LR, CLIP = 8, 4, 2, 8, 3, 0.3, 0.5
CFG = GPTConfig(vocab_size=64, num_layers=L, d_model=16, num_heads=2, mlp_dim=32, max_len=S,
                hooks=Hooks((HOOKS,)))
TOKENS = (S, S, 6, 4)  # layers 2 and 3 compute a bucket of the remaining tokens
WEIGHTS = (0.25, 0.5, 0.75)  # exit points after layers 0, 1 and 2


def optimizer():
    return optax.chain(optax.clip_by_global_norm(CLIP), optax.sgd(LR, momentum=0.9))


def batches():
    rng = np.random.default_rng(1)
    return [
        {k: rng.integers(0, 64, (B, S)).astype(np.int32) for k in ("inputs", "targets")}
        for _ in range(STEPS)
    ]


@functools.cache
def initial_state():
    params = nnx.to_pure_dict(nnx.state(GPT(CFG, rngs=nnx.Rngs(0))))
    return jax.device_get({"params": params, "opt_state": optimizer().init(params)})


@functools.cache
def threshold() -> float:
    """The median confidence at the first exit point: about half the tokens exit there."""
    model = GPT(CFG, rngs=nnx.Rngs(0))
    x, _, _ = model.layers[0](model.embed(batches()[0]["inputs"]))
    probs = jax.nn.softmax(model.readout(x), axis=-1)
    return float(np.median(np.max(probs, axis=-1)))


def options():
    return tuple(
        ((NAME, ExitLayer(TOKENS[i], WEIGHTS[i] if i < 3 else 0.0, "softmax_max", threshold(),
                          True)),)
        for i in range(L)
    )


@functools.cache
def reference():
    opts = whole_model(L, batch_size=B, microbatches=M, options=options(), hooks=CFG.hooks)
    setup = stage_setup(CFG, optimizer())
    parallel = expert_parallel(make_mesh(1, 1, 1))
    step = jax.jit(make_train_step(setup, opts, parallel))
    state = initial_state()
    p, s = state["params"], state["opt_state"]
    metrics = []
    for batch in batches():
        p, s, m = step(p, s, batch)
        metrics.append(jax.device_get(m))
    evaluate = jax.jit(make_eval_step(setup, opts, parallel))
    return metrics, jax.device_get({"params": p, "opt_state": s}), float(evaluate(p, batches()[0]))


@functools.cache
def programs(stages: int, fsdp: bool = False):
    setup = StageSetup(parts=ModelParts.of(CFG), optimizer=optimizer(), grad_clip=CLIP,
                       fsdp=fsdp)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), initial_state())
    transport = Transport(make_mesh(stages, 8 // stages // 2, 1))
    return PipelinePrograms(setup, transport, abstract["params"], seq_len=S), abstract


def spec_for(assignment, schedule="1f1b"):
    stages = stage_specs(assignment, frozen_layers=(), microbatches=M, batch_size=B,
                         dtype="float32", options=options(), hooks=CFG.hooks)
    return PipelineSpec(stages, schedule, schedule_tasks(schedule, len(assignment), M))


def trained(assignment, schedule="1f1b", fsdp=False):
    progs, template = programs(len(assignment), fsdp)
    exe = progs.lower(spec_for(assignment, schedule)).compile()
    pipeline = Pipeline(progs, template)
    pipeline.place(initial_state(), exe.spec)
    metrics = [
        host_metrics(jax.device_get(pipeline.step(exe, **b)), CFG.hooks) for b in batches()
    ]
    return pipeline, metrics


@pytest.mark.slow
@pytest.mark.parametrize(
    ("assignment", "schedule", "fsdp"),
    [((2, 2), "1f1b", False), ((1, 1, 1, 1), "gpipe", False), ((2, 2), "1f1b", True)],
)
def test_early_exit_on_a_pipeline_equals_the_single_program(assignment, schedule, fsdp):
    ref_metrics, ref_state, ref_eval = reference()
    # The premises: tokens exit at the first stage's exit points, buckets force some out,
    # and the gradient norm (with the exits' readout gradient) is clipped.
    assert ref_metrics[0][EXITED][0] > 0.2 and ref_metrics[0][FORCED].sum() > 0
    assert ref_metrics[0]["grad_norm"] > CLIP
    pipeline, metrics = trained(assignment, schedule, fsdp)
    for got, ref in zip(metrics, ref_metrics, strict=True):
        for key in ("loss", "grad_norm", LOSS, EXIT_CE):
            np.testing.assert_allclose(got[key], ref[key], rtol=1e-5, err_msg=key)
        # Which tokens exit, are forced out and computed: decided from the carry that crossed.
        for key in (EXITED, FORCED, PROCESSED):
            np.testing.assert_allclose(got[key], ref[key], atol=1e-7, err_msg=key)
    assert_close(ref_state, pipeline.host_state(), 1e-5)
    np.testing.assert_allclose(pipeline.evaluate([tuple(batches()[0].values())]), ref_eval,
                               rtol=1e-5)


def test_later_stages_skip_the_tokens_that_exited_in_earlier_ones():
    ref_metrics, _, _ = reference()
    _, metrics = trained((1, 1, 1, 1))
    processed = metrics[0][PROCESSED]
    # Layer 1 (stage 1) computes only what the exit after layer 0 (stage 0) left.
    np.testing.assert_allclose(processed[1], 1.0 - metrics[0][EXITED][0], atol=1e-6)
    assert processed[1] < 0.8 and processed[3] < processed[2] < processed[1]
    np.testing.assert_allclose(processed, ref_metrics[0][PROCESSED], atol=1e-7)


def test_the_head_update_includes_the_earlier_stages_readout_gradient(monkeypatch):
    _, ref_state, _ = reference()
    monkeypatch.setattr(StepRunner, "_gather_readout_grads", lambda self, spec: None)
    pipeline, _ = trained((2, 2))
    got = pipeline.host_state()["params"]
    # Without the exits' gradient the head moves differently from the single program's...
    err = np.max(np.abs(got["head"]["kernel"] - ref_state["params"]["head"]["kernel"]))
    assert err > 1e-3
    # ...which the full pipeline matches (the parametrised test above).


@pytest.mark.slow
def test_profiling_times_the_exit_layers_with_their_readout():
    progs, template = programs(2)
    exe = progs.lower(spec_for((2, 2)), profiling=True).compile()
    pipeline = Pipeline(progs, template)
    pipeline.place(initial_state(), exe.spec)
    _, profile = pipeline.profile_step(exe, **batches()[0], repeats=1)
    units = profile.units
    assert min(units.layer_forward) > 0 and min(units.layer_backward) > 0
    _, light = pipeline.profile_step(exe, **batches()[1], repeats=1)
    assert not light.units_measured and len(light.units.layer_forward) == L
    # A kept stage input holds the carry (and, before the last stage, the targets) too.
    acts = B // M * S * CFG.d_model * 4 // 2  # float32 activations per data device
    assert profile.memory[1]["microbatch_input"] == acts + B // M * S // 2  # + bool carry


@pytest.mark.slow
def test_training_on_a_pipeline_equals_one_program(tmp_path):
    base = dict(early_exit__enabled=True, early_exit__first=1, early_exit__every=1,
                early_exit__start_step=0, early_exit__threshold=0.0056, model__num_layers=L,
                data__seq_len=16, train__steps=4, train__microbatches=2, train__eval_every=4,
                pipeline__profile_on_change=False)
    single, staged = tmp_path / "single", tmp_path / "staged"
    train(tiny_config(**base), single, progress=False)
    train(tiny_config(**base, mesh__stage=2, pipeline__stage_layers="(2,2)"), staged,
          progress=False)
    for key, tol in (("loss", dict(rtol=1e-4)), (PROCESSED, dict(atol=1e-6)),
                     (EXITED, dict(atol=1e-6)), ("eval_loss", dict(rtol=1e-4))):
        want, got = logged(single, key), logged(staged, key)
        assert sorted(want) == sorted(got) and want, key
        for step in want:
            np.testing.assert_allclose(got[step], want[step], err_msg=f"{key} {step}", **tol)
    assert logged(single, EXITED)[4][0] > 0  # tokens exit in the first stage


def test_a_timed_step_counts_waiting_for_the_previous_step_as_idle():
    """A stage whose parameters (and readout) from the previous step arrive late begins its
    first task then: the wait is a bubble, not the task's time (which the balancer reads)."""
    # (task, dispatched, the arrival of what it waits for from before the step, its end,
    # whether the watcher saw it end)
    no, F, B = -math.inf, Task("F", 0), Task("B", 0)
    seen = [
        [(_READY, 0.0, 5.0, 0.0, False), (F, 1.0, no, 6.0, True), (B, 1.0, no, 9.5, True)],
        [(_READY, 0.0, no, 0.0, False), (F, 1.0, no, 7.0, True), (B, 1.0, no, 8.0, True)],
    ]
    (f0, b0), (f1, b1) = _timeline(dict(enumerate(seen)), 0.0).values()
    # A task starts when the one that computed its input ended (stage 1's F after stage 0's).
    assert (f0.start, f0.end) == (5.0, 6.0) and (b0.start, b0.end) == (8.0, 9.5)
    assert (f1.start, f1.end) == (6.0, 7.0) and (b1.start, b1.end) == (7.0, 8.0)
    # Stage 0's watcher woke late and noted its F ending at 7.5, after stage 1's F (which
    # needed its output) ended: that note is left out, not a task cut to nothing.
    seen[0][1] = (F, 1.0, no, 7.5, True)
    (_, _), (f1, _) = _timeline(dict(enumerate(seen)), 0.0).values()
    assert (f1.start, f1.end) == (1.0, 7.0)
