"""A dynamic-capacity MoE run over 2 local processes x 4 CPU devices (issue 15 §4): process 0's
policy decides, and both processes swap to each of its Plans at the same step, moving layers
between the processes' stages where the Plan says so. The ragged path
(the default) takes new capacities as a runtime input, so the swaps come within a few steps;
agreement on Plans that compile a new program is tested with threads as processes in
tests/recompile/test_agreement.py."""

import os
import subprocess
import sys

import pytest

from dynjax.writers import read_jsonl

from ..helpers import ROOT, TWO_PROCESS_BASE, losses, two_processes

# With 4 local experts of top-2 routing, capacity factors >= 1 keep each layer's ragged buffer at
# its worst case (`ragged_totals`): every capacity the policy picks runs the same program.
DYNAMIC = {
    "moe.every": 1,
    "moe.dispatch": "ragged",
    "moe.capacity.policy": "dynamic",
    "moe.capacity.window": 2,
    "moe.capacity.factor": 1.0,
    "moe.capacity.min_factor": 1.0,
    "moe.capacity.max_factor": 2.0,
    "recompile.delta_launch": 1,
    "train.steps": 12,
    "train.eval_every": 12,
    "train.checkpoint_every": 12,
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh",
    [
        {"mesh.data": 8},  # one program over both processes
        {"mesh.stage": 2, "mesh.data": 4, "train.microbatches": 2},  # a stage per process
    ],
    ids=["one-program", "stage-per-process"],
)
def test_both_processes_swap_to_process_0s_plans_at_the_same_steps(tmp_path, mesh):
    """(The stage-per-process run failed once in stop 24, of three runs on a loaded machine, with
    an error reading a step's metrics that was never explained; 19 runs of it since, 15 of them
    three at a time, all passed with the same swaps and losses in both processes.)"""
    two_processes(tmp_path, {**TWO_PROCESS_BASE, **DYNAMIC, **mesh})
    workdirs = (tmp_path, tmp_path / "process_1")
    swaps = [
        [
            (e["swap_step"], e["plan"]["parts"]["moe"]["capacities"], e["cache_hit"])
            for e in read_jsonl(w / "events.jsonl")
            if e["event"] == "recompile"
        ]
        for w in workdirs
    ]
    print("swaps (step, capacities, cache hit) per process:", swaps)
    assert swaps[0] == swaps[1]
    assert swaps[0] and all(hit for _, _, hit in swaps[0])
    factors = [
        {r["step"]: r["capacity_factor"] for r in read_jsonl(w / "metrics.jsonl") if "loss" in r}
        for w in workdirs
    ]
    assert factors[0] == factors[1]
    assert factors[0][1] == 1.0 and factors[0][12] != 1.0  # it trained on the new Plans
    assert losses(tmp_path) == losses(tmp_path / "process_1")


@pytest.mark.slow
def test_a_forced_rebalance_moves_a_layer_to_the_other_process_and_keeps_the_losses(tmp_path):
    """A stage per process, 4 layers laid out (3, 1); a user policy of process 0 asks for
    (2, 2) from the start: layer 2 moves from process 0's stage to process 1's with its
    optimizer state, and the losses are those of the 2 processes trained on (2, 2) from the
    start (which test_data_multiprocess holds equal to one process's)."""
    run = {
        **TWO_PROCESS_BASE,
        "model.num_layers": 4,
        "mesh.stage": 2,
        "mesh.data": 4,
        "train.microbatches": 2,
        # Steps enough for the background lowering (~20 s on a loaded 2-core machine) and
        # compile (a cache hit) of the new layout: it swapped at step 13 of such a run.
        "train.steps": 32,
        "train.eval_every": 32,
        "train.checkpoint_every": 32,
        "recompile.delta_launch": 1,
    }
    # The reference also fills the persistent compilation cache with the programs of (2, 2),
    # so that the forced run's background compile of them finishes within its steps.
    reference = tmp_path / "reference"
    two_processes(reference, {**run, "pipeline.stage_layers": "2,2"})
    multi = tmp_path / "multi"
    args = [f"--config.{k}={v}" for k, v in {**run, "pipeline.stage_layers": "3,1"}.items()]
    command = [sys.executable, "tests/scripts/force_layout.py", "2,2", "0",
               "--config", "tests/tiny.py", "--workdir", str(multi), *args]
    launcher = (
        "import sys; from dynjax.launch.local import launch; sys.exit(launch(2, 4, sys.argv[1:]))"
    )
    done = subprocess.run([sys.executable, "-c", launcher, *command], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    migrations = [
        [(e["step"], e["moves"]) for e in read_jsonl(w / "events.jsonl")
         if e["event"] == "migrate"]
        for w in (multi, multi / "process_1")
    ]
    print("migrations per process:", migrations)
    assert migrations[0] == migrations[1]
    [(step, moves)] = migrations[0]
    assert moves == [[2, 0, 1]] and 0 < step < 32
    want = losses(reference)
    assert sorted(want) == list(range(1, 33))
    # Within float32 rounding: the layouts split the same sums differently; a layer that
    # lost its optimizer state in the move would differ by ~1e-2.
    assert losses(multi) == pytest.approx(want, rel=1e-5, abs=0)
    assert losses(multi / "process_1") == losses(multi)
