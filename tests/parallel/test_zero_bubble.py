"""ZB-H1 in the pipeline runtime: each backward cut into B (input gradient) and W (weight
gradients), W deferred (issue 33 §2).

The cut itself on a small function (exact, nothing computed twice, the weight matmuls in W);
then the pipeline of 4 stages x 2 data devices (uneven, MoE dropping tokens, clipping that
triggers) against the single program, recomputing and on residuals, with frozen layers, and
across a layer migration; and a run of `dynjax.train`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dynjax.balance import schedule_tasks
from dynjax.parallel.split_backward import split_backward
from dynjax.train import train
from dynjax.writers import read_jsonl

from ..helpers import assert_close, losses
from ..tiny import tiny_config
from .test_pipeline_runtime import (
    ASSIGNMENT,
    CFG,
    assert_frozen_matches_one_device,
    assert_matches_one_device,
    pipeline_setup,
    reference_run,
    spec_for,
    train_and_migrate,
)
from .test_residuals import programs_for

ZB = "zb_h1"


def mlp_gradients(ws, x):
    def f(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.sum(x**2)

    _, vjp = jax.vjp(f, ws, x)
    return vjp(jnp.ones(()))


def dots(jaxpr_fn, *args) -> list[tuple]:
    """The operand shapes of every dot_general ``jaxpr_fn`` traces to."""
    eqns = jax.make_jaxpr(jaxpr_fn)(*args).jaxpr.eqns
    return [
        tuple(v.aval.shape for v in e.invars) for e in eqns if e.primitive.name == "dot_general"
    ]


def test_the_cut_is_exact_and_puts_the_weight_matmuls_in_w():
    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.normal(size=s) / 4, jnp.float32) for s in ((8, 16), (16, 16), (16, 8))]
    x = jnp.asarray(rng.normal(size=(4, 8)), jnp.float32)
    split, _ = split_backward(mlp_gradients, (ws, x), lambda out: [False] * 3 + [True])
    flat = jax.tree.leaves((ws, x))
    b_out, boundary = split.b(*flat)
    reads = [flat[i] for i in split.w_reads]  # the input x (the first matmul's activation)
    assert split.w_reads == (3,)
    w_out = split.w(*reads, *boundary)
    for got, want in zip(w_out + b_out, jax.tree.leaves(mlp_gradients(ws, x)), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    # B: the three forward matmuls and the input-gradient chain (dy @ W^T; the first layer's
    # is the input gradient itself), W: one x^T dy per weight. Six and three: none twice.
    in_b = dots(lambda *a: split.b(*a), *flat)
    in_w = dots(lambda *a: split.w(*a), *reads, *boundary)
    assert len(in_b) == 6 and len(in_w) == 3
    whole = dots(mlp_gradients, ws, x)
    assert sorted(in_b + in_w) == sorted(whole)
    # each W matmul contracts the 4 rows of the batch: an activation against a cotangent
    assert all(a[0] == 4 and b[0] == 4 for a, b in in_w)


def test_the_cut_handles_inputs_repeats_literals_constants_and_effects():
    """Outputs that are inputs, repeated, literal or made in B for W; a closed-over constant;
    an effect, which runs once per backward (in B); W reads only what it needs."""
    const = jnp.arange(1.0, 5.0)
    calls = []

    def fn(w, x):
        jax.debug.callback(lambda v: calls.append(float(v)), jnp.sum(x))
        h = jnp.tanh(x * const)
        grad = w * h
        return (grad, grad, w, h, jnp.zeros(())), (h, x)

    w, x = jnp.full((4,), 0.5), jnp.arange(4.0)
    split, _ = split_backward(fn, (w, x), lambda out: [False] * 5 + [True] * 2)
    assert split.w_reads == (0,)  # w; not x: h crosses as the boundary
    b_out, boundary = split.b(w, x)
    assert len(calls) == 1 and len(boundary) == 1
    w_out = split.w(w, *boundary)
    assert len(calls) == 1
    want = jax.tree.leaves(fn(w, x))
    for got, ref in zip(w_out + b_out, want, strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-6)


@pytest.fixture(scope="module")
def programs():
    return pipeline_setup()


def test_zb_h1_matches_one_device(programs):
    exe = programs[0].lower(spec_for(ASSIGNMENT, ZB)).compile()
    assert {k for k, _ in exe.programs} >= {"bwd_b", "bwd_w"} and ("bwd", 1) not in exe.programs
    assert_matches_one_device(*programs, spec_for(ASSIGNMENT, ZB))


def test_zb_h1_on_residuals_matches_one_device():
    assert_matches_one_device(*programs_for(recompute=False), spec_for(ASSIGNMENT, ZB))


def test_zb_h1_with_frozen_layers_matches_one_device(programs):
    assert_frozen_matches_one_device(*programs, ZB)


def test_a_layer_migrates_exactly_under_zb_h1(programs):
    programs, template = programs
    ref_metrics, ref_state = reference_run(CFG)
    before = programs.lower(spec_for(ASSIGNMENT, ZB)).compile()
    after = programs.lower(spec_for((2, 1, 1, 1), ZB)).compile()
    pipeline, migration, losses = train_and_migrate(programs, template, before, after)
    assert migration.moves == ((1, 1, 0),)
    np.testing.assert_allclose(losses, [m["loss"] for m in ref_metrics], rtol=1e-5)
    assert_close(ref_state, pipeline.host_state(), 1e-5)


@pytest.mark.parametrize("recompute", [True, False])
def test_b_and_w_together_cost_the_backward(programs, recompute):
    """Compute does not grow: a middle stage's B and W together count no more FLOPs than its
    fused backward (3% fewer here, recomputing: XLA counts the two programs' fusions apart),
    and W holds a real share of them (the weight matmuls), recomputing or on residuals."""
    programs, _ = programs if recompute else programs_for(recompute=False)
    stage = spec_for(ASSIGNMENT, ZB).stages[1]  # layers 1 and 2 (the MoE layer)

    def flops(kind):
        cost = programs.lower_one(kind, stage).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]

    whole, b, w = flops("bwd"), flops("bwd_b"), flops("bwd_w")
    assert 0.9 * whole <= b + w <= 1.01 * whole
    assert 0.1 * whole < w < 0.5 * whole


def test_a_zb_h1_run_trains_as_1f1b_does_and_profiles_its_w_tasks(tmp_path):
    """Through `dynjax.train` (2 stages x 2 data devices, MoE): the same losses as 1F1B; the
    profiled step's timeline holds each stage's B and W in ZB-H1's order, and the memory
    profile counts what B keeps for W in a microbatch's kept bytes where a stage keeps
    anything (the first stage has no B: it passes no gradient back)."""
    runs = {}
    for schedule in ("1f1b", ZB):
        cfg = tiny_config(
            model__num_layers=3, moe__every=2, mesh__stage=2, mesh__data=2, train__steps=4,
            train__microbatches=2, train__checkpoint_every=100, train__eval_every=100,
            pipeline__stage_layers="(2,1)", pipeline__schedule=schedule,
            pipeline__profile_every=2, recompile__delta_launch=1,
        )
        train(cfg, tmp_path / schedule, progress=False)
        runs[schedule] = tmp_path / schedule
    assert losses(runs[ZB]) == pytest.approx(losses(runs["1f1b"]), rel=1e-5)
    profiles = [e for e in read_jsonl(runs[ZB] / "events.jsonl") if e["event"] == "profile"]
    timed = [e for e in profiles if e["timeline"] is not None]
    assert timed, "no profile's watchers saw a task end"
    tasks = schedule_tasks(ZB, 2, 2)
    for profile in timed:
        rows = [[(k, m) for k, m, _, _ in row] for row in profile["timeline"]]
        assert rows == [[(t.kind, t.microbatch) for t in lane] for lane in tasks]
    kept = {
        schedule: [m["microbatch_input"] for m in next(
            e for e in read_jsonl(runs[schedule] / "events.jsonl") if e["event"] == "profile"
        )["stage_memory_bytes"]]
        for schedule in runs
    }
    assert kept[ZB][0] == kept["1f1b"][0] and kept[ZB][1] > kept["1f1b"][1]
