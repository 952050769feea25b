"""Checkpoint layouts: layout 1 (the state gathered to host, one Orbax item per (MoE layer,
expert), host checksums) against layout 2 (`dynjax.checkpoint.layout`: three items, each
device's shards written as they are, checksums on device, restore into sharded targets).

For an MoE model with many layers x experts at small widths, on 8 fake CPU devices (data 2 x
expert 4): the items per checkpoint, the seconds of a complete (synchronous) save and of a
restore onto the mesh, and the peak growth of the process's resident memory during each (a
sampling thread, psutil, with glibc returning freed memory at once). On CPU the "devices" live
in host memory too, so this counts every copy either layout makes, and a restore's growth
includes the restored state itself. Medians of ``--repeats`` after a first save and restore of
each (compiles); ratios are layout 2 / layout 1.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=. \\
        python3 benchmarks/checkpoint.py [--layers 16 --experts 16 --d-model 64 --mlp-dim 128]
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import psutil

from dynjax.checkpoint import Checkpointer, layout
from dynjax.config import default_config
from dynjax.dynamism.moe.checkpoint import EXPERT_STACKS, expert_layer
from dynjax.experiment import Experiment


def save_layout1(directory: Path, step: int, state: Any) -> int:
    """Layout 1's save as it was (commit 15c1e43): the whole state to host, cut into one item
    per (MoE layer, expert) with Adler-32 checksums; returns the item count."""
    items: dict[str, dict[str, np.ndarray]] = {layout.DENSE: {}}
    for key, arr in layout.flatten(jax.device_get(state)).items():
        moe_layer = expert_layer(key)
        if moe_layer is None:
            items[layout.DENSE][key] = arr
            continue
        for e in range(arr.shape[0]):
            items.setdefault(f"expert_l{moe_layer}_e{e}", {})[key] = arr[e]
    sums = {n: {k: layout.v1_checksum(a) for k, a in item.items()} for n, item in items.items()}
    args = {n: ocp.args.StandardSave(layout.nest(item)) for n, item in items.items()}
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=True)
    with ocp.CheckpointManager(directory, options=options) as manager:
        # The state is today's model's, its attention columns already per head: said so, the
        # restore reads them as they are (a layout-1 checkpoint of its time would be reordered).
        meta = {"step": step, "checksums": sums, "qkv_columns": layout.QKV_COLUMNS}
        meta = ocp.args.JsonSave(meta)
        manager.save(step, args=ocp.args.Composite(**args, meta=meta))
    return len(items) + 1


def _libc() -> ctypes.CDLL | None:
    """glibc, told to give freed memory back to the system (large blocks mmapped, the heap top
    trimmed), so that resident-memory growth shows each operation's own allocations rather
    than what an earlier one left in the allocator; None elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: 64 KiB
    libc.mallopt(-1, 0)  # M_TRIM_THRESHOLD
    return libc


LIBC = _libc()


def measure(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """(seconds, peak resident-memory growth in MB, result) of ``fn()``."""
    gc.collect()
    if LIBC is not None:
        LIBC.malloc_trim(0)
    proc = psutil.Process()
    base, peak, done = proc.memory_info().rss, [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    result = jax.block_until_ready(fn())
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    return seconds, (max(peak[0], proc.memory_info().rss) - base) / 1e6, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--mlp-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cfg = default_config()
    m = cfg.model
    m.num_layers, m.d_model, m.mlp_dim = args.layers, args.d_model, args.mlp_dim
    cfg.moe.every, cfg.moe.num_experts = 1, args.experts
    cfg.mesh.data, cfg.mesh.expert = 2, 4
    exp = Experiment.from_config(cfg)
    state = exp.init_state()
    state = jax.tree.map(lambda a: a + 1 if a.dtype.kind == "f" else a, state)  # moments != 0
    mb = sum(a.nbytes for a in jax.tree.leaves(state)) / 1e6
    rows: dict[str, dict[str, list[float]]] = {"layout 1": {}, "layout 2": {}}

    def record(name: str, what: str, fn: Callable[..., Any], *fn_args: Any) -> None:
        seconds, grew, _ = measure(functools.partial(fn, *fn_args))
        rows[name].setdefault(f"{what} s", []).append(seconds)
        rows[name].setdefault(f"{what} MB", []).append(grew)

    def fresh() -> Any:
        """New arrays, as a training step makes (a jax.Array keeps the host copy that a first
        device_get made of it)."""
        return jax.block_until_ready(jax.tree.map(jnp.copy, state))

    def restore(ckpt: Checkpointer, step: int) -> Any:
        return ckpt.restore(step, exp.abstract_state)[0]

    with tempfile.TemporaryDirectory() as tmp:
        dirs = {"layout 1": Path(tmp) / "old", "layout 2": Path(tmp) / "new"}
        new = Checkpointer(
            dirs["layout 2"], stacks=EXPERT_STACKS, keep=args.repeats + 1, async_save=False
        )
        new.save(0, state, {})  # compiles the checksums
        save_layout1(dirs["layout 1"], 0, state)
        for step in range(1, args.repeats + 1):
            record("layout 1", "save", save_layout1, dirs["layout 1"], step, fresh())
            record("layout 2", "save", new.save, step, fresh(), {})
        new.close()
        readers = {
            n: Checkpointer(d, stacks=EXPERT_STACKS, keep=args.repeats + 1)
            for n, d in dirs.items()
        }
        for ckpt in readers.values():
            restore(ckpt, 0)  # compiles
        for step in range(1, args.repeats + 1):
            for name, ckpt in readers.items():
                record(name, "restore", restore, ckpt, step)
        items = {n: sum(p.is_dir() for p in (d / "1").iterdir()) for n, d in dirs.items()}
        for ckpt in readers.values():
            ckpt.close()
    print(
        f"\n{args.layers} MoE layers x {args.experts} experts, d_model {args.d_model}, mlp_dim "
        f"{args.mlp_dim}: state "
        f"{mb:.1f} MB on {len(jax.devices())} devices (data 2 x expert 4); medians of "
        f"{args.repeats}"
    )
    cols = ("save s", "save MB", "restore s", "restore MB")
    print(f"{'':>10}{'items':>7}" + "".join(f"{c:>12}" for c in cols))
    med = {n: {c: statistics.median(v) for c, v in r.items()} for n, r in rows.items()}
    for name in ("layout 1", "layout 2"):
        print(f"{name:>10}{items[name]:>7}" + "".join(f"{med[name][c]:>12.3f}" for c in cols))
    ratio = "".join(f"{med['layout 2'][c] / med['layout 1'][c]:>12.3f}" for c in cols)
    print(f"{'2 / 1':>10}{items['layout 2'] / items['layout 1']:>7.3f}{ratio}")


if __name__ == "__main__":
    main()
