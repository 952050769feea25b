"""Interleaved 1F1B (``pipeline.schedule="interleaved_1f1b"``, issue 33 §2) runs and equals the
single program: 2 stage sub-meshes x 2 chunks each (4 logical stages, non-adjacent chunks on
one sub-mesh), 2 data devices per stage, MoE dropping tokens and clipping that triggers.
"""

import jax
import numpy as np
import pytest

from dynjax.balance import schedule_tasks, simulate
from dynjax.model import ModelParts
from dynjax.parallel import make_mesh
from dynjax.parallel.dispatch import dispatch_order, overlapped_order
from dynjax.parallel.executable import PipelinePrograms
from dynjax.parallel.pipeline import Pipeline
from dynjax.parallel.stage import StageSetup
from dynjax.parallel.stages import PipelineSpec, stage_specs
from dynjax.parallel.transport import Transport

from ..helpers import assert_close, moe_options
from .test_pipeline_runtime import (
    CAPS,
    CFG,
    CLIP,
    B,
    M,
    assert_matches_one_device,
    initial_state,
    optimizer,
)

ASSIGNMENT = (1, 2, 1, 1)  # logical stages 0, 2 on sub-mesh 0; 1, 3 on sub-mesh 1
DEVICES, V = 2, 2


def interleaved_spec(assignment=ASSIGNMENT):
    stages = stage_specs(
        assignment,
        frozen_layers=(),
        microbatches=M,
        batch_size=B,
        dtype="float32",
        options=moe_options(CFG, CAPS, z_loss_weight=1e-3),
    )
    tasks = schedule_tasks("interleaved_1f1b", DEVICES, M, V)
    return PipelineSpec(stages, "interleaved_1f1b", tasks)


@pytest.fixture(scope="module")
def interleaved():
    setup = StageSetup(parts=ModelParts.of(CFG), optimizer=optimizer(), grad_clip=CLIP)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), initial_state())
    transport = Transport(make_mesh(DEVICES, 2, 1), virtual_stages=V)
    return PipelinePrograms(setup, transport, abstract["params"], seq_len=8), abstract


def test_logical_stages_share_sub_meshes_round_robin(interleaved):
    programs, template = interleaved
    meshes = programs.transport.stage_meshes
    assert programs.transport.devices_of == (0, 1, 0, 1)
    assert meshes[0] == meshes[2] and meshes[1] == meshes[3] and meshes[0] != meshes[1]
    pipeline = Pipeline(programs, template)
    pipeline.place(initial_state(), interleaved_spec())
    layers = [sorted(pipeline.state[s]["params"].get("layers", {})) for s in range(4)]
    assert layers == [[0], [1, 2], [3], [4]]
    for s in range(4):
        devices = {d for x in jax.tree.leaves(pipeline.state[s]) for d in x.devices()}
        assert devices == set(meshes[s].devices.flat)


def test_interleaved_pipeline_matches_one_device(interleaved):
    assert_matches_one_device(*interleaved, interleaved_spec())


def test_a_layer_moves_between_chunks_of_two_sub_meshes_exactly(interleaved):
    """Layer 1 moves from logical stage 1 (sub-mesh 1) to logical stage 0 (sub-mesh 0) after
    a step; training goes on equal to the single program, the momentum with its layer."""
    from .test_pipeline_runtime import reference_run, train_and_migrate

    ref_metrics, ref_state = reference_run(CFG)
    programs, template = interleaved
    before = programs.lower(interleaved_spec()).compile()
    after = programs.lower(interleaved_spec((2, 1, 1, 1))).compile()
    assert {s for _, s in after.compiled} == {0, 1}  # logical stages 2 and 3 keep theirs
    pipeline, migration, losses = train_and_migrate(programs, template, before, after)
    assert migration.moves == ((1, 1, 0),)  # (layer, from logical stage, to logical stage)
    layer = pipeline.state[0]["params"]["layers"][1]
    assert {d for x in jax.tree.leaves(layer) for d in x.devices()} == set(
        programs.transport.stage_meshes[0].devices.flat
    )
    assert sorted(pipeline.state[0]["opt_state"][1][0].trace["layers"]) == [0, 1]
    np.testing.assert_allclose(losses, [m["loss"] for m in ref_metrics], rtol=1e-5)
    assert_close(ref_state, pipeline.host_state(), 1e-5)


@pytest.mark.parametrize("order", [dispatch_order, overlapped_order])
@pytest.mark.parametrize("devices,v,m", [(2, 2, 2), (2, 2, 4), (4, 2, 8), (3, 3, 6)])
def test_orders_run_every_logical_task_after_its_input(order, devices, v, m):
    tasks = schedule_tasks("interleaved_1f1b", devices, m, v)
    stages = devices * v
    done, lanes = set(), [[] for _ in range(devices)]
    for s, task, action in order(tasks):
        assert s == task.chunk * devices + s % devices  # the chunk's logical stage
        if action == "send":
            assert (task.kind, s, task.microbatch) in done
            continue
        needs = {"F": ("F", s - 1), "B": ("B", s + 1)}[task.kind]
        if 0 <= needs[1] < stages and not (task.kind == "F" and s == 0):
            assert (needs[0], needs[1], task.microbatch) in done, (s, task)
        done.add((task.kind, s, task.microbatch))
        lanes[s % devices].append(task)
    # each sub-mesh gets its tasks in its schedule's order, every chunk's F and B once
    assert [tuple(lane) for lane in lanes] == [tuple(t) for t in tasks]
    assert len(done) == 2 * stages * m


def test_interleaving_shrinks_the_simulated_bubble():
    """The formula (Narayanan et al. 2021 §2.2): bubble (S - 1)(f + b) / v of a device."""
    s, m, f, b = 4, 8, 1.0, 2.0
    flat = simulate([f] * s, [b] * s, m, schedule="1f1b")
    v = 2
    inter = simulate([f / v] * (s * v), [b / v] * (s * v), m,
                     schedule="interleaved_1f1b", virtual_stages=v)
    assert flat.iteration_time == pytest.approx(m * (f + b) + (s - 1) * (f + b))
    assert inter.iteration_time == pytest.approx(m * (f + b) + (s - 1) * (f + b) / v)
