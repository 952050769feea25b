"""Two local processes of 4 CPU devices each, every one reading only the batch rows its devices
consume (issue 15 §5): the same losses as one process of 8 devices."""


import numpy as np
import pytest

from dynjax.dynamism.freezing import PLASTICITY
from dynjax.experiment import Experiment
from dynjax.recompile import History, Plan
from dynjax.train import train
from dynjax.writers import read_jsonl

from .helpers import TWO_PROCESS_BASE, TWO_PROCESS_LAYOUTS, losses, one_and_two, two_processes
from .tiny import dotted_config


@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh, reads",
    [
        # one program over both processes: each reads the half of every batch its devices hold
        ({"mesh.data": 8}, (4, 4)),
        # one stage per process: the first stage's process reads the inputs, the last's the
        # targets (whole microbatches each)
        ({"mesh.stage": 2, "mesh.data": 4, "train.microbatches": 2}, (8, 8)),
    ],
)
def test_two_processes_reading_their_rows_match_one(tmp_path, mesh, reads):
    overrides = {**TWO_PROCESS_BASE, **mesh}
    single = tmp_path / "single"
    train(dotted_config(overrides), single, progress=False)
    out = two_processes(tmp_path / "multi", overrides)
    for process, rows in enumerate(reads):
        assert f"[{process}]   batches (host)     {rows} rows of each read here" in out
    want = losses(single)
    assert sorted(want) == [1, 2, 3, 4]
    # Within float32 rounding: a stage of 4 devices adds up across processes in another order
    # (main's pipeline gives the same last-bit difference); other data would differ by ~1e-2.
    assert losses(tmp_path / "multi") == pytest.approx(want, rel=1e-6, abs=0)
    assert losses(tmp_path / "multi" / "process_1") == losses(tmp_path / "multi")


@pytest.mark.slow
@pytest.mark.parametrize("layout", TWO_PROCESS_LAYOUTS)
@pytest.mark.parametrize("granularity", ["element", "block"])
def test_two_processes_prune_as_one_process(tmp_path, granularity, layout):
    """Gradual global magnitude pruning (seed 000 Alg. 1) over 2 processes x 4 devices makes
    the selection one process of 8 devices makes (the same kept counts and layer densities
    at every event) and trains alike. In one program the scores, the bisection's counts and
    the masks are global arrays; in a pipeline each process counts its own stage and the
    counts are summed through the coordinator."""
    run = {
        **TWO_PROCESS_BASE,
        **TWO_PROCESS_LAYOUTS[layout],
        "train.steps": 12,
        "train.eval_every": 12,
        "pruning.enabled": True,
        "pruning.start_step": 2,
        "pruning.every": 3,
        "pruning.steps": 3,
        "pruning.final_sparsity": 0.6,
        "pruning.granularity": granularity,
        "pruning.block_size": 16,
    }
    single, multi = one_and_two(tmp_path, run)
    workdirs = (single, multi, multi / "process_1")
    prunes = [
        [(e["step"], e["kept"], e["layer_density"]) for e in read_jsonl(w / "events.jsonl")
         if e["event"] == "prune"]
        for w in workdirs
    ]
    assert len(prunes[0]) == 4 and prunes[0][-1][1] < prunes[0][0][1]
    assert prunes[1] == prunes[0] and prunes[2] == prunes[0]
    # Within float32 rounding: a data shard of 4 devices adds up across processes in another
    # order (as in test_two_processes_reading_their_rows_match_one).
    assert losses(multi) == pytest.approx(losses(single), rel=1e-6, abs=0)
    assert losses(multi / "process_1") == losses(multi)


@pytest.mark.slow
@pytest.mark.parametrize("layout", TWO_PROCESS_LAYOUTS)
def test_two_processes_measure_plasticity_as_one_process(tmp_path, layout):
    """Egeria's plasticity probe (seed 000 §2.3) over 2 processes x 4 devices: both processes
    measure what one process of 8 devices does (in one program the probe runs the layers on
    global arrays; in a pipeline the activation passes from process 0's stage to process 1's
    and the per-layer values are exchanged); process 0 decides (from a step's measurements,
    the prefix one process freezes from them) and both swap the frozen layers in at the same
    step. When the Controller decides and a swap lands depend on the machine's load, so the
    runs are compared step by step until either swapped."""
    run = {
        **TWO_PROCESS_BASE,
        **TWO_PROCESS_LAYOUTS[layout],
        "model.num_layers": 4,
        "train.steps": 16,
        "train.eval_every": 16,
        "freezing.enabled": True,
        "freezing.metric": "plasticity",
        "freezing.every": 2,
        "freezing.reference_every": 4,
        "freezing.start_step": 4,
        "freezing.threshold": 0.5,
        "freezing.patience": 1,
        "recompile.delta_launch": 1,
    }
    single, multi = one_and_two(tmp_path, run)
    workdirs = (single, multi, multi / "process_1")
    events = [read_jsonl(w / "events.jsonl") for w in workdirs]
    freezes = [[e for e in ev if e["event"] == "freeze"] for ev in events]
    assert freezes[1] and not freezes[2]  # process 0 decides
    measured = [{r["step"]: r[PLASTICITY] for r in read_jsonl(w / "metrics.jsonl")
                 if PLASTICITY in r} for w in workdirs]
    # The runs' Controllers may decide from different steps (when depends on the machine's
    # load), so each of process 0's decisions is checked against the prefix one process's rule
    # freezes from the measurements logged up to its metrics_step (a measurement the Controller
    # saw with step s is logged with step s + 1).
    [rule] = next(p for p in Experiment.from_config(dotted_config(run)).plugins
                  if p.name == "freezing").policies()
    for decided in freezes[1]:
        entries = tuple((s - 1, {PLASTICITY: np.array(v, np.float64)})  # null: NaN
                        for s, v in sorted(measured[1].items()) if s - 1 <= decided["metrics_step"])
        prefix = decided["frozen_prefix"][0]
        proposal = rule.propose(History(entries), Plan(frozen_layers=tuple(range(prefix))))
        assert proposal is not None, decided
        [want] = proposal.records
        assert decided["frozen_prefix"] == want["frozen_prefix"]
        assert decided["plasticity"] == pytest.approx(want["plasticity"], rel=1e-6)
    # Where the two runs decided from the same step, they decided alike.
    alone = {e["metrics_step"]: e for e in freezes[0]}
    for decided in freezes[1]:
        if decided["metrics_step"] in alone:
            want = alone[decided["metrics_step"]]
            assert decided["frozen_prefix"] == want["frozen_prefix"]
            assert decided["plasticity"] == pytest.approx(want["plasticity"], rel=1e-5)
    recompiles = [[(e["swap_step"], e["plan_diff"]) for e in ev if e["event"] == "recompile"]
                  for ev in events[1:]]
    assert recompiles[0] == recompiles[1]
    swaps = [next((e["swap_step"] for e in ev if e["event"] == "recompile"), run["train.steps"])
             for ev in events]
    assert measured[1] and measured[1] == measured[2]
    early = [s for s in measured[0] if s <= min(swaps)]
    assert early
    for step in early:
        assert measured[1][step] == pytest.approx(measured[0][step], rel=1e-5)
    want, got = losses(single), losses(multi)
    before = [s for s in want if s <= min(swaps)]
    assert before
    assert [got[s] for s in before] == pytest.approx([want[s] for s in before], rel=1e-6, abs=0)
    assert losses(multi / "process_1") == got
