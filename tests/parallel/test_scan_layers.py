"""Layers scanned (``model.scan_layers``) equal layers unrolled (issue 15 §3).

Scanned and unrolled forwards give the same loss, gradients and per-layer metrics in float32
for a dense model, an MoE model, a pruned model (a weight hook inside the scan) and a model with
frozen layers, on one device and in a 2-stage pipeline on 8 fake devices, across a layer
migration; the grouping of layers into scanned runs splits on every static difference.
"""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from dynjax.balance import schedule_tasks
from dynjax.config import set_value, validate_config
from dynjax.dynamism import pruning_math as pm
from dynjax.errors import ConfigError
from dynjax.experiment import Experiment
from dynjax.model import GPT, GPTConfig, ModelParts
from dynjax.model.gpt import layer_runs, scan_runs
from dynjax.parallel import make_mesh, make_train_step, whole_model
from dynjax.parallel.executable import PipelinePrograms
from dynjax.parallel.pipeline import Pipeline, host_metrics
from dynjax.parallel.stage import StageSetup
from dynjax.parallel.stages import PipelineSpec, stage_specs
from dynjax.parallel.transport import Transport

from ..helpers import loss_terms, moe_options, stage_setup
from ..tiny import tiny_config

DENSE = GPTConfig(vocab_size=64, num_layers=6, d_model=16, num_heads=2, mlp_dim=32, max_len=8)
# MoE layers 1-3: 1 and 2 share capacities (one scanned run), 3 has its own.
MOE = dataclasses.replace(DENSE, moe_layers=(1, 2, 3), num_experts=4, top_k=2)
CAPS = ((3, 5, 3, 5), (3, 5, 3, 5), (4, 4, 2, 6))
B = 8


def setup_of(cfg: GPTConfig, scan: bool, opt=None, scan_min: int = 2):
    cfg = dataclasses.replace(cfg, scan_layers=scan, scan_min_layers=scan_min)
    return stage_setup(cfg, opt)


def spec_of(cfg: GPTConfig, caps, z_loss_weight=0.0, **kw):
    """The single program's one stage of ``cfg``."""
    options = moe_options(cfg, caps, z_loss_weight=z_loss_weight) if cfg.moe_layers else ()
    return whole_model(cfg.num_layers, batch_size=B, options=options, **kw)


def params_of(cfg: GPTConfig):
    return jax.device_get(nnx.to_pure_dict(nnx.state(GPT(cfg, rngs=nnx.Rngs(0)))))


def batch(seed=1, seq=8):
    rng = np.random.default_rng(seed)
    return {k: rng.integers(0, 64, (B, seq)).astype(np.int32) for k in ("inputs", "targets")}


def assert_trees_close(ref, got, rtol, what=""):
    for (path, x), y in zip(
        jax.tree_util.tree_leaves_with_path(ref), jax.tree.leaves(got), strict=True
    ):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        np.testing.assert_array_equal(np.isnan(x), np.isnan(y))  # NaN: a frozen layer's norm
        x, y = np.nan_to_num(x), np.nan_to_num(y)
        err = np.max(np.abs(x - y), initial=0) / (np.max(np.abs(x), initial=0) + 1e-30)
        assert err < rtol, f"{what}{jax.tree_util.keystr(path)}: relative error {err:.2e}"


def loss_and_grads(setup, params, data, spec):
    """(loss, metrics), gradients; and how many scans the traced forward holds."""
    f = lambda p: loss_terms(setup, spec, None, p, data["inputs"], data["targets"])
    scans = str(jax.make_jaxpr(f)(params)).count("scan[")
    return jax.jit(jax.value_and_grad(f, has_aux=True))(params), scans


def test_layer_runs_are_maximal_runs_of_equal_keys():
    assert layer_runs([]) == ()
    assert layer_runs(list("aabbbac")) == ((0, 2), (2, 5), (5, 6), (6, 7))
    assert layer_runs([1, 1, 1, 1]) == ((0, 4),)


def test_scan_runs_split_on_kind_capacities_options_freezing_and_remat():
    cfg = dataclasses.replace(MOE, num_layers=8, moe_layers=(2, 3, 4))
    blocks = list(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))).layers)
    caps = ((2, 2, 2, 2), (2, 2, 2, 2), (1, 2, 3, 4))
    options = moe_options(cfg, caps, base=[()] * 7 + [(("some_plugin", 1),)])
    frozen = [True] + [False] * 7
    # frozen 0 | dense 1 | MoE 2-3 (same capacities) | MoE 4 | dense 5-6 | dense 7 with a record
    assert scan_runs(blocks, options, [{}] * 8, frozen, ["none"] * 8) == (
        (0, 1), (1, 2), (2, 4), (4, 5), (5, 7), (7, 8)
    )
    # dense 5 and 6 under different rematerialisation policies: two scan bodies
    remat = ["none"] * 6 + ["full"] * 2
    assert scan_runs(blocks, options, [{}] * 8, frozen, remat) == (
        (0, 1), (1, 2), (2, 4), (4, 5), (5, 6), (6, 7), (7, 8)
    )


@pytest.mark.slow
@pytest.mark.parametrize("cfg, caps", [(DENSE, ()), (MOE, CAPS)], ids=["dense", "moe"])
def test_scanned_forward_and_gradients_equal_unrolled(cfg, caps):
    params, data = params_of(cfg), batch()
    opts = spec_of(cfg, caps, z_loss_weight=1e-3)
    (ref, ref_grads), unrolled_scans = loss_and_grads(setup_of(cfg, False), params, data, opts)
    (got, got_grads), scans = loss_and_grads(setup_of(cfg, True), params, data, opts)
    assert unrolled_scans == 0 and scans > 0  # the layers really ran under a scan
    assert_trees_close(ref, got, 1e-5, "forward ")
    assert_trees_close(ref_grads, got_grads, 1e-5, "gradient ")
    if caps:  # capacities drop tokens: per-layer stats came out of the scan in layer order
        assert got[1]["moe/dropped"].shape == (3,) and float(ref[1]["moe/dropped"][0]) > 0


PRUNED = (0.2, 0.4, 0.6, 0.8)  # the fraction of each layer's prunable weights set to zero


def pruned_experiment(scan: bool) -> Experiment:
    return Experiment.from_config(
        tiny_config(
            pruning__enabled=True, model__num_layers=4, model__scan_layers=scan,
            model__scan_min_layers=2,
        )
    )


@pytest.mark.slow
def test_a_weight_hook_inside_the_scan_equals_unrolled():
    """Pruning's weight hook (zero pattern, density metric) runs on each layer's own weights
    inside the scan: same loss, gradients (zero at pruned weights) and per-layer densities."""
    rng = np.random.default_rng(0)
    data = {k: rng.integers(0, 256, (8, 32)).astype(np.int32) for k in ("inputs", "targets")}
    results = {}
    for scan in (False, True):
        exp = pruned_experiment(scan)
        plan = exp.initial_plan()
        opts = exp.step_spec(plan)
        assert all(opts.options)
        params = exp.init_host_state()["params"]
        names = set(pm.prunable_leaves(params))

        def prune(path, w, names=names):
            name = jax.tree_util.keystr(path, simple=True, separator="/")
            if name not in names:
                return w
            keep = np.random.default_rng(len(name)).random(w.shape)
            return np.where(keep < PRUNED[path[1].key], 0, w).astype(w.dtype)

        params = jax.tree_util.tree_map_with_path(prune, params)
        results[scan] = loss_and_grads(exp.stage_setup, params, data, opts)[0], params
    (ref, ref_grads), params = results[False]
    (got, got_grads), _ = results[True]
    assert_trees_close(ref, got, 1e-5, "forward ")
    assert_trees_close(ref_grads, got_grads, 1e-5, "gradient ")
    density = np.asarray(got[1]["pruning/density"])
    assert density.shape == (4,) and np.all(np.diff(density) < 0)  # one density per layer
    pruned = {n: np.asarray(w) == 0 for n, w in pm.prunable_leaves(params).items()}
    for name, grad in pm.prunable_leaves(got_grads).items():
        assert not np.any(np.asarray(grad)[pruned[name]]), name


@pytest.mark.slow
def test_frozen_layers_train_as_unrolled():
    """A frozen prefix and a frozen layer inside: a train step (2 microbatches, SGD) leaves
    them unchanged and moves the others as the unrolled step does."""
    params, data = params_of(MOE), batch()
    opt = optax.sgd(0.3)
    opts = spec_of(MOE, CAPS, microbatches=2, frozen_layers=(0, 1, 4))
    out = {}
    for scan in (False, True):
        step = jax.jit(make_train_step(setup_of(MOE, scan, opt), opts, None))
        out[scan] = step(params, opt.init(params), data)
    ref, got = out[False], out[True]
    assert_trees_close(ref[0], got[0], 1e-5, "params ")
    assert_trees_close(ref[2], got[2], 1e-5, "metrics ")
    for i in (0, 1, 4):
        for x, y in zip(
            jax.tree.leaves(params["layers"][i]), jax.tree.leaves(got[0]["layers"][i]), strict=True
        ):
            np.testing.assert_array_equal(x, y)


def test_scan_layers_must_be_a_bool():
    cfg = tiny_config()
    with pytest.raises(ConfigError, match="model.scan_layers"):
        set_value(cfg, "model.scan_layers", "1")  # the command line's --config.model.scan_layers
    set_value(cfg, "model.scan_layers", "False")
    validate_config(cfg, 8)
    assert not Experiment.from_config(cfg).model_cfg.scan_layers


def test_runs_shorter_than_scan_min_layers_are_unrolled():
    """The default scans the 6 dense layers' one run only from ``scan_min_layers`` <= 6 on."""
    params, data = params_of(DENSE), batch()
    opts = spec_of(DENSE, ())
    scans = {n: loss_and_grads(setup_of(DENSE, True, scan_min=n), params, data, opts)[1]
             for n in (6, 7)}
    assert scans[6] > 0 and scans[7] == 0, scans  # (the index loop of `_stack` is one too)
    assert tiny_config().model.scan_min_layers == 8  # the default (`SCAN_MIN_LAYERS`)


def test_scan_min_layers_below_two_is_a_config_error():
    with pytest.raises(ConfigError, match=r"model.scan_min_layers=1 must be >= 2.*"
                       r"model.scan_layers=False"):
        validate_config(tiny_config(model__scan_min_layers=1), 8)


def test_a_split_backward_pipeline_unrolls_its_stages():
    """ZB-H1 cuts each stage's backward at its layers' equations: its stages never scan,
    whatever model.scan_layers says; 1F1B's do."""
    def scanned(schedule):
        cfg = tiny_config(mesh__stage=2, pipeline__schedule=schedule, model__scan_layers=True)
        return Experiment.from_config(cfg).model_cfg.scan_layers

    assert not scanned("zb_h1") and scanned("1f1b")


# -- a 2-stage pipeline on 8 fake devices (2 stages x 2 data x 2 expert) ------------------------

PIPE = dataclasses.replace(MOE, moe_layers=(1, 2, 4), num_experts=4)
PIPE_CAPS = ((4, 4, 4, 4),) * 3
M, STEPS = 2, 3


def run_pipeline(cfg, scan, layouts, frozen=(), caps=PIPE_CAPS):
    """Per-step losses and the final host state of a pipeline that runs step s on
    ``layouts[s]`` (a migration where it changes)."""
    cfg = dataclasses.replace(cfg, scan_layers=scan, scan_min_layers=2)
    opt = optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.3, momentum=0.9))
    params = params_of(cfg)
    state = {"params": params, "opt_state": opt.init(params)}
    setup = StageSetup(parts=ModelParts.of(cfg), optimizer=opt, grad_clip=0.5)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    programs = PipelinePrograms(
        setup, Transport(make_mesh(2, 2, 2)), abstract["params"], seq_len=8
    )

    def executable(layout):
        stages = stage_specs(
            layout,
            frozen_layers=frozen,
            microbatches=M,
            batch_size=B,
            dtype="float32",
            options=moe_options(cfg, caps, z_loss_weight=1e-3) if caps else (),
            hooks=cfg.hooks,
        )
        spec = PipelineSpec(stages, "1f1b", schedule_tasks("1f1b", len(layout), M))
        return programs.lower(spec).compile()

    pipeline = Pipeline(programs, abstract)
    exe = executable(layouts[0])
    pipeline.place(state, exe.spec)
    losses = []
    for step in range(STEPS):
        if layouts[step] != layouts[step - 1] and step > 0:
            exe = executable(layouts[step])
            pipeline.migrate(exe)
        metrics = host_metrics(jax.device_get(pipeline.step(exe, **batch(step))), cfg.hooks)
        losses.append(metrics["loss"])
    return np.array(losses), pipeline.host_state()


@pytest.mark.slow
def test_pipeline_with_scan_migrates_and_equals_unrolled():
    """MoE layers on 2 stages; before step 1 layer 3 moves from stage 1 to stage 0."""
    layouts = [(3, 3), (4, 2), (4, 2)]
    ref_losses, ref_state = run_pipeline(PIPE, False, layouts)
    losses, state = run_pipeline(PIPE, True, layouts)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(ref_state, state, 1e-5)


@pytest.mark.slow
def test_pipeline_with_scan_and_frozen_layers_equals_unrolled():
    layouts = [(3, 3)] * STEPS
    ref_losses, ref_state = run_pipeline(DENSE, False, layouts, frozen=(0, 1, 3), caps=())
    losses, state = run_pipeline(DENSE, True, layouts, frozen=(0, 1, 3), caps=())
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(ref_state, state, 1e-5)
