"""A pipeline stage's update runs one compiled program per layer signature, shared by its equal
layers and kept across Plans (`dynjax.parallel.stage_update`), and trains as the single program.
"""

import dataclasses

import jax
import numpy as np

from dynjax.parallel.pipeline import Pipeline

from ..helpers import assert_close
from .test_pipeline_runtime import (
    CFG,
    adamw,
    batches,
    host_metrics,
    initial_state,
    pipeline_setup,
    reference_run,
    spec_for,
)

DENSE = dataclasses.replace(CFG, num_layers=6, moe_layers=())


def distinct(programs) -> int:
    return len({id(p) for p in programs})


def test_equal_layers_share_one_update_program_and_plans_reuse_it():
    programs, _ = pipeline_setup(mesh_shape=(2, 1, 1), cfg=DENSE)
    exe = programs.lower(spec_for((3, 3), "1f1b", cfg=DENSE)).compile()
    first, last = exe.programs["update", 0], exe.programs["update", 1]
    # stage 0: three layers and the embedding with positions; stage 1: three layers and the
    # final norm with the head. One layer program each, one for the other units.
    assert [g.layer for g in first.groups] == [0, 1, 2, None]
    assert [g.layer for g in last.groups] == [3, 4, 5, None]
    assert distinct(first.units[:3]) == distinct(last.units[:3]) == 1
    assert distinct(first.units) == distinct(last.units) == 2
    compiled = dict(programs._unit_updates)
    moved = programs.lower(spec_for((4, 2), "1f1b", cfg=DENSE)).compile()
    # Layer 3 lands on a stage that updates equal layers: no update program is compiled.
    assert programs._unit_updates == compiled
    assert moved.programs["update", 0].units[3] is first.units[0]


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
