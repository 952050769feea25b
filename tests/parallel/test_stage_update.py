"""A pipeline stage's update runs one compiled program per layer signature, shared by its equal
layers and kept across Plans (`dynjax.parallel.stage_update`), and trains as the single program.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dynjax.parallel.metrics import fold_microbatches
from dynjax.parallel.pipeline import Pipeline
from dynjax.parallel.stage import update_fn
from dynjax.parallel.stage_update import GROUP_LAYERS, lower_stage_update

from ..helpers import assert_close
from .test_pipeline_runtime import (
    CFG,
    adamw,
    batches,
    host_metrics,
    initial_state,
    optimizer,
    pipeline_setup,
    reference_run,
    spec_for,
)

DENSE = dataclasses.replace(CFG, num_layers=6, moe_layers=())
DEEP = dataclasses.replace(CFG, num_layers=16, moe_layers=())


def distinct(programs) -> int:
    return len({id(p) for p in programs})


def test_equal_layer_groups_share_one_update_program_and_plans_reuse_it():
    assert GROUP_LAYERS == 4
    programs, _ = pipeline_setup(mesh_shape=(2, 1, 1), cfg=DEEP)
    exe = programs.lower(spec_for((8, 8), "1f1b", cfg=DEEP)).compile()
    first, last = exe.programs["update", 0], exe.programs["update", 1]
    # stage 0: two groups of four layers, then the embedding with positions; stage 1: two
    # groups, then the final norm with the head. One layer program each, one for the rest.
    assert [g.layers for g in first.groups] == [(0, 1, 2, 3), (4, 5, 6, 7), ()]
    assert [g.layers for g in last.groups] == [(8, 9, 10, 11), (12, 13, 14, 15), ()]
    assert distinct(first.units[:2]) == distinct(last.units[:2]) == 1
    assert distinct(first.units) == distinct(last.units) == 2
    compiled = dict(programs._unit_updates)
    moved = programs.lower(spec_for((12, 4), "1f1b", cfg=DEEP)).compile()
    # Layers 8-11 land on a stage that updates equal groups: no update program is compiled.
    assert programs._unit_updates == compiled
    assert moved.programs["update", 0].units[2] is first.units[0]


def test_a_pipeline_with_adamw_trains_as_the_single_program():
    """AdamW's step count is shared by every group of a stage: each call must read it as it
    was before the step (a count read after another group's write would be the step after)."""
    programs, template = pipeline_setup(mesh_shape=(2, 1, 1), opt=adamw, cfg=DENSE)
    spec = spec_for((3, 3), "1f1b", cfg=DENSE)
    exe = programs.lower(spec).compile()
    pipeline = Pipeline(programs, template)
    pipeline.place(initial_state(adamw, DENSE), spec)
    losses = [host_metrics(jax.device_get(pipeline.step(exe, **b)))["loss"] for b in batches()]
    ref_metrics, ref_state = reference_run(DENSE, adamw)
    np.testing.assert_allclose(losses, [m["loss"] for m in ref_metrics], rtol=1e-5)
    # Adam's normalised steps enlarge float noise in near-zero gradients (as in
    # test_migration_carries_adamw_counts_and_moments_exactly); a wrong count moves whole steps.
    assert_close(ref_state, pipeline.host_state(), 1e-4)
    counts = [int(x) for x in jax.tree.leaves(pipeline.host_state()["opt_state"])
              if np.ndim(x) == 0 and np.issubdtype(np.asarray(x).dtype, np.integer)]
    assert counts and set(counts) == {len(batches())}


@pytest.mark.parametrize("opt", [optimizer, adamw], ids=["sgd", "adamw"])
def test_the_update_counts_the_flops_of_the_one_program_update(opt):
    """`StageUpdate.cost_analysis` sums its calls (a shared program once per group it
    updates): the FLOPs of `stage.update_fn` compiled whole, as benchmarks count a step."""
    programs, _ = pipeline_setup(mesh_shape=(2, 1, 1), opt=opt, cfg=DEEP)
    spec = spec_for((8, 8), "1f1b", cfg=DEEP)
    exe = programs.lower(spec).compile()
    hooks = programs.setup.parts.cfg.hooks
    for stage in spec.stages:
        shapes = programs.shapes(stage)
        sq = (jax.ShapeDtypeStruct((1,), jnp.float32),) * spec.num_stages
        folded = jax.eval_shape(lambda m: fold_microbatches(m, hooks),
                                (shapes.metrics,) * stage.microbatches)
        whole = jax.jit(update_fn(programs.setup, stage)).lower(
            shapes.params, shapes.opt_state, shapes.acc, sq, folded).compile().cost_analysis()
        whole = (whole[0] if isinstance(whole, list) else whole)["flops"]
        split = exe.programs["update", stage.index].cost_analysis()["flops"]
        np.testing.assert_allclose(split, whole, rtol=1e-3)


def test_the_update_traced_whole_computes_what_its_programs_do():
    """Over several processes a stage's update is one program (`lower_stage_update`'s
    ``whole``): the same arithmetic as the group programs called in turn."""
    programs, _ = pipeline_setup(mesh_shape=(2, 1, 1), opt=adamw, cfg=DEEP)
    stage = spec_for((8, 8), "1f1b", cfg=DEEP).stages[0]
    shapes, mesh = programs.shapes(stage), programs.transport.stage_meshes[0]
    rng = np.random.default_rng(0)  # positive values: Adam's second moment is one

    def concrete(tree):
        return jax.tree.map(lambda a: jax.device_put(
            rng.uniform(0.1, 1.0, a.shape).astype(a.dtype) if jnp.issubdtype(a.dtype, jnp.floating)
            else np.full(a.shape, 3, a.dtype), a.sharding), tree)

    state = [concrete(t) for t in (shapes.params, shapes.opt_state, shapes.acc)]
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    sq = (jax.device_put(np.float32([4.0]), replicated),) * 2
    per_mb = tuple(concrete(shapes.metrics) for _ in range(stage.microbatches))
    outs = []
    for whole in (False, True):
        update = lower_stage_update(programs.setup, stage, mesh, shapes, {},
                                    whole=whole).compile()
        copies = jax.tree.map(jnp.copy, state)  # each program donates its inputs
        outs.append(jax.device_get(update(*copies, sq, per_mb)))
    assert_close(outs[0], outs[1], 1e-6)
