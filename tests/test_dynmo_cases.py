"""benchmarks/dynmo_cases.py: recorded traces become rows, and their extrapolation to the paper's
depth (every measured layer copied r times) keeps the measured work."""

import json
from pathlib import Path

import numpy as np
import pytest

from dynjax.balance import simulate

from .helpers import benchmark_script

cases = benchmark_script("dynmo_cases")


def write_trace(path: Path, fwd: list[list[float]], *, embed: float = 0.0, head: float = 0.0,
                name: str = "MoE") -> None:
    """A trace as ``record`` writes it: one sample per row of ``fwd`` (backward = 2 x forward),
    every layer 1,000 state bytes, embedding and head ``embed`` / ``head`` seconds each way."""
    layers = len(fwd[0])
    meta = {"case": name, "source": "configs/test.py", "devices": "test", "steps": 10 * len(fwd),
            "num_layers": layers, "stage_layers": [layers // 4] * 4, "microbatches": 8,
            "layer_params": [100] * layers, "embed_param_bytes": 0, "head_param_bytes": 0}
    samples = [{"step": 1 + 10 * i, "plan": i, "frozen_layers": [],
                "layer_forward_seconds": f, "layer_backward_seconds": [2 * x for x in f],
                "embed_seconds": [embed, embed], "head_seconds": [head, head],
                "layer_state_bytes": [1000] * layers, "stage_seconds": [1.0] * 4}
               for i, f in enumerate(fwd)]
    path.write_text("".join(json.dumps(r) + "\n" for r in [meta, *samples]))


def test_copies_keep_the_measured_work_per_sample():
    """r copies of every measured layer: r x the layers' time and bytes, the embedding and head
    counted once, at the two ends, and each layer's copies consecutive."""
    meta, *samples = cases.read_jsonl(cases.TRACES / "MoE.jsonl")
    r = 12
    for sample in samples[:5]:
        one = cases.measured_layers(sample, meta)
        deep = cases.measured_layers(sample, meta, r)
        ends = np.sum(sample["embed_seconds"]) + np.sum(sample["head_seconds"])
        assert deep.time.sum() - ends == pytest.approx(r * (one.time.sum() - ends))
        raw = np.array(sample["layer_forward_seconds"]) + sample["layer_backward_seconds"]
        assert one.time.sum() == pytest.approx(raw.sum() + ends)
        assert deep.time[r:-r] == pytest.approx(np.repeat(raw, r)[r:-r])
        assert deep.time[0] == pytest.approx(raw[0] + np.sum(sample["embed_seconds"]))
        assert deep.time[1] == pytest.approx(raw[0])
        state = np.array(sample["layer_state_bytes"], dtype=float)
        # record's model: embedding and head parameters, Adam's 2 moments and their gradients.
        embed, head = 4 * meta["embed_param_bytes"], 4 * meta["head_param_bytes"]
        assert deep.memory.sum() == r * (state.sum() - embed - head) + embed + head
        assert deep.memory[0] == state[0] and deep.memory[-1] == state[-1]
        assert deep.memory[1] == state[0] - embed and deep.memory[-2] == state[-1] - head
        assert deep.memory[1] == state[2]  # layers 0 and 2 are alike (dense) without the ends


def test_a_recorded_trace_gives_the_simulated_row():
    """Static uniform = the weighted mean of each sample's simulated iteration, from the JSON."""
    path = cases.TRACES / "freezing.jsonl"
    meta, *samples = cases.read_measured(path)  # the profiles that ran every layer alone
    case = cases.recorded_case(path)
    row = cases.run(case)
    assert case.layers == meta["num_layers"] and case.stages == len(meta["stage_layers"])
    expected, weights = [], []
    ends = [s["step"] for s in samples[1:]] + [meta["steps"] + 1]
    for sample, end in zip(samples, ends, strict=True):
        f = np.array(sample["layer_forward_seconds"]) / case.unit_seconds
        b = np.array(sample["layer_backward_seconds"]) / case.unit_seconds
        f[0] += sample["embed_seconds"][0] / case.unit_seconds
        b[0] += sample["embed_seconds"][1] / case.unit_seconds
        f[-1] += sample["head_seconds"][0] / case.unit_seconds
        b[-1] += sample["head_seconds"][1] / case.unit_seconds
        stages = len(meta["stage_layers"])
        per = meta["num_layers"] // stages
        sim = simulate(f.reshape(stages, per).sum(1), b.reshape(stages, per).sum(1),
                       meta["microbatches"], comm=cases.COMM)
        expected.append(sim.iteration_time)
        weights.append(end - sample["step"])
    assert row["static"] == pytest.approx(np.average(expected, weights=weights))
    assert row["partition"] <= row["static"] * 1.001  # freezing leaves the uniform split slower


def test_uniform_model_on_24_stages_gains_nothing(tmp_path):
    """Equal layers, no embedding or head: the uniform split is optimal on 96 x 24 as on 8 x 4."""
    path = tmp_path / "MoE.jsonl"
    write_trace(path, [[0.01] * 8] * 3)
    case = cases.recorded_case(path, layers=96, stages=24)
    assert (case.layers, case.stages, case.micro, case.extrapolated) == (96, 24, 0, True)
    row = cases.run(case)
    for balancer in ("partition", "diffusion", "re-packed"):
        assert row["static"] / row[balancer] == pytest.approx(1.0)
    assert row["gpus"] == 24


def test_a_skewed_model_on_24_stages_balances(tmp_path):
    """A heavy last layer (12 heavy copies on the last 3 of 24 stages) is spread by partition."""
    path = tmp_path / "MoE.jsonl"
    write_trace(path, [[0.01] * 7 + [0.04]] * 3)
    row = cases.run(cases.recorded_case(path, layers=96, stages=24))
    assert row["static"] / row["partition"] > 1.2


def test_a_dense_run_beside_the_trace_is_the_dense_baseline(tmp_path):
    """``<case>.dense.jsonl``: "x dense" divides its uniform iteration by partition's."""
    write_trace(tmp_path / "sparse_attention.jsonl", [[0.01] * 8] * 2, name="sparse attention")
    write_trace(tmp_path / "sparse_attention.dense.jsonl", [[0.02] * 8], name="sparse attention")
    for kw in ({}, {"layers": 96, "stages": 24}):
        case = cases.recorded_case(tmp_path / "sparse_attention.jsonl", **kw)
        row = cases.run(case)
        micro = case.micro or 4 * case.stages
        per = case.layers // case.stages
        dense = simulate([2.0 * per] * case.stages, [4.0 * per] * case.stages, micro,
                         comm=cases.COMM).iteration_time
        assert row["dense"] == pytest.approx(dense)
        assert row["dense"] / row["partition"] == pytest.approx(2.0, rel=0.02)


def test_rows_for_every_case_and_their_extrapolation(tmp_path):
    """A trace file makes its case recorded (4 rows: raw, medians, and both at the paper's
    depth); the other cases stay synthetic."""
    write_trace(tmp_path / "early_exit.jsonl", [[0.01] * 8] * 2, name="early exit")
    rows = cases.cases_with_traces(tmp_path)
    assert [(c.name, c.layers, c.stages) for c in rows[:4]] == [
        ("early exit", 8, 4), ("early exit", 8, 4), ("early exit", 96, 24),
        ("early exit", 96, 24)]
    assert [c.variant for c in rows[:4]] == ["", "Plan medians", "96x24", "96x24, Plan medians"]
    assert sorted(c.name for c in rows[4:]) == sorted(
        c.name for c in cases.synthetic_cases() if c.name != "early exit")
    assert all(c.source == "(synthetic)" for c in rows[4:])


def test_tiled_copies_keep_alternating_layers(tmp_path):
    """Stacking the measured model keeps MoE-like layers apart: uniform on 32 x 16 pairs a heavy
    layer with a light one on every stage, as on 8 x 4, so nothing is gained; copying each layer
    in a row puts two heavy copies on one stage and two light ones on the next."""
    path = tmp_path / "MoE.jsonl"
    write_trace(path, [[0.01, 0.03] * 4] * 3)
    tiled = cases.run(cases.recorded_case(path, layers=32, stages=16, tiled=True))
    assert tiled["static"] / tiled["partition"] == pytest.approx(1.0)
    assert tiled["imbalance static"] == pytest.approx(0.0)
    rows = cases.run(cases.recorded_case(path, layers=32, stages=16))
    assert rows["imbalance static"] > 0.5


def test_rescaled_samples_are_dropped(tmp_path):
    """Only profiles whose units ran alone become samples; the one before stands for the steps of
    a dropped one (a trace without ``units`` keeps every sample)."""
    path = tmp_path / "MoE.jsonl"
    write_trace(path, [[0.01] * 8, [0.05] * 8, [0.02] * 8])
    meta, *samples = cases.read_jsonl(path)
    samples[1]["units"] = "rescaled"
    path.write_text("".join(json.dumps(r) + "\n" for r in [meta, *samples]))
    case = cases.recorded_case(path)
    assert case.steps == (1, 21) and case.weights == (20.0, 10.0)
    assert case.trace(21).fwd[3] == pytest.approx(2.0)  # 0.02 s in units of the 0.01 s forward
    del samples[1]["units"]
    path.write_text("".join(json.dumps(r) + "\n" for r in [meta, *samples]))
    assert cases.recorded_case(path).steps == (1, 11, 21)


def test_the_profiles_after_plan_swaps_count_by_what_they_changed(tmp_path, monkeypatch):
    # A swap costs the profile after a move where it moved layers, plus the profile after
    # resizing the layers whose cost it changed; one that changed neither (e.g. exits turned
    # on) the profile after resizing every layer.
    rows = [{"steps": 300}] + [
        {"plan": p, "stage_layers": layout, "layer_cost": cost}
        for p, layout, cost in ((0, [2, 2], [1, 1, 1, 1]), (0, [2, 2], [1, 1, 1, 1]),
                                (1, [1, 3], [1, 1, 1, 1]), (2, [1, 3], [1, 0.5, 1, 0.5]),
                                (3, [2, 2], [1, 0.5, 1, 0.25]), (4, [2, 2], [1, 0.5, 1, 0.25]))
    ]
    (tmp_path / "MoD.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    plan_swaps, steps = cases.swaps("MoD", tmp_path)
    assert plan_swaps == [(True, ()), (False, (1, 3)), (True, (3,)), (False, ())] and steps == 300
    assert cases.resizes(plan_swaps) == ["1,3", "3", "all"]
    assert cases.swaps("MoE", tmp_path) == ([], 0)
    record = {"move_units_seconds": 0.2,
              "resize_units_seconds": {"1,3": 0.5, "3": 0.3, "all": 0.7}}
    assert cases.swap_seconds(record, plan_swaps) == pytest.approx(0.2 * 2 + 0.5 + 0.3 + 0.7)
    del record["resize_units_seconds"]["3"]
    assert cases.swap_seconds(record, plan_swaps) is None  # a swap that happened, unmeasured
    assert cases.swap_seconds(record, plan_swaps[:2]) == pytest.approx(0.7)
    # A record from before units kept their times: every unit alone after each swap.
    assert cases.swap_seconds({"units_alone_seconds": 0.6}, plan_swaps) == pytest.approx(2.4)
    moves = [(True, ()), (True, ())]  # a recorded run that moved layers twice in 300 steps
    monkeypatch.setattr(cases, "swaps", lambda name, traces=cases.TRACES: (moves, 300))
    measured = {"MoD": {"move_units_seconds": 0.6, "profile_seconds": 0.01,
                        "plain_step_seconds": 0.5}}
    assert cases.overhead("MoD", measured, "swaps") == f"{2 * 0.6 / (300 * 0.5):.1%}"
    assert cases.overhead("MoE", {}, "swaps") == "-"
    assert cases.cadence("MoD") == 1 and cases.cadence("pruning") == 1000
    assert cases.overhead("MoD", measured) == "2.0%"
    assert cases.overhead("pruning", {"pruning": measured["MoD"]}) == "0.0%"


def test_measured_rows_read_the_real_pipeline_results(tmp_path):
    result = {"static_layout": [8, 8], "balanced_layout": [11, 5], "static_tokens_per_sec": 100.0,
              "balanced_tokens_per_sec": 125.0, "measured_speedup": 1.25,
              "predicted_speedup": 1.4, "calibrated_speedup": 1.2, "bound_speedup": 1.6}
    (tmp_path / "freezing.json").write_text(json.dumps(result))
    rows = cases.measured_rows(tmp_path)
    assert len(rows) == 6
    freezing = next(r for r in rows if r.startswith("freezing"))
    assert "8,8/11,5" in freezing and "1.25x" in freezing and "2.23x" in freezing
    assert next(r for r in rows if r.startswith("MoE")).endswith("not measured")
