"""Parallel equals sequential: the MPMD pipeline against the single-program step on one device.

4 stages x 2 data devices with an uneven assignment, GPipe and 1F1B over the same compiled stage
programs, MoE (dropping tokens) and learned positions, gradient clipping that triggers; then a
changed assignment mid-training (migration), with SGD and with the real AdamW. The first also
runs the Llama family (grouped-query attention, SwiGLU, shared expert, RoPE).
"""

import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from dynjax.balance import schedule_tasks
from dynjax.model import GPT, GPTConfig, ModelParts
from dynjax.optim import make_optimizer
from dynjax.parallel import expert_parallel, make_mesh, make_train_step, whole_model
from dynjax.parallel import timeline as timeline_module
from dynjax.parallel.dispatch import dispatch_order, overlapped_order
from dynjax.parallel.executable import PipelinePrograms
from dynjax.parallel.pipeline import Pipeline
from dynjax.parallel.pipeline import host_metrics as fold_host_metrics
from dynjax.parallel.profile import (
    ANCHORS,
    UnitTimes,
    program_temp_bytes,
    rescaled_units,
    stage_busy_seconds,
    stage_memory,
    timed_units,
    units_busy_seconds,
)
from dynjax.parallel.residuals import kept_bytes
from dynjax.parallel.stage import StageSetup
from dynjax.parallel.stages import PipelineSpec, stage_specs
from dynjax.parallel.transport import Transport
from dynjax.settings import optimizer_settings, read_run

from ..helpers import assert_close, loss_terms, moe_options, stage_setup
from ..tiny import tiny_config

CFG = GPTConfig(
    vocab_size=64,
    num_layers=5,
    d_model=16,
    num_heads=2,
    mlp_dim=32,
    max_len=8,
    positions="learned",
    moe_layers=(2,),
    num_experts=4,
    top_k=2,
)
# The Llama family (docs/models.md): one key/value head for two query heads, SwiGLU experts
# with a shared one, RoPE (the family has no learned positions).
LLAMA = dataclasses.replace(
    CFG, family="llama", positions="rope", num_kv_heads=1, shared_expert_dim=16
)
FAMILIES = {"gpt": CFG, "llama": LLAMA}
CAPS = ((2, 5, 3, 4),)  # uneven and small: tokens are dropped


def host_metrics(raw):
    """`pipeline.host_metrics` with the model's hook sets."""
    return fold_host_metrics(raw, CFG.hooks)
CLIP = 0.5  # below the gradient norm of the first step: clipping is global and active
LR = 0.3
M, B, STEPS = 2, 8, 3
ASSIGNMENT = (1, 2, 1, 1)


def optimizer():
    # SGD moves parameters by the gradient itself, so the comparison sees gradient errors as they
    # are (Adam would amplify float noise in near-zero gradients to full-size steps); its
    # momentum is per-parameter optimizer state that must follow its layer between stages.
    return optax.chain(optax.clip_by_global_norm(CLIP), optax.sgd(LR, momentum=0.9))


def adamw():
    """The optimizer training runs (`make_optimizer`): clipping, then AdamW with warmup and
    cosine decay. Adam's step count and the schedule's are scalars every stage holds a copy
    of; its moments are per parameter and must follow their layer between stages."""
    cfg = tiny_config(train__steps=STEPS, train__grad_clip=CLIP)
    return make_optimizer(optimizer_settings(read_run(cfg).train))


def batches():
    rng = np.random.default_rng(1)
    return [
        {k: rng.integers(0, 64, (B, 8)).astype(np.int32) for k in ("inputs", "targets")}
        for _ in range(STEPS)
    ]


@functools.cache
def initial_state(opt=optimizer, cfg=CFG):
    """Host arrays, shared by the tests (nothing mutates them)."""
    params = nnx.to_pure_dict(nnx.state(GPT(cfg, rngs=nnx.Rngs(0))))
    return jax.device_get({"params": params, "opt_state": opt().init(params)})


@pytest.fixture(scope="module")
def reference():
    return reference_run(CFG)


@functools.cache
def reference_run(cfg, opt=optimizer):
    """Per-step metrics and final state of the single-program step on one device."""
    opts = whole_model(
        cfg.num_layers,
        batch_size=B,
        options=moe_options(cfg, CAPS if cfg.moe_layers else (), z_loss_weight=1e-3),
        microbatches=M,
    )
    parallel = expert_parallel(make_mesh(1, 1, 1))
    setup = stage_setup(cfg, opt())
    step = jax.jit(make_train_step(setup, opts, parallel))
    state = initial_state(opt, cfg)
    p, s = state["params"], state["opt_state"]
    metrics = []
    for batch in batches():
        p, s, m = step(p, s, batch)
        metrics.append(jax.device_get(m))
    return metrics, jax.device_get({"params": p, "opt_state": s})


def assert_matches_one_device(programs, template, spec) -> None:
    """``spec``'s pipeline trains the test batches as the single program does (`reference_run`):
    losses, MoE drops and clipped gradient norms step by step, then the final state."""
    ref_metrics, ref_state = reference_run(CFG)
    exe = programs.lower(spec).compile()
    pipeline = Pipeline(programs, template)
    pipeline.place(initial_state(), spec)
    assert ref_metrics[0]["grad_norm"] > CLIP and ref_metrics[0]["moe/dropped"].sum() > 0
    for step, batch in enumerate(batches()):
        metrics = host_metrics(jax.device_get(pipeline.step(exe, **batch)))
        ref = ref_metrics[step]
        for key in ("loss", "aux_loss", "z_loss", "grad_norm", "dropped_fraction"):
            np.testing.assert_allclose(metrics[key], ref[key], rtol=1e-5, err_msg=key)
        np.testing.assert_array_equal(metrics["moe/dropped"], ref["moe/dropped"])
    assert_close(ref_state, pipeline.host_state(), 1e-5)


def pipeline_setup(mesh_shape=(4, 2, 1), opt=optimizer, cfg=CFG):
    setup = StageSetup(parts=ModelParts.of(cfg), optimizer=opt(), grad_clip=CLIP)
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), initial_state(opt, cfg)
    )
    transport = Transport(make_mesh(*mesh_shape))
    programs = PipelinePrograms(setup, transport, abstract["params"], seq_len=8)
    return programs, abstract


def spec_for(assignment, schedule, frozen=(), capacities=CAPS, cfg=CFG):
    stages = stage_specs(
        assignment,
        frozen_layers=frozen,
        microbatches=M,
        batch_size=B,
        dtype="float32",
        options=moe_options(cfg, capacities if cfg.moe_layers else (), z_loss_weight=1e-3),
    )
    return PipelineSpec(stages, schedule, schedule_tasks(schedule, len(assignment), M))


@pytest.fixture(scope="module")
def programs():
    return pipeline_setup()


@functools.cache
def llama_programs():
    return pipeline_setup(cfg=LLAMA)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_uneven_pipeline_matches_one_device(programs, reference, schedule, family):
    cfg = FAMILIES[family]
    programs, template = programs if family == "gpt" else llama_programs()
    ref_metrics, ref_state = reference if family == "gpt" else reference_run(cfg)
    spec = spec_for(ASSIGNMENT, schedule)
    exe = programs.lower(spec).compile()
    start_params = initial_state(cfg=cfg)["params"]
    # The premises: the first step really clips, the capacities really drop tokens.
    assert ref_metrics[0]["grad_norm"] > CLIP and ref_metrics[0]["moe/dropped"].sum() > 0
    pipeline = Pipeline(programs, template)
    pipeline.place(initial_state(cfg=cfg), spec)
    for step, batch in enumerate(batches()):
        metrics = host_metrics(jax.device_get(pipeline.step(exe, **batch)))
        ref = ref_metrics[step]
        for key in ("loss", "aux_loss", "z_loss", "grad_norm", "dropped_fraction"):
            np.testing.assert_allclose(metrics[key], ref[key], rtol=1e-5, err_msg=key)
        for key in ("moe/group_loads", "moe/dropped", "moe/tokens_per_expert"):
            np.testing.assert_array_equal(metrics[key], ref[key], err_msg=key)
        if step == 0:
            # SGD's first step is LR x the clipped gradient (momentum starts at zero): it is
            # LR x CLIP long only if every stage scaled its gradients by the global norm.
            moved = jax.tree.map(np.subtract, pipeline.host_state()["params"], start_params)
            np.testing.assert_allclose(optax.tree.norm(moved), LR * CLIP, rtol=1e-5)
    assert_close(ref_state, pipeline.host_state(), 1e-5)


def test_stages_hold_their_own_layers_on_their_own_devices(programs):
    programs, template = programs
    spec = spec_for(ASSIGNMENT, "1f1b")
    pipeline = Pipeline(programs, template)
    pipeline.place(initial_state(), spec)
    layers = [sorted(pipeline.state[s]["params"].get("layers", {})) for s in range(4)]
    assert layers == [[0], [1, 2], [3], [4]]
    assert "embed" in pipeline.state[0]["params"] and "head" in pipeline.state[3]["params"]
    for s in range(4):
        devices = {d for x in jax.tree.leaves(pipeline.state[s]) for d in x.devices()}
        assert devices == set(programs.transport.stage_meshes[s].devices.flat)


def test_a_step_is_dispatched_without_waiting_for_the_device(programs, monkeypatch):
    programs, template = programs
    spec = spec_for(ASSIGNMENT, "gpipe")
    programs.lower(spec).compile()
    exe = programs.lower(spec).compile()  # equal stage specs: every program from the cache
    assert exe.compiled == ()
    # New capacities for the MoE layer (2, on stage 1) lower stage 1's forward and backward
    # only: the gradient norm and update programs do not depend on capacities.
    resized = programs.lower(spec_for(ASSIGNMENT, "gpipe", capacities=((4, 4, 4, 4),)))
    assert sorted(resized.lowered) == [("bwd", 1), ("fwd", 1)]
    pipeline = Pipeline(programs, template)
    pipeline.place(initial_state(), spec)
    data = batches()
    jax.block_until_ready(pipeline.step(exe, **data[0]))

    # A step never waits on a device result, whatever the machine's speed: every way the host
    # can read or wait for a jax.Array is refused while the steps are dispatched.
    def refuse(*_args, **_kwargs):
        raise AssertionError("a pipeline step waited for the device")

    array_type = type(jax.numpy.zeros(()))
    with monkeypatch.context() as patch:
        patch.setattr(jax, "block_until_ready", refuse)
        patch.setattr(jax, "device_get", refuse)
        for name in (
            "__array__",
            "__float__",
            "__int__",
            "__bool__",
            "item",
            "tolist",
            "block_until_ready",
        ):
            patch.setattr(array_type, name, refuse)
        outs = [pipeline.step(exe, **data[i % STEPS]) for i in range(4)]
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(outs[-1]))


@pytest.mark.parametrize("make_order", [dispatch_order, overlapped_order])
def test_dispatch_orders_respect_dependencies(make_order):
    for name in ("gpipe", "1f1b", "zb_h1"):
        tasks = schedule_tasks(name, 4, 3)
        order = make_order(tasks)
        ran, sent = set(), set()
        for s, t, action in order:
            key = (t.kind, s, t.microbatch)
            if action == "send":
                assert key in ran and key not in sent  # sent once, after it ran
                sent.add(key)
                continue
            if t.kind == "F" and s > 0:
                assert ("F", s - 1, t.microbatch) in sent
            if t.kind == "B" and s < 3:
                assert ("B", s + 1, t.microbatch) in sent
            if t.kind == "W":  # after its own B; a W sends nothing
                assert ("B", s, t.microbatch) in ran
            ran.add(key)
        for s in range(4):  # each stage's own list, in its own order
            assert [t for st, t, a in order if st == s and a == "run"] == list(tasks[s])
        # every forward but the last stage's and every backward but the first's is sent
        assert len(sent) == 2 * 3 * 3
    f0, b0 = schedule_tasks("gpipe", 1, 1)[0]
    f1, b1 = type(f0)("F", 1), type(f0)("B", 1)
    with pytest.raises(ValueError, match="deadlocks"):
        make_order(((f0, b0, f1, b1), (f1, b1, f0, b0)))


def test_overlapped_order_meets_each_transfer_when_it_is_needed():
    """1F1B on 2 stages: in the sweep order stage 0 receives B1's gradient before it runs B0,
    so (with transfers both processes take part in) it waits for stage 1's second microbatch
    before its first backward; the overlapped order interleaves them as the schedule does."""
    tasks = schedule_tasks("1f1b", 2, 4)

    def stage0(order):
        return [f"{t.kind}{t.microbatch}{'' if st == 0 else '<'}" for st, t, a in order
                if (st == 0 and a == "run") or (st == 1 and a == "send")]

    assert stage0(dispatch_order(tasks))[:5] == ["F0", "F1", "B0<", "B1<", "B0"]
    assert stage0(overlapped_order(tasks)) == [
        "F0", "F1", "B0<", "B0", "F2", "B1<", "B1", "F3", "B2<", "B2", "B3<", "B3"
    ]


def train_and_migrate(programs, template, before, after):
    """The test batches on ``before``'s layout, migrating to ``after``'s before step 1; checks
    the state is moved bit for bit (momentum included). Returns (pipeline, migration, losses)."""
    pipeline = Pipeline(programs, template)
    pipeline.place(initial_state(), before.spec)
    exe, losses = before, []
    for step, batch in enumerate(batches()):
        if step == 1:
            held = pipeline.host_state()
            migration = pipeline.migrate(after)
            exe = after
            for x, y in zip(
                jax.tree.leaves(held), jax.tree.leaves(pipeline.host_state()), strict=True
            ):
                np.testing.assert_array_equal(x, y)
        losses.append(host_metrics(jax.device_get(pipeline.step(exe, **batch)))["loss"])
    return pipeline, migration, losses


@pytest.mark.slow
def test_migration_is_exact_and_recompiles_only_changed_stages(programs, reference):
    programs, template = programs
    ref_metrics, ref_state = reference
    before = programs.lower(spec_for(ASSIGNMENT, "1f1b")).compile()
    after = programs.lower(spec_for((2, 1, 1, 1), "1f1b")).compile()
    assert {s for _, s in after.compiled} == {0, 1}  # stages 2 and 3 keep layers 3 and 4
    pipeline, migration, losses = train_and_migrate(programs, template, before, after)
    assert migration.moves == ((1, 1, 0),)  # (layer, from stage, to stage)
    assert sorted(pipeline.state[0]["params"]["layers"]) == [0, 1]
    momentum = pipeline.state[0]["opt_state"][1][0].trace["layers"]
    assert sorted(momentum) == [0, 1]  # the momentum moved with its layer
    layer_bytes = sum(x.nbytes for x in jax.tree.leaves(initial_state()["params"]["layers"][1]))
    assert migration.bytes == 2 * layer_bytes  # parameters and momentum
    assert migration.recompiled_stages == (0, 1)
    np.testing.assert_allclose(losses, [m["loss"] for m in ref_metrics], rtol=1e-5)
    assert_close(ref_state, pipeline.host_state(), 1e-5)


FROZEN = (0, 1, 3)  # a frozen prefix (embedding, layers 0-1) and a frozen layer inside


def frozen_reference(cfg=CFG):
    """The single-program loss with stop_gradient on the frozen units, on one device."""
    opts = whole_model(
        cfg.num_layers, batch_size=B, options=moe_options(cfg, CAPS, z_loss_weight=1e-3)
    )
    setup = stage_setup(cfg)
    parallel = expert_parallel(make_mesh(1, 1, 1))
    opt = optimizer()

    def stopped(params):
        layers = {
            i: jax.lax.stop_gradient(p) if i in FROZEN else p for i, p in params["layers"].items()
        }
        embed = {k: jax.lax.stop_gradient(params[k]) for k in ("embed", "pos") if k in params}
        return {**params, **embed, "layers": layers}

    def loss(params, inputs, targets):
        return loss_terms(setup, opts, parallel, stopped(params), inputs, targets)[0]

    @jax.jit
    def step(params, opt_state, batch):
        grads = [
            jax.grad(loss)(params, batch["inputs"][j::M], batch["targets"][j::M]) for j in range(M)
        ]
        grads = jax.tree.map(lambda *g: sum(g) / M, *grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    state = initial_state(cfg=cfg)
    p, s = state["params"], state["opt_state"]
    for batch in batches():
        p, s = step(p, s, batch)
    return jax.device_get({"params": p, "opt_state": s})


def assert_frozen_matches_one_device(programs, template, schedule: str):
    """``schedule``'s pipeline with the `FROZEN` units trains the test batches to the state of
    `frozen_reference`."""
    spec = spec_for(ASSIGNMENT, schedule, frozen=FROZEN)
    exe = programs.lower(spec).compile()
    pipeline = Pipeline(programs, template)
    pipeline.place(initial_state(), spec)
    for batch in batches():
        pipeline.step(exe, **batch)
    assert_close(frozen_reference(), pipeline.host_state(), 1e-5)
    return exe


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_frozen_layers_get_no_gradient_and_a_frozen_prefix_no_backward(programs, family):
    cfg = FAMILIES[family]
    programs, template = programs if family == "gpt" else llama_programs()
    exe = programs.lower(spec_for(ASSIGNMENT, "1f1b", frozen=FROZEN)).compile()
    assert ("bwd", 0) not in exe.programs  # stage 0 (embedding, layer 0) runs no backward
    assert ("fwd", 0) in exe.programs
    # Stage 1 (layer 1 frozen, layer 2 trainable) returns no input gradient (only a scalar to
    # wait on): nothing before it trains. Stage 2 (layer 3, frozen) returns one for layer 2,
    # but no weight gradient.
    _, g_in = exe.programs["bwd", 1].out_info[:2]
    assert g_in.shape == ()
    acc_2, g_in_2 = exe.programs["bwd", 2].out_info[:2]
    assert acc_2 == {} and g_in_2.shape == (B // M, 8, CFG.d_model)
    pipeline = Pipeline(programs, template)
    start = initial_state(cfg=cfg)
    pipeline.place(start, exe.spec)
    assert sorted(pipeline.acc[1]["layers"]) == [2]  # the accumulator holds trainable layers only
    for batch in batches():
        pipeline.step(exe, **batch)
    got = pipeline.host_state()
    positions = [("pos",)] if cfg.positions == "learned" else []
    unchanged = [("embed",), *positions] + [("layers", i) for i in FROZEN]
    for unit in unchanged:
        node_start, node_got = start["params"], got["params"]
        for key in unit:
            node_start, node_got = node_start[key], node_got[key]
        for x, y in zip(jax.tree.leaves(node_start), jax.tree.leaves(node_got), strict=True):
            np.testing.assert_array_equal(x, y)
    momentum = got["opt_state"][1][0].trace["layers"]
    assert all(not np.any(x) for i in FROZEN for x in jax.tree.leaves(momentum[i]))
    assert_close(frozen_reference(cfg), got, 1e-5)


@pytest.mark.slow
def test_repack_onto_fewer_stages_is_exact_and_frees_the_rest(programs, reference):
    """Seed 000 §3.4: four stages merge into two mid-training; learning does not notice."""
    programs, template = programs
    ref_metrics, ref_state = reference
    before = programs.lower(spec_for(ASSIGNMENT, "1f1b")).compile()
    packed = programs.lower(spec_for((3, 2), "1f1b")).compile()
    pipeline, migration, losses = train_and_migrate(programs, template, before, packed)
    assert migration.moves == ((1, 1, 0), (2, 1, 0), (3, 2, 1), (4, 3, 1))
    assert sorted(pipeline.state) == [0, 1]  # sub-meshes 2 and 3 hold nothing any more
    assert sorted(pipeline.state[1]["params"]["layers"]) == [3, 4]
    stage_1 = set(programs.transport.stage_meshes[1].devices.flat)
    assert all(
        set(leaf.devices()) <= stage_1 for leaf in jax.tree.leaves(pipeline.state[1])
    )
    np.testing.assert_allclose(losses, [m["loss"] for m in ref_metrics], rtol=1e-5)
    assert_close(ref_state, pipeline.host_state(), 1e-5)
    programs.release((2, 3))
    assert all(spec.index < 2 for _, spec in programs._compiled)
    assert all(spec.index < 2 for spec in programs._shapes)


def step_counts(tree):
    """The step-count scalars in an optimizer state (Adam's, the learning-rate schedule's)."""
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [int(x) for path, x in paths if getattr(path[-1], "name", None) == "count"]


@pytest.mark.slow
def test_migration_carries_adamw_counts_and_moments_exactly():
    """Two stages grow to four after one step: the stages that are new take the step counts
    from the stage that held them, the moved layers take their moments, and training goes on
    as on the two stages that never moved."""
    programs, template = pipeline_setup(opt=adamw)
    start = initial_state(adamw)
    two = programs.lower(spec_for((3, 2), "1f1b")).compile()
    four = programs.lower(spec_for(ASSIGNMENT, "1f1b")).compile()
    loss = lambda pipeline, exe, batch: host_metrics(
        jax.device_get(pipeline.step(exe, **batch))
    )["loss"]
    unmoved = Pipeline(programs, template)
    unmoved.place(start, two.spec)
    ref_losses = [loss(unmoved, two, batch) for batch in batches()]

    pipeline = Pipeline(programs, template)
    pipeline.place(start, two.spec)
    losses = [loss(pipeline, two, batches()[0])]
    held = pipeline.host_state()
    assert [step_counts(pipeline.state[s]["opt_state"]) for s in (0, 1)] == [[1, 1]] * 2
    migration = pipeline.migrate(four)
    assert migration.moves == ((1, 0, 1), (2, 0, 1), (3, 1, 2), (4, 1, 3))
    # Every stage holds, bit for bit, what placing the full state on four stages gives it.
    placed = Pipeline(programs, template)
    placed.place(held, four.spec)
    assert sorted(pipeline.state) == sorted(placed.state) == [0, 1, 2, 3]
    for s in range(4):
        for (path, x), y in zip(
            jax.tree_util.tree_leaves_with_path(placed.state[s]),
            jax.tree.leaves(pipeline.state[s]),
            strict=True,
        ):
            np.testing.assert_array_equal(x, y, err_msg=f"stage {s} {jax.tree_util.keystr(path)}")
        assert step_counts(pipeline.state[s]["opt_state"]) == [1, 1]
    mu = pipeline.state[2]["opt_state"][1][0].mu["layers"]
    assert sorted(mu) == [3]  # the moments moved with their layer
    held_mu = held["opt_state"][1][0].mu["layers"][3]
    for x, y in zip(jax.tree.leaves(held_mu), jax.tree.leaves(mu[3]), strict=True):
        np.testing.assert_array_equal(x, y)
    losses += [loss(pipeline, four, batch) for batch in batches()[1:]]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert [step_counts(pipeline.state[s]["opt_state"]) for s in range(4)] == [[STEPS] * 2] * 4
    # Two and four stages run different programs: float noise, which Adam's normalised steps
    # enlarge in near-zero gradients (a reset count would change whole steps: warmup, bias).
    assert_close(unmoved.host_state(), pipeline.host_state(), 1e-4)


@pytest.mark.slow
def test_profile_of_frozen_layers_counts_only_the_backward_the_step_runs(programs):
    programs, template = programs
    exe = programs.lower(spec_for(ASSIGNMENT, "1f1b", frozen=FROZEN), profiling=True).compile()
    pipeline = Pipeline(programs, template)
    pipeline.place(initial_state(), exe.spec)
    _, profile = pipeline.profile_step(exe, **batches()[0], repeats=1)
    units = profile.units
    # The embedding and layers 0-1 form the frozen prefix: no backward at all.
    assert units.embed[1] == 0 and units.layer_backward[:2] == (0.0, 0.0)
    # Layer 3 is frozen but after trainable layer 2: it passes gradients back.
    assert units.layer_backward[3] > 0 and units.layer_backward[2] > 0
    assert min(units.layer_forward) > 0 and min(units.head) > 0


def test_a_periodic_profile_rescales_the_measured_units_by_its_own_timeline(programs):
    programs, template = programs
    exe = programs.lower(spec_for(ASSIGNMENT, "1f1b"), profiling=True).compile()
    pipeline = Pipeline(programs, template)
    pipeline.place(initial_state(), exe.spec)
    _, full = pipeline.profile_step(exe, **batches()[0], repeats=1)
    assert full.units_measured and full.event(0)["units"] == "measured"

    def unit_program_ran(*args, **kwargs):
        raise AssertionError("a periodic profile of a measured layout ran a unit alone")

    no_units = dataclasses.replace(exe, profiling={key: unit_program_ran for key in exe.profiling})
    _, light = pipeline.profile_step(no_units, **batches()[1], repeats=1)
    assert not light.units_measured and light.event(1)["units"] == "rescaled"
    # Each stage's units scale by its busy time in this step against what they add up to
    # alone (not against the measured step's, which may be a first run); a stage measured
    # idle keeps them, and so do all when a watcher woke only after its stage's tasks ended
    # (a loaded machine: `Profile.timeline_measured`).
    now = stage_busy_seconds(light.timeline)
    then = units_busy_seconds(full.units.by_unit(), exe.spec)
    assert then[0] == pytest.approx(
        exe.spec.microbatches * (sum(full.units.embed) + full.units.layer_forward[0]
                                 + full.units.layer_backward[0])
    )
    then = np.array([then[s] for s in range(len(ASSIGNMENT))])
    factors = np.where(then > 0, now / np.where(then > 0, then, 1.0), 1.0)
    if not light.timeline_measured:
        factors = np.ones_like(factors)
    owner = [s for s, count in enumerate(ASSIGNMENT) for _ in range(count)]
    units = zip(light.units.layer_forward, light.units.layer_backward, strict=True)
    for i, (f, b) in enumerate(units):
        np.testing.assert_allclose(f, full.units.layer_forward[i] * factors[owner[i]], rtol=1e-9)
        np.testing.assert_allclose(b, full.units.layer_backward[i] * factors[owner[i]], rtol=1e-9)
    np.testing.assert_allclose(light.units.head, np.array(full.units.head) * factors[-1])


def test_after_a_plan_change_only_the_units_it_changed_and_the_anchors_run_alone(programs):
    # A unit keeps its measurement while its timing signature stays: a capacity change re-times
    # the MoE layer alone, a move the layer moved alone, and a new layout whose units are all
    # known re-times none of them; each also re-runs the ANCHORS longest known units of distinct
    # signatures and scales every other kept time by the median of their changes (the
    # machine's drift). A later profile of a layout rescales them from its step's timeline.
    programs, template = programs

    def lowered(assignment, capacities, schedule="1f1b"):
        spec = spec_for(assignment, schedule, capacities=capacities)
        exe = programs.lower(spec, profiling=True).compile()

        def counted(key, program):
            return lambda *args: ran.append(key[1].layers) or program(*args)

        return dataclasses.replace(
            exe, profiling={key: counted(key, p) for key, p in exe.profiling.items()}
        )

    def anchor_units(units):
        # the first unit of each of the ANCHORS longest kept times (units of one signature share
        # theirs; distinct signatures' timings differ)
        first = {}
        for u, t in units.items():
            first.setdefault(tuple(t), u)
        return [u for t, u in sorted(first.items(), key=lambda tu: -sum(tu[0]))[:ANCHORS]]

    def anchors(units):  # their layers (() for the embedding or the head)
        return {() if u[0] != "layers" else (u[1],) for u in anchor_units(units)}

    def kept_with_drift(now, before, changed):
        # every unit but ``changed`` and the anchors' signatures: its earlier time x one factor,
        # the median of the anchors' changes (the anchors as re-timed: a new timing each)
        kept = {u: t for u, t in before.items() if u not in changed}
        timed = anchor_units(kept)
        drift = np.median([sum(now[a]) / sum(before[a]) for a in timed])
        scaled = [u for u in kept if all(before[u] != before[a] for a in timed)]
        for u in scaled:
            np.testing.assert_allclose(now[u], np.array(before[u]) * drift, rtol=1e-9)
        assert scaled and drift != 1.0  # the anchors ran again (new timings, not kept ones)

    ran = []
    first = lowered(ASSIGNMENT, CAPS)
    pipeline = Pipeline(programs, template)
    pipeline.place(initial_state(), first.spec)
    _, full = pipeline.profile_step(first, **batches()[0], repeats=1)
    assert set(ran) == {(), (0,), (1,), (2,), (3,), (4,)}  # () is the embedding and the head
    steps = iter(batches()[1:] * 2)

    def profiled(exe):
        ran.clear()
        pipeline.migrate(exe)
        return pipeline.profile_step(exe, **next(steps), repeats=1)[1]

    before = full.units.by_unit()
    kept = {u: t for u, t in before.items() if u != ("layers", 2)}
    resized = profiled(lowered(ASSIGNMENT, ((3, 5, 3, 4),)))
    assert resized.units_measured and set(ran) == {(2,), *anchors(kept)}
    now = resized.units.by_unit()
    kept_with_drift(now, before, {("layers", 2)})
    moved = profiled(lowered((1, 1, 2, 1), ((3, 5, 3, 4),)))  # layer 2 to stage 2
    assert moved.units_measured and set(ran) == {(2,), *anchors({**now, ("layers", 2): (0, 0)})}
    kept_with_drift(moved.units.by_unit(), now, {("layers", 2)})
    same = profiled(lowered((1, 1, 2, 1), ((3, 5, 3, 4),), "gpipe"))  # new spec, no new unit
    assert same.units_measured and set(ran) == anchors(moved.units.by_unit())
    kept_with_drift(same.units.by_unit(), moved.units.by_unit(), set())
    again = profiled(lowered((1, 1, 2, 1), ((3, 5, 3, 4),), "gpipe"))  # the same layout again
    assert not again.units_measured and not ran


def test_a_timed_step_waits_for_the_last_update_instead_of_running_a_mark(programs, monkeypatch):
    # A stage's first task starts when its parameters are ready. Parameters an update wrote are
    # ready with that update's metrics, which the watchers wait for; only parameters no update
    # here wrote (placed, migrated) need a small program per stage (a profile every step).
    programs, template = programs
    exe = programs.lower(spec_for(ASSIGNMENT, "1f1b")).compile()
    pipeline = Pipeline(programs, template)
    pipeline.place(initial_state(), exe.spec)
    marks, mark = [], timeline_module._MARK
    monkeypatch.setattr(timeline_module, "_MARK", lambda leaf: marks.append(leaf) or mark(leaf))
    first, second, _ = batches()
    pipeline.timed_step(exe, **first)
    assert len(marks) == len(ASSIGNMENT)
    _, timeline = pipeline.timed_step(exe, **second)
    assert len(marks) == len(ASSIGNMENT)
    assert all(row and 0 <= row[0].start <= row[0].end for row in timeline)


def test_a_periodic_profile_is_taken_while_later_steps_run(programs):
    # `start_profile_step` returns once the step is dispatched; the next step is dispatched
    # before its Profile is asked for. Training is bit for bit that of plain steps, and the
    # Profile is exactly what the blocking path computes from the same timeline: the measured
    # units rescaled by its stage busy times, and the memory of the layout.
    programs, template = programs
    exe = programs.lower(spec_for(ASSIGNMENT, "1f1b"), profiling=True).compile()
    plain, profiled = Pipeline(programs, template), Pipeline(programs, template)
    for pipeline in (plain, profiled):
        pipeline.place(initial_state(), exe.spec)
    first, second, third = batches()
    _, full = profiled.profile_step(exe, **first, repeats=1)
    metrics, pending = profiled.start_profile_step(exe, **second)
    later = profiled.step(exe, **third)
    light = pending.result()
    plain_metrics = [plain.step(exe, **batch) for batch in (first, second, third)]
    for got, want in zip((metrics, later), plain_metrics[1:], strict=True):
        np.testing.assert_array_equal(host_metrics(got)["loss"], host_metrics(want)["loss"])
    for x, y in zip(
        jax.tree.leaves(plain.host_state()), jax.tree.leaves(profiled.host_state()), strict=True
    ):
        np.testing.assert_array_equal(x, y)
    assert not light.units_measured and light.stage_layers == ASSIGNMENT
    # Every task of the step, in each stage's order, each after the one before it.
    assert [[(t.kind, t.microbatch) for t in row] for row in light.timeline] == [
        [(t.kind, t.microbatch) for t in tasks] for tasks in exe.spec.tasks
    ]
    for row in light.timeline:
        for a, b in zip(row, row[1:], strict=False):
            assert 0 <= a.start <= a.end <= b.start
    then = units_busy_seconds(full.units.by_unit(), exe.spec)
    # (A timeline whose watcher woke after its stage's tasks ended keeps the units as they
    # were: `Profile.timeline_measured`.)
    factors = {s: busy / then[s] if then[s] > 0 and light.timeline_measured else 1.0
               for s, busy in enumerate(stage_busy_seconds(light.timeline))}
    assert light.units == UnitTimes.of(rescaled_units(full.units.by_unit(), exe.spec, factors))
    temps = program_temp_bytes(exe.programs)
    boundary = lambda stage: exe.splits[stage.index].boundary  # noqa: E731
    fresh = stage_memory(exe.spec, profiled.state, profiled.acc, temps, programs.shapes, boundary)
    # with what each stage's layers keep for their backward (the memory model's shares)
    kept = [tuple(kept_bytes(programs.setup, one, programs.transport.stage_meshes[one.index],
                             programs.shapes(one))
                  for unit, one, _ in timed_units(exe.spec, programs.setup.parts)
                  if unit[0] == "layers" and one.index == s) for s in range(len(ASSIGNMENT))]
    expected = tuple({**fresh[s], "layer_activations": kept[s]} for s in range(len(ASSIGNMENT)))
    assert light.memory == full.memory == expected
