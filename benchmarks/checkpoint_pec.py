"""Partial expert checkpoints (seed 004 §3, issue 13): checkpoint size for K = 1..E experts per
MoE layer against the full save, and the seconds a save blocks training.

The model is shaped like the paper's GPT-350M-16E (24 layers, MoE every other layer, 16
experts) scaled to CPU: ``--layers`` layers, MoE every other one, 16 experts, d_model 128, on 8
fake CPU devices (data 2 x expert 4). The state is filled with random values (Adam moments
included), as a trained state is: zeros would compress on disk.

Sizes: bytes on disk of a step directory (every file Orbax wrote, metadata included) and the
``bytes`` of its ``checkpoint`` event, each over the full save's; predicted: seed 004 eq. 5-6,
whose symbols the text lost and which the surrounding text defines (say so, as asked):
S_full = (P_ne + P_e)(B_w + B_o) and S_PEC = (P_ne + K/E P_e)(B_w + B_o) for PEC_WO; for PEC_W
only B_w of the expert part scales by K/E, for PEC_O only B_o. P_ne, P_e: non-expert and expert
parameter counts; B_w = 4 (float32 weights), B_o = 8 (AdamW's two float32 moments).

Blocking: seconds ``Checkpointer.save`` takes before training may go on, for a full save with
``async_save`` off (it returns once written), a full asynchronous save and a PEC asynchronous
save of K=1 (sequential experts); each save of fresh arrays, the previous save finished first
(so no save waits on another); medians of ``--repeats``. On CPU the device-to-host copy Orbax
makes before returning is a host memcpy, so the asynchronous numbers are a floor. Then the
seconds of ``restore_latest`` from each directory: the PEC one assembles the experts from the
last saves (up to ``--repeats`` + 2 steps), the full ones read one step.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=. \\
        python3 benchmarks/checkpoint_pec.py [--layers 8 --repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from dynjax.checkpoint import Checkpointer, layout
from dynjax.config import default_config
from dynjax.dynamism.moe.checkpoint import EXPERT_STACKS
from dynjax.experiment import Experiment
from dynjax.model.facts import moe_layer_indices

B_W, B_O = 4, 8


def disk_bytes(step_dir: Path) -> int:
    return sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file())


def predicted(p_ne: int, p_e: int, k: int, e: int, content: str) -> float:
    """Seed 004 eq. 6 over eq. 5 (module docstring)."""
    w = k / e if "W" in content else 1.0
    o = k / e if "O" in content else 1.0
    return (p_ne * (B_W + B_O) + p_e * (w * B_W + o * B_O)) / ((p_ne + p_e) * (B_W + B_O))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    cfg = default_config()
    m = cfg.model
    m.num_layers, m.d_model, m.mlp_dim = args.layers, args.d_model, 4 * args.d_model
    cfg.moe.every, cfg.moe.num_experts = 2, args.experts
    cfg.mesh.data, cfg.mesh.expert = 2, 4
    exp = Experiment.from_config(cfg)
    keys = iter(jax.random.split(jax.random.key(0), 10_000))
    state = jax.tree.map(
        lambda a: jax.random.normal(next(keys), a.shape, a.dtype) if a.dtype.kind == "f" else a,
        exp.init_state(),
    )
    params = layout.split(state["params"], EXPERT_STACKS)
    p_e = sum(a.size for a in params[layout.ROWS].values())
    p_ne = sum(a.size for a in params[layout.DENSE].values())
    layers, e = moe_layer_indices(cfg.model.num_layers, cfg.moe.every), args.experts

    def fresh() -> Any:
        return jax.block_until_ready(jax.tree.map(jnp.copy, state))

    def sequential(i: int, k: int) -> dict[int, list[int]]:
        """Seed 004 §3.2's sequential selection, interleaved across layers (a stand-in here:
        the policy is `dynjax.dynamism.moe.checkpoint`'s)."""
        return {layer: [(i * k + j + n) % e for j in range(k)] for n, layer in enumerate(layers)}

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        sizes: dict[tuple[int, str], tuple[int, int]] = {}
        for content in ("WO", "W", "O"):
            ks = sorted({k for k in (1, 2, 4, 8, 16) if k < e} | {e}) if content == "WO" else [1]
            for k in ks:
                events: list[dict[str, Any]] = []
                directory = Path(tmp) / f"size-{content}-{k}"
                ckpt = Checkpointer(
                    directory, stacks=EXPERT_STACKS, keep=1, async_save=False, emit=events.append
                )
                ckpt.save(1, state, {})  # every expert has a copy: the next save is partial
                ckpt.save(2, state, {}, rows=sequential(1, k), content=content)
                ckpt.close()
                sizes[(k, content)] = (disk_bytes(directory / "2"), events[-1]["bytes"])
        full_disk, full_event = sizes[(e, "WO")]
        for (k, content), (disk, event) in sizes.items():
            rows.append((content, k, predicted(p_ne, p_e, k, e, content), event / full_event,
                         disk / full_disk, disk))

        blocking: dict[str, list[float]] = {}
        restoring: dict[str, list[float]] = {}
        for name, async_save, k in (
            ("full, sync", False, None),
            ("full, async", True, None),
            ("PEC K=1, async", True, 1),
        ):
            directory = Path(tmp) / name.replace(" ", "")
            ckpt = Checkpointer(directory, stacks=EXPERT_STACKS, keep=1, async_save=async_save)
            ckpt.save(0, fresh(), {})  # compiles the checksums; every expert has a copy
            ckpt.wait()
            if k is not None:
                ckpt.save(1, fresh(), {}, rows=sequential(0, k))  # compiles the gathers
                ckpt.wait()
            for i in range(2, args.repeats + 2):
                arrays = fresh()
                start = time.perf_counter()
                ckpt.save(i, arrays, {}, rows=None if k is None else sequential(i, k))
                blocking.setdefault(name, []).append(time.perf_counter() - start)
                ckpt.wait()
            for _ in range(args.repeats + 1):  # the first compiles
                start = time.perf_counter()
                jax.block_until_ready(ckpt.restore_latest(lambda meta: exp.abstract_state)[0])
                restoring.setdefault(name, []).append(time.perf_counter() - start)
            ckpt.close()

    mb = sum(a.nbytes for a in jax.tree.leaves(state)) / 1e6
    print(
        f"\n{args.layers} layers ({len(layers)} MoE) x {e} experts, d_model {args.d_model}: "
        f"{p_ne / 1e6:.2f}M non-expert + {p_e / 1e6:.2f}M expert parameters, state {mb:.1f} MB, "
        f"{len(jax.devices())} devices (data 2 x expert 4)"
    )
    print(f"{'content':>8}{'K':>4}{'predicted':>11}{'event bytes':>13}{'on disk':>9}{'MB':>8}")
    for content, k, pred, event, disk, size in rows:
        print(f"{content:>8}{k:>4}{pred:>11.3f}{event:>13.3f}{disk:>9.3f}{size / 1e6:>8.2f}")
    print(f"\nseconds per save (blocking) and per restore_latest, medians of {args.repeats}")
    base = statistics.median(blocking["full, sync"])
    base_restore = statistics.median(restoring["full, sync"][1:])
    print(f"{'':>16}{'save s':>10}{'/ full sync':>13}{'restore s':>11}{'/ full':>8}")
    for name, values in blocking.items():
        med, rest = statistics.median(values), statistics.median(restoring[name][1:])
        print(f"{name:>16}{med:>10.4f}{med / base:>13.3f}{rest:>11.4f}{rest / base_restore:>8.3f}")


if __name__ == "__main__":
    main()
