"""Proportion of lost tokens (PLT, seed 004 eq. 7) after 1, 2 and 4 injected faults, with a
fixed K and with dynamic K (§5.3), on a tiny 16-expert model trained on CPU.

Each run trains the same config from scratch with partial expert checkpoints (K = 1 of 16
experts per MoE layer per save, sequential selection) and is interrupted after the steps in
``--faults`` (a fault: the loop stops at once, as if the process died) and resumed from its
workdir each time; a fault between two saves costs PLT as one right after the earlier save (the
steps after it are re-trained whole). For each fault the table gives the accumulated PLT right
after the recovery (``checkpoint_recovery`` event's ``total_plt``) and the K for later saves,
and the PLT at the end of training (``checkpoint/plt`` of metrics.jsonl), both runs from the
same seed. A short run on CPU loses far more than the paper's (a save holds 1/16 of each layer's
experts, so an expert waits 16 saves: here most of the run), so the absolute numbers are not
the paper's; what the table shows is the shape of its Fig. 15b: with a fixed K the PLT grows
with every fault, dynamic K doubles K after a recovery above ``checkpoint.plt_limit`` and the
later faults lose less.

    PYTHONPATH=. python3 benchmarks/checkpoint_plt.py [--steps 96 --faults 20,44,64,84]
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

from dynjax.config import default_config
from dynjax.recompile import Monitor
from dynjax.train import train
from dynjax.writers import read_jsonl

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "data" / "corpus.txt"


class Fault(Exception):
    """The injected fault: raised from the loop once the chosen step is dispatched."""


def config(steps: int, dynamic_k: bool):
    c = default_config()
    c.train.steps, c.train.batch_size, c.train.warmup_steps = steps, 8, 4
    c.train.log_every, c.train.eval_every, c.train.checkpoint_every = 1, 10_000, 2
    c.data.path, c.data.seq_len, c.data.max_tokens = str(CORPUS), 32, 200_000
    c.model.num_layers, c.model.d_model, c.model.num_heads, c.model.mlp_dim = 4, 32, 2, 64
    c.moe.every, c.moe.num_experts, c.moe.top_k = 2, 16, 2  # MoE layers 1 and 3
    c.checkpoint.async_save = False
    c.checkpoint.experts_per_save = 1
    c.checkpoint.dynamic_k = dynamic_k
    return c


def run(steps: int, faults: list[int], dynamic_k: bool, workdir: Path) -> dict:
    """Train with a fault after each step of ``faults``; the recoveries and the final PLT."""
    push = Monitor.push
    for fault in [*faults, None]:

        def push_or_fail(self, step, metrics, fault=fault):
            push(self, step, metrics)
            if step + 1 == fault:
                raise Fault(step + 1)

        Monitor.push = push_or_fail
        try:
            train(config(steps, dynamic_k), workdir, progress=False)
        except Fault:
            pass
        finally:
            Monitor.push = push
    events = read_jsonl(workdir / "events.jsonl")
    events = [e for e in events if e["event"] == "checkpoint_recovery"]
    last = read_jsonl(workdir / "metrics.jsonl")[-1]
    return {"recoveries": events, "final_plt": last["checkpoint/plt"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--faults", default="20,44,64,84", help="steps after which a fault hits")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    faults = [int(f) for f in args.faults.split(",")]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for dynamic in (False, True):
            results[dynamic] = run(args.steps, faults, dynamic, Path(tmp) / str(dynamic))
    print(f"PLT (eq. 7) after each fault: 16 experts, K = 1 at the start, a save every 2 "
          f"steps, {args.steps} steps, faults after steps {faults}, plt_limit 0.0375")
    print(f"{'faults':>6} {'restored step':>13} | {'fixed K: PLT':>12} {'K':>3} | "
          f"{'dynamic K: PLT':>14} {'K':>3}")
    for n in range(len(faults)):
        fixed, dyn = (results[d]["recoveries"][n] for d in (False, True))
        print(f"{n + 1:>6} {fixed['step']:>13} | {fixed['total_plt']:>12.4f} "
              f"{fixed['experts_per_save']:>3} | {dyn['total_plt']:>14.4f} "
              f"{dyn['experts_per_save']:>3}")
    ratio = results[True]["final_plt"] / results[False]["final_plt"]
    print(f"{'end':>6} {args.steps:>13} | {results[False]['final_plt']:>12.4f} {'':>3} | "
          f"{results[True]['final_plt']:>14.4f} {'':>3}   (dynamic / fixed = {ratio:.2f})")


if __name__ == "__main__":
    main()
