"""A dynamic-capacity MoE run over 2 local processes x 4 CPU devices (issue 15 §4): process 0's
policy decides, and both processes swap to each of its Plans at the same step. The ragged path
(the default) takes new capacities as a runtime input, so the swaps come within a few steps;
agreement on Plans that compile a new program is tested with threads as processes in
tests/test_recompile_agreement.py."""

import pytest

from dynjax.writers import read_jsonl

from .test_data_multiprocess import BASE, losses, two_processes

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
    ids=["one_program", "pipeline"],
)
def test_both_processes_swap_to_process_0s_plans_at_the_same_steps(tmp_path, mesh):
    two_processes(tmp_path, {**BASE, **DYNAMIC, **mesh})
    workdirs = (tmp_path, tmp_path / "process_1")
    swaps = [
        [
            (e["swap_step"], e["plan"]["capacities"], e["cache_hit"])
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
