"""Tensor parallelism (issue 15 §1): what the compiled step exchanges, and its time.

For mesh.tensor = T on 8 devices (data = 8 / T, FSDP off, so the only collectives are the
gradient mean over 'data' and Megatron-LM's reductions over 'tensor'), the single-program train
step's collectives by kind, with the bytes of their results per device (read from the compiled
HLO), and its median step time against T = 1 in the same run. With the fused attention
projection's columns per head (`dynjax.model.attention.qkv_per_head`) and T dividing the
heads, a step holds only all-reduces: no all-to-all or collective permute moves columns between
the projection and the attention. On a CPU the fake devices share the cores, so the times show
what the partitioned program costs there, not a GPU's speed.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=. \\
        python benchmarks/tensor_parallel.py [--tensor 1,2,4,8] [--steps 15]
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import time

import jax

from dynjax.config import load_config
from dynjax.experiment import Experiment

COLLECTIVE = re.compile(
    r"^\s*(?:ROOT )?%\S+ = (.*?) "
    r"(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?\("
)
SHAPE = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")
BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "pred": 1, "s8": 1, "u8": 1}


def collectives(hlo: str) -> tuple[collections.Counter, collections.Counter]:
    """Per kind, the count and the bytes of the results (per device) in a compiled module."""
    count, size = collections.Counter(), collections.Counter()
    for line in hlo.splitlines():
        found = COLLECTIVE.search(line)
        if not found:
            continue
        kind = found.group(2)
        count[kind] += 1
        for dtype, dims in SHAPE.findall(found.group(1)):
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            size[kind] += n * BYTES.get(dtype, 4)
    return count, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/quickstart.py")
    parser.add_argument("--tensor", default="1,2,4,8")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per size")
    args = parser.parse_args()
    sizes = [int(t) for t in args.tensor.split(",")]
    devices = jax.device_count()
    print(f"device: {jax.devices()[0].device_kind} x{devices}, jax {jax.__version__}")
    rows = []
    for t in sizes:
        cfg = load_config(args.config, [
            f"mesh.tensor={t}", f"mesh.data={devices // t}", "parallel.fsdp=False",
        ])
        exp = Experiment.from_config(cfg)
        step = exp.lower_train_step(exp.initial_plan()).compile()
        count, size = collectives(step.as_text())
        state = exp.init_state()
        params, opt_state = state["params"], state["opt_state"]
        batch = exp.device_batch(exp.order.batch(0))
        times = []
        for i in range(3 + args.steps):  # 3 to warm up
            t0 = time.perf_counter()
            params, opt_state, _ = step(params, opt_state, batch)
            jax.block_until_ready(params)
            if i >= 3:
                times.append(time.perf_counter() - t0)
        rows.append((t, devices // t, count, size, statistics.median(times)))
        m = cfg.model
    print(f"{m.num_layers} layers, d_model {m.d_model}, {m.num_heads} heads, mlp {m.mlp_dim}, "
          f"batch {cfg.train.batch_size} x {cfg.data.seq_len}; median of {args.steps} steps")
    print(f"{'tensor':>6}{'data':>6}  {'collectives (count, MB per device)':<58}"
          f"{'step ms':>9}{'/ tensor 1':>12}")
    base = rows[0][4]
    for t, data, count, size, seconds in rows:
        listed = ", ".join(f"{k} {count[k]} ({size[k] / 1e6:.2f})" for k in sorted(count))
        print(f"{t:>6}{data:>6}  {listed:<58}{1e3 * seconds:>9.1f}{seconds / base:>12.2f}")


if __name__ == "__main__":
    main()
