"""Two local processes (jax.distributed, gloo on CPU) run the pipeline: same losses as one."""

import json
import shutil

import numpy as np
import pytest

from dynjax.train import train
from dynjax.writers import read_jsonl

from ..helpers import layer_moves, losses, one_and_two, two_processes
from ..tiny import dotted_config

# Two stages of one device each, one per process: every activation and gradient crosses
# processes (transfers inside a process are those of the single-process tests).
OVERRIDES = {
    "model.num_layers": 3,
    "model.d_model": 16,
    "model.mlp_dim": 32,
    "moe.every": 2,
    "mesh.stage": 2,
    "train.steps": 4,
    "train.microbatches": 2,
    "train.eval_every": 4,
    "pipeline.profile_on_change": False,
}


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_two_processes_match_one(tmp_path, schedule):
    run = {**OVERRIDES, "pipeline.schedule": schedule}
    single = tmp_path / "single"
    train(dotted_config(run), single, progress=False)

    multi = tmp_path / "multi"
    out = two_processes(multi, run, devices=1)
    assert "[0] dynjax run summary" in out and "[1] dynjax run summary" in out
    want = losses(single)
    assert sorted(want) == [1, 2, 3, 4]
    assert losses(multi) == want  # bit for bit: the same programs, moved the same way
    assert losses(multi / "process_1") == want  # every process logs the same metrics
    evals = lambda w: [r["eval_loss"] for r in read_jsonl(w / "metrics.jsonl") if "eval_loss" in r]
    assert evals(multi) == evals(single) and len(evals(single)) == 1


@pytest.mark.slow
def test_the_balancer_decides_from_every_process_stages_and_moves_layers_between_them(tmp_path):
    """Issue 15 §4: each process times its own stage; the profiles are gathered, so process 0's
    balancer sees every layer and stage, and the layers its Plan moves cross processes."""
    run = {
        **OVERRIDES,
        "model.num_layers": 5,
        # Layers wide enough to outweigh a task's fixed costs, so that (4, 1) is clearly slower
        # than a split near (3, 2) in every profile, not only in some noisy ones.
        "model.d_model": 128,
        "model.mlp_dim": 512,
        "moe.every": 0,
        "pipeline.stage_layers": "4,1",  # deliberately unbalanced
        "pipeline.profile_every": 10,
        "balance.enabled": True,
        "balance.every": 5,
        "balance.amortize_steps": 10**9,
        "recompile.delta_launch": 1,
        # Decided at step 2 (on step 0's profile); the swap waits for both processes' compile
        # (in the background it landed at step 43 in one run, later on a loaded machine).
        "recompile.blocking": True,
        "train.steps": 30,
        "train.eval_every": 30,
        "train.log_every": 10,
    }
    workdir = tmp_path / "multi"
    two_processes(workdir, run, devices=1)
    workdirs = (workdir, workdir / "process_1")
    events = [read_jsonl(w / "events.jsonl") for w in workdirs]
    profiles = [[e for e in ev if e["event"] == "profile"] for ev in events]
    # Every process holds the same gathered profiles: both stages' timelines and memory, and
    # a time for every layer, each measured by the process that holds it.
    assert profiles[0] and len(profiles[0]) == len(profiles[1])
    measured = lambda e: {k: v for k, v in e.items() if k not in ("time", "seconds")}
    for mine, theirs in zip(*profiles, strict=True):
        assert measured(mine) == measured(theirs)
        assert mine["timeline"] is None or (len(mine["timeline"]) == 2 and all(mine["timeline"]))
        assert len(mine["stage_memory_bytes"]) == 2
        assert len(mine["layer_forward_seconds"]) == 5
        assert min(mine["layer_forward_seconds"]) > 0 and min(mine["head_seconds"]) > 0
    decisions = [e for e in events[0] if e["event"] == "rebalance"]
    assert decisions and decisions[0]["old"] == [4, 1] and decisions[0]["profile_step"] == 0
    assert not [e for e in events[1] if e["event"] == "rebalance"]  # process 0 decides
    first = next(e for e in decisions if e["accepted"])
    assert first["new"] != [4, 1]
    assert first["predicted_new_seconds"] < first["predicted_old_seconds"]
    migrations = [
        [(e["step"], e["moves"]) for e in ev if e["event"] == "migrate"] for ev in events
    ]
    print("migrations per process:", migrations)
    assert migrations[0] == migrations[1]
    step, moves = migrations[0][0]
    assert moves == layer_moves([4, 1], first["new"]) and 0 < step < 30
    assert losses(workdir) == losses(workdir / "process_1")


@pytest.mark.slow
def test_each_process_checkpoints_its_stages_and_a_rerun_on_any_process_count_resumes(tmp_path):
    """Issue 15 §4: each process saves its own stage's part; a step one process never finished
    is set aside, and the rerun resumes from the last complete step with the losses of the run
    that was not interrupted, on two processes and on one."""
    run = {**OVERRIDES, "train.steps": 6, "train.checkpoint_every": 2, "train.eval_every": 6}
    workdir = tmp_path / "multi"
    two_processes(workdir, run, devices=1)
    want = losses(workdir)
    parts = [workdir / "checkpoints" / f"process_{p}" for p in range(2)]
    assert [sorted(int(s.name) for s in p.iterdir() if s.name.isdigit()) for p in parts] == [
        [2, 4, 6],
        [2, 4, 6],
    ]
    # Process 0 holds the embedding and layer 0, process 1 the rest: no process saves it all.
    held = [json.loads((p / "6" / "meta" / "metadata").read_text())["checksums"] for p in parts]
    assert "params/embed/embedding" in held[0] and "params/embed/embedding" not in held[1]
    assert "params/head/kernel" in held[1] and "params/head/kernel" not in held[0]
    assert {"params/layers/0/attn/qkv/kernel", "params/layers/2/attn/qkv/kernel"} <= (
        set(held[0]) | set(held[1])
    )

    # As if process 1 died while saving step 6: the step is incomplete.
    one_process = tmp_path / "one"
    shutil.copytree(workdir, one_process)
    shutil.rmtree(parts[1] / "6")
    two_processes(workdir, run, devices=1)  # the rerun's losses of steps 5, 6 replace the first
    events = read_jsonl(workdir / "events.jsonl")
    assert [e["step"] for e in events if e["event"] == "resume"] == [4]
    incomplete = [e for e in events if e["event"] == "checkpoint_incomplete"]
    assert [e["step"] for e in incomplete] == [6]
    assert [c.name.split("-")[0] for c in (parts[0] / "corrupt").iterdir()] == ["6"]  # kept
    assert losses(workdir) == want  # steps 5 and 6 again, as the run that was not interrupted
    assert sorted(int(s.name) for s in parts[1].iterdir() if s.name.isdigit()) == [2, 4, 6]

    # One process with both stages reads the parts (of step 4, with step 6 gone from both).
    for p in range(2):
        shutil.rmtree(one_process / "checkpoints" / f"process_{p}" / "6")
    config = dotted_config(run)
    train(config, one_process, progress=False)
    resumed = [e for e in read_jsonl(one_process / "events.jsonl") if e["event"] == "resume"]
    assert [e["step"] for e in resumed] == [4]
    got = losses(one_process)
    assert {s: got[s] for s in (5, 6)} == {s: want[s] for s in (5, 6)}


@pytest.mark.slow
def test_partial_expert_checkpoints_of_two_processes_resume_as_one_process(tmp_path):
    """PEC (seed 004 §3) in a pipeline over processes: every process's ledger picks the same
    experts and the part of the MoE layer's process saves them. After the newest step is
    lost, the rerun assembles every expert from its newest copy (the steps before the one it
    resumes from) with the sources, recovery accounting (PLT) and losses one process of the
    same pipeline gets."""
    run = {
        **OVERRIDES,
        "train.steps": 8,
        "train.checkpoint_every": 2,
        "train.eval_every": 8,
        "train.keep_checkpoints": 4,
        "checkpoint.experts_per_save": 1,
    }
    single, multi = one_and_two(tmp_path, run, devices=1)
    saved = lambda w: [(e["step"], e["experts_saved"]) for e in read_jsonl(w / "events.jsonl")
                       if e["event"] == "checkpoint"]
    want = saved(single)
    assert [s for s, _ in want] == [2, 4, 6, 8] and want[1][1] == {"1": [0]}  # K=1 of 4
    by_step = [{s: e for s, e in saved(w)} for w in (multi, multi / "process_1")]
    assert [{**by_step[0][s], **by_step[1][s]} for s, _ in want] == [e for _, e in want]
    assert losses(multi) == losses(single)

    shutil.rmtree(single / "checkpoints" / "8")
    for p in range(2):
        shutil.rmtree(multi / "checkpoints" / f"process_{p}" / "8")
    train(dotted_config(run), single, progress=False)
    two_processes(multi, run, devices=1)
    recoveries = [
        [{k: v for k, v in e.items() if k != "time"} for e in read_jsonl(w / "events.jsonl")
         if e["event"] == "checkpoint_recovery"]
        for w in (single, multi, multi / "process_1")
    ]
    [alone] = recoveries[0]
    assert alone["step"] == 6 and alone["lost_tokens"] > 0  # experts from steps 2 to 6
    assert {s for layer in alone["layers"].values() for s in layer["sources"]} > {6}
    assert recoveries[1] == [alone] and recoveries[2] == [alone]
    assert losses(multi) == losses(single)
    assert losses(multi / "process_1") == losses(single)


@pytest.mark.slow
def test_a_pipeline_over_two_processes_resumes_a_checkpoint_of_one_process(tmp_path):
    """The other way round: one process wrote the whole state; each of two processes reads
    its stage's leaves from it and goes on with the losses of the uninterrupted run."""
    run = {**OVERRIDES, "train.steps": 6, "train.checkpoint_every": 2, "train.eval_every": 6}
    workdir = tmp_path / "run"
    train(dotted_config(run), workdir, progress=False)
    want = losses(workdir)
    shutil.rmtree(workdir / "checkpoints" / "6")
    two_processes(workdir, run, devices=1)
    for w in (workdir, workdir / "process_1"):
        resumed = [e for e in read_jsonl(w / "events.jsonl") if e["event"] == "resume"]
        assert [e["step"] for e in resumed] == [4]
    assert losses(workdir) == want
    assert {s: losses(workdir / "process_1")[s] for s in (5, 6)} == {s: want[s] for s in (5, 6)}
    # From now on the run saves in parts, beside the whole checkpoints it resumed from.
    saved = [workdir / "checkpoints" / f"process_{p}" / "6" for p in range(2)]
    assert all(s.is_dir() for s in saved)


@pytest.mark.slow
def test_a_re_pack_moves_every_layer_off_process_1_and_releases_its_devices(
    tmp_path, monkeypatch
):
    """Issue 15 §4 and seed 000 §3.4: process 0 decides to pack the two stages into one; both
    processes move process 1's layers to process 0 at the same step, process 1 gives its
    device back through the release hook and keeps taking part (its metrics, the profiles and
    its empty part of each checkpoint), and the losses stay those of the two-stage run."""
    steps, every = 40, 10
    run = {
        **OVERRIDES,
        # Dense: the one-stage program rounds a few results an ulp apart from the two-stage one,
        # and an MoE capacity drop can flip on such an ulp (seen with the swap at steps 16 and
        # 17: equal to step 70, then apart), after which the runs part further.
        "moe.every": 0,
        "pipeline.profile_on_change": True,
        "balance.repack": True,
        "balance.repack_every": 5,
        "balance.repack_target": 1,
        "balance.repack_max_slowdown": 100.0,
        "balance.memory_bytes": 1e12,
        "balance.release_hook": "dynjax.launch.release:append_to_file",
        "recompile.delta_launch": 1,
        # The swap waits for the one-stage program's compile: it lands at the same step on any
        # machine (in the background it took from 38 to over 300 steps); a checkpoint every 10
        # steps, all kept, leaves one after it to resume from.
        "recompile.blocking": True,
        "train.steps": steps,
        "train.log_every": 10,
        "train.eval_every": steps,
        "train.checkpoint_every": every,
        "train.keep_checkpoints": steps // every,
    }
    released = tmp_path / "released.jsonl"
    monkeypatch.setenv("DYNJAX_RELEASED_FILE", str(released))
    reference = tmp_path / "reference"
    two_stages = {k: v for k, v in run.items() if not k.startswith("balance.")}
    train(dotted_config(two_stages), reference, progress=False)
    workdir = tmp_path / "multi"
    two_processes(workdir, run, devices=1)
    events = [read_jsonl(w / "events.jsonl") for w in (workdir, workdir / "process_1")]
    decision = next(e for e in events[0] if e["event"] == "repack")
    assert decision["old"] == [2, 1] and decision["new"] == [3] and decision["accepted"]
    migrations = [[e for e in ev if e["event"] == "migrate"] for ev in events]
    assert [(e["step"], e["moves"]) for e in migrations[0]] == [
        (e["step"], e["moves"]) for e in migrations[1]
    ]
    (migrate,) = migrations[0]
    assert migrate["moves"] == layer_moves([2, 1], [3])
    releases = [[e for e in ev if e["event"] == "release"] for ev in events]
    for (release,) in releases:
        assert release["step"] == migrate["step"] and release["stages"] == [1]
        assert [d["process"] for d in release["devices"]] == [1]
    assert releases[0][0]["hook"] is None  # process 0 gave nothing back: its own hook is idle
    assert releases[1][0]["hook"].endswith("append_to_file")
    (line,) = read_jsonl(released)  # one hook call, by process 1, with its one device
    assert line["devices"] == releases[1][0]["devices"]
    want = losses(reference)
    for w in (workdir, workdir / "process_1"):
        got = losses(w)
        assert sorted(got) == sorted(want)  # process 1 logs every step after its release too
        np.testing.assert_allclose([got[s] for s in sorted(want)],
                                   [want[s] for s in sorted(want)], rtol=1e-5)
    # The last checkpoint: process 0's part holds every leaf, process 1's none.
    held = [
        json.loads((workdir / "checkpoints" / f"process_{p}" / str(steps) / "meta" / "metadata")
                   .read_text())["checksums"]
        for p in range(2)
    ]
    assert "params/head/kernel" in held[0] and "params/layers/2/attn/qkv/kernel" in held[0]
    assert held[1] == {}

    # Resumed from the first checkpoint after the swap, the run stays packed: process 1 is
    # released again at once, and the steps after it repeat the first run's losses.
    packed = next((s for s in range(every, steps, every) if s > migrate["step"]), None)
    assert packed is not None, f"swapped at step {migrate['step']}: no packed step to resume from"
    first = losses(workdir)
    for p in range(2):
        for step in range(packed + every, steps + every, every):
            shutil.rmtree(workdir / "checkpoints" / f"process_{p}" / str(step))
    two_processes(workdir, run, devices=1)
    for w in (workdir, workdir / "process_1"):
        resumed = [e for e in read_jsonl(w / "events.jsonl") if e["event"] == "release"][-1]
        assert resumed["step"] == packed and resumed["reason"] == "resumed re-packed"
        assert [d["process"] for d in resumed["devices"]] == [1]
    assert losses(workdir) == first
    assert len(read_jsonl(released)) == 2  # process 1's hook, once per run


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout, devices, rel",
    [
        # a stage per process: the stages' assignments come with their gathered metrics, and
        # each process routes its own stage's MoE layers from its cache; bit for bit
        ({}, 1, 0.0),
        # one program over both processes: the Monitor gathers the global assignments, and
        # each process places the rows its device holds from its cache; the two processes'
        # shards add up across processes in another order (float32 rounding)
        ({"mesh.stage": 1, "mesh.data": 2, "train.microbatches": 1}, 1, 1e-6),
    ],
    ids=["stage-per-process", "one-program"],
)
def test_the_routing_cache_switches_on_in_every_process_at_the_same_step(
    tmp_path, layout, devices, rel
):
    """Seed 001 §4.2 across processes: each process caches every sample's assignments and
    measures the routing stability from its own cache; process 0's policy switches cached
    routing on, all swap at the same step and route from their caches from there."""
    run = {
        **OVERRIDES,
        **layout,
        "moe.every": 1,  # MoE layers on both processes: each routes its own from its cache
        # 48 training windows and a batch of 8: every sample comes back every 6 steps.
        "train.steps": 300,
        "data.max_tokens": 1600,
        "data.val_fraction": 0.05,
        "moe.caching.enabled": True,
        "moe.caching.warmup_steps": 0,
        "moe.caching.window": 2,
        "moe.caching.on_threshold": 0.5,
        "moe.caching.off_threshold": 0.1,
        "train.learning_rate": 1e-4,
        "train.checkpoint_every": 300,
        "train.eval_every": 300,
        "train.log_every": 1,
        "recompile.delta_launch": 1,
        "recompile.blocking": True,
    }
    single, workdir = one_and_two(tmp_path, run, devices)
    workdirs = (workdir, workdir / "process_1")
    swaps = [
        [(e["swap_step"], e["plan_diff"]) for e in read_jsonl(w / "events.jsonl")
         if e["event"] == "recompile"]
        for w in workdirs
    ]
    assert swaps[0] == swaps[1] and swaps[0][0][1] == {"parts.moe.cached_routing": [False, True]}
    switched = swaps[0][0][0]
    records = [[r for r in read_jsonl(w / "metrics.jsonl") if "routing_stability" in r]
               for w in workdirs]
    assert [r["routing_stability"] for r in records[0]] == [
        r["routing_stability"] for r in records[1]
    ]
    assert all(r["cached_routing"] == (r["step"] > switched) for r in records[0])
    want, got = losses(single), losses(workdir)
    assert got == losses(workdir / "process_1") and len(got) == 300
    # Until either switched (which one first depends on the machine), two compute what one
    # does.
    alone = next((e["swap_step"] for e in read_jsonl(single / "events.jsonl")
                  if e["event"] == "recompile"), len(got))
    before = [s for s in got if s <= min(switched, alone)]
    assert before
    assert [got[s] for s in before] == pytest.approx([want[s] for s in before], rel=rel, abs=0)


# Process 1 sleeps after its first compile: longer than gloo waits for a peer to set up a
# collective's context (30 s, fixed in XLA), as a slow compile of the last stage did in a
# recorded benchmark run (DEADLINE_EXCEEDED in the first step's first transfer).
LATE_SECONDS = 35
SLOW_FIRST_COMPILE = f'''
import os
if os.environ.get("DYNJAX_PROCESS_ID") == "1":
    import time
    from dynjax.recompile import compiler
    first = compiler.Compiler.get
    def late(self, plan):
        got = first(self, plan)
        time.sleep({LATE_SECONDS})
        return got
    compiler.Compiler.get = late
'''


@pytest.mark.slow
def test_a_process_that_compiles_longer_is_waited_for_before_the_first_step(tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_FIRST_COMPILE)
    run = {**OVERRIDES, "train.steps": 2, "train.eval_every": 100}
    out = two_processes(tmp_path / "multi", run, devices=1, pythonpath=hook)
    assert "[0] dynjax run summary" in out and "[1] dynjax run summary" in out
    assert sorted(losses(tmp_path / "multi")) == [1, 2]
