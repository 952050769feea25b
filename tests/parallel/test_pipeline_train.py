"""The pipeline inside dynjax.train: it trains (with data and expert parallelism inside its
stages), logs, evaluates, checkpoints in the single-stage layout, and a run resumes with a
different number of stages."""

import shutil

import pytest

from dynjax.train import train
from dynjax.writers import read_jsonl

from ..helpers import logged
from ..tiny import tiny_config


def pipeline_config(**overrides):
    base = dict(
        model__num_layers=3,
        moe__every=2,
        train__steps=8,
        train__microbatches=2,
        train__eval_every=4,
        train__checkpoint_every=4,
        train__log_every=1,
        mesh__data=2,
        pipeline__profile_on_change=False,
    )
    return tiny_config(**{**base, **overrides})


@pytest.mark.slow
def test_pipeline_run_resumes_on_one_stage_with_the_same_losses(tmp_path):
    single = tmp_path / "single"
    train(pipeline_config(), single, progress=False)

    # 2 stages x 2 data x 2 expert devices: expert parallelism inside a stage.
    staged = tmp_path / "staged"
    config = pipeline_config(mesh__stage=2, mesh__expert=2, pipeline__stage_layers="(2,1)")
    summary = train(config, staged, progress=False)
    assert summary.checkpoints == [4, 8]
    items = sorted(p.name for p in (staged / "checkpoints" / "4").iterdir() if p.is_dir())
    # The full-tree layout of single-stage runs (`dynjax.checkpoint.layout`).
    assert items == ["dense", "experts", "meta"]
    compile_event = next(e for e in read_jsonl(staged / "events.jsonl") if e["event"] == "compile")
    assert compile_event["plan"]["stage_layers"] == [2, 1]

    # Resume the staged run's step-4 checkpoint on one stage (the single-program step).
    mixed = tmp_path / "mixed"
    shutil.copytree(staged / "checkpoints" / "4", mixed / "checkpoints" / "4")
    resumed = train(pipeline_config(), mixed, progress=False)
    assert resumed.start_step == 4 and resumed.final_step == 8

    want = logged(single, "loss")
    assert sorted(want) == list(range(1, 9))
    for run, steps in ((staged, range(1, 9)), (mixed, range(5, 9))):
        got = logged(run, "loss")
        assert sorted(got) == list(steps)
        for step in steps:
            assert abs(got[step] - want[step]) <= 1e-4 * want[step], (run.name, step, got, want)
    for key in ("eval_loss", "dropped_fraction", "grad_norm"):
        a, b = logged(single, key), logged(staged, key)
        assert a.keys() == b.keys() and a
        assert all(abs(a[s] - b[s]) <= 1e-4 * abs(a[s]) + 1e-6 for s in a), key
    assert logged(staged, "tokens_per_expert") == logged(single, "tokens_per_expert")


@pytest.mark.slow
def test_a_bfloat16_pipeline_trains_as_the_bfloat16_single_program(tmp_path):
    """A stage sends its activation in the compute dtype the next stage was lowered for: a
    bfloat16 pipeline used to fail to lower its first stage's backward (the layers handed back
    a float32 residual, the next stage's input gradient came back in bfloat16). The stage
    boundary rounds the residual to bfloat16, which the single program keeps wider."""
    config = dict(model__num_layers=2, moe__every=0, train__dtype="bfloat16", mesh__data=1)
    single, staged = tmp_path / "single", tmp_path / "staged"
    train(pipeline_config(**config), single, progress=False)
    train(pipeline_config(**config, mesh__stage=2), staged, progress=False)
    want, got = logged(single, "loss"), logged(staged, "loss")
    assert sorted(got) == sorted(want) == list(range(1, 9))
    for step in want:
        assert abs(got[step] - want[step]) <= 2e-3 * want[step], (step, got, want)
