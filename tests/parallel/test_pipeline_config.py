"""Pipeline keys of the config and fields of the Plan: bad assignments fail before training."""

import pytest

from dynjax import config as config_lib
from dynjax.config import validate_config
from dynjax.errors import ConfigError
from dynjax.experiment import Experiment
from dynjax.recompile import Plan, PlanContext, PlanError
from dynjax.settings import microbatches, num_stages, read_run, stage_layers
from dynjax.train import main

from ..tiny import tiny_config

CTX = PlanContext(batch_size=8, num_layers=4, pipeline_stages=3, batch_shards=2)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"mesh__stage": 3, "pipeline__stage_layers": "(2,0,2)"},
            r"stage\(s\) \[1\] hold no layers",
        ),
        (
            {"mesh__stage": 2, "pipeline__stage_layers": "(1,2)"},
            r"sums to 3 layers but model.num_layers=4",
        ),
        (
            {"mesh__stage": 2, "pipeline__stage_layers": "(1,1,2)"},
            r"gives 3 stages but mesh.stage=2",
        ),
        ({"mesh__stage": 5}, r"mesh.stage=5 exceeds model.num_layers=4"),
        (
            {"mesh__stage": 4, "mesh__data": 4},
            r"16 devices, but only 8 are available.*device_count=16",
        ),
        ({"mesh__stage": 2, "pipeline__stage_layers": "(1,x)"}, r"tuple of layer counts"),
        ({"mesh__stage": 2, "pipeline__schedule": "zb"}, r"pipeline.schedule='zb'"),
        (
            {"mesh__stage": 2, "mesh__tensor": 2, "pipeline__schedule": "zb_h1"},
            r"pipeline.schedule='zb_h1' keeps .* needs mesh.expert=1 and mesh.tensor=1 "
            r"\(got 1 and 2\)",
        ),
        (
            {"mesh__stage": 2, "pipeline__virtual_stages": 2},
            r"pipeline.virtual_stages=2 with pipeline.schedule='1f1b': interleaved_1f1b needs",
        ),
        (
            {"mesh__stage": 2, "pipeline__schedule": "interleaved_1f1b"},
            r"pipeline.virtual_stages=1 .*interleaved_1f1b needs virtual_stages >= 2",
        ),
        (
            {"pipeline__schedule": "interleaved_1f1b", "pipeline__virtual_stages": 2},
            r"needs a pipeline: set mesh.stage >= 2",
        ),
        (
            {
                "mesh__stage": 2,
                "pipeline__schedule": "interleaved_1f1b",
                "pipeline__virtual_stages": 2,
                "train__microbatches": 3,
                "train__batch_size": 6,
            },
            r"train.microbatches=3 must be a multiple of mesh.stage=2",
        ),
        (
            {
                "mesh__stage": 2,
                "pipeline__schedule": "interleaved_1f1b",
                "pipeline__virtual_stages": 2,
                "pipeline__stage_layers": "(2,2)",
            },
            r"gives 2 stages but mesh.stage=2 x pipeline.virtual_stages=2",
        ),
        (
            {
                "mesh__stage": 2,
                "pipeline__schedule": "interleaved_1f1b",
                "pipeline__virtual_stages": 3,
            },
            r"mesh.stage=2 x pipeline.virtual_stages=3 exceeds model.num_layers=4",
        ),
        (
            {
                "mesh__stage": 2,
                "pipeline__schedule": "interleaved_1f1b",
                "pipeline__virtual_stages": 2,
                "balance__repack": True,
            },
            r"balance.repack with pipeline.schedule='interleaved_1f1b'",
        ),
        ({"train__microbatches": -1}, r"train.microbatches=-1 must be >= 0"),
        ({"balance__enabled": True}, r"balance.enabled needs a pipeline"),
        (
            {"mesh__stage": 2, "balance__enabled": True, "balance__method": "greedy"},
            r"balance.method='greedy' is not one of",
        ),
        (
            {"mesh__stage": 2, "balance__enabled": True, "balance__every": 0},
            r"balance.every > 0 or balance.threshold > 0",
        ),
        (
            {"mesh__stage": 2, "balance__enabled": True, "pipeline__profile_on_change": False},
            r"balance.by='time' needs profiles",
        ),
    ],
)
def test_bad_stage_assignments_fail_clearly(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(tiny_config(model__num_layers=4, **overrides), num_devices=8)


def test_cli_rejects_a_bad_assignment_before_training(capsys, tmp_path):
    argv = [
        "--config", "tests/tiny.py", "--workdir", str(tmp_path / "run"),
        "--config.model.num_layers=4", "--config.mesh.stage=2",
        "--config.pipeline.stage_layers=(4,0)",
    ]
    assert main(argv) == 2
    assert "stage(s) [1] hold no layers" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_an_interleaved_pipeline_counts_logical_stages():
    """mesh.stage x virtual_stages logical stages, uniform over them; the default microbatches
    are a multiple of mesh.stage (the schedule's groups)."""
    cfg = tiny_config(
        model__num_layers=6,
        mesh__stage=2,
        mesh__data=2,
        train__batch_size=12,
        pipeline__schedule="interleaved_1f1b",
        pipeline__virtual_stages=2,
    )
    run = read_run(cfg)
    assert num_stages(run) == 4 and stage_layers(run) == (2, 2, 1, 1)
    assert microbatches(run) == 6  # multiples of 2 up to 8 dividing the 6 rows per shard: 2, 6
    plan = Experiment.from_config(cfg).initial_plan()
    assert plan.virtual_stages == 2 and plan.stage_layers == (2, 2, 1, 1)
    ctx = PlanContext(batch_size=12, num_layers=6, pipeline_stages=4, batch_shards=2)
    with pytest.raises(PlanError, match="does not re-pack"):
        plan.replace(stage_layers=(3, 2, 1)).validate(ctx)
    with pytest.raises(PlanError, match="must be a multiple of the stages"):
        plan.replace(microbatches=3).validate(ctx)
    with pytest.raises(PlanError, match="interleaved schedules need virtual_stages >= 2"):
        plan.replace(virtual_stages=1).validate(ctx)


def test_stage_layers_default_to_uniform_and_microbatches_to_twice_the_stages():
    cfg = read_run(
        tiny_config(model__num_layers=6, mesh__stage=4, mesh__data=2, train__batch_size=16)
    )
    assert stage_layers(cfg) == (2, 2, 1, 1)  # the first stages take the extra
    assert microbatches(cfg) == 8
    single = read_run(tiny_config())
    assert stage_layers(single) == () and microbatches(single) == 1
    one_stage = read_run(tiny_config(pipeline__stage_layers="(2,)"))
    assert stage_layers(one_stage) == (2,)  # the pipeline runtime on one stage
    assert microbatches(one_stage) == 1
    assert microbatches(read_run(tiny_config(mesh__stage=2, mesh__data=4))) == 2


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"stage_layers": ()}, ["stage_layers is empty", "3 pipeline stages"]),
        ({"stage_layers": (1, 1, 1, 1)}, ["has 4 stages but only 3 stage sub-meshes"]),
        ({"stage_layers": (2, 0, 2)}, ["stage(s) [1] hold no layers"]),
        ({"stage_layers": (2, 1, 2)}, ["sums to 5 layers", "has 4"]),
        ({"schedule": "zero-bubble"}, ["schedule = 'zero-bubble'", "gpipe"]),
        ({"frozen_layers": (1, 7)}, ["frozen_layers [7]"]),
        ({"microbatches": 8}, ["microbatch of 1 sequences", "2 devices"]),
    ],
)
def test_invalid_pipeline_plans_name_the_fix(changes, words):
    plan = Plan(stage_layers=(2, 1, 1)).replace(**changes)
    with pytest.raises(PlanError) as err:
        plan.validate(CTX)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_a_plan_may_use_fewer_stages_than_the_mesh_has():
    Plan(stage_layers=(2, 2)).validate(CTX)  # a re-packed Plan: sub-mesh 2 is unused
    Plan(stage_layers=(4,)).validate(CTX)


def test_pipeline_plan_fields_round_trip_and_old_plans_load():
    plan = Plan(stage_layers=[1, 3], schedule="gpipe", frozen_layers=[3, 0, 0], microbatches=4)
    assert plan.frozen_layers == (0, 3) and plan.stage_layers == (1, 3)
    assert Plan.from_dict(plan.to_dict()) == plan
    assert plan.diff(plan.replace(stage_layers=(2, 2))) == {"stage_layers": ([1, 3], [2, 2])}
    old = Plan.from_dict({"capacities": [], "cached_routing": False, "microbatches": 1,
                          "dtype": "float32"})  # saved before the pipeline existed
    assert old.stage_layers == () and old.schedule == "1f1b" and old.frozen_layers == ()
    single = PlanContext(batch_size=8, num_layers=4)
    old.validate(single)
    old.replace(frozen_layers=(1,)).validate(single)  # the single-program step freezes too
    with pytest.raises(PlanError, match=r"frozen_layers \[4\] are not layers"):
        old.replace(frozen_layers=(4,)).validate(single)


def test_static_baselines_uniform_and_by_param():
    uniform = read_run(tiny_config(model__num_layers=4, moe__every=2, mesh__stage=3,
                                   pipeline__stage_layers="uniform"))
    assert stage_layers(uniform) == (2, 1, 1) and num_stages(uniform) == 3
    # only layer 3 holds an MoE block (4 experts): 20864 parameters against 8544
    by_param = tiny_config(model__num_layers=4, moe__every=4, mesh__stage=2, mesh__data=2,
                           pipeline__stage_layers="by_param")
    config_lib.validate_config(by_param, 8)
    assert stage_layers(read_run(by_param), [1, 1, 1, 5]) == (3, 1)
    plan = Experiment.from_config(by_param).initial_plan()
    assert plan.stage_layers == (3, 1)  # uniform would give (2, 2)
