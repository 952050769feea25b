"""benchmarks/real_pipeline.py: the steady-state window it measures, the profile it balances
from, and (slow) one case run end to end on two pinned processes (issue 33 §1)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from .helpers import ROOT, benchmark_script

bench = benchmark_script("real_pipeline")

KEYS = ("static_tokens_per_sec", "balanced_tokens_per_sec", "measured_speedup",
        "predicted_speedup", "bound_speedup")


def write(workdir: Path, events: list[dict], rates: dict[int, float]) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    metrics = [{"step": s, "loss": 1.0, "tokens_per_sec": r} for s, r in rates.items()]
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))


PROFILE = {"event": "profile", "step": 6, "layer_forward_seconds": [1.0, 1.0, 1.0, 1.0],
           "layer_backward_seconds": [2.0, 2.0, 2.0, 2.0], "embed_seconds": [0.5, 0.25],
           "head_seconds": [3.0, 6.0]}


def test_set_overrides_keep_numbers_as_numbers_and_come_after_the_case_settings():
    sets = bench.parse_sets(["train.microbatches=8", "optim.lr=3e-4", "model.kind=llama"])
    assert sets == {"train.microbatches": 8, "optim.lr": 3e-4, "model.kind": "llama"}
    _, values = bench.overrides("freezing", 10, None, "", sets)
    assert values["train.microbatches"] == 8  # COMMON says 4
    assert values["train.steps"] == 10 and values["pipeline.stage_layers"] == ""


@pytest.mark.parametrize("item", ["train.microbatches", "=8"])
def test_a_set_without_key_and_value_is_refused(item):
    with pytest.raises(ValueError, match="KEY=VALUE"):
        bench.parse_sets([item])


def test_the_steady_window_starts_after_the_last_swap_and_profile(tmp_path):
    events = [{"event": "freeze", "step": 3}, {"event": "recompile", "step": 3, "swap_step": 5},
              PROFILE]
    # steps 1..7 pay for the compile, the swap and the profile; 8 is the first interval after
    write(tmp_path, events, {s: (1.0 if s <= 7 else 100.0 + s) for s in range(1, 13)})
    assert bench.settled_step(tmp_path) == 6
    assert bench.steady_tokens_per_sec(tmp_path) == np.median([108, 109, 110, 111, 112])


def test_a_decision_not_swapped_in_by_the_end_is_refused(tmp_path):
    events = [{"event": "recompile", "step": 3, "swap_step": 5}, {"event": "freeze", "step": 9}]
    write(tmp_path, events, {s: 1.0 for s in range(1, 13)})
    with pytest.raises(RuntimeError, match="freeze decided at step 9 .* raise --steps"):
        bench.settled_step(tmp_path)


def test_the_task_overhead_calibrated_on_one_layout_reproduces_its_step():
    fwd, bwd = np.array([1.0, 1.0, 3.0, 3.0]), np.array([2.0, 2.0, 6.0, 6.0])
    static, balanced = (2, 2), (3, 1)
    compute_only = bench.simulated_seconds(fwd, bwd, static, 4, "1f1b", 0.0)
    o = bench.task_overhead(fwd, bwd, static, 4, "1f1b", compute_only + 5.0)
    assert o > 0
    assert math.isclose(bench.simulated_seconds(fwd, bwd, static, 4, "1f1b", o),
                        compute_only + 5.0, rel_tol=1e-9)
    # the overhead lengthens every task of the other layout too
    assert bench.simulated_seconds(fwd, bwd, balanced, 4, "1f1b", o) > bench.simulated_seconds(
        fwd, bwd, balanced, 4, "1f1b", 0.0)
    # a measured step the layers alone exceed needs no overhead
    assert bench.task_overhead(fwd, bwd, static, 4, "1f1b", compute_only / 2) == 0.0


def test_too_few_steady_steps_are_refused(tmp_path):
    write(tmp_path, [PROFILE], {s: 1.0 for s in range(1, 10)})
    with pytest.raises(RuntimeError, match="only 2 steady steps after step 6"):
        bench.steady_tokens_per_sec(tmp_path)


def test_layer_times_fold_the_embedding_and_head_into_the_end_layers(tmp_path):
    write(tmp_path, [{**PROFILE, "layer_forward_seconds": [9.0] * 4}, PROFILE], {})
    fwd, bwd = bench.layer_times(tmp_path)  # the newest profile
    np.testing.assert_array_equal(fwd, [1.5, 1.0, 1.0, 4.0])
    np.testing.assert_array_equal(bwd, [2.25, 2.0, 2.0, 8.0])


def test_the_measured_bubble_is_each_processs_idle_share_of_the_step(tmp_path):
    """Logical stages 0 and 2 share process 0 (interleaved): their overlapping tasks count once."""
    timeline = [
        [["F", 0, 0.0, 1.0], ["B", 0, 2.0, 3.0]],  # stage 0, process 0
        [["F", 0, 1.0, 4.0]],  # stage 1, process 1
        [["F", 0, 0.5, 1.5]],  # stage 2, process 0 again
        [["F", 0, 1.0, 2.0]],  # stage 3, process 1 (inside stage 1's task)
    ]
    write(tmp_path, [{**PROFILE, "timeline": timeline}], {})
    # process 0 busy 0-1.5 and 2-3 of 0-4 (idle 37.5%), process 1 busy 1-4 (idle 25%)
    assert bench.measured_bubble(tmp_path) == pytest.approx((0.375 + 0.25) / 2)


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pins 2 processes to a core each")
def test_the_schedules_run_on_two_pinned_processes(tmp_path):
    out = tmp_path / "schedules.json"
    # the schedules' code paths; the runs without recompute only set a flag of 1F1B's and ZB's
    cmd = [sys.executable, "benchmarks/real_pipeline.py", "--schedules", "--layers", "4",
           "--steps", "8", "--rounds", "1", "--run", "interleaved_1f1b", "--run", "zb_h1",
           "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())["schedules"]
    assert set(result) == {"1f1b", "interleaved_1f1b", "zb_h1"}
    for row in result.values():
        assert row["tokens_per_sec"] > 0 and 0 <= row["bubble"] < 1 and row["compile_seconds"] > 0
    assert result["1f1b"]["speedup_vs_1f1b"] == 1.0
    assert "interleaved_1f1b" in done.stdout


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pins 2 processes to a core each")
def test_one_case_runs_on_two_pinned_processes(tmp_path):
    out = tmp_path / "mod.json"
    cmd = [sys.executable, "benchmarks/real_pipeline.py", "--case", "mod", "--layers", "4",
           "--steps", "8", "--rounds", "1", "--set", "train.microbatches=2", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    for key in KEYS:
        assert isinstance(result[key], float) and math.isfinite(result[key]) and result[key] > 0
    assert result["static_layout"] == [2, 2] and sum(result["balanced_layout"]) == 4
    assert result["overrides"] == {"train.microbatches": 2}
    assert "measured speedup" in done.stdout and "predicted" in done.stdout
    assert "share of the bound's gain" in done.stdout and "refinements" in result


def test_refining_reruns_the_layout_each_balanced_runs_own_profile_picks(tmp_path, monkeypatch):
    """Static (3, 3) profiles to (4, 2); the (4, 2) run's own profile moves one more layer,
    (5, 1), whose run keeps it: three runs in round 0, and round 1 takes the last layout."""
    profiles = {(3, 3): [1, 1, 1, 2, 2, 2], (4, 2): [1, 1, 1, 1, 1, 5], (5, 1): [1, 1, 1, 1, 1, 5]}
    rates = {(3, 3): 100.0, (4, 2): 120.0, (5, 1): 150.0}
    ran = []

    def fake_run(command):
        workdir = Path(command[command.index("--workdir") + 1])
        layout = next(a for a in command if a.startswith("--config.pipeline.stage_layers="))
        layout = tuple(int(n) for n in layout.split("=")[1].split(","))
        ran.append((workdir.name, layout))
        profile = {**PROFILE, "layer_forward_seconds": profiles[layout],
                   "layer_backward_seconds": [0.0] * 6, "embed_seconds": [0.0, 0.0],
                   "head_seconds": [0.0, 0.0]}
        write(workdir, [profile], {s: rates[layout] for s in range(1, 13)})

    monkeypatch.setattr(bench, "run", fake_run)
    result = bench.measure_case("freezing", 12, 2, 6, tmp_path, refine=3)
    assert ran == [("freezing-static-0", (3, 3)), ("freezing-balanced-0", (4, 2)),
                   ("freezing-refined1-0", (5, 1)), ("freezing-static-1", (3, 3)),
                   ("freezing-balanced-1", (5, 1))]
    assert result["balanced_layout"] == [5, 1]
    assert result["refinements"] == [{"layout": [4, 2], "tokens_per_sec": 120.0}]
    assert result["measured_speedup"] == pytest.approx(1.5)
    # the bound is the static profile's: slowest stage 6 over 9 / 2
    assert result["bound_speedup"] == pytest.approx(6 / 4.5)
    assert result["bound_gain_share"] == pytest.approx(0.5 / (6 / 4.5 - 1))


@pytest.mark.parametrize("argv", [["--parallel-check", "--refine", "1"],
                                  ["--case", "freezing", "--refine", "-1"]])
def test_refine_takes_a_count_and_goes_with_a_case(argv, capsys):
    assert bench.main(argv) == 2
    assert "error: --refine takes a count >= 0 and goes with --case" in capsys.readouterr().err
