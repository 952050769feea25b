"""Resuming a workdir: a corrupt checkpoint is set aside and its step saved again; a changed
config is applied where the saved state allows it and refused before any work where it does not;
every resume is recorded; logged metrics name the Plan their step ran with."""

import json
import shutil
from pathlib import Path

import pytest

from dynjax.dynamism.moe import MoEPlugin
from dynjax.dynamism.moe.part import capacities_of
from dynjax.errors import ConfigError
from dynjax.experiment import Experiment
from dynjax.recompile import Plan
from dynjax.resume import config_changes
from dynjax.train import main, train
from dynjax.writers import read_jsonl

from .helpers import corrupt, events_of, losses, train_cli
from .tiny import tiny_config

RUN = {"train__steps": 16, "train__checkpoint_every": 4, "train__eval_every": 1000}


def run_killed_after_save(workdir: Path, step: int) -> None:
    """The CLI on the same config as `RUN`, killed by itself right after saving ``step``."""
    assert train_cli("tests/scripts/kill_after_save.py", workdir, RUN, step) == -9


@pytest.mark.slow
def test_a_corrupt_step_is_saved_again_and_a_crash_after_it_resumes_from_it(tmp_path):
    reference = tmp_path / "reference"
    train(tiny_config(**RUN), reference, progress=False)

    run = tmp_path / "run"
    run_killed_after_save(run, 8)  # checkpoints 4 and 8
    corrupt(run / "checkpoints" / "8")
    run_killed_after_save(run, 8)  # falls back to 4, sets 8 aside, trains and saves 8 again
    assert [e["step"] for e in events_of(run, "checkpoint_restore")] == [4]
    [moved] = events_of(run, "checkpoint_restore_failed")
    assert moved["step"] == 8 and Path(moved["moved_to"]).parent == run / "checkpoints" / "corrupt"

    summary = train(tiny_config(**RUN), run, progress=False)
    assert [e["step"] for e in events_of(run, "checkpoint_restore")] == [4, 8]
    assert summary.start_step == 8 and summary.checkpoints == [8, 12, 16]
    assert not events_of(run, "checkpoint_failed")
    got, want = losses(run), losses(reference)
    assert got == want  # every step, bit for bit


def test_a_process_killed_right_after_a_save_has_logged_every_step_it_saved(tmp_path):
    """Metrics reach the host Δ steps late; a save logs them first (issue 32 §6), so the steps
    a resumed run skips are in metrics.jsonl."""
    run_killed_after_save(tmp_path, 8)
    assert set(losses(tmp_path)) == set(range(1, 9))


def test_a_model_or_data_change_is_refused_before_any_work(tmp_path):
    cfg = tiny_config(train__steps=4, train__checkpoint_every=4)
    train(cfg, tmp_path, progress=False)
    saved_config = (tmp_path / "config.json").read_text()
    changed = tiny_config(
        train__steps=8, model__d_model=64, data__seq_len=16, seed=1, train__batch_size=16
    )
    with pytest.raises(ConfigError) as err:
        train(changed, tmp_path, progress=False)
    for key in ("model.d_model", "data.seq_len", "seed", "train.batch_size", "--workdir"):
        assert key in str(err.value)
    assert "train.steps" not in str(err.value)  # a change a resume may make
    assert (tmp_path / "config.json").read_text() == saved_config
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["4"]  # nothing moved
    assert not events_of(tmp_path, "checkpoint_restore")  # no array was read


# Each MoE key that decides what the saved state is (`MoEPlugin.fixed_on_resume`), changed from
# the saved run's value: top_k keeps every parameter's shape, so without the refusal a resume
# would restore and silently train another model.
MOE_CHANGES = {
    "moe.every": (2, 1),
    "moe.num_experts": (4, 8),
    "moe.top_k": (2, 1),
    "moe.expert_mlp_dim": (0, 32),
    "moe.bias_balancing.enabled": (False, True),
    "moe.shared_expert_dim": (0, 16),
    "moe.shared_expert_gate": (False, True),
}
# What a change needs beside it to be a valid config (a gate needs a shared expert to gate).
COMPANIONS = {"moe.shared_expert_gate": {"moe__shared_expert_dim": 16}}


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """A 4-step MoE run with its checkpoint of step 4."""
    workdir = tmp_path_factory.mktemp("moe_run")
    train(tiny_config(moe__every=2, train__steps=4, train__checkpoint_every=4), workdir,
          progress=False)
    return workdir


def test_the_moe_keys_a_resume_cannot_follow_are_declared():
    assert set(MOE_CHANGES) == set(MoEPlugin.fixed_on_resume)


@pytest.mark.parametrize("key", sorted(MOE_CHANGES))
def test_an_moe_shape_change_is_refused_before_any_work(moe_run, tmp_path, key):
    workdir = tmp_path / "run"
    shutil.copytree(moe_run, workdir)
    saved_config = (workdir / "config.json").read_text()
    before, after = MOE_CHANGES[key]
    overrides = {"moe__every": 2, "train__steps": 8, "train__checkpoint_every": 4}
    changed = tiny_config(**overrides | COMPANIONS.get(key, {}) | {key.replace(".", "__"): after})
    with pytest.raises(ConfigError) as err:
        train(changed, workdir, progress=False)
    assert f"{key}: {before!r} -> {after!r}" in str(err.value) and "--workdir" in str(err.value)
    assert "train.steps" not in str(err.value)  # a change a resume may make
    assert (workdir / "config.json").read_text() == saved_config
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["4"]  # nothing moved
    assert not events_of(workdir, "checkpoint_restore")  # no array was read


def test_the_cli_refuses_a_changed_model_with_exit_2(tmp_path, capsys):
    train(tiny_config(train__steps=4, train__checkpoint_every=4), tmp_path, progress=False)
    code = main(["--config=tests/tiny.py", f"--workdir={tmp_path}", "--config.model.d_model=64"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "model.d_model: 32 -> 64" in err


def test_the_cli_says_no_checkpoint_could_be_restored_with_exit_2(tmp_path, capsys):
    """Every checkpoint of the workdir corrupt: an error naming where they were set aside, not
    a traceback, and nothing deleted."""
    train(tiny_config(train__steps=4, train__checkpoint_every=4), tmp_path, progress=False)
    corrupt(tmp_path / "checkpoints" / "4")
    code = main(["--config=tests/tiny.py", f"--workdir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "could be restored" in err
    assert "Traceback" not in err
    assert (tmp_path / "checkpoints" / "corrupt").is_dir()


@pytest.mark.slow
def test_step_options_that_changed_are_applied_and_recorded(tmp_path):
    base = {"moe__every": 2, "train__checkpoint_every": 4, "train__eval_every": 1000}
    train(tiny_config(train__steps=4, **base), tmp_path, progress=False)
    changed = tiny_config(
        train__steps=8,
        train__dtype="bfloat16",
        train__microbatches=2,
        moe__capacity__factor=2.0,
        **base,
    )
    summary = train(changed, tmp_path, progress=False)
    assert summary.start_step == 4 and summary.final_step == 8
    [resume] = events_of(tmp_path, "resume")
    assert resume["step"] == 4
    assert resume["config_diff"] == {
        "moe.capacity.factor": [1.25, 2.0],
        "train.dtype": ["float32", "bfloat16"],
        "train.microbatches": [0, 2],
        "train.steps": [4, 8],
    }
    assert resume["plan_diff"]["dtype"] == ["float32", "bfloat16"]
    assert resume["plan_diff"]["microbatches"] == [1, 2]
    ran = Plan.from_dict(events_of(tmp_path, "compile")[-1]["plan"])
    exp = Experiment.from_config(changed)
    assert ran == exp.initial_plan()  # what the new config implies, nothing of the old
    assert json.loads((tmp_path / "config.json").read_text())["train"]["dtype"] == "bfloat16"


def test_a_resume_keeps_what_the_policies_decided_unless_its_keys_changed():
    cfg = tiny_config(moe__every=1, mesh__stage=2, pipeline__schedule="gpipe")
    exp = Experiment.from_config(cfg)
    initial = exp.initial_plan()
    decided = initial.replace(stage_layers=(1, 1)).with_part(
        "moe", capacities=((5, 9, 12, 3), (7, 7, 7, 7)), cached_routing=True
    )
    assert exp.resumed_plan(decided, {}) == decided
    assert exp.resumed_plan(decided, {"train.learning_rate": (1e-3, 2e-3)}) == decided
    new_factor = exp.resumed_plan(decided, {"moe.capacity.factor": (1.0, 1.25)})
    assert new_factor == decided.with_part("moe", capacities=capacities_of(initial))
    schedule = exp.resumed_plan(decided.replace(schedule="1f1b"), {"pipeline.schedule": (0, 0)})
    assert schedule.schedule == "gpipe" and capacities_of(schedule) == capacities_of(decided)


def test_config_changes_counts_keys_an_older_run_lacked_with_their_default():
    cfg = tiny_config()
    saved = cfg.to_dict()
    del saved["balance"]["repack"]  # a key added after that run: it ran with the default
    saved["train"]["removed_key"] = 1  # a key since removed: nothing to compare
    assert config_changes(saved, cfg) == {}
    cfg.balance.repack = True
    assert config_changes(saved, cfg) == {"balance.repack": (False, True)}


class RaiseCapacities:
    """One more slot for every expert once the metrics of step 3 are seen: one Plan change."""

    name = "raise"

    def propose(self, history, plan):
        caps = capacities_of(plan)
        if history.latest_step is None or history.latest_step < 3 or caps[0][0] > 20:
            return None
        return plan.with_part("moe", capacities=tuple(tuple(c + 1 for c in cs) for cs in caps))


@pytest.mark.slow
def test_logged_metrics_name_the_plan_their_step_ran_with(tmp_path):
    # Long enough (a few seconds of tiny steps) for a background compile on a busy machine.
    cfg = tiny_config(moe__every=2, train__steps=200, train__eval_every=1000)
    # The first run fills JAX's persistent cache, so the second swaps within a few steps
    # (tests/helpers.py, train_with_warm_cache).
    train(cfg, tmp_path / "warm", policies=[RaiseCapacities()], progress=False)
    train(cfg, tmp_path / "run", policies=[RaiseCapacities()], progress=False)
    [swap] = events_of(tmp_path / "run", "recompile")
    assert swap["swap_step"] < 195, "the background compile outlasted the run"
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    factors = {r["step"]: r["capacity_factor"] for r in records if "loss" in r}
    assert sorted(factors) == list(range(1, 201))
    old, new = factors[1], factors[200]
    assert new > old
    # Line `step` holds training step step - 1; the swap's first step is `swap_step`.
    assert all(f == (old if s - 1 < swap["swap_step"] else new) for s, f in factors.items())


def test_a_resume_says_its_step_and_marks_the_records_it_writes(tmp_path, capsys):
    """Issue 32 §7: a line names the step resumed from, and the resumed run's metrics records
    carry ``resumed_from``, so a step logged twice (trained again after a resume) is told
    apart."""
    run = {"train__checkpoint_every": 4, "train__eval_every": 1000}
    train(tiny_config(train__steps=6, **run), tmp_path, progress=False)  # logs 5, 6; saves 4, 6
    (tmp_path / "checkpoints" / "6").rename(tmp_path / "moved")  # as if killed before saving 6
    capsys.readouterr()
    train(tiny_config(train__steps=8, **run), tmp_path, progress=False)
    assert f"resumed from step 4 of {tmp_path / 'checkpoints'}" in capsys.readouterr().out
    records = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
    first = [r["step"] for r in records if "resumed_from" not in r]
    again = [r["step"] for r in records if r.get("resumed_from") == 4]
    assert first == list(range(1, 7)) and again == [5, 6, 7, 8]


def test_a_short_resumed_run_measures_the_throughput_of_its_steps(tmp_path):
    """Steps still in flight at the end are fetched one at a time, each as it completes: a
    resumed run of fewer steps than the monitor's delay fetched them in one call and timed the
    second step as taking no time (tokens/s a million times too high)."""
    run = {"train__checkpoint_every": 4, "train__eval_every": 1000, "train__log_every": 20}
    train(tiny_config(train__steps=4, **run), tmp_path, progress=False)
    train(tiny_config(train__steps=6, **run), tmp_path, progress=False)
    rates = {r.get("resumed_from"): r["tokens_per_sec"]
             for r in read_jsonl(tmp_path / "metrics.jsonl") if "tokens_per_sec" in r}
    assert set(rates) == {None, 4}
    assert rates[4] < 100 * rates[None]  # the same steps; a loaded machine varies them ~10x
