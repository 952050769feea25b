"""`model.remat`: each policy computes the no-remat step exactly, keeps less for the backward in
the order none > save_proj > full (the compiled step's memory analysis), travels per layer in
the Plan into the stage specs (a policy change recompiles only its stage) and the balancer's
memory model, and its config errors say the key and the fix."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from dynjax import resume
from dynjax.errors import ConfigError
from dynjax.experiment import Experiment
from dynjax.model import GPT, GPTConfig, lm_loss
from dynjax.model.moe import static_options
from dynjax.model.remat import REMAT
from dynjax.parallel.executable import program_key, program_kinds
from dynjax.parallel.profile import timed_units
from dynjax.parallel.residuals import kept_bytes
from dynjax.recompile import Plan, PlanContext, PlanError
from dynjax.train import main

from ..tiny import tiny_config

POLICIES = REMAT[1:]
# Llama's block (its SwiGLU gate is a projection too) with an MoE layer after three dense ones;
# the first frozen, so `scan_layers` runs the other two as one scan.
LLAMA_MOE = GPTConfig(
    vocab_size=64, num_layers=4, d_model=32, num_heads=2, mlp_dim=64, max_len=16,
    family="llama", moe_layers=(3,), num_experts=4, top_k=2, scan_min_layers=2,
)
OPTIONS = static_options(4, (3,), ((16,) * 4,))
TOKENS = jax.random.randint(jax.random.key(1), (4, 16), 0, 64)


def loss_and_grads(cfg: GPTConfig, remat):
    graphdef, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(0)))

    def loss(params):
        logits, _, _ = nnx.merge(graphdef, params).forward(
            TOKENS, options=OPTIONS, remat=remat, frozen=(0,)
        )
        return lm_loss(logits, TOKENS)

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.fixture(scope="module")
def reference():
    return loss_and_grads(dataclasses.replace(LLAMA_MOE, scan_layers=False), None)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("remat", POLICIES)
def test_each_policy_gives_the_loss_and_gradients_of_no_remat(reference, remat, scan):
    cfg = dataclasses.replace(LLAMA_MOE, scan_layers=scan)
    got = loss_and_grads(cfg, (remat,) * 4)
    for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-7)


def test_offload_moves_the_projections_to_host_and_back():
    """``offload_proj`` keeps the projections in pinned host memory: the gradient's program
    moves each there in the forward (XLA:CPU then lowers the moves to nothing: the config
    refuses the policy there, `test_offload_on_cpu_is_a_config_error`)."""
    cfg = dataclasses.replace(LLAMA_MOE, num_layers=1, moe_layers=())
    graphdef, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(0)))

    def loss(params, remat):
        logits, _, _ = nnx.merge(graphdef, params).forward(TOKENS, remat=remat)
        return lm_loss(logits, TOKENS)

    def host_arrays(remat):
        jaxpr = jax.make_jaxpr(jax.grad(loss), static_argnums=1)(params, remat)
        return str(jaxpr).count("<host>")

    assert host_arrays(("save_proj",)) == 0
    # qkv, attention out, gate, up and down: each moved to host and its copy read back
    assert host_arrays(("offload_proj",)) >= 5


def test_kept_memory_falls_from_none_to_save_proj_to_full():
    """The compiled train step of a model whose activations dominate (long sequences, narrow
    layers) needs fewer temporary bytes the less its layers keep. Scanned, so that XLA:CPU
    recomputes each layer in its backward iteration: unrolled, its scheduler runs the
    recomputation beside the forward and the peak does not move (docs/models.md). A scanned
    "none" keeps the matmuls' outputs only (`rematerialised`), so even it needs less than the
    unrolled step."""
    temp = {}
    for scan in (True, False):
        exp = Experiment.from_config(tiny_config(
            model__num_layers=4, model__mlp_dim=128, model__scan_layers=scan,
            model__scan_min_layers=2,
            data__seq_len=128, train__batch_size=16,
        ))
        plan = exp.initial_plan()
        for remat in ("none", "save_proj", "full") if scan else ("none",):
            compiled = exp.lower_train_step(plan.replace(remat=(remat,) * 4)).compile()
            temp[scan, remat] = compiled.memory_analysis().temp_size_in_bytes
    assert temp[True, "none"] > 1.3 * temp[True, "save_proj"], temp
    assert temp[True, "save_proj"] > 1.1 * temp[True, "full"], temp
    assert temp[True, "none"] < 0.75 * temp[False, "none"], temp


@pytest.mark.parametrize("overrides", [
    # a wrapper that reads the readout (parameters of the last layers) and carries per token
    dict(early_exit__enabled=True),
    # MPipeMoE's own checkpoint nested in the block's
    dict(moe__every=2, moe__chunks=2, moe__memory_reuse="S4"),
], ids=["early_exit", "moe_s4"])
def test_a_train_step_under_per_layer_policies_equals_one_without(overrides):
    exp = Experiment.from_config(tiny_config(model__num_layers=3, **overrides))
    plan = exp.initial_plan().replace(frozen_layers=(0,))
    mixed = plan.replace(remat=("full", "none", "save_proj"))
    assert exp.step_spec(mixed).remat == mixed.remat
    batch = exp.device_batch(exp.order.batch(0))
    after = []
    for p in (plan, mixed):
        state = exp.init_state()  # the step donates it
        after.append(exp.lower_train_step(p).compile()(state["params"], state["opt_state"], batch))
    for a, b in zip(*(jax.tree.leaves(jax.device_get(x[:2])) for x in after), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(after[1][2]["loss"], after[0][2]["loss"], rtol=1e-6)


def test_the_plan_carries_one_policy_per_layer():
    ctx = PlanContext(batch_size=8, num_layers=4)
    plan = Plan(remat=("full", "none", "save_proj", "none"))
    plan.validate(ctx)
    assert Plan.from_dict(plan.to_dict()) == plan
    assert Plan(remat=("none",) * 4) == Plan()  # no policy is one Plan, however written
    assert plan.diff(plan.replace(remat=("full", "full", "save_proj", "none"))) == {
        "remat": (["full", "none", "save_proj", "none"], ["full", "full", "save_proj", "none"])
    }
    with pytest.raises(PlanError, match="has 2 policies but the model has 4 layers"):
        Plan(remat=("full", "full")).validate(ctx)
    with pytest.raises(PlanError, match=r"remat policies \['ful'\] are unknown"):
        Plan(remat=("ful", "none", "none", "none")).validate(ctx)
    exp = Experiment.from_config(tiny_config(model__remat="save_proj"))
    assert exp.initial_plan().remat == ("save_proj", "save_proj")


def test_one_layers_policy_recompiles_only_its_stage():
    """The Plan's per-layer policy reaches the stage specs: a change in layer 1 (stage 0) keys
    stage 0's forward and backward anew (the compile cache's keys, `program_key`), and nothing
    of stage 1 nor either stage's gradient-norm and update programs."""
    exp = Experiment.from_config(tiny_config(
        model__num_layers=4, mesh__stage=2, train__microbatches=2
    ))
    plan = exp.initial_plan()
    changed = plan.replace(remat=("none", "full", "none", "none"))
    hooks = exp.pipeline_programs.setup.parts.cfg.hooks
    old, new = (exp.pipeline_spec(p).stages for p in (plan, changed))
    assert [s.remat for s in new] == [("none", "full"), ()]
    rekeyed = [
        (kind, s.index)
        for a, s in zip(old, new, strict=True)
        for kind in program_kinds(s)
        if program_key(kind, a, hooks) != program_key(kind, s, hooks)
    ]
    assert rekeyed == [("fwd", 0), ("bwd", 0)]


def test_the_profile_weighs_each_layer_by_what_its_policy_keeps():
    """The balancer's memory model shares a stage's temporaries by each layer's kept
    activations (`layer_memory`); a profile measures them per layer with its policy."""
    exp = Experiment.from_config(tiny_config(model__num_layers=3, mesh__stage=2))
    programs = exp.pipeline_programs
    remat = ("save_proj", "none", "full")  # stage 0: layers 0-1, stage 1: layer 2 (last)
    spec = exp.pipeline_spec(exp.initial_plan().replace(remat=remat, stage_layers=(2, 1)))
    kept = {}
    for unit, one, _ in timed_units(spec, programs.setup.parts):
        if unit[0] == "layers":
            mesh = programs.transport.stage_meshes[one.index]
            kept[remat[unit[1]]] = kept_bytes(programs.setup, one, mesh, programs.shapes(one))
    assert kept["none"] > kept["save_proj"] > kept["full"] > 0


@pytest.mark.parametrize("value, message", [
    ("fulll", "error: model.remat='fulll' is not one of ("),
    ("offload_proj", "error: model.remat='offload_proj' offloads the projections' outputs to "
                     "pinned host memory, but on the cpu backend"),
])
def test_bad_values_are_config_errors(capsys, value, message):
    assert main(["--config=tests/tiny.py", f"--config.model.remat={value}"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    if value == "offload_proj":
        assert "use model.remat='save_proj'" in err



@pytest.mark.slow
@pytest.mark.parametrize("schedule, recompute", [("1f1b", False), ("zb_h1", True)])
def test_a_pipeline_step_under_per_layer_policies_equals_one_without(schedule, recompute):
    """Stage programs rematerialise their layers: on the residuals a forward keeps
    (``recompute`` off) and in ZB-H1's cut backward (a rematerialised block cut as a whole)."""
    exp = Experiment.from_config(tiny_config(
        model__num_layers=3, mesh__stage=2, train__microbatches=2, pipeline__schedule=schedule,
        pipeline__recompute=recompute,
    ))
    plan = exp.initial_plan()
    states, losses = [], []
    for p in (plan, plan.replace(remat=("full", "save_proj", "full"))):
        runtime = exp.runtime(p)
        metrics = runtime.step(exp.lower_train_step(p).compile(), exp.order.batch(0), None)
        losses.append(float(runtime.host_metrics(0, jax.device_get(metrics))["loss"]))
        states.append(jax.tree.leaves(runtime.pipeline.host_state()["params"]))
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)
    for a, b in zip(*states, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)


def test_a_run_resumes_under_another_policy():
    """What a block keeps for its backward is not what the state is: a resumed run may change
    `model.remat`, and its Plan then takes the new config's policies."""
    changes = {"model.remat": ("none", "full")}
    resume.check_resumable(changes, "workdir")  # no error
    with pytest.raises(ConfigError, match="model.d_model"):
        resume.check_resumable({"model.d_model": (32, 64)}, "workdir")
    saved, implied = Plan(microbatches=2), Plan(remat=("full", "full"))
    assert resume.resumed_plan(saved, implied, changes) == Plan(
        microbatches=2, remat=("full", "full")
    )
