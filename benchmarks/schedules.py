"""The pipeline schedules in the balancer's simulator: iteration time, bubble and activations.

One table per ``--stages``/``--microbatches``: each schedule of `dynjax.balance.SCHEDULES` on equal
stages with a forward of 1, a backward of 2 (for ZB-H1 split into B = 1 and W = 1, a matmul's
input and weight gradients) and ``--comm`` per hop, against 1F1B measured in the same run; the
interleaved schedule with ``--chunks`` chunks per device of ``1 / chunks`` of its layers each. The
simulator's bubbles equal the schedules' formulas (tests/balance/test_simulate.py). The runtime
runs every one of them. Measured on a pipeline of pinned processes: ``benchmarks/real_pipeline.py
--schedules``.

    PYTHONPATH=. python3 benchmarks/schedules.py --stages 4 --microbatches 8
"""

from __future__ import annotations

import argparse

from dynjax.balance import SCHEDULES, simulate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=2, help="interleaved_1f1b's chunks")
    parser.add_argument("--comm", type=float, default=0.0, help="transfer time per hop")
    args = parser.parse_args()
    s, m = args.stages, args.microbatches
    rows = {}
    for name in SCHEDULES:
        v = args.chunks if name == "interleaved_1f1b" else 1
        rows[name] = simulate(
            [1.0 / v] * (s * v), [2.0 / v] * (s * v), m, schedule=name, comm=args.comm,
            virtual_stages=v,
        )
    base = rows["1f1b"].iteration_time
    print(f"{s} stages, {m} microbatches, F=1 B=2 (ZB-H1: B=1 W=1), comm {args.comm:g} per hop; "
          "peak in flight counts stored stage inputs (interleaved: of 1/chunks of the layers)")
    print(f"{'schedule':18s} {'iteration':>9s} {'vs 1f1b':>7s} {'bubble':>6s} "
          f"{'peak in flight':>14s}")
    for name, sim in rows.items():
        print(f"{name:18s} {sim.iteration_time:9.2f} {base / sim.iteration_time:6.2f}x "
              f"{sim.bubble_ratio:6.1%} {max(sim.peak_in_flight):14d}")


if __name__ == "__main__":
    main()
