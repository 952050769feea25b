"""A pipeline whose forward keeps its VJP's residuals (``pipeline.recompute=False``) equals the
single program, and its backward no longer runs the forward again (issue 33 §3).

4 stages x 2 data devices, uneven, MoE dropping tokens, clipping that triggers, 1F1B; then frozen
layers (a frozen prefix: its residuals are constants, nothing of it is kept)."""

import jax
import pytest

from dynjax.model import ModelParts
from dynjax.parallel import make_mesh
from dynjax.parallel.executable import PipelinePrograms
from dynjax.parallel.stage import StageSetup
from dynjax.parallel.transport import Transport

from .test_pipeline_runtime import (
    ASSIGNMENT,
    CFG,
    CLIP,
    assert_frozen_matches_one_device,
    assert_matches_one_device,
    initial_state,
    optimizer,
    spec_for,
)


def programs_for(recompute: bool) -> tuple[PipelinePrograms, dict]:
    setup = StageSetup(
        parts=ModelParts.of(CFG), optimizer=optimizer(), grad_clip=CLIP, recompute=recompute
    )
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), initial_state())
    programs = PipelinePrograms(setup, Transport(make_mesh(4, 2, 1)), abstract["params"], 8)
    return programs, abstract


@pytest.fixture(scope="module")
def kept():
    return programs_for(recompute=False)


def test_a_pipeline_on_residuals_matches_one_device(kept):
    assert_matches_one_device(*kept, spec_for(ASSIGNMENT, "1f1b"))


def test_frozen_layers_on_residuals_match_one_device(kept):
    exe = assert_frozen_matches_one_device(*kept, "1f1b")
    assert ("bwd", 0) not in exe.programs  # stage 0 (embedding, layer 0) runs no backward


def test_the_backward_on_residuals_runs_no_second_forward(kept):
    """The compute shrinks for real: a middle stage's backward program on residuals has fewer
    FLOPs than the recomputing one (by about its forward), and its forward returns residuals
    but no parameter (they are the backward's own arguments)."""
    programs, _ = kept
    recomputing, _ = programs_for(recompute=True)
    stage = spec_for(ASSIGNMENT, "1f1b").stages[1]  # layers 1 and 2 (the MoE layer)
    flops = {}
    for name, p in (("kept", programs), ("recomputed", recomputing)):
        cost = {k: p.lower_one(k, stage).compile().cost_analysis() for k in ("fwd", "bwd")}
        cost = {k: (c[0] if isinstance(c, list) else c)["flops"] for k, c in cost.items()}
        flops[name] = cost
    forward = flops["recomputed"]["fwd"]
    assert flops["kept"]["bwd"] < flops["recomputed"]["bwd"] - 0.5 * forward
    shapes = programs.shapes(stage)
    params = {(a.shape, a.dtype) for a in jax.tree.leaves(shapes.params) if a.ndim == 2}
    assert shapes.residuals and not {(a.shape, a.dtype) for a in shapes.residuals} & params


def test_recompute_off_refuses_expert_and_tensor_parallelism():
    from dynjax.config import validate_config
    from dynjax.errors import ConfigError

    from ..tiny import tiny_config

    cfg = tiny_config(model__num_layers=4, mesh__stage=2, mesh__tensor=2,
                      pipeline__recompute=False)
    with pytest.raises(ConfigError, match="pipeline.recompute=False .* mesh.tensor=1"):
        validate_config(cfg, num_devices=8)
