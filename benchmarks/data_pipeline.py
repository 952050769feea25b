"""Host time spent on batches per training step, before and after per-host reading + prefetch.

Runs ``dynjax.train`` on a config (default the quickstart) three ways, alternating rounds:

* before: the batch built as before issue 15 §5 (one window at a time, every row of the global
  batch, on the training thread: ``data.prefetch=0``);
* after, prefetch 0: the vectorised reader, on the training thread;
* after, prefetch 2: the same on the background thread (the default).

and reports medians over rounds of the host ms per step spent reading batches, the ms per step
the loop waited for them (in the prefetcher's ``get``; on the training thread reading is
waiting: mean, median and the largest after the first steps), and tokens/s (noisy on a shared
machine), with ratios against "before" from the same run. Inside a run these include the
training thread's contention with XLA's threads; a second table times the reader alone:
before and after, and one process's rows when 1, 2 or 4 processes split a data-parallel batch
(each reads B/P rows).

    PYTHONPATH=. python benchmarks/data_pipeline.py [--config configs/quickstart.py]
        [--steps 30] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from contextlib import nullcontext
from unittest import mock

import numpy as np

from dynjax.config import load_config
from dynjax.data import Batch, Prefetcher, TrainOrder
from dynjax.experiment import Experiment
from dynjax.train import train


def per_sample_batch(order: TrainOrder, step: int, rows: np.ndarray | None = None) -> Batch:
    """The reader before issue 15 §5: the whole batch, one sample and one window at a time."""
    w, n = order.windows, order.windows.num_train
    ids = np.empty(order.batch_size, np.int64)
    for j in range(order.batch_size):
        epoch, pos = divmod(step * order.batch_size + j, n)
        ids[j] = order._permutation(epoch)[pos]
    starts = ids * w.seq_len
    tokens = np.stack([np.asarray(w.tokens[s : s + w.seq_len + 1]) for s in starts])
    tokens = tokens.astype(np.int32)
    return Batch(tokens[:, :-1], tokens[:, 1:], ids, np.arange(order.batch_size))


COLUMNS = ("read ms/step", "waited ms/step", "median wait", "max wait, t>=3", "tokens/s")
WARM_UP = 3  # the first steps' gets wait while the loop's first dispatches hold the GIL


def one_run(cfg, variant: str) -> tuple[float, ...]:
    """The `COLUMNS` of one training run (waits in ms)."""
    cfg = cfg.copy_and_resolve_references()
    cfg.data.prefetch = 2 if variant == "after, prefetch 2" else 0
    waits, get = [], Prefetcher.get

    def timed_get(self, step):
        began = time.perf_counter()
        batch = get(self, step)
        waits.append(1e3 * (time.perf_counter() - began))
        return batch

    before = variant == "before"
    reader = mock.patch.object(TrainOrder, "batch", per_sample_batch) if before else nullcontext()
    with tempfile.TemporaryDirectory() as workdir, reader, mock.patch.object(
        Prefetcher, "get", timed_get
    ):
        s = train(cfg, workdir, progress=False)
    return (1e3 * s.batch_build_seconds, 1e3 * s.batch_wait_seconds, statistics.median(waits),
            max(waits[WARM_UP:]), s.tokens_per_sec or 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/quickstart.py")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    cfg = load_config(
        args.config,
        [f"train.steps={args.steps}", f"train.log_every={max(args.steps // 6, 1)}",
         f"train.eval_every={10 * args.steps}", f"train.checkpoint_every={10 * args.steps}"],
    )
    variants = ("before", "after, prefetch 0", "after, prefetch 2")
    results: dict[str, list[tuple[float, ...]]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            results[v].append(one_run(cfg, v))
            print(f"  {v}: " + ", ".join(f"{c} {x:.3f}" for c, x in zip(
                COLUMNS, results[v][-1], strict=True)), flush=True)
    med = {v: [statistics.median(r[i] for r in results[v]) for i in range(len(COLUMNS))]
           for v in variants}
    print(f"\n{args.config}: batch {cfg.train.batch_size} x {cfg.data.seq_len}, {args.steps} "
          f"steps, median of {args.rounds} rounds; ms, (ratio against 'before')")
    print(f"{'':18}" + "".join(f"{c:>21}" for c in COLUMNS))
    for v in variants:
        cells = [f"{x:10.3f} ({x / b:6.2f})" for x, b in zip(med[v], med["before"], strict=True)]
        print(f"{v:18}" + "".join(f"{c:>21}" for c in cells))

    exp = Experiment.from_config(cfg)
    size = cfg.train.batch_size

    def read_ms(read) -> float:
        times = []
        for step in range(200):
            began = time.perf_counter()
            read(step)
            times.append(1e3 * (time.perf_counter() - began))
        return statistics.median(times)

    base = read_ms(lambda step: per_sample_batch(exp.order, step))
    print(f"\nms to read a process's rows of a batch alone (median of 200 steps; ratio against "
          f"'before')\n  before, all {size} rows: {base:.4f} ms")
    for processes in (1, 2, 4):
        rows = np.arange(size // processes)
        ms = read_ms(lambda step, rows=rows: exp.order.batch(step, rows))
        print(f"  after, P={processes}: {len(rows):3d} rows  {ms:.4f} ms  ({ms / base:.2f})")


if __name__ == "__main__":
    main()
