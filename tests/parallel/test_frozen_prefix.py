"""A stage's frozen prefix: its forward keeps the prefix's output and its backward recomputes
only the trainable rest (`dynjax.parallel.stage.frozen_prefix`)."""

import jax
import numpy as np
import optax
import pytest

from dynjax.balance import schedule_tasks
from dynjax.model import ModelParts
from dynjax.parallel import make_mesh
from dynjax.parallel.executable import PipelinePrograms
from dynjax.parallel.stage import StageSetup, frozen_prefix
from dynjax.parallel.stages import PipelineSpec, stage_specs
from dynjax.parallel.transport import Transport

from .test_scan_layers import DENSE, B, assert_trees_close, params_of, run_pipeline

FROZEN = (0, 1, 2)


def specs(layout, frozen=FROZEN):
    return stage_specs(
        layout, frozen_layers=frozen, microbatches=2, batch_size=B, dtype="float32",
        options=(), hooks=DENSE.hooks,
    )


def test_which_stages_skip_their_frozen_prefix():
    setup = StageSetup(parts=ModelParts.of(DENSE), optimizer=optax.sgd(0.1), grad_clip=0.0)
    # Stage 0 of (4, 2): the embedding and layers 0-2 frozen, layer 3 trains.
    assert [frozen_prefix(setup, s) for s in specs((4, 2))] == [3, 0]
    # Stage 1 of (2, 2, 2): nothing before layer 2 trains, so layer 2 is a prefix too.
    assert [frozen_prefix(setup, s) for s in specs((2, 2, 2))] == [0, 1, 0]
    # A trainable layer before the frozen ones: the input gradient must flow through them.
    assert [frozen_prefix(setup, s) for s in specs((2, 2, 2), frozen=(1, 2))] == [0, 0, 0]
    # The last stage returns every layer's metrics from its backward: it keeps its prefix.
    assert [frozen_prefix(setup, s) for s in specs((2, 4))] == [0, 0]
    # Every layer of stage 0 frozen: it has no backward at all.
    assert [frozen_prefix(setup, s) for s in specs((3, 3))] == [0, 0]


def test_the_backward_of_a_frozen_prefix_stage_costs_less_than_its_forward():
    """Stage 0 of (4, 2) with layers 0-2 frozen: its backward recomputes and differentiates
    layer 3 alone (about 3 layer forwards of FLOPs), less than the 4-layer forward; recomputing
    the prefix too would cost about 6."""
    opt = optax.sgd(0.1)
    params = params_of(DENSE)
    setup = StageSetup(parts=ModelParts.of(DENSE), optimizer=opt, grad_clip=0.0)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    programs = PipelinePrograms(setup, Transport(make_mesh(2, 2, 2)), abstract, seq_len=8)
    stages = specs((4, 2))
    exe = programs.lower(PipelineSpec(stages, "1f1b", schedule_tasks("1f1b", 2, 2))).compile()

    def flops(kind):
        cost = exe.programs[kind, 0].cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]

    assert flops("bwd") < flops("fwd"), (flops("bwd"), flops("fwd"))


@pytest.mark.slow
def test_a_pipeline_skipping_frozen_prefixes_trains_as_one_without():
    """The same frozen model on two layouts: (3, 3) has no prefix to skip (stage 0 is all
    frozen), (4, 2) skips three layers on stage 0."""
    ref_losses, ref_state = run_pipeline(DENSE, False, [(3, 3)] * 3, frozen=FROZEN, caps=())
    losses, state = run_pipeline(DENSE, False, [(4, 2)] * 3, frozen=FROZEN, caps=())
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    assert_trees_close(ref_state, state, 1e-6)
