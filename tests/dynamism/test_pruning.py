"""The pruning plugin end to end (seed 000 §2.2, §3.2.1, Alg. 1): a real run's prune events follow
the cubic schedule; the global masks over a model split into pipeline stages are a single-device
top-k; pruned weights and their Adam moments stay exactly zero through updates, a migration
between stages, a checkpoint and a resume; the pipeline and the single-program step agree on a
pruned model; bad settings are named."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from dynjax.checkpoint import Checkpointer
from dynjax.checkpoint.layout import split
from dynjax.config import validate_config
from dynjax.dynamism import pruning_math as pm
from dynjax.dynamism.moe.checkpoint import EXPERT_STACKS
from dynjax.dynamism.pruning import PruneState, PruningPlugin, named_masks, prune
from dynjax.errors import ConfigError
from dynjax.experiment import Experiment
from dynjax.train import train
from dynjax.writers import read_jsonl

from ..helpers import events_of
from ..tiny import tiny_config

SCHEDULE = dict(
    pruning__enabled=True,
    pruning__initial_sparsity=0.2,
    pruning__final_sparsity=0.75,
    pruning__start_step=2,
    pruning__every=3,
    pruning__steps=3,  # events at steps 2, 5, 8, 11
)


def adam_moments(opt_state):
    """(mu, nu) of the Adam state inside an optimizer state, each by parameter path."""
    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)
    [adam] = [x for x in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(x)]
    return pm.prunable_leaves(adam.mu), pm.prunable_leaves(adam.nu)


def pruned_stay_zero(state) -> int:
    """Assert that every pruned weight and its Adam moments are exactly zero and every kept
    weight is not; returns how many weights are pruned."""
    state = jax.device_get(state)
    masks, weights = named_masks(state["opt_state"]), pm.prunable_leaves(state["params"])
    mu, nu = adam_moments(state["opt_state"])
    assert list(masks) == list(weights)
    pruned = 0
    for name, keep in masks.items():
        keep = np.asarray(keep)
        assert keep.dtype == bool and keep.shape == weights[name].shape, name
        for what, tree in (("weight", weights), ("mu", mu), ("nu", nu)):
            assert not np.any(np.asarray(tree[name])[~keep]), (what, name)
        assert np.all(np.asarray(weights[name])[keep] != 0), name
        pruned += int((~keep).sum())
    return pruned


@pytest.mark.slow
def test_a_run_prunes_on_schedule_and_resumes_with_its_masks(tmp_path):
    cfg = dict(model__num_layers=3, train__checkpoint_every=100, train__eval_every=100, **SCHEDULE)
    train(tiny_config(train__steps=7, **cfg), tmp_path, progress=False)  # events 2, 5; saves 7
    summary = train(tiny_config(train__steps=12, **cfg), tmp_path, progress=False)  # 8, 11
    assert summary.start_step == 7 and summary.checkpoints == [7, 12]

    exp = Experiment.from_config(tiny_config(**cfg))
    total = sum(int(np.prod(w.shape)) for w in pm.prunable_leaves(exp.abstract_params).values())
    events = events_of(tmp_path, "prune")
    assert [e["step"] for e in events] == [2, 5, 8, 11]
    schedule = dict(initial=0.2, final=0.75, start=2, every=3, steps=3)
    for e in events:
        want = pm.sparsity_at(e["step"], **schedule)
        assert e["sparsity"] == pytest.approx(want, abs=1e-12)
        assert e["total"] == total and e["kept"] == pm.keep_count(total, want)
    assert [round(e["sparsity"], 6) for e in events] == [0.2, 0.587037, 0.729630, 0.75]

    ckpt = Checkpointer(tmp_path / "checkpoints", stacks=EXPERT_STACKS, keep=5)
    (at7, _), (at12, _) = (ckpt.restore(s, exp.abstract_state) for s in (7, 12))
    ckpt.close()
    assert pruned_stay_zero(at7) == total - events[1]["kept"]
    assert pruned_stay_zero(at12) == total - events[-1]["kept"]
    before, after = named_masks(at7["opt_state"]), named_masks(at12["opt_state"])
    assert all(not np.any(after[n] & ~before[n]) for n in before)  # pruned stays pruned
    # Each layer's density in the event, the metrics and the layer costs is its kept fraction.
    counts = {n: int(m.sum()) for n, m in after.items()}
    for i, density in enumerate(events[-1]["layer_density"]):
        mine = [n for n in after if n.startswith(f"layers/{i}/")]
        kept = sum(counts[n] for n in mine) / sum(after[n].size for n in mine)
        assert density == pytest.approx(kept, rel=1e-6)
    costs = read_jsonl(tmp_path / "layer_costs.jsonl")
    assert costs[-1]["layer_cost"] == pytest.approx(events[-1]["layer_density"], rel=1e-6)
    assert costs[0]["layer_cost"] == pytest.approx([1.0] * 3)  # step 1: still dense
    logged = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "pruning/density" in r]
    assert logged[-1]["step"] == 12
    assert logged[-1]["pruning/density"] == pytest.approx(events[-1]["layer_density"], rel=1e-6)


def tied_host_state(exp, integer=False):
    """Fresh host state whose prunable weights have many ties and no zeros (with ``integer``,
    small integers: exact block norms)."""
    state = exp.init_host_state()
    rng = np.random.default_rng(0)

    def quantise(path, w):
        if not pm.prunable(jax.tree_util.keystr(path, simple=True, separator="/")):
            return w
        if integer:
            return rng.choice(np.array([-2, -1, 1, 2], w.dtype), size=w.shape)
        return (np.sign(w) * np.ceil(np.abs(w) * 100) / 100).astype(w.dtype)

    state["params"] = jax.tree_util.tree_map_with_path(quantise, state["params"])
    return state


def reference_masks(weights, keep, block_size=None):
    """Single-device global top-k over all prunable weights in model order, ties by position."""
    if block_size is None:
        scores = {n: np.abs(w) for n, w in weights.items()}
    else:
        def norms(w):
            *lead, k, n = w.shape
            t = w.astype(np.float64).reshape(*lead, k // block_size, block_size, n // block_size,
                                             block_size)
            return np.sqrt((t**2).sum(axis=(-3, -1)))
        scores = {n: norms(w) for n, w in weights.items()}
    flat = np.concatenate([s.ravel() for s in scores.values()])
    kept = np.zeros(flat.size, bool)
    kept[np.lexsort((np.arange(flat.size), -flat))[:keep]] = True
    out, i = {}, 0
    for name, s in scores.items():
        m = kept[i : i + s.size].reshape(s.shape)
        if block_size is not None:
            m = np.repeat(np.repeat(m, block_size, -2), block_size, -1)
        out[name], i = m, i + s.size
    return out


@pytest.mark.slow
@pytest.mark.parametrize("granularity", ["element", "block"])
@pytest.mark.parametrize(
    "mesh",
    [{}, {"mesh__stage": 4, "mesh__data": 2}],
    ids=["one-device", "four-stages"],
)
def test_global_masks_are_a_single_device_topk_of_the_whole_model(mesh, granularity):
    cfg = tiny_config(
        model__num_layers=4,
        moe__every=2,
        pruning__enabled=True,
        pruning__granularity=granularity,
        pruning__block_size=8,
        **mesh,
    )
    exp = Experiment.from_config(cfg)
    host = tied_host_state(exp, integer=granularity == "block")
    runtime = exp.runtime(exp.initial_plan(), host)
    assert len(runtime.stage_states()) == (4 if mesh else 1)
    weights = pm.prunable_leaves(host["params"])
    block = 8 if granularity == "block" else None
    keep, total, _ = prune(
        runtime.stage_states(), 0.6, granularity=granularity, block_size=block or 32
    )
    assert keep == pm.keep_count(total, 0.6)
    want = reference_masks(weights, keep, block)
    state = jax.device_get(runtime.checkpoint_state())  # the full tree, stages joined
    got = named_masks(state["opt_state"])
    assert list(got) == list(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        np.testing.assert_array_equal(
            pm.prunable_leaves(state["params"])[name], np.where(want[name], weights[name], 0)
        )
    pruned_stay_zero(state)


def test_expert_masks_shard_and_checkpoint_like_expert_weights():
    exp = Experiment.from_config(
        tiny_config(moe__every=2, mesh__expert=2, pruning__enabled=True)
    )
    [masks] = [
        x.masks for x in jax.tree.leaves(
            exp.abstract_state["opt_state"], is_leaf=lambda x: isinstance(x, PruneState)
        ) if isinstance(x, PruneState)
    ]
    assert masks["layers"][1]["moe"]["w_in"].sharding.spec == P("expert")
    assert masks["layers"][1]["attn"]["qkv"]["kernel"].sharding.spec == P()
    assert masks["layers"][1]["moe"]["router"] is None  # not pruned: no mask
    item = split(exp.abstract_state, EXPERT_STACKS)["experts"]["opt_state/masks/layers/1/moe/w_out"]
    assert item.dtype == bool and item.shape == (4, 64, 32)  # [E, expert_mlp_dim, d]


# The Llama family's keys (docs/models.md): SwiGLU's gate and the shared expert are pruned too.
FAMILIES = {
    "gpt": {},
    "llama": dict(model__family="llama", model__num_kv_heads=1, moe__shared_expert_dim=16),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_pruned_entries_stay_zero_through_steps_migration_and_a_checkpoint(tmp_path, family):
    """4 layers (layer 1 MoE) on 2 stages x 2 expert devices, clipping active: prune, train,
    move a layer to the other stage, prune further, save, restore on one device, train; the
    pipeline step equals the single-program step on the same pruned state."""
    base = dict(
        **FAMILIES[family],
        model__num_layers=4,
        moe__every=2,
        mesh__expert=2,
        train__microbatches=2,
        train__grad_clip=0.05,  # below the gradient norms: clipping uses the global norm
        pruning__enabled=True,
    )
    exp = Experiment.from_config(
        tiny_config(**base, mesh__stage=2, pipeline__stage_layers="(2,2)")
    )
    plan = exp.initial_plan()
    runtime = exp.runtime(plan)
    exe = exp.lower_train_step(plan).compile()
    step = lambda s: runtime.step(exe, exp.order.batch(s), None)
    step(0)
    keep, total, _ = prune(runtime.stage_states(), 0.5)
    assert pruned_stay_zero(runtime.checkpoint_state()) == total - keep
    step(1), step(2)
    assert pruned_stay_zero(runtime.checkpoint_state()) == total - keep

    moved = plan.replace(stage_layers=(1, 3))  # layer 1, MoE, to stage 1 with its masks
    exe = exp.lower_train_step(moved).compile()
    migration = runtime.swap(moved, exe)
    assert migration is not None and migration.moves == ((1, 0, 1),)
    assert pruned_stay_zero(runtime.checkpoint_state()) == total - keep
    step(3)
    keep, _, _ = prune(runtime.stage_states(), 0.8)
    step(4)
    assert pruned_stay_zero(runtime.checkpoint_state()) == total - keep

    # A checkpoint, restored onto one device group: the single-program step continues it.
    ckpt = Checkpointer(tmp_path, stacks=EXPERT_STACKS, keep=2, async_save=False)
    ckpt.save(5, runtime.checkpoint_state(), {})
    single = Experiment.from_config(tiny_config(**base))
    host, _ = ckpt.restore(5, single.abstract_state)
    ckpt.close()
    one = single.runtime(single.initial_plan(), host)
    one_exe = single.lower_train_step(single.initial_plan()).compile()
    one_metrics = one.step(one_exe, exp.order.batch(5), None)
    metrics = step(5)
    assert pruned_stay_zero(one.checkpoint_state()) == total - keep
    assert pruned_stay_zero(runtime.checkpoint_state()) == total - keep
    # Parallel equals sequential on the pruned model: the same loss, and the same update (the
    # clip factor counts the kept weights' gradients only, in both runtimes).
    loss = runtime.host_metrics(5, jax.device_get(metrics))["loss"]
    np.testing.assert_allclose(loss, jax.device_get(one_metrics)["loss"], rtol=1e-5)
    got = pm.prunable_leaves(jax.device_get(runtime.checkpoint_state()["params"]))
    want = pm.prunable_leaves(jax.device_get(one.checkpoint_state()["params"]))
    for name in want:
        np.testing.assert_allclose(got[name], want[name], atol=2e-6, err_msg=name)
    if family == "llama":  # the gate and the shared expert are pruned with the rest
        for part in ("layers/0/mlp/gate/kernel", "layers/1/moe/shared/gate/kernel"):
            assert 0 < np.mean(want[part] == 0) < 1, part


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"pruning__final_sparsity": 1.0}, "pruning.final_sparsity"),
        ({"pruning__initial_sparsity": 0.9}, "pruning.initial_sparsity"),
        ({"pruning__every": 0}, "pruning.every"),
        ({"pruning__granularity": "row"}, "pruning.granularity"),
        ({"pruning__include": "nothing/matches"}, "pruning.include"),
        # d_model 32, mlp_dim 64: 24 divides neither
        ({"pruning__granularity": "block", "pruning__block_size": 24}, "pruning.block_size=24"),
    ],
)
def test_bad_settings_name_their_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate_config(tiny_config(pruning__enabled=True, **overrides), 1)


def test_block_sizes_are_checked_against_the_real_matrices():
    # qkv is [32, 96], experts [4, 32, 40]: 16 divides d_model and mlp_dim but not 40
    validate_config(tiny_config(pruning__enabled=True, pruning__granularity="block",
                                pruning__block_size=16), 1)
    with pytest.raises(ConfigError, match="moe/w_in"):
        validate_config(tiny_config(pruning__enabled=True, pruning__granularity="block",
                                    pruning__block_size=16, moe__every=2,
                                    moe__expert_mlp_dim=40), 1)


# --- block granularity: the block-sparse matmul the Plan switches to -------------------------


def _counts(*rows_of_layers, size=8):
    """``[L, 5, size]`` column counts as the weight hook reports them (descending, -1 pads)."""
    out = np.full((len(rows_of_layers), 5, size), -1.0)
    for i, rows in enumerate(rows_of_layers):
        for j, row in enumerate(rows):
            out[i, j, : len(row)] = sorted(row, reverse=True)
    return out


def test_the_sparse_path_policy_picks_linears_below_the_crossover():
    from dynjax.dynamism.pruning import SparsePath
    from dynjax.recompile import History, Plan

    # `LINEARS` (attn/qkv, attn/out, mlp/up, mlp/down, mlp/gate: GPT has no gate); (rows, cols)
    shapes = (((8, 6), (8, 2), (8, 4), (32, 2), (0, 0)), ((8, 6), (8, 2), (0, 0), (0, 0), (0, 0)))
    policy = SparsePath(shapes=shapes, sparse_below=0.5, max_groups=2)
    counts = _counts(
        ([8, 8, 8, 8, 8, 8], [3, 1], [5, 5, 5, 2], [9, 2]),
        ([8, 3, 2, 1, 1, 0], [5, 5]),  # layer 1 is MoE: no mlp/*
    )
    # attn/out: 3 + 1 of 16 blocks; mlp/up: 3 x 5 + 2 of 32 (not below half); mlp/down: 11 of
    # 64; layer 1's qkv at two nonzero widths: 8 + 4 x 3 = 20 of 48 blocks.
    assert policy.widths(counts) == (
        (0, "attn/out", ((3, 1), (1, 1))), (0, "mlp/down", ((9, 1), (2, 1))),
        (1, "attn/qkv", ((8, 1), (3, 4), (0, 1))),
    )
    history = History.of([(7, {"pruning/column_counts": counts})])
    proposal = policy.propose(history, Plan())
    assert proposal.plan.part("pruning")["sparse"] == policy.widths(counts)
    assert policy.propose(history, proposal.plan) is None  # nothing new
    assert policy.propose(History(), Plan()) is None


def test_the_sparse_path_policy_recuts_groups_only_when_it_saves_a_fifth():
    from dynjax.dynamism.pruning import SparsePath
    from dynjax.recompile import History, Plan

    policy = SparsePath(shapes=(((8, 4),) + ((0, 0),) * 4,), sparse_below=1.0, max_groups=1)
    plan = policy.propose(History.of([(0, {"pruning/column_counts": _counts(([5, 5, 5, 5],))})]),
                          Plan()).plan
    assert plan.part("pruning")["sparse"] == ((0, "attn/qkv", ((5, 4),)),)
    fewer = lambda *row: History.of([(1, {"pruning/column_counts": _counts((list(row),))})])
    assert policy.propose(fewer(5, 4, 4, 4), plan) is None  # 20 -> 20 blocks
    assert policy.propose(fewer(5, 5, 5, 4), plan) is None  # still 20
    recut = policy.propose(fewer(4, 4, 4, 4), plan)  # 16 <= 0.8 x 20
    assert recut.plan.part("pruning")["sparse"] == ((0, "attn/qkv", ((4, 4),)),)
    # A legacy single K (Plans saved before groups) that no longer covers is re-cut at once.
    legacy = Plan().with_part("pruning", sparse=((0, "attn/qkv", 4),))
    assert policy.propose(fewer(4, 4, 4, 4), legacy) is None  # the same widths as ((4, 4),)
    assert policy.propose(fewer(5, 4, 4, 4), legacy).plan.part("pruning")["sparse"] == (
        (0, "attn/qkv", ((5, 4),)),)
    # Widths that no longer cover, and a new cut above sparse_below: the linear goes dense.
    strict = SparsePath(shapes=policy.shapes, sparse_below=0.5, max_groups=1)
    assert strict.propose(fewer(5, 4, 4, 4), legacy).plan.part("pruning")["sparse"] == ()


def test_present_groups_are_the_column_groups_of_the_zero_pattern():
    from dynjax.model.pruned import column_counts, present_groups
    from dynjax.model.sparse_linear import column_groups, group_widths

    rng = np.random.default_rng(3)
    mask = rng.random((6, 9)) < 0.4
    mask[:, 4] = False  # an empty column
    w = rng.normal(size=(24, 36)).astype(np.float32) * np.kron(mask, np.ones((4, 4)))
    counts = np.asarray(column_counts(w, 4, 11))
    np.testing.assert_array_equal(counts, [*sorted(mask.sum(0), reverse=True), -1, -1])
    for groups in (1, 3):
        widths = group_widths(counts[:9], groups)
        for (c, r), (hc, hr) in zip(present_groups(w, 4, widths), column_groups(mask, widths),
                                    strict=True):
            np.testing.assert_array_equal(np.asarray(c), np.asarray(hc))
            np.testing.assert_array_equal(np.asarray(r), np.asarray(hr))


@pytest.mark.slow
def test_block_sparse_linears_equal_dense_ones_at_fewer_flops():
    import dataclasses

    from dynjax.dynamism.pruning import COLUMN_COUNTS, SparsePath, linear_block_shapes
    from dynjax.model.sparse_linear import group_blocks
    from dynjax.parallel import expert_parallel, make_train_step

    cfg = tiny_config(
        model__num_layers=2, model__d_model=64, model__mlp_dim=128,
        pruning__enabled=True, pruning__granularity="block", pruning__block_size=8,
        pruning__sparse_below=1.0,
    )
    exp = Experiment.from_config(cfg)
    host = exp.init_host_state()
    rng = np.random.default_rng(0)  # one scale for every matrix: none is pruned away whole
    host["params"] = jax.tree_util.tree_map_with_path(
        lambda p, w: rng.normal(0, 0.02, w.shape).astype(w.dtype)
        if pm.prunable(jax.tree_util.keystr(p, simple=True, separator="/")) else w,
        host["params"],
    )
    dense = exp.initial_plan()
    runtime = exp.runtime(dense, host)
    prune(runtime.stage_states(), 0.7, granularity="block", block_size=8)
    pruned = jax.device_get(runtime.state)
    dense_exe = exp.lower_train_step(dense).compile()
    metrics = jax.device_get(runtime.step(dense_exe, exp.order.batch(0), None))
    policy = SparsePath(shapes=linear_block_shapes(exp.abstract_params, 8), sparse_below=1.0,
                        max_groups=3)
    widths = policy.widths(metrics[COLUMN_COUNTS])
    assert len(widths) == 8 and all(len(w) > 1 for _, _, w in widths)  # several widths each
    dense_blocks = 2 * (8 * 24 + 8 * 8 + 8 * 16 + 16 * 8)
    assert sum(group_blocks(w) for _, _, w in widths) < 0.45 * dense_blocks  # blocks skipped
    sparse = dense.with_part("pruning", sparse=widths)

    def step_flops(plan):  # the sparse loop as one step: cost_analysis counts a loop body once
        opts = exp.step_spec(plan)
        unrolled = tuple(
            tuple((n, dataclasses.replace(r, loop=False)) for n, r in layer)
            for layer in opts.options
        )
        opts = dataclasses.replace(opts, options=unrolled)
        step = make_train_step(exp.stage_setup, opts, expert_parallel(exp.mesh))
        state = exp.abstract_state
        lowered = jax.jit(step).lower(state["params"], state["opt_state"], exp.abstract_batch(plan))
        return lowered.compile().cost_analysis()["flops"]

    assert step_flops(sparse) < 0.9 * step_flops(dense)

    results = []
    for exe in (dense_exe, exp.lower_train_step(sparse).compile()):
        runtime.state = exp.place_state(pruned)
        m = jax.device_get(runtime.step(exe, exp.order.batch(1), None))
        results.append((m["loss"], pm.prunable_leaves(jax.device_get(runtime.state["params"]))))
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-6)
    for name, w in results[0][1].items():
        np.testing.assert_allclose(results[1][1][name], w, atol=1e-6, err_msg=name)
    pruned_stay_zero(runtime.state)


@pytest.mark.slow
def test_a_plan_without_the_sparse_loop_counts_its_flops_in_full():
    # benchmarks/dynamic_step.py counts a block-sparse Plan's FLOPs on the same Plan with
    # loop=False: XLA's cost_analysis counts the loop over block-columns' body once.
    from dynjax.dynamism.pruning import PruningPlugin

    cfg = tiny_config(
        model__d_model=64, model__mlp_dim=128, pruning__enabled=True,
        pruning__granularity="block", pruning__block_size=8,
    )
    exp = Experiment.from_config(cfg)
    looped = exp.initial_plan().with_part("pruning", sparse=((0, "mlp/up", 4),))
    unrolled = looped.with_part("pruning", loop=False)
    plugin = next(p for p in exp.plugins if isinstance(p, PruningPlugin))
    assert [r.loop for r in plugin.records(looped)] == [True, True]
    assert [r.loop for r in plugin.records(unrolled)] == [False, False]
    assert [r.widths for r in plugin.records(unrolled)] == [(("mlp/up", ((4, 16),)),), ()]
    flops = {
        name: exp.lower_train_step(plan).compile().cost_analysis()["flops"]
        for name, plan in (("dense", exp.initial_plan()), ("loop", looped), ("one", unrolled))
    }
    # Layer 0's mlp/up, [64, 128] in 8 x 8 blocks, at K = 4 of 8 block-rows saves half its
    # forward and backward multiply-adds over the batch's 8 x 32 tokens (within 10%: the gathers
    # count too); with the loop, cost_analysis counts its body once, and the columns the body
    # does not unroll go uncounted (how many depends on `sparse_linear._unroll`).
    saved = 3 * 2 * (8 * 32) * 64 * 128 / 2
    assert abs(flops["dense"] - flops["one"] - saved) < 0.1 * saved
    assert flops["one"] - flops["loop"] > 0.25 * saved


@pytest.mark.parametrize("scale", ["init", "none"])
def test_scale_free_ranking_keeps_every_matrix_alive(scale):
    """At 90% block sparsity on fresh weights, ranking |w| in units of each matrix's init std
    keeps blocks of every matrix, and is the single-device top-k of those scaled scores; raw
    magnitudes (scale="none") prune GPT-2's 1/sqrt(2L)-smaller residual projections away."""
    from dynjax.config import gpt_config
    from dynjax.model.gpt import init_std

    cfg = tiny_config(
        model__num_layers=4, model__d_model=64, model__mlp_dim=128,
        pruning__enabled=True, pruning__granularity="block", pruning__block_size=8,
        pruning__start_step=0, pruning__steps=1, pruning__initial_sparsity=0.9,
        pruning__final_sparsity=0.9, pruning__scale=scale,
    )
    exp = Experiment.from_config(cfg)
    host = exp.init_host_state()
    runtime = exp.runtime(exp.initial_plan(), host)
    weights = pm.prunable_leaves(host["params"])
    plugin = PruningPlugin(PruningPlugin.read(cfg.pruning), exp.facts)
    [event] = plugin.before_step(0, runtime.stage_states(), exp.initial_plan())
    model = gpt_config(cfg)
    units = {n: init_std(model, n) if scale == "init" else 1.0 for n in weights}
    want = reference_masks({n: w / units[n] for n, w in weights.items()}, event["kept"], 8)
    got = named_masks(jax.device_get(runtime.checkpoint_state())["opt_state"])
    residual = [n for n in got if n.endswith(("attn/out/kernel", "mlp/down/kernel"))]
    assert len(residual) == 8
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    if scale == "init":
        assert all(got[n].any() for n in got), [n for n in got if not got[n].any()]
    else:
        assert all(not got[n].any() for n in residual)
