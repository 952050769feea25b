"""Partial expert checkpoints' policy (seed 004 §3.2, eq. 7, §5.3): selection, the token
ledger, the proportion of lost tokens and dynamic K, against hand NumPy computations."""

import json
import math

import numpy as np
import pytest

from dynjax.checkpoint import layout
from dynjax.config import validate_config
from dynjax.dynamism.moe.checkpoint import ExpertLedger
from dynjax.errors import ConfigError
from dynjax.train import train
from dynjax.writers import read_jsonl

from ..helpers import (
    check_recoveries,
    events_of,
    overwrite_expert,
    train_cli,
)
from ..tiny import tiny_config


def _sequential_saves(ledger: ExpertLedger, saves: int) -> list[dict[int, list[int]]]:
    """Run ``saves`` partial saves after the first (full) one, one step apart."""
    ledger.count(1, np.ones(ledger.tokens.shape))
    ledger.saved(1, ledger.select())
    out = []
    for step in range(2, saves + 2):
        ledger.count(step, np.ones(ledger.tokens.shape))
        chosen = ledger.select()
        ledger.saved(step, chosen)
        out.append(chosen)
    return out


def test_the_first_save_is_full_and_fig5_is_reproduced():
    """Fig. 5: E = R = 3, K = 1, MoE layers 1, 3, 5, 7: the first partial save writes experts
    1-0, 3-1, 5-2, 7-0 and the next 1-1, 3-2, 5-0, 7-1."""
    ledger = ExpertLedger([1, 3, 5, 7], 3, 3, 1)
    assert ledger.select() is None  # no copy of anything yet: all
    first, second = _sequential_saves(ledger, 2)
    assert first == {1: [0], 3: [1], 5: [2], 7: [0]}
    assert second == {1: [1], 3: [2], 5: [0], 7: [1]}


@pytest.mark.parametrize(
    ("layers", "experts", "ranks", "k"),
    [(4, 8, 4, 1), (3, 8, 2, 3), (6, 16, 4, 2), (5, 12, 3, 5), (2, 4, 1, 3)],
)
def test_sequential_covers_every_expert_each_cycle_and_balances_ranks(layers, experts, ranks, k):
    ledger = ExpertLedger(list(range(layers)), experts, ranks, k)
    cycle = math.ceil(experts / k)
    saves = _sequential_saves(ledger, 3 * cycle)
    per_rank_bytes = []
    for chosen in saves:
        assert all(len(v) == k for v in chosen.values())
        ranks_of = np.concatenate([ledger.rank_of(v) for v in chosen.values()])
        per_rank_bytes.append(np.bincount(ranks_of, minlength=ranks))
    for start in range(len(saves) - cycle + 1):  # any ceil(E/K) consecutive saves: all experts
        for layer in range(layers):
            seen = {e for chosen in saves[start : start + cycle] for e in chosen[layer]}
            assert seen == set(range(experts)), (start, layer)
    per_rank_bytes = np.array(per_rank_bytes)  # [saves, ranks] experts (equal sizes) per rank
    assert (per_rank_bytes.max(1) - per_rank_bytes.min(1) <= 1).all()
    assert (per_rank_bytes.sum(1) == layers * k).all()


def test_sequential_is_unbalanced_without_the_interleave():
    """What the interleave buys: the same windows over experts in index order put a save's
    experts on one rank (Fig. 5's worst case), so the balance test above can fail."""
    ledger = ExpertLedger([0, 1, 2, 3], 8, 4, 1)
    contiguous = [[(i + s) % 8 for i in range(4)] for s in range(8)]
    spread = [np.bincount(ledger.rank_of(c), minlength=4) for c in contiguous]
    assert max(int(s.max() - s.min()) for s in spread) == 2


def test_load_aware_picks_the_experts_with_most_unsaved_tokens():
    ledger = ExpertLedger([0, 2], 4, 2, 2, selection="load_aware")
    rng = np.random.default_rng(0)
    loads = rng.integers(0, 100, size=(6, 2, 4))
    ledger.count(1, loads[0])
    ledger.saved(1, ledger.select())  # full
    since = np.zeros((2, 4), np.int64)
    for step in range(2, 7):
        ledger.count(step, loads[step - 1])
        since += loads[step - 1]
        chosen = ledger.select()
        for i, layer in enumerate((0, 2)):
            assert chosen[layer] == sorted(np.argsort(-since[i], kind="stable")[:2].tolist())
            since[i, chosen[layer]] = 0
        ledger.saved(step, chosen)


def _synthetic(seed: int, k: int = 1, **kw):
    """A ledger over 8 steps of random loads [3 layers, 4 experts], saved every 2 steps."""
    rng = np.random.default_rng(seed)
    loads = rng.integers(0, 50, size=(8, 3, 4))
    ledger = ExpertLedger([1, 3, 5], 4, 2, k, **kw)
    saves = {}
    for step in range(1, 9):
        ledger.count(step, loads[step - 1])
        if step % 2 == 0:
            saves[step] = ledger.select()
            ledger.saved(step, saves[step])
    return ledger, loads, saves


def _newest_sources(saves, step):
    """Per layer and expert, the newest save <= ``step`` that holds it (what restore reads)."""
    holds = lambda s, layer, e: s <= step and (saves[s] is None or e in saves[s][layer])
    return {
        layer: [max(s for s in saves if holds(s, layer, e)) for e in range(4)]
        for layer in (1, 3, 5)
    }


def test_plt_equals_a_hand_computation():
    ledger, loads, saves = _synthetic(1)
    sources = _newest_sources(saves, 8)
    restored = ExpertLedger.from_meta(
        json.loads(json.dumps(ledger.to_meta())),
        selection="sequential",
        plt_limit=0.0375,
        dynamic_k=False,
        history=3,
    )
    recovery = restored.recover(sources)
    lost = np.zeros((3, 4), np.int64)
    for i, layer in enumerate((1, 3, 5)):
        for e in range(4):
            lost[i, e] = loads[sources[layer][e] : 8, i, e].sum()  # steps src+1 .. 8
    assert recovery.lost_tokens == {layer: lost[i].tolist() for i, layer in enumerate((1, 3, 5))}
    assert recovery.lost_steps == {
        layer: [8 - s for s in sources[layer]] for layer in (1, 3, 5)
    }
    assert recovery.plt == pytest.approx(lost.sum() / loads.sum())
    assert lost.sum() > 0
    event = recovery.event()
    assert event["event"] == "checkpoint_recovery" and event["lost_tokens"] == lost.sum()


def test_a_row_the_storage_saved_unasked_counts_from_its_step():
    """The storage saves a row no step holds even if not asked (after a quarantine): the
    restore then reads that expert from a step the ledger did not choose it at."""
    ledger, loads, saves = _synthetic(7)
    sources = _newest_sources(saves, 8)
    unasked = next(e for e in range(4) if sources[3][e] < 6)
    sources[3][unasked] = 6
    recovery = ledger.recover(sources)
    assert recovery.lost_tokens[3][unasked] == loads[6:8, 1, unasked].sum()
    assert recovery.lost_steps[3][unasked] == 2


def test_a_second_fault_counts_only_the_tokens_after_the_first_recovery():
    """Two faults on one trajectory: recover at 8, train 4 more steps with no save of some
    experts, recover at 10 (a later save): the experts still restored from the old copy lose
    only steps 9..10, and eq. 7 sums the two faults over all tokens processed."""
    ledger, loads, saves = _synthetic(2)
    first = ledger.recover(_newest_sources(saves, 8))
    more = np.random.default_rng(3).integers(0, 50, size=(2, 3, 4))
    ledger.count(9, more[0])
    ledger.count(10, more[1])
    chosen = ledger.select()
    ledger.saved(10, chosen)
    saves[10] = chosen
    # A restore of step 10: the experts saved at 10 lose nothing; the others come from the
    # copies of the first recovery, which since hold their state at step 8.
    second = ledger.recover(_newest_sources(saves, 10))
    for i, layer in enumerate((1, 3, 5)):
        for e in range(4):
            want = 0 if e in chosen[layer] else int(more[:, i, e].sum())
            assert second.lost_tokens[layer][e] == want
            assert second.lost_steps[layer][e] == (0 if e in chosen[layer] else 2)
    lost = sum(sum(map(sum, r.lost_tokens.values())) for r in (first, second))
    assert second.total_plt == pytest.approx(lost / (loads.sum() + more.sum()))


def test_a_fault_restoring_the_same_step_again_counts_its_losses_once():
    ledger, _, saves = _synthetic(4)
    meta = json.loads(json.dumps(ledger.to_meta()))
    settings = {"selection": "sequential", "plt_limit": 0.0375, "dynamic_k": False, "history": 3}
    first = ExpertLedger.from_meta(meta, **settings).recover(_newest_sources(saves, 8))
    again = ExpertLedger.from_meta(meta, **settings).recover(_newest_sources(saves, 8))
    assert again.total_plt == first.total_plt == first.plt


def test_dynamic_k_doubles_exactly_when_the_limit_is_crossed_and_caps_at_e():
    ledger, _, saves = _synthetic(5, k=1, dynamic_k=True, plt_limit=0.5)
    sources = _newest_sources(saves, 8)
    below = ExpertLedger.from_meta(
        ledger.to_meta(), selection="sequential", plt_limit=0.5, dynamic_k=True, history=3
    ).recover(sources)
    assert below.total_plt < 0.5 and below.experts_per_save == 1
    limit = below.total_plt * 0.999  # just under this fault's PLT: crossed
    ks = []
    for _ in range(4):
        restored = ExpertLedger.from_meta(
            ledger.to_meta(), selection="sequential", plt_limit=limit, dynamic_k=True, history=3
        )
        ks.append(restored.recover(sources).experts_per_save)
        ledger.set_k(restored.k)
    assert ks == [2, 4, 4, 4]  # doubles once per recovery above the limit, never above E
    exact = ExpertLedger.from_meta(
        ledger.to_meta() | {"k": 1},
        selection="sequential",
        plt_limit=below.total_plt,  # equal is not above
        dynamic_k=True,
        history=3,
    )
    assert exact.recover(sources).experts_per_save == 1
    off = ExpertLedger.from_meta(
        ledger.to_meta() | {"k": 1},
        selection="sequential",
        plt_limit=limit,
        dynamic_k=False,
        history=3,
    )
    assert off.recover(sources).experts_per_save == 1


def test_the_ledger_survives_its_metadata_round_trip():
    ledger, _, _ = _synthetic(6, k=2, selection="load_aware")
    meta = json.loads(json.dumps(ledger.to_meta()))
    again = ExpertLedger.from_meta(
        meta, selection="load_aware", plt_limit=0.0375, dynamic_k=False, history=3
    )
    assert again.to_meta() == ledger.to_meta()
    assert again.select() == ledger.select()


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"checkpoint__experts_per_save": 5, "moe__every": 2}, "checkpoint.experts_per_save=5"),
        ({"checkpoint__experts_per_save": 1}, "checkpoint.experts_per_save=1 needs MoE"),
        ({"checkpoint__experts_per_save": -1, "moe__every": 2}, "checkpoint.experts_per_save"),
        ({"checkpoint__pec_content": "X"}, "checkpoint.pec_content"),
        ({"checkpoint__pec_selection": "random"}, "checkpoint.pec_selection"),
        ({"checkpoint__plt_limit": 0.0}, "checkpoint.plt_limit"),
        ({"checkpoint__plt_limit": 1.5}, "checkpoint.plt_limit"),
    ],
)
def test_bad_settings_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate_config(tiny_config(**overrides), 1)


def test_good_settings_pass():
    validate_config(tiny_config(checkpoint__experts_per_save=4, moe__every=2), 1)
    validate_config(tiny_config(checkpoint__experts_per_save=0), 1)


# -- end to end: a training process killed and resumed --------------------------------------

PEC_RUN = {
    "moe__every": 1,  # two MoE layers (0 and 1) of 4 experts
    "checkpoint__experts_per_save": 1,
    "train__steps": 12,
    "train__checkpoint_every": 2,
    "train__eval_every": 1000,
}


@pytest.mark.slow
def test_a_killed_pec_run_restores_accounts_its_plt_and_trains_on(tmp_path):
    """K = 1 of 4 experts, a save every 2 steps (2 full, 4, 6 partial), SIGKILL right after the
    save of 6: the restore takes each expert from its newest copy (sequential: layer 0 saved
    expert 0 at 4 and 1 at 6, layer 1 experts 1 and 2), and the PLT reported is the one the
    logged routing counts give."""
    run = tmp_path / "run"
    assert train_cli("tests/scripts/kill_after_save.py", run, PEC_RUN, 6) == -9
    summary = train(tiny_config(**PEC_RUN), run, progress=False)
    assert summary.start_step == 6 and summary.final_step == 12
    assert np.isfinite(summary.final_loss)
    [rec] = check_recoveries(run)
    assert rec["layers"]["0"]["sources"] == [4, 6, 2, 2]
    assert rec["layers"]["1"]["sources"] == [2, 4, 6, 2]
    assert rec["layers"]["0"]["lost_steps"] == [2, 0, 4, 4]
    assert 0 < rec["plt"] == rec["total_plt"] < 1
    # The running PLT of metrics.jsonl: the fault's lost tokens over the tokens through t.
    logged = {m["step"]: m for m in read_jsonl(run / "metrics.jsonl")
              if m["time"] > rec["time"] and "loss" in m}  # steps' records, not evaluations
    through = sum(
        np.sum(m["tokens_per_expert"])
        for m in read_jsonl(run / "metrics.jsonl")
        if m["time"] < rec["time"] and m["step"] <= 6
    )
    through += sum(np.sum(logged[t]["tokens_per_expert"]) for t in range(7, 13))
    assert logged[12]["checkpoint/plt"] == pytest.approx(rec["lost_tokens"] / through)


@pytest.mark.slow
def test_a_corrupted_expert_of_a_run_counts_the_plt_of_its_older_copy(tmp_path, caplog):
    """A PEC run saved at 2 (full), 4 and 6 (K = 1: layer 0 saved expert 0 at 4 and expert 1 at
    6); expert 1's weights at step 6 are then overwritten on disk. The resumed run restores
    that expert from its previous copy (step 2), with a warning and a fallback event, and its
    recovery counts the tokens routed to it in steps 3 to 6, as the logged routing counts give
    (the copy at 6 would have lost none)."""
    run = tmp_path / "run"
    train(tiny_config(**{**PEC_RUN, "train__steps": 6}), run, progress=False)
    step_dir = run / "checkpoints" / "6"
    assert layout.held_rows(json.loads((step_dir / "meta" / "metadata").read_text()))[
        "params/layers/0/moe/w_out"
    ] == (1,)
    overwrite_expert(step_dir, "params/layers/0/moe/w_out", 0)  # stored row 0: expert 1
    summary = train(tiny_config(**PEC_RUN), run, progress=False)
    assert summary.start_step == 6 and summary.final_step == 12
    [fallback] = events_of(run, "checkpoint_expert_fallback")
    assert (fallback["step"], fallback["layer"], fallback["expert"], fallback["group"]) == (
        6, 0, 1, "weights",
    )
    assert fallback["fallback_step"] == 2 and "expert 1 of layer 0" in caplog.text
    [rec] = check_recoveries(run)  # every expert's lost tokens as the logs give them
    assert rec["layers"]["0"]["sources"] == [4, 2, 2, 2]  # not [4, 6, 2, 2]
    assert rec["layers"]["0"]["lost_steps"][1] == 4
    routed = {  # [MoE layer, expert] tokens of each step of the first run
        m["step"]: np.array(m["tokens_per_expert"])
        for m in read_jsonl(run / "metrics.jsonl")
        if "tokens_per_expert" in m and m["time"] < rec["time"]
    }
    assert sorted(routed) == [1, 2, 3, 4, 5, 6]
    lost = sum(routed[t][0, 1] for t in range(3, 7))  # layer 0, expert 1, steps 3..6
    assert rec["layers"]["0"]["lost_tokens"][1] == lost > 0
    total = sum(a.sum() for a in routed.values())
    assert rec["plt"] == pytest.approx(rec["lost_tokens"] / total, rel=1e-12)


KILL_SEEDS = range(10)


def kill_plan(seed: int, steps: int, every: int) -> list[tuple[int, str]]:
    """One to three SIGKILLs (step, when) of `tests/scripts/kill_at.py`, each after the last (the
    restart reaches it): at a dispatched step, mid-save or right after a save."""
    rng = np.random.default_rng(seed)
    plan, step = [], 1
    for _ in range(rng.integers(1, 4)):
        if step >= steps - 1:
            break
        step = int(rng.integers(step + 1, steps))
        when = ["step", "mid_save", "after_save"][rng.integers(3)]
        if when != "step" and step + (-step) % every < steps:  # the next step that saves
            step += (-step) % every
        else:
            when = "step"
        plan.append((step, when))
    return plan


def sure_restores(plan: list[tuple[int, str]], every: int) -> int:
    """How many restarts after the kills of ``plan`` must find a committed checkpoint: one
    exists once a kill came right after a completed save, or once a process started two saves
    (Orbax finishes an asynchronous save before it starts the next). Before any commit a
    process starts at step 0; the saves it started are those of the steps before its kill, and
    a mid-save kill's own. Chance commits (a save that finished before the kill) only add."""
    committed, sure = False, 0
    for step, when in plan:
        started = list(range(every, step, every)) + ([step] if when != "step" else [])
        committed = committed or when == "after_save" or len(started) >= 2
        sure += committed
    return sure


def test_every_kill_plan_restores():
    """The random kills below are not all before the first commit: every seed's plan has a
    restart that must restore (so its recoveries are checked), and they add up across seeds."""
    sure = [sure_restores(kill_plan(s, PEC_RUN["train__steps"], 2), 2) for s in KILL_SEEDS]
    assert min(sure) >= 1 and sum(sure) >= 15, sure
    assert sure_restores([(2, "step"), (5, "step")], 2) == 1  # the first kill precedes a save
    assert sure_restores([(2, "mid_save"), (4, "after_save")], 2) == 1


@pytest.mark.slow
@pytest.mark.parametrize("seed", KILL_SEEDS)
def test_random_kills_are_all_accounted(tmp_path, seed):
    """Fault injection: SIGKILL at random points (`kill_plan`: a dispatched step, mid-save with
    Orbax still writing, right after a save), one to three times, then train to the end: every
    restart that finds a checkpoint restores it and accounts a recovery (at least the restarts
    `sure_restores` counts), every PLT equals the one recomputed from the logs, training
    completes."""
    run = {**PEC_RUN, "checkpoint__async_save": True, "checkpoint__dynamic_k": bool(seed % 2)}
    workdir, steps, every = tmp_path / "run", run["train__steps"], run["train__checkpoint_every"]
    plan = kill_plan(seed, steps, every)
    for step, when in plan:
        assert train_cli("tests/scripts/kill_at.py", workdir, run, step, when) == -9
    summary = train(tiny_config(**run), workdir, progress=False)
    assert summary.final_step == steps and np.isfinite(summary.final_loss)
    starts = [e["step"] for e in events_of(workdir, "resume")]
    restored = [e["step"] for e in events_of(workdir, "checkpoint_restore")]
    assert starts == restored  # every restart that found a checkpoint restored it
    assert len(starts) >= sure_restores(plan, every) >= 1, (plan, starts)
    recoveries = check_recoveries(workdir)
    assert [r["step"] for r in recoveries] == starts  # each restore accounted, once


@pytest.mark.slow
def test_one_fault_costs_no_more_validation_loss_than_the_steps_it_lost(tmp_path):
    """Seed 004 Fig. 7: with PLT <= 3.75% one fault leaves the final validation loss within
    noise of the fault-free run. K = 2 of 4 experts (every expert saved every other save), a
    save every 2 steps, SIGKILL after the save of step 36 of 40, resumed.

    Tolerance: the fault rolled some experts back by at most ``lost_steps`` steps (2) and
    nothing else; rolling *everything* back that far would cost at most the fault-free run's
    validation-loss decrease over its last ``lost_steps`` steps, so the PEC run's final
    validation loss must be within that of the fault-free one (about 0.01 here; the two runs
    differ by about 3e-4, on the same batches in the same order)."""
    run = {**PEC_RUN, "checkpoint__experts_per_save": 2, "train__steps": 40,
           "train__eval_every": 2}
    fault_free = train(tiny_config(**run), tmp_path / "fault_free", progress=False)
    assert train_cli("tests/scripts/kill_after_save.py", tmp_path / "pec", run, 36) == -9
    faulty = train(tiny_config(**run), tmp_path / "pec", progress=False)
    [rec] = events_of(tmp_path / "pec", "checkpoint_recovery")
    assert 0 < rec["total_plt"] <= 0.0375
    lost = max(max(v["lost_steps"]) for v in rec["layers"].values())
    assert lost == 2
    evals = {
        m["step"]: m["eval_loss"]
        for m in read_jsonl(tmp_path / "fault_free" / "metrics.jsonl")
        if "eval_loss" in m
    }
    tolerance = evals[40 - lost] - evals[40]
    print(f"PLT {rec['total_plt']:.4f}: tolerance {tolerance:.2e}, observed difference "
          f"{abs(faulty.eval_loss - fault_free.eval_loss):.2e}")
    assert tolerance > 0
    assert abs(faulty.eval_loss - fault_free.eval_loss) <= tolerance
    assert faulty.eval_loss != fault_free.eval_loss  # the fault did change the experts
