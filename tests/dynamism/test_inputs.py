"""A scheme's per-layer runtime arrays and host-side hooks, outside the library: step inputs
(read by its block hook, changed without a recompile), batch inputs (cut into microbatches like
the tokens, on both runtimes), a hook set's stage loss with its step metric and a derived total,
and `observe` and `record_fields` in the training loop. The MoE plugin uses the same hooks."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from dynjax.dynamism import BUILTIN, Plugin
from dynjax.experiment import Experiment
from dynjax.model.hooks import HookSet
from dynjax.parallel.step_inputs import InputSignature
from dynjax.train import train
from dynjax.writers import read_jsonl

from ..tiny import tiny_config


def add_offset(x, weight, inputs):
    """Scales the block's output by 1 + the layer's step input ``offset`` [1] and, when given,
    each row by 1 + its batch input ``shift`` (one value per row): a scale, since the next
    layer norms would take a constant shift out again."""
    out = x * (1 + inputs["offset"][0])
    if "shift" in inputs:
        out = out * (1 + inputs["shift"][:, None, None])
    return out, {"offset/mean": jnp.mean(out)}


def offset_loss(layer_metrics, weights):
    """``weight`` x the sum over the stage's layers of their mean output, as ``offset_sum``."""
    total = sum((m["offset/mean"] for m in layer_metrics if "offset/mean" in m), jnp.float32(0))
    return (weights[0] if weights else 0.0) * total, {"offset_sum": total}


def offset_total(metrics, xp):
    return {"offset/total": xp.sum(metrics["offset/mean"])} if "offset/mean" in metrics else {}


@dataclasses.dataclass(frozen=True)
class OffsetSettings:
    enabled: bool
    value: float
    shift: bool
    weight: float


class Offset(Plugin):
    """Every layer's output scaled by a runtime value of its own (the Plan's ``values``), and
    with ``shift`` by a value per sample; ``weight`` x the scaled outputs' mean joins the loss."""

    name = "offset"
    hook_sets = (
        HookSet(
            "offset",
            block=add_offset,
            reads=("offset", "shift"),
            stage_loss=offset_loss,
            step_metrics=(("offset_sum", "mean", "sum"),),
            derived=offset_total,
        ),
    )
    logged_scalars = ("offset_sum",)
    Settings = OffsetSettings

    @classmethod
    def config(cls):
        c = ml_collections.ConfigDict()
        c.enabled = False
        c.value = 0.0
        c.shift = False
        c.weight = 0.0
        return c

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.observed: list[int] = []

    def initial_plan(self, plan):
        values = (self.settings.value,) * self.facts.num_layers
        return plan.with_part("offset", values=values, shift=self.settings.shift)

    def layer_options(self, plan):
        return [self.settings.weight] * self.facts.num_layers

    def step_inputs(self, plan):
        values = plan.part("offset")["values"]
        return {"offset": {i: np.array([v], np.float32) for i, v in enumerate(values)}}

    def compiled_part(self, plan):
        return {**plan.part("offset"), "values": ()}  # a step input: read, not compiled in

    def batch_input_signatures(self, plan):
        if not plan.part("offset")["shift"]:
            return ()
        return (InputSignature("shift", tuple(range(self.facts.num_layers)), (), "float32"),)

    def batch_inputs(self, step, sample_ids, plan):
        if not plan.part("offset")["shift"]:
            return {}
        rows = (np.asarray(sample_ids) % 5).astype(np.float32) * 0.01
        return {"shift": {i: rows * (i + 1) for i in range(self.facts.num_layers)}}

    def observe(self, step, metrics, sample_ids, plan):
        self.observed.append(step)
        metrics["offset/observed"] = np.float64(len(self.observed))

    def record_fields(self, metrics, plan):
        return {"offset_observed": int(metrics["offset/observed"])}


OFFSET = BUILTIN.with_(Offset)
BASE = dict(model__num_layers=4, train__batch_size=8, train__microbatches=2)


def step_metrics(exp, plan, executable=None, batches=1):
    """The host metrics of ``batches`` steps of ``plan`` from the initial state (with its batch
    inputs), on ``executable`` (default: ``plan``'s own)."""
    runtime = exp.runtime(plan)
    executable = executable or exp.lower_train_step(plan).compile()
    out = []
    for t in range(batches):
        batch = exp.order.batch(t)
        batch_in = exp.batch_inputs(t, batch, plan)
        metrics = jax.device_get(runtime.step(executable, batch, batch_in))
        out.append(runtime.host_metrics(t, metrics))
    return out


@pytest.mark.slow
def test_a_step_input_is_read_by_its_hook_and_changes_without_a_recompile():
    exp = Experiment.from_config(tiny_config(OFFSET, offset__enabled=True, **BASE), OFFSET)
    plain = Experiment.from_config(tiny_config(OFFSET, **BASE), OFFSET)
    zero = exp.initial_plan()
    moved = zero.with_part("offset", values=(0.0, 0.5, 0.0, -0.5))
    assert exp.compile_key(moved) == exp.compile_key(zero)  # one executable for both
    executable = exp.lower_train_step(zero).compile()
    [at_zero] = step_metrics(exp, zero, executable)
    [ref] = step_metrics(plain, plain.initial_plan())
    np.testing.assert_allclose(at_zero["loss"], ref["loss"], rtol=1e-6)  # offsets of 0
    [on_zeros] = step_metrics(exp, moved, executable)
    [own] = step_metrics(exp, moved)
    assert on_zeros["loss"] != at_zero["loss"]  # the values moved with no new program
    np.testing.assert_array_equal(on_zeros["loss"], own["loss"])
    np.testing.assert_array_equal(on_zeros["offset/mean"], own["offset/mean"])


@pytest.mark.slow
def test_batch_inputs_and_a_stage_loss_give_the_single_program_result_on_a_pipeline():
    """Batch inputs cut into 2 microbatches and a stage loss summed over 2 stages."""
    run = dict(offset__enabled=True, offset__shift=True, offset__weight=0.1, **BASE)
    single = Experiment.from_config(tiny_config(OFFSET, **run), OFFSET)
    pipe = Experiment.from_config(tiny_config(OFFSET, mesh__stage=2, **run), OFFSET)
    unshifted = Experiment.from_config(
        tiny_config(OFFSET, **{**run, "offset__shift": False}), OFFSET
    )
    want = step_metrics(single, single.initial_plan(), batches=2)
    got = step_metrics(pipe, pipe.initial_plan(), batches=2)
    [plain] = step_metrics(unshifted, unshifted.initial_plan())
    assert want[0]["loss"] != plain["loss"]  # the shift ran
    for w, g in zip(want, got, strict=True):
        for key in ("loss", "grad_norm", "offset_sum", "offset/mean", "offset/total"):
            np.testing.assert_allclose(g[key], w[key], rtol=1e-5, err_msg=key)
    assert want[0]["offset/mean"].shape == (4,) and np.ndim(want[0]["offset_sum"]) == 0
    np.testing.assert_allclose(want[0]["offset/total"], np.sum(want[0]["offset/mean"]), rtol=1e-6)
    np.testing.assert_allclose(want[0]["offset_sum"], want[0]["offset/total"], rtol=1e-5)


@pytest.mark.slow
def test_the_loop_runs_observe_and_logs_its_fields_and_scalars(tmp_path):
    cfg = tiny_config(OFFSET, offset__enabled=True, offset__shift=True, train__steps=4, **BASE)
    train(cfg, tmp_path, schemes=OFFSET, progress=False)
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
    assert [r["offset_observed"] for r in rows] == [1, 2, 3, 4]  # each step observed once
    assert all(isinstance(r["offset_sum"], float) for r in rows)
