"""The run report (dynjax.report): arrays from records, and PNGs + report.md from real runs."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from dynjax import report
from dynjax.dynamism import BUILTIN, Plugin
from dynjax.dynamism.freezing import FreezingPlugin
from dynjax.dynamism.moe.report import expert_load
from dynjax.dynamism.pruning import PruningPlugin
from dynjax.report.pngs import scheme_plots
from dynjax.train import train

from ..helpers import ROOT
from ..tiny import tiny_config

# ---------------------------------------------------------------------------------------------
# Recorded runs, one of each kind, built once for the module


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("runs")
    configs = {
        "dense": tiny_config(train__steps=8, train__checkpoint_every=4, train__eval_every=4),
        "moe": tiny_config(
            moe__every=1,
            moe__capacity__policy="dynamic",
            moe__capacity__window=2,
            train__steps=10,
            train__eval_every=5,
            train__checkpoint_every=10,
        ),
        # An unbalanced pipeline whose balancer decides every 5 steps on fresh profiles, with
        # MoE layers (1, 3) so that it also writes layer_costs.jsonl with profiled times.
        "pipeline": tiny_config(
            model__num_layers=4,
            moe__every=2,
            mesh__stage=2,
            pipeline__stage_layers="(3,1)",
            pipeline__profile_every=5,
            balance__enabled=True,
            balance__every=5,
            balance__amortize_steps=10**9,
            train__steps=15,
            train__eval_every=15,
            train__checkpoint_every=15,
        ),
    }
    for name, cfg in configs.items():
        train(cfg, base / name, progress=False)
    return base


EXPECTED = {
    "dense": {"loss", "throughput"},
    "moe": {"loss", "throughput", "expert_load", "layer_costs"},
    "pipeline": {"loss", "throughput", "expert_load", "pipeline", "layer_costs"},
}


def check_pngs(plots, out):
    """Every written PNG is a full-width, non-blank image of the size the report says."""
    import matplotlib.image

    markdown = (out / "report.md").read_text()
    for p in plots:
        if p.path is None:
            assert f"Skipped: {p.reason}" in markdown
            continue
        image = matplotlib.image.imread(p.path)
        assert image.shape[:2] == (p.height, p.width) and p.width == report.WIDTH * report.DPI
        assert 200 <= p.height <= 3000
        assert image[..., :3].std() > 0.05  # not blank: lines, text, colour
        assert f"]({p.path.name})" in markdown


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense", "moe", "pipeline"])
def test_report_renders_each_kind_of_run(runs, kind, tmp_path):
    plots = report.write_report(runs / kind, tmp_path)
    assert {p.name for p in plots if p.path} == EXPECTED[kind]
    assert {p.name for p in plots if p.path is None} == {p[0] for p in report.PLOTS} - EXPECTED[
        kind
    ]
    check_pngs(plots, tmp_path)
    markdown = (tmp_path / "report.md").read_text()
    assert "| median tokens/s |" in markdown and "| final eval loss |" in markdown


def test_moe_capacity_is_the_plans_slots_per_step(runs):
    run = report.load_run(runs / "moe")
    load = expert_load(run)
    steps = load.steps
    assert load.tokens.shape == (steps.size, 2, 4)  # 2 MoE layers x 4 experts
    # Every step routes batch x seq_len x top_k token-choices.
    assert (load.tokens.sum(axis=2) == 8 * 32 * 2).all()
    # The first Plan: ceil(1.25 x 32 x 2 / 4) = 20 slots per sequence, x 8 sequences per step.
    first_plan = report.plan_changes(run.events)[0][1]
    assert first_plan["parts"]["moe"]["capacities"] == [[20] * 4] * 2
    assert (load.capacity[0] == 160).all()
    changes = report.plan_changes(run.events)
    for t, step in enumerate(steps):
        plan = [p for b, p in changes if b < step][-1]
        caps = plan["parts"]["moe"]["capacities"]
        np.testing.assert_array_equal(load.capacity[t], np.array(caps) * 8)


def test_pipeline_load_layout_and_decisions(runs):
    run = report.load_run(runs / "pipeline")
    load = report.stage_load(run)
    # A profile whose timeline measured nothing (a loaded CPU) logs none and is not drawn.
    profiles = [e for e in run.events_of("profile") if e["timeline"] is not None]
    assert load.steps.tolist() == [e["step"] + 1 for e in profiles]
    assert load.forward.shape == load.backward.shape == (len(profiles), 2)
    assert (load.forward + load.backward > 0).all()
    assert ((0 <= load.bubble_ratio) & (load.bubble_ratio < 1)).all()
    bounds, per_stage = report.stage_layers(run)
    assert bounds[0] == 0 and per_stage[0].tolist() == [3, 1]
    decisions = run.events_of("rebalance")
    assert decisions and decisions[0]["old"] == [3, 1]
    marks = report.event_marks(run)
    accepted = [e["step"] for e in decisions if e["accepted"]]
    assert marks.get("rebalance", np.array([])).tolist() == sorted(accepted)
    costs = report.layer_costs(run)
    assert costs.modelled.shape[1] == costs.seconds.shape[1] == 4
    assert costs.profiled_steps.size >= 2 and (costs.seconds > 0).all()


def test_summary_of_a_finished_run(runs):
    s = report.summary(report.load_run(runs / "dense"))
    assert (s["first_step"], s["last_step"], s["train_steps_logged"]) == (1, 8, 8)
    assert s["final_loss"] > 0 and s["final_eval_loss"] > 0 and s["median_tokens_per_sec"] > 0
    assert s["checkpoints_saved"] == [4, 8] and s["checkpoints_kept"] == [4, 8]
    assert len(s["compile_seconds"]) == 1 and s["recompiles"] == []
    assert s["median_mfu"] is None


def test_a_torn_last_line_is_skipped(runs, tmp_path):
    live = tmp_path / "live"
    shutil.copytree(runs / "dense", live, ignore=shutil.ignore_patterns("checkpoints"))
    with open(live / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "loss": 3.1, "tokens_per')  # a writer caught mid-line
    with open(live / "events.jsonl", "a") as f:
        f.write('{"event": "checkpoint", "st')
    run = report.load_run(live)
    assert report.series(run.metrics, "loss")[0].tolist() == list(range(1, 9))
    plots = report.write_report(run, tmp_path / "out")
    check_pngs(plots, tmp_path / "out")


# ---------------------------------------------------------------------------------------------
# The command line


def test_cli_writes_into_workdir_report_by_default(runs, tmp_path, capsys):
    work = tmp_path / "dense"
    shutil.copytree(runs / "dense", work)
    assert report.main([str(work)]) == 0
    assert (work / "report" / "report.md").is_file() and (work / "report" / "loss.png").is_file()
    assert "report.md" in capsys.readouterr().out


def test_cli_refuses_a_missing_workdir_without_a_traceback(tmp_path):
    missing = tmp_path / "nope"
    done = subprocess.run(
        [sys.executable, "-m", "dynjax.report", str(missing)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and str(missing) in done.stderr
    assert "Traceback" not in done.stderr


def test_cli_refuses_a_directory_without_metrics(tmp_path, capsys):
    (tmp_path / "events.jsonl").write_text("")
    assert report.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no metrics.jsonl in") and "Traceback" not in err


def test_cli_reports_an_output_it_cannot_write(runs, tmp_path, capsys):
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    assert report.main([str(runs / "dense"), "--out", str(blocked / "report")]) == 2
    assert capsys.readouterr().err.startswith("error: cannot write the report")


# ---------------------------------------------------------------------------------------------
# Records -> arrays, on hand-written records


def plan(**fields):
    return {"capacities": [], "stage_layers": [], "frozen_layers": [], **fields}


def test_plans_run_the_steps_after_their_swap():
    events = [
        {"event": "compile", "step": 0, "plan": plan(capacities=[[2, 2]])},
        {"event": "checkpoint", "step": 3},
        {"event": "recompile", "step": 2, "swap_step": 5, "plan": plan(capacities=[[3, 1]])},
    ]
    changes = report.plan_changes(events)
    assert [b for b, _ in changes] == [0, 5]
    caps = [p["capacities"] for p in report.plans_at(changes, [1, 5, 6, 9])]
    assert caps == [[[2, 2]], [[2, 2]], [[3, 1]], [[3, 1]]]  # step 5 ran before the swap
    assert report.plans_at(changes, [0]) == [None]


def test_a_resumed_run_undoes_the_swaps_it_redid():
    # Swapped at 50, killed at 60, resumed from the checkpoint of step 40 (with the old Plan),
    # then swapped again at 55.
    events = [
        {"event": "compile", "step": 0, "plan": plan(capacities=[[2]])},
        {"event": "recompile", "swap_step": 50, "plan": plan(capacities=[[3]])},
        {"event": "compile", "step": 40, "plan": plan(capacities=[[2]])},
        {"event": "recompile", "swap_step": 55, "plan": plan(capacities=[[4]])},
    ]
    changes = report.plan_changes(events)
    assert [(b, p["capacities"]) for b, p in changes] == [(0, [[2]]), (40, [[2]]), (55, [[4]])]


def test_expert_capacity_follows_the_plan_times_the_groups(tmp_path):
    run = report.Run(
        tmp_path,
        config={"train": {"batch_size": 4}, "moe": {"every": 2}, "model": {"num_layers": 4}},
        metrics=[
            {"step": s, "tokens_per_expert": [[10, 6], [8, 8]] if s < 4 else [[12, 4], [9, 7]]}
            for s in range(1, 7)
        ]
        + [{"step": 7, "tokens_per_expert": [[1, 2, 3]]}],  # another shape: skipped
        events=[
            {"event": "compile", "step": 0, "plan": plan(capacities=[[2, 2], [2, 2]])},
            {"event": "recompile", "swap_step": 3, "plan": plan(capacities=[[4, 1], [3, 2]])},
        ],
    )
    load = expert_load(run)
    assert load.steps.tolist() == [1, 2, 3, 4, 5, 6] and load.layers == [1, 3]
    np.testing.assert_array_equal(load.capacity[2], [[8, 8], [8, 8]])  # step 3: first Plan
    np.testing.assert_array_equal(load.capacity[3], [[16, 4], [12, 8]])  # x 4 sequences
    np.testing.assert_allclose(load.utilisation[3], [[12 / 16, 1.0], [9 / 12, 7 / 8]])


def test_series_keeps_the_newest_value_of_a_step_and_only_finite_numbers():
    records = [
        {"step": 1, "loss": 5.0},
        {"step": 2, "loss": 4.0},
        {"step": 3, "loss": float("nan")},
        {"step": 2, "loss": 4.5},  # a resumed run redoes step 2
        {"step": 4, "eval_loss": 4.2},
        {"step": 5, "loss": True},
    ]
    steps, values = report.series(records, "loss")
    assert steps.tolist() == [1, 2] and values.tolist() == [5.0, 4.5]


def test_stage_load_sums_each_stages_tasks_and_pads_a_changed_stage_count(tmp_path):
    two = [[["F", 0, 0.0, 1.0], ["B", 0, 2.0, 4.0]], [["F", 0, 1.0, 1.5], ["B", 0, 1.5, 2.0]]]
    one = [[["F", 0, 0.0, 0.5], ["F", 1, 0.5, 1.0], ["B", 0, 1.0, 2.0]]]
    events = [
        {"event": "profile", "step": 0, "timeline": two, "bubble_ratio": 0.3,
         "iteration_seconds": 4.0},
        {"event": "profile", "step": 9, "timeline": one, "bubble_ratio": 0.0,
         "iteration_seconds": 2.0},
    ]  # fmt: skip
    load = report.stage_load(report.Run(tmp_path, events=events))
    assert load.steps.tolist() == [1, 10]
    np.testing.assert_allclose(load.forward, [[1.0, 0.5], [1.0, np.nan]])
    np.testing.assert_allclose(load.backward, [[2.0, 0.5], [1.0, np.nan]])
    assert load.bubble_ratio.tolist() == [0.3, 0.0] and load.iteration_seconds.tolist() == [4, 2]


def test_event_marks_split_accepted_and_declined_decisions(tmp_path):
    events = [
        {"event": "rebalance", "step": 2, "accepted": True},
        {"event": "rebalance", "step": 7, "accepted": False},
        {"event": "repack", "step": 9, "accepted": False},
        {"event": "recompile", "step": 2, "swap_step": 6},
        {"event": "migrate", "step": 6},
        {"event": "checkpoint", "step": 6},
    ]
    marks = report.event_marks(report.Run(tmp_path, events=events))
    assert {k: v.tolist() for k, v in marks.items()} == {
        "recompile": [6],
        "rebalance": [2],
        "rebalance_rejected": [7],
        "migrate": [6],
    }


# ---------------------------------------------------------------------------------------------
# Freezing, pruning, MFU and several processes, on a hand-written workdir


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture
def synthetic(tmp_path):
    """A 4-layer run that freezes a growing prefix, prunes, logs MFU, over two processes."""
    work = tmp_path / "run"
    work.mkdir()
    config = {"model": {"num_layers": 4}, "train": {"batch_size": 8}, "moe": {"every": 0}}
    (work / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    metrics = []
    for step in range(1, 41):
        sparsity = [min(0.9, 0.02 * step * (layer + 1) / 2) for layer in range(4)]
        metrics.append({
            "step": step,
            "loss": 5.0 - step / 20,
            "tokens_per_sec": 1000.0 + 50 * rng.standard_normal(),
            "mfu": 0.3 + 0.01 * rng.standard_normal(),
            "tflops_per_device": 90.0,
            "model_flops_per_token": 5701632.0,
            "pruning/sparsity": sparsity,
            "pruning/target_sparsity": float(np.mean(sparsity)),
        })  # fmt: skip
        if step % 10 == 0:
            metrics.append({"step": step, "eval_loss": 5.0 - step / 20 + 0.1})
        if step % 5 == 0:  # a measured plasticity; the frozen prefix is not measured (null)
            prefix = 0 if step <= 10 else 1 if step <= 20 else 2
            plasticity = [None] * prefix + [1.0 / step + 0.1 * layer for layer in range(prefix, 4)]
            metrics.append({"step": step, "loss": 5.0 - step / 20,
                            "freezing/plasticity": plasticity})  # fmt: skip
    write_jsonl(work / "metrics.jsonl", metrics)
    frozen = {10: [0], 20: [0, 1], 30: [0, 1, 3]}
    events = [{"event": "compile", "step": 0, "plan": plan(), "compile_seconds": 3.0}]
    events += [
        {"event": "recompile", "step": s - 2, "swap_step": s, "plan": plan(frozen_layers=f),
         "compile_seconds": 1.5, "lower_seconds": 0.2, "policy": "freezing",
         "reason": "freeze | more", "steps_during_compile": 2, "cache_hit": False}
        for s, f in frozen.items()
    ]  # fmt: skip
    write_jsonl(work / "events.jsonl", events)
    (work / "process_1").mkdir()
    write_jsonl(work / "process_1" / "metrics.jsonl", [
        {"step": s, "loss": 5.0 - s / 20, "tokens_per_sec": 900.0 + s} for s in range(1, 41)
    ])  # fmt: skip
    (work / "process_3").mkdir()  # a process that has written nothing yet
    return work


def test_freezing_pruning_mfu_and_processes_render(synthetic, tmp_path):
    run = report.load_run(synthetic)
    frozen = report.frozen_layers(run)
    assert frozen.boundaries.tolist() == [0, 10, 20, 30]
    assert frozen.prefix.tolist() == [0, 1, 2, 2] and frozen.count.tolist() == [0, 1, 2, 3]
    pruning = report.scheme_series(run, "pruning")
    assert pruning["pruning/sparsity"][1].shape == (40, 4)
    assert pruning["pruning/target_sparsity"][1].shape == (40,)
    steps, plasticity = report.scheme_series(run, "freezing")["freezing/plasticity"]
    assert steps.tolist() == list(range(5, 41, 5)) and plasticity.shape == (8, 4)
    assert np.isnan(plasticity[2, 0]) and not np.isnan(plasticity[2, 1])  # step 15: prefix 1
    np.testing.assert_allclose(plasticity[-1], [np.nan, np.nan, 1 / 40 + 0.2, 1 / 40 + 0.3])
    assert sorted(run.processes) == [1, 3] and len(run.processes[1].metrics) == 40

    plots = report.write_report(run, tmp_path / "out")
    written = {p.name: p for p in plots if p.path}
    assert set(written) == {"loss", "throughput", "freezing", "freezing_metrics", "pruning"}
    assert written["throughput"].height == 700  # a second panel: MFU
    check_pngs(plots, tmp_path / "out")
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert "| median MFU | 30." in markdown and "| model FLOPs / token | 5,701,632 |" in markdown
    assert "| recompiles | 3 (4.5 s compiling) |" in markdown
    assert "freeze / more" in markdown  # a '|' in a reason does not break the table
    assert "| 1 | 40 | 40 |" in markdown and "| 3 | 0 | n/a |" in markdown


def test_arrays_need_no_matplotlib(synthetic):
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from dynjax import report\n"
        "from dynjax.dynamism.moe.report import expert_load\n"
        f"run = report.load_run({str(synthetic)!r})\n"
        "assert report.frozen_layers(run).prefix.tolist() == [0, 1, 2, 2]\n"
        "assert report.summary(run)['last_step'] == 40\n"
        "assert report.scheme_series(run, 'pruning') and expert_load(run) is None\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_a_schemes_plots_come_from_its_plugin():
    """`Plugin.report_plots`: the report draws each scheme's own plots after the run's loss and
    throughput, in scheme order (MoE's expert load among the built-in ones)."""

    class Toy(Plugin):
        name = "toy"

        @classmethod
        def report_plots(cls):
            return (("toy", "Toy", lambda run, fig: None, lambda run: "never drawn", "A toy."),)

    builtin = ["freezing", "freezing_metrics", "expert_load", "pruning"]
    assert [p[0] for p in scheme_plots(BUILTIN.with_(Toy))] == [*builtin, "toy"]
    assert [p[0] for p in report.PLOTS] == [
        "loss", "throughput", *builtin, "pipeline", "layer_costs",
    ]  # fmt: skip
    assert [p[0] for p in FreezingPlugin.report_plots()] == ["freezing", "freezing_metrics"]
    assert [p[0] for p in PruningPlugin.report_plots()] == ["pruning"]
