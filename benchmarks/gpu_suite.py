"""The GPU path, run and measured: one script, section by section, for one H100/H200.

    PYTHONPATH=. python benchmarks/gpu_suite.py --out DIR [--only SECTION,...] [--tiny]

writes ``DIR/gpu_suite.json`` (``meta``: device kind, platform, jax/jaxlib/flax versions, ``tiny``;
``sections``: status, seconds and budget of each; ``records``: one per measurement, each with
the device kind, versions, dtype and shapes) and ``DIR/gpu_suite.md`` (a table per section),
both rewritten after every record, so a run cut short (``timeout``) still leaves what finished.
A section that raises is recorded (error type and message) and the next one runs. Each section
has a time budget (printed); past it, its remaining cases are recorded as skipped.
``benchmarks/run_gpu_suite.sh`` is the two-call split for a lent GPU machine.

``--tiny`` runs every section's code path at toy sizes on CPU (Pallas kernels interpreted):
what CI runs (tests/test_gpu_suite.py). Its numbers say nothing about speed; the .md opens with
a banner saying so and every record carries ``"tiny": true``. Runs that differ from another only
in their sizes or overrides are recorded as skipped there (`TINY_SKIPS`): a training subprocess
costs half a minute on 2 CPU cores, and the code path is the same.

Sections (timings are medians of several runs after a warm-up, blocking on the results):

- ``kernels``: each Pallas kernel compiled for the GPU (interpreted with ``--tiny``) against a
  float32 reference at highest matmul precision (``pallas_kernels.xla``'s dense computations),
  forward and gradients: block-sparse flash attention, hashed sparse attention, block-sparse
  SpMM, the block-pruned linear's Pallas path, and the ragged MoE path (``grouped_ffn`` through
  ``ragged_dot`` against its hand-tiled einsum). ``pass`` when the largest error relative to
  the reference's largest magnitude is within ``tol`` (tf32-level on GPU).
- ``attention``: causal attention forward+backward in bf16 at 4k/8k/16k tokens, head dim 64 and
  128: ``jax.nn.dot_product_attention`` (``cudnn``: skipped off GPU; ``xla``), the block-sparse
  kernel at 100/50/25/10% of the causal blocks and the hashed kernel at 8 and 16 buckets.
  ``tflops``: 14 * head_dim FLOPs (seven matmuls of forward + flash backward) per computed
  (query, key) pair (dense: the causal triangle; block-sparse: computed blocks x block^2) over
  the time; ``vs_cudnn``: cuDNN's time over this one's (> 1: faster than cuDNN dense).
- ``spmm``: ``block_pruned_matmul`` (both paths, ``pallas`` and ``xla``) against ``jnp.dot`` for
  MLP weights at block densities 50/25/10%, forward and forward+backward, bf16; and the Pallas
  path on columns of unequal density cut into 4 groups (``computed``: the blocks it computes
  over the dense ones), as pruning's sparse path runs it.
- ``moe``: one MoE layer forward+backward in bf16, top-2, capacity factor 1.25: the ragged path
  (``ragged_dot``), the static per-expert path and a dense one-hot (GShard einsum) dispatch of
  the same slots; ``tokamax.ragged_dot`` against ``jax.lax.ragged_dot`` where importable.
- ``train``: ``python -m dynjax.train`` subprocesses (the stable CLI, `run_train`: each run is
  stopped once its ``metrics.jsonl`` holds a few logged intervals after the warm-up one and
  after its last Plan swap; medians over those): tokens/s and the logged ``mfu``
  (``train.peak_flops`` from the device kind: 989e12 on H100/H200 in bf16; "n/a" elsewhere) for
  a GPT-2-small shape (byte vocabulary), the Llama family at its parameter count (RMSNorm,
  SwiGLU, grouped-query attention; ``vs_gpt``: its tokens/s over GPT's, benchmarks/families.py's
  pairing), a larger dense shape and an MoE of about the small one's active size; plus, in
  process, the single-program step's blocked time against the host's dispatch time (until the
  call returns), and each ``model.remat`` policy's step (``remat <policy>``: step ms, tokens/s,
  ``vs_none``, and the compiled step's ``peak_bytes`` and ``temp_bytes`` from
  ``memory_analysis()``; ``offload_proj`` skipped where the device's memory is host memory).
- ``schemes``: step time of each dynamic scheme against the same model without it, with the
  config overrides that put the model in that state quickly (each record lists them): frozen
  half, 90% block pruning on the sparse path, MoD at capacity 0.125, early exit on the buckets
  its run ends on, hashed sparse attention at 8k tokens (against dense at 8k); medians of the
  intervals after the run's last Plan swap (``reached``: the swap landed before the run's cap),
  and every swap's ``swap_stall_seconds`` from ``events.jsonl``.
- ``traces``: the same schemes (and MoE) on the pipeline runtime with one stage
  (``pipeline.stage_layers="(L,)"``) profiling per-layer forward/backward seconds every logged
  interval, in bfloat16 (`TRACE_DTYPE`), copied with ``dynmo_cases.record`` into
  ``DIR/traces/<case>.jsonl``: ``dynmo_cases.cases_with_traces(DIR / "traces")`` reads them as
  GPU rows (copy them to ``benchmarks/traces/`` to replace the CPU-recorded ones).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.metadata
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from families import configs as family_configs
from families import model_diff, param_count
from flax import nnx
from kernels import _timed, causal_block_mask, dpa_attention, hashed_ids
from sparse_matmul import _with_backward, balanced_block_mask, skewed_block_mask
from step_throughput import remat_rows

from dynjax.model import dense_attention
from dynjax.model.moe import MoE, RaggedCapacities, SlotLayout, assign_slots, grouped_ffn, route
from dynjax.model.sparse_linear import (
    block_mask_of,
    block_pruned_matmul,
    column_block_index,
    column_groups,
    group_blocks,
    group_widths,
)
from dynjax.writers import read_jsonl
from pallas_kernels import (
    BlockSparseMatrix,
    block_sparse_attention,
    block_sparse_matmul,
    hashed_block_sparse_attention,
    xla,
)
from pallas_kernels.backend import route as kernel_route
from pallas_kernels.block_index import range_blocks
from pallas_kernels.selector import random_block_mask
from pallas_kernels.timing import median_seconds

ROOT = Path(__file__).resolve().parent.parent
H100_BF16_PEAK = 989e12  # H100/H200 SXM dense bf16 FLOP/s (datasheet, without sparsity)
TINY_BANNER = ("**TINY RUN (--tiny): toy sizes on CPU, Pallas kernels interpreted. The numbers "
               "say nothing about speed; only that every code path runs.**")


@dataclasses.dataclass
class Env:
    """What every section reads: sizes by mode, where results go, the section's deadline."""

    tiny: bool
    out: Path
    repeats: int
    deadline: float = math.inf

    @property
    def on_gpu(self) -> bool:
        return jax.default_backend() == "gpu"

    @property
    def dtype(self):
        return jnp.bfloat16

    def time_left(self) -> bool:
        return time.perf_counter() < self.deadline


def versions() -> dict:
    device = jax.devices()[0]
    return {
        "device": device.device_kind,
        "platform": device.platform,
        "jax": jax.__version__,
        "jaxlib": importlib.metadata.version("jaxlib"),
        "flax": importlib.metadata.version("flax"),
    }


class Results:
    """``gpu_suite.json`` and ``gpu_suite.md`` under ``out``, rewritten after every record."""

    def __init__(self, out: Path, tiny: bool):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        self.meta = {**versions(), "tiny": tiny, "started": started}
        self.sections: dict[str, dict] = {}
        self.records: list[dict] = []
        path = out / "gpu_suite.json"
        if path.is_file():  # a second --only run into the same DIR adds to the first
            old = json.loads(path.read_text())
            self.sections, self.records = old["sections"], old["records"]

    def add(self, section: str, record: dict) -> None:
        common = {k: self.meta[k] for k in ("device", "platform", "jax", "jaxlib", "flax", "tiny")}
        self.records.append({"section": section, **record, **common})
        self.write()

    def section(self, name: str, **status) -> None:
        self.sections[name] = status
        self.write()

    def write(self) -> None:
        data = {"meta": self.meta, "sections": self.sections, "records": self.records}
        tmp = self.out / "gpu_suite.json.tmp"
        tmp.write_text(json.dumps(data, indent=1, default=str))
        tmp.replace(self.out / "gpu_suite.json")
        (self.out / "gpu_suite.md").write_text(self.markdown())

    def markdown(self) -> str:
        m = self.meta
        lines = ["# dynjax GPU suite", ""]
        if m["tiny"]:
            lines += [TINY_BANNER, ""]
        lines += [f"{m['device']} ({m['platform']}), jax {m['jax']}, jaxlib {m['jaxlib']}, "
                  f"flax {m['flax']}; started {m['started']}.", ""]
        common = {"section", "device", "platform", "jax", "jaxlib", "flax", "tiny"}
        for name, status in self.sections.items():
            lines += [f"## {name}", "", ", ".join(f"{k}: {v}" for k, v in status.items()), ""]
            rows = [{k: v for k, v in r.items() if k not in common}
                    for r in self.records if r["section"] == name]
            if rows:
                lines += [markdown_table(rows), ""]
        return "\n".join(lines)


def markdown_table(rows: list[dict]) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    cell = lambda v: ("" if v is None else f"{v:.4g}" if isinstance(v, float)  # noqa: E731
                      else str(v).replace("|", "/"))
    return "\n".join(["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys),
                      *("| " + " | ".join(cell(r.get(k)) for k in keys) + " |" for r in rows)])


def skipped(name: str, reason: str, **fields) -> dict:
    return {"name": name, "status": "skipped", "reason": reason, **fields}


def shape_str(*shapes) -> str:
    return " ".join("x".join(map(str, s)) for s in shapes)


# -- kernels ------------------------------------------------------------------------------------


def _rel_error(got, want) -> float:
    want = np.asarray(want, np.float64)
    scale = max(float(np.max(np.abs(want))), 1e-30)
    return float(np.max(np.abs(np.asarray(got, np.float64) - want))) / scale


def check(name: str, fn: Callable, ref: Callable, args: tuple, wrt: tuple[int, ...],
          tol: float, shapes: str, route: str | None = None) -> dict:
    """Forward and the gradients in ``wrt`` of ``fn`` against ``ref`` (highest precision); a
    kernel that fails to lower or run is recorded as an error and the next one is checked."""
    row = {"name": name, "route": route or kernel_route(None), "tol": tol, "dtype": "float32",
           "shapes": shapes}
    try:
        out = jax.jit(fn)(*args)
        cot = jax.random.normal(jax.random.key(7), out.shape, jnp.float32)
        loss = lambda f: lambda *a: jnp.sum(f(*a).astype(jnp.float32) * cot)  # noqa: E731
        grads = jax.jit(jax.grad(loss(fn), wrt))(*args)
        with jax.default_matmul_precision("highest"):
            want = jax.jit(ref)(*args)
            want_grads = jax.jit(jax.grad(loss(ref), wrt))(*args)
    except Exception as err:  # noqa: BLE001
        return {**row, "status": "error", "error": f"{type(err).__name__}: {err}"[:500]}
    fwd = _rel_error(out, want)
    bwd = max(_rel_error(g, w) for g, w in zip(grads, want_grads, strict=True))
    ok = fwd <= tol and bwd <= tol
    return {**row, "status": "pass" if ok else "fail", "fwd_rel_err": fwd, "grad_rel_err": bwd}


def kernels(env: Env) -> Iterator[dict]:
    seq, dim, block = (64, 16, 16) if env.tiny else (512, 64, 64)
    tol = 1e-4 if kernel_route(None) == "interpret" else 2e-2  # GPU: tf32-level dots
    keys = jax.random.split(jax.random.key(0), 6)
    shape = (1, 2, seq, dim)
    q, k, v = (jax.random.normal(key, shape, jnp.float32) for key in keys[:3])
    n, scale = seq // block, 1 / math.sqrt(dim)
    mask = jnp.asarray(causal_block_mask(n, 0.5))
    yield check(
        "block_sparse_attention",
        lambda q, k, v: block_sparse_attention(q, k, v, mask, block_size=block),
        lambda q, k, v: xla.masked_attention(q, k, v, mask, block_size=block, causal=True,
                                             scale=scale),
        (q, k, v), (0, 1, 2), tol, f"qkv {shape_str(shape)}, block {block}, 50% causal blocks")
    ids = tuple(map(jnp.asarray, hashed_ids(shape[:3], 4, seed=1)))
    yield check(
        "hashed_block_sparse_attention",
        lambda q, k, v: hashed_block_sparse_attention(q, k, v, *ids, block_size=block),
        lambda q, k, v: xla.hashed_attention(q, k, v, ids, scale=scale),
        (q, k, v), (0, 1, 2), tol, f"qkv {shape_str(shape)}, block {block}, 4 buckets")
    rows, d_in, d_out = (32, 64, 64) if env.tiny else (256, 512, 1024)
    x = jax.random.normal(keys[3], (rows, d_in), jnp.float32)
    dense = jax.random.normal(keys[4], (d_in, d_out), jnp.float32)
    w = BlockSparseMatrix.from_dense(dense, block, random_block_mask((d_in // block,
                                                                      d_out // block), 0.5))
    with_blocks = lambda blocks: dataclasses.replace(w, blocks=blocks)  # noqa: E731
    yield check(
        "block_sparse_matmul",
        lambda x, b: block_sparse_matmul(x, with_blocks(b)),
        lambda x, b: x @ with_blocks(b).to_dense(),
        (x, w.blocks), (0, 1), tol, f"x {rows}x{d_in}, w {d_in}x{d_out}, block {block}, 50%")
    index = jnp.asarray(column_block_index(balanced_block_mask(d_in // block, d_out // block,
                                                               0.25, seed=0)))
    present = jnp.kron(block_mask_of(index, d_in // block), jnp.ones((block, block)))
    yield check(
        "block_pruned_matmul (pallas path)",
        lambda x, w: block_pruned_matmul(x, w, index, block_size=block, impl="pallas"),
        lambda x, w: x @ (w * present),
        (x, dense), (0, 1), tol, f"x {rows}x{d_in}, w {d_in}x{d_out}, block {block}, 25%")
    experts, tiles, t, d, h = (4, 6, 8, 16, 32) if env.tiny else (8, 32, 64, 256, 512)
    # Every tile used: an unused one (expert E) is zero rows whose input gradient the tiled
    # reference computes against the last expert and ragged_dot leaves zero.
    expert = jnp.asarray(np.sort(np.random.default_rng(0).integers(0, experts, tiles)),
                         jnp.int32)
    buf = jax.random.normal(keys[5], (tiles, t, d), jnp.float32)
    wk = jax.random.split(jax.random.key(1))
    w_in = jax.random.normal(wk[0], (experts, d, h), jnp.float32) / math.sqrt(d)
    w_out = jax.random.normal(wk[1], (experts, h, d), jnp.float32) / math.sqrt(h)
    yield check(
        "ragged MoE (grouped_ffn, ragged_dot)",
        lambda b, wi, wo: grouped_ffn(b, expert, wi, wo, tiles=False),
        lambda b, wi, wo: grouped_ffn(b, expert, wi, wo, tiles=True),
        (buf, w_in, w_out), (0, 1, 2), tol,
        f"buf {tiles}x{t}x{d}, w_in {experts}x{d}x{h}, w_out {experts}x{h}x{d}",
        route="xla ragged_dot")


# -- attention ----------------------------------------------------------------------------------


def attention(env: Env) -> Iterator[dict]:
    seqs, dims, width, block = ((128, 256), (16, 32), 64, 32) if env.tiny else (
        (4096, 8192, 16384), (64, 128), 1024, 128)
    r = max(env.repeats // 2, 2)
    qkv = (0, 1, 2)
    sparse = functools.partial(block_sparse_attention, block_size=block)
    hashed = functools.partial(hashed_block_sparse_attention, block_size=block)
    timers = {
        "dpa cudnn": _timed(functools.partial(dpa_attention, implementation="cudnn"), True, r, qkv),
        "dpa xla": _timed(functools.partial(dpa_attention, implementation="xla"), True, r, qkv),
        "block-sparse": _timed(sparse, True, r, qkv),
        "hashed": _timed(hashed, True, r, qkv),
    }
    for seq in seqs:  # the longest last: the first skipped when the budget runs out
        for dim in dims:
            heads = width // dim  # one layer's heads at a fixed width
            shape = (1, heads, seq, dim)
            keys = jax.random.split(jax.random.key(seq + dim), 3)
            q, k, v = (jax.random.normal(key, shape, env.dtype) for key in keys)
            n = seq // block
            causal_pairs = n * (n + 1) // 2 * block * block
            base = {"dtype": "bfloat16", "shapes": f"qkv {shape_str(shape)} (b, h, s, d)",
                    "seq": seq, "head_dim": dim, "pass": "fwd+bwd"}
            cudnn_s = None
            cases = [("dpa cudnn", "dense causal", causal_pairs, (q, k, v)),
                     ("dpa xla", "dense causal", causal_pairs, (q, k, v))]
            for density in (1.0, 0.5, 0.25, 0.1):
                mask = causal_block_mask(n, density, seed=seq)
                cases.append(("block-sparse", f"{density:.0%} of causal blocks",
                              int(mask.sum()) * block * block, (q, k, v, jnp.asarray(mask))))
            for buckets in (8, 16):
                ids = hashed_ids(shape[:3], buckets, seed=seq)
                need = np.asarray(range_blocks(ids[1], ids[0], ids[3], ids[2], block))
                cases.append(("hashed", f"{buckets} buckets",
                              int(need.sum()) * block * block,
                              (q, k, v, *map(jnp.asarray, ids))))
            for kernel, what, pairs, args in cases:
                row = {"name": kernel, "blocks": what, **base,
                       "computed_pairs_frac": pairs / (heads * causal_pairs)
                       if kernel == "hashed" else pairs / causal_pairs}
                if kernel == "dpa cudnn" and not env.on_gpu:
                    yield skipped(kernel, "cuDNN attention needs a GPU", **base)
                    continue
                if not env.time_left():
                    yield skipped(kernel, "section budget spent", **row)
                    continue
                try:  # e.g. out of memory: the other cases still run
                    seconds = timers[kernel](*args)
                except Exception as err:  # noqa: BLE001
                    yield {**row, "status": "error", "error": f"{type(err).__name__}: {err}"[:300]}
                    continue
                total_pairs = pairs if kernel == "hashed" else pairs * heads
                cudnn_s = seconds if kernel == "dpa cudnn" else cudnn_s
                yield {**row, "status": "ok", "ms": 1e3 * seconds,
                       "tflops": 14 * dim * total_pairs / seconds / 1e12,
                       "vs_cudnn": cudnn_s / seconds if cudnn_s else None}


# -- spmm ---------------------------------------------------------------------------------------


def time_matmul(matmul: Callable, *, backward: bool, args: tuple, repeats: int) -> float:
    """Median seconds of ``matmul(x, w)``, or with ``backward`` of one forward and backward
    against the cotangent ``g`` (``args = (x, w, g)``)."""
    if backward:
        return median_seconds(jax.jit(_with_backward(matmul)), *args, repeats=repeats)
    return median_seconds(jax.jit(matmul), *args[:2], repeats=repeats)


def spmm(env: Env) -> Iterator[dict]:
    tokens, weights, block, densities = (64, ((64, 128),), 16, (0.25,)) if env.tiny else (
        8192, ((4096, 16384), (2048, 8192)), 128, (0.5, 0.25, 0.1))
    r = env.repeats
    for d_in, d_out in weights:
        keys = jax.random.split(jax.random.key(d_in + d_out), 3)
        x = jax.random.normal(keys[0], (tokens, d_in), env.dtype)
        w = jax.random.normal(keys[1], (d_in, d_out), env.dtype)
        g = jax.random.normal(keys[2], (tokens, d_out), env.dtype)
        base = {"dtype": "bfloat16", "shapes": f"x {tokens}x{d_in} @ w {d_in}x{d_out}",
                "block": block}
        for backward in (False, True):
            how = "fwd+bwd" if backward else "fwd"
            run = functools.partial(time_matmul, backward=backward, args=(x, w, g), repeats=r)
            dense_s = run(jnp.dot)
            yield {"name": "dense jnp.dot", **base, "pass": how, "status": "ok",
                   "ms": 1e3 * dense_s}
            for density in densities:
                mask = balanced_block_mask(d_in // block, d_out // block, density, seed=d_out)
                index = jnp.asarray(column_block_index(mask))
                for impl in ("pallas", "xla"):
                    row = {"name": f"block_pruned_matmul {impl}", **base, "pass": how,
                           "density": density, "K": f"{index.shape[1]}/{d_in // block}"}
                    if not env.time_left():
                        yield skipped(row.pop("name"), "section budget spent", **row)
                        continue
                    fn = functools.partial(block_pruned_matmul, index=index, block_size=block,
                                           impl=impl)
                    seconds = run(lambda x, w, fn=fn: fn(x, w))
                    yield {**row, "status": "ok", "ms": 1e3 * seconds,
                           "vs_dense": dense_s / seconds}
            yield from _skewed_spmm(env, run, base, how, dense_s, d_in, d_out, block, densities)


def _skewed_spmm(env: Env, run, base: dict, how: str, dense_s: float, d_in: int, d_out: int,
                 block: int, densities: tuple[float, ...]) -> Iterator[dict]:
    """The Pallas path on columns of unequal density (as a global ranking leaves them) at the
    lowest density, its columns cut into 4 groups as pruning's policy cuts them."""
    density = min(densities)
    mask = skewed_block_mask(d_in // block, d_out // block, density, seed=d_out)
    widths = group_widths(mask.sum(axis=0), 4)
    row = {"name": "block_pruned_matmul pallas, skewed columns in 4 groups", **base, "pass": how,
           "density": round(float(mask.mean()), 3),
           "computed": round(group_blocks(widths) / mask.size, 3)}
    if not env.time_left():
        yield skipped(row.pop("name"), "section budget spent", **row)
        return
    fn = functools.partial(block_pruned_matmul, index=column_groups(mask, widths),
                           block_size=block, impl="pallas")
    seconds = run(lambda x, w: fn(x, w))
    yield {**row, "status": "ok", "ms": 1e3 * seconds, "vs_dense": dense_s / seconds}


# -- moe ----------------------------------------------------------------------------------------


def onehot_moe(layer: MoE, x: jax.Array, capacity: int) -> jax.Array:
    """GShard's dense dispatch: one-hot dispatch and combine tensors over every slot, einsums
    in and out; the same (token, choice) pairs and slots as the static path."""
    num, k = layer.w_in.shape[0], layer.top_k
    logits = x.astype(jnp.float32) @ layer.router[...].astype(jnp.float32)
    _, gates, experts, _ = route(logits, k)
    layout = SlotLayout((capacity,) * num)
    slot, kept, _ = assign_slots(experts, layout)
    onehot = jax.nn.one_hot(slot, layout.total + 1, dtype=x.dtype)[..., :-1]  # [G, S, k, T]
    dispatch = jnp.sum(onehot, axis=2)
    combine = jnp.einsum("gskt,gsk->gst", onehot, jnp.where(kept, gates, 0.0).astype(x.dtype))
    g, _, d = x.shape
    rows = jnp.einsum("gst,gsd->gtd", dispatch, x).reshape(g, num, capacity, d)
    w_in, w_out = layer.w_in[...].astype(x.dtype), layer.w_out[...].astype(x.dtype)
    h = jax.nn.gelu(jnp.einsum("gecd,edh->gech", rows, w_in))
    out = jnp.einsum("gech,ehd->gecd", h, w_out).reshape(g, num * capacity, d)
    return jnp.einsum("gst,gtd->gsd", combine, out)


def moe(env: Env) -> Iterator[dict]:
    groups, seq, d, h, counts = (2, 32, 16, 32, (4,)) if env.tiny else (
        8, 1024, 1024, 2048, (8, 64))
    for num in counts:
        yield from moe_paths(env, groups, seq, d, h, num, top_k=2)
        yield from tokamax_ragged_dot(env, groups * seq * 2, d, h, num)


def moe_paths(env: Env, groups: int, seq: int, d: int, h: int, num: int,
              top_k: int) -> Iterator[dict]:
    """One MoE layer's three dispatch paths at capacity factor 1.25, forward+backward."""
    capacity = math.ceil(1.25 * seq * top_k / num)
    graphdef, params = nnx.split(MoE(d, h, num, top_k, out_std=0.02, rngs=nnx.Rngs(0)))
    x = jax.random.normal(jax.random.key(num), (groups, seq, d), env.dtype)
    ragged = RaggedCapacities(jnp.full((num,), capacity, jnp.int32),
                              min(num * capacity, seq * top_k))
    paths = {
        "static (per expert)": lambda m, x: m(x, capacities=(capacity,) * num)[0],
        "ragged (ragged_dot)": lambda m, x: m(x, capacities=ragged)[0],
        "one-hot dispatch": lambda m, x: onehot_moe(m, x, capacity),
    }
    base = {"dtype": "bfloat16", "experts": num, "top_k": top_k, "capacity": capacity,
            "shapes": f"x {groups}x{seq}x{d}, experts {num}x({d}x{h}, {h}x{d})"}
    static_out, static_s = None, None
    for name, path in paths.items():
        if not env.time_left():
            yield skipped(name, "section budget spent", **base)
            continue
        fn = functools.partial(lambda p, x, path: path(nnx.merge(graphdef, p), x), path=path)
        out = np.asarray(jax.jit(fn)(params, x), np.float32)
        loss = functools.partial(lambda p, x, fn: jnp.sum(fn(p, x).astype(jnp.float32)), fn=fn)
        seconds = median_seconds(jax.jit(jax.grad(loss, (0, 1))), params, x, repeats=env.repeats)
        if static_out is None:
            static_out, static_s = out, seconds
        yield {"name": name, **base, "pass": "fwd+bwd", "status": "ok", "ms": 1e3 * seconds,
               "vs_static": static_s / seconds,
               "max_abs_diff_vs_static": float(np.max(np.abs(out - static_out)))}


def tokamax_ragged_dot(env: Env, rows: int, d: int, h: int, num: int) -> Iterator[dict]:
    """``tokamax.ragged_dot`` against ``jax.lax.ragged_dot`` on evenly split groups."""
    base = {"experts": num, "dtype": "bfloat16", "shapes": f"lhs {rows}x{d}, rhs {num}x{d}x{h}"}
    try:
        import tokamax
    except ImportError as err:
        yield skipped("tokamax.ragged_dot", f"not importable ({err}); needs jax >= 0.11", **base)
        return
    keys = jax.random.split(jax.random.key(3))
    lhs = jax.random.normal(keys[0], (rows, d), env.dtype)
    rhs = jax.random.normal(keys[1], (num, d, h), env.dtype)
    sizes = jnp.full((num,), rows // num, jnp.int32).at[-1].add(rows % num)
    lax_s = median_seconds(jax.jit(jax.lax.ragged_dot), lhs, rhs, sizes, repeats=env.repeats)
    tok_s = median_seconds(jax.jit(tokamax.ragged_dot), lhs, rhs, sizes, repeats=env.repeats)
    yield {"name": "tokamax.ragged_dot", **base, "status": "ok", "ms": 1e3 * tok_s,
           "lax_ragged_dot_ms": 1e3 * lax_s, "vs_lax": lax_s / tok_s}


# -- training runs (subprocesses of the stable CLI) --------------------------------------------


def peak_overrides(env: Env) -> list[str]:
    """``train.peak_flops`` for MFU: the H100/H200 SXM bf16 dense peak; elsewhere none, so
    dynjax's own table decides (PCIe/NVL parts: their lower peaks; CPU: no MFU, "n/a")."""
    kind = jax.devices()[0].device_kind.lower()
    sxm = ("h100" in kind or "h200" in kind) and not ("pcie" in kind or "nvl" in kind)
    return [f"train.peak_flops={H100_BF16_PEAK}"] if sxm else []


@dataclasses.dataclass(frozen=True)
class Progress:
    """A run's logs so far: its Plan swaps and its timed intervals after the warm-up one."""

    events: list[dict]
    metrics: list[dict]
    log_every: int

    @classmethod
    def read(cls, workdir: Path, log_every: int) -> Progress:
        logs = [read_jsonl(workdir / f) if (workdir / f).is_file() else []
                for f in ("events.jsonl", "metrics.jsonl")]
        return cls(*logs, log_every)

    @property
    def swaps(self) -> list[dict]:
        return [e for e in self.events if e["event"] == "recompile"]

    @property
    def last_swap(self) -> int:
        return max((e["swap_step"] for e in self.swaps), default=0)

    @property
    def settled(self) -> list[dict]:
        """Timed intervals after the first (dispatch warm-up) and wholly after the last swap."""
        timed = [m for m in self.metrics if "tokens_per_sec" in m][1:]
        return [m for m in timed if m["step"] - self.log_every >= self.last_swap]

    def enough(self, swaps: int, intervals: int) -> bool:
        return len(self.swaps) >= swaps and len(self.settled) >= intervals


def run_train(env: Env, name: str, overrides: list[str], *, log_every: int, intervals: int,
              swaps: int = 0, dtype: str = "bfloat16", keep_workdir: bool = False) -> dict:
    """One ``python -m dynjax.train`` run, stopped once its logs hold ``swaps`` Plan swaps and
    then ``intervals`` logged intervals (or after ``cap_s`` seconds, or at the section's
    deadline): a run measured in its final state whatever its background compiles take, and
    with no final eval or checkpoint. Medians are over those intervals. Its temporary workdir
    is removed once read, unless ``keep_workdir`` (then the caller removes ``workdir``); a
    failed run's stays, with its ``stderr.txt``."""
    cap_s = 60.0 if env.tiny else 90.0  # tiny: 2 loaded CPU cores, a swap and an interval
    workdir = Path(tempfile.mkdtemp(prefix=f"gpu_suite_{name.replace(' ', '_')}_"))
    never = 10**7  # steps: the run is stopped from here
    overrides = [f"train.steps={never}", f"train.log_every={log_every}",
                 f"train.eval_every={never}", f"train.checkpoint_every={never}",
                 f"train.dtype={dtype}", *peak_overrides(env), *overrides]
    command = [sys.executable, "-m", "dynjax.train", "--config", "configs/quickstart.py",
               "--workdir", str(workdir), *(f"--config.{o}" for o in overrides)]
    env_vars = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(ROOT), os.environ.get("PYTHONPATH", "")]))}
    start = time.perf_counter()
    stop = min(start + cap_s, max(env.deadline, start + 30))
    with open(workdir / "stderr.txt", "w") as err:
        proc = subprocess.Popen(command, cwd=ROOT, env=env_vars, stdout=subprocess.DEVNULL,
                                stderr=err)
        while proc.poll() is None and time.perf_counter() < stop:
            time.sleep(0.5)
            if Progress.read(workdir, log_every).enough(swaps, intervals):
                break
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        elif proc.returncode:
            lines = [x for x in (workdir / "stderr.txt").read_text().splitlines()
                     if x.strip() and "JAX_TRACEBACK" not in x]
            raise RuntimeError(f"{name}: dynjax.train exited {proc.returncode}: "
                               + " / ".join(lines[-2:]))
    wall = time.perf_counter() - start
    for log in workdir.glob("*.jsonl"):  # a line torn by the kill: dropped
        log.write_text("".join(json.dumps(r) + "\n" for r in read_jsonl(log)))
    run = Progress.read(workdir, log_every)
    settled = run.settled
    if not settled:
        raise RuntimeError(f"{name}: no timed interval after {len(run.swaps)} swaps in "
                           f"{wall:.0f} s (cap {cap_s:.0f} s)")
    median = lambda key: (statistics.median(m[key] for m in settled)  # noqa: E731
                          if key in settled[0] else None)
    compile_event = next(e for e in run.events if e["event"] == "compile")
    if not keep_workdir:
        shutil.rmtree(workdir)
    return {
        "workdir": workdir if keep_workdir else None, "command": " ".join(command[1:]),
        "wall_s": wall,
        "tokens_per_sec": median("tokens_per_sec"), "mfu": median("mfu"),
        "final_loss": settled[-1].get("loss"), "intervals": len(settled),
        "reached": run.enough(swaps, intervals), "last_swap_step": run.last_swap,
        "compile_s": compile_event["lower_seconds"] + compile_event["compile_seconds"],
        "swaps": len(run.swaps),
        "swap_stall_s": [round(e["swap_stall_seconds"], 4) for e in run.swaps],
        "swap_compile_s": [round(e["lower_seconds"] + e["compile_seconds"], 2)
                           for e in run.swaps],
        "final_plan": (run.swaps[-1] if run.swaps else compile_event)["plan"],
    }


LLAMA_RUN = "Llama family, GPT-2 small's parameters"
# The runs a tiny run records as skipped: the same code path as a run it keeps (the large
# dense shape is the small one's path; traces: freezing swaps and MoE does not, as the others).
TINY_SKIPS = {"large dense", "trace pruning", "trace MoD", "trace early exit",
              "trace sparse attention"}


def skip_reason(env: Env, name: str) -> str | None:
    """Why the run ``name`` is recorded as skipped (its section's budget is spent, or a tiny run
    keeps another of its code path), or None: it runs."""
    if not env.time_left():
        return "section budget spent"
    if env.tiny and name in TINY_SKIPS:
        return "tiny: the same code path as a run kept (TINY_SKIPS)"
    return None


def model_overrides(layers: int, d_model: int, heads: int, seq: int, batch: int) -> list[str]:
    return [f"model.num_layers={layers}", f"model.d_model={d_model}", f"model.num_heads={heads}",
            f"model.mlp_dim={4 * d_model}", f"data.seq_len={seq}", f"train.batch_size={batch}",
            f"data.max_tokens={max(400_000, 40 * seq * batch)}"]


def shape_of(layers: int, d_model: int, heads: int, seq: int, batch: int) -> str:
    return f"L{layers} d{d_model} h{heads} mlp{4 * d_model} seq{seq} batch{batch} vocab256"


def train(env: Env) -> Iterator[dict]:
    if env.tiny:
        shapes = {"GPT-2 small shape": (2, 64, 4, 64, 4), "large dense": (3, 64, 4, 128, 2)}
        intervals, log_every, expert_mlp = 3, 2, 128
    else:
        shapes = {"GPT-2 small shape": (12, 768, 12, 1024, 16),
                  "large dense": (24, 2048, 16, 2048, 2)}
        intervals, log_every, expert_mlp = 5, 5, 1536
    small = shapes["GPT-2 small shape"]
    runs = {"GPT-2 small shape": model_overrides(*small)}
    # Llama's block at GPT-2 small's parameter count (benchmarks/families.py's pairing)
    pair = family_configs(str(ROOT / "configs/quickstart.py"), str(ROOT / "configs/llama_tiny.py"),
                          model_overrides(*small))
    params = {LLAMA_RUN: param_count(pair["llama"]), "GPT-2 small shape": param_count(pair["gpt"])}
    runs[LLAMA_RUN] = [*model_overrides(*small), *model_diff(pair["gpt"], pair["llama"])]
    runs["large dense"] = model_overrides(*shapes["large dense"])
    runs["MoE, top-2 of 8 every other layer"] = [
        *model_overrides(*small), "moe.every=2", "moe.num_experts=8", "moe.top_k=2",
        f"moe.expert_mlp_dim={expert_mlp}"]
    measured: dict[str, float] = {}
    for name, overrides in runs.items():
        shape = shape_of(*shapes.get(name, small))
        if name.startswith("MoE"):
            shape += f", 8 experts x mlp{expert_mlp}, top-2, every 2nd layer"
        if name == LLAMA_RUN:
            m = pair["llama"].model
            shape += f", llama: kv heads {m.num_kv_heads}, SwiGLU mlp{m.mlp_dim}"
        if reason := skip_reason(env, name):
            yield skipped(name, reason, shapes=shape)
            continue
        run = run_train(env, name, overrides, log_every=log_every, intervals=intervals)
        measured[name] = run["tokens_per_sec"]
        _, d_model, heads, _, _ = shapes.get(name, small)
        record = {"name": name, "status": "ok", "dtype": "bfloat16", "shapes": shape,
                  # the run's dense attention: cuDNN's flash kernel or the einsums
                  "attention": dense_attention.route(jnp.bfloat16, d_model // heads),
                  "tokens_per_sec": run["tokens_per_sec"],
                  "mfu": run["mfu"] if run["mfu"] is not None else "n/a",
                  "compile_s": run["compile_s"], "final_loss": run["final_loss"],
                  "intervals": run["intervals"], "wall_s": run["wall_s"],
                  "overrides": " ".join(overrides)}
        if name in params:
            record["params"] = params[name]
        if name == LLAMA_RUN and "GPT-2 small shape" in measured:
            record["vs_gpt"] = run["tokens_per_sec"] / measured["GPT-2 small shape"]
        yield record
    if env.time_left():
        yield dispatch_vs_device(env, small, steps=6 if env.tiny else 20)
    yield from remat_policies(env, small)


def remat_policies(env: Env, shape: tuple) -> Iterator[dict]:
    """Each `model.remat` policy on the small shape's single-program step, every layer scanned
    (the tiny shape's too), in bf16 (step_throughput.py's `remat_rows`: step ms, tokens/s, its
    ratio to "none", and the compiled step's peak and temporary bytes from
    ``memory_analysis()``)."""
    from dynjax.config import load_config
    from dynjax.experiment import Experiment

    if not env.time_left():
        yield skipped("remat policies", "section budget spent", shapes=shape_of(*shape))
        return
    cfg = load_config(ROOT / "configs/quickstart.py", [
        *model_overrides(*shape), "train.dtype=bfloat16", "model.scan_layers=True",
        "model.scan_min_layers=2", "data.prefetch=0",
    ])
    rows = remat_rows(Experiment.from_config(cfg), steps=3 if env.tiny else 10, rounds=3)
    for row in rows:
        yield {"name": f"remat {row.pop('remat')}", "dtype": "bfloat16",
               "shapes": shape_of(*shape) + ", scanned", **row}


def dispatch_vs_device(env: Env, shape: tuple, steps: int) -> dict:
    """The single-program step in process: the host's dispatch (until the call returns) against
    the step blocked on, and steps dispatched back to back (the device's pace when it is the
    bottleneck)."""
    from dynjax.config import load_config
    from dynjax.experiment import Experiment

    cfg = load_config(ROOT / "configs/quickstart.py",
                      [*model_overrides(*shape), "train.dtype=bfloat16", "data.prefetch=0"])
    exp = Experiment.from_config(cfg)
    plan = exp.initial_plan()
    fn = exp.lower_train_step(plan).compile()
    state = exp.init_state()
    batches = [exp.device_batch(exp.order.batch(t), plan=plan) for t in range(steps)]
    params, opt = state["params"], state["opt_state"]
    params, opt, m = fn(params, opt, batches[0])  # warm up
    jax.block_until_ready(m)
    dispatch, blocked = [], []
    for b in batches:
        t0 = time.perf_counter()
        params, opt, m = fn(params, opt, b)
        t1 = time.perf_counter()
        jax.block_until_ready(m)
        dispatch.append(t1 - t0)
        blocked.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for b in batches:
        params, opt, m = fn(params, opt, b)
    jax.block_until_ready(m)
    pipelined = (time.perf_counter() - t0) / steps
    return {"name": "dispatch vs device", "status": "ok", "dtype": "bfloat16",
            "shapes": shape_of(*shape), "dispatch_ms": 1e3 * statistics.median(dispatch),
            "blocked_step_ms": 1e3 * statistics.median(blocked),
            "back_to_back_step_ms": 1e3 * pipelined,
            "dispatch_share": statistics.median(dispatch) / statistics.median(blocked)}


# -- schemes and traces -------------------------------------------------------------------------


def scheme_setting(env: Env) -> dict:
    """The shape the schemes run at and each scheme's overrides, both modes."""
    if env.tiny:
        shape, long_seq, block, intervals, log_every = (4, 64, 4, 64, 4), 256, 16, 3, 2
        # one column group: the grouped loops' compile (the swap) outlasts a tiny run's cap
        every, window, attn_block, column_groups = 2, 3, 16, 1
    else:
        shape, long_seq, block, intervals, log_every = (8, 768, 12, 1024, 8), 8192, 128, 5, 10
        every, window, attn_block, column_groups = 5, 5, 64, 4
    layers = shape[0]
    schemes = {
        "none": [],
        "freezing, half the layers": [
            "freezing.enabled=True", "freezing.start_step=1", f"freezing.every={every}",
            "freezing.percentile=100.0", "freezing.max_fraction=0.5"],
        "pruning 90%, block-sparse path": [
            "pruning.enabled=True", "pruning.granularity=block", f"pruning.block_size={block}",
            "pruning.initial_sparsity=0.9", "pruning.final_sparsity=0.9",
            "pruning.start_step=1", "pruning.steps=1", "pruning.every=1",
            "pruning.sparse_below=0.5", "pruning.scale=init",
            f"pruning.column_groups={column_groups}"],
        "MoD, capacity 0.125": ["mod.enabled=True", "mod.capacity=0.125"],
        "early exit, final buckets": [
            "early_exit.enabled=True", "early_exit.start_step=1", "early_exit.threshold=0.4",
            f"early_exit.window={window}"],
    }
    attn = "pallas" if env.on_gpu else "xla"
    long = {
        "none, long sequence": [],
        f"sparse attention, 8 buckets, {attn} kernel": [
            "sparse_attention.enabled=True", f"sparse_attention.kernel={attn}",
            f"sparse_attention.window={window}", f"sparse_attention.block={attn_block}"],
    }
    return {"shape": shape, "long": (layers, shape[1], shape[2], long_seq, 1),
            "intervals": intervals,
            "log_every": log_every, "schemes": schemes, "long_schemes": long,
            "attn_block": attn_block}


# The schemes whose state arrives with a Plan swap (a policy's proposal, compiled in the
# background): measured after it lands ("reached" says whether it did before the run's cap).
SWAPPING = ("freezing, half the layers", "pruning 90%, block-sparse path",
            "early exit, final buckets")


def schemes(env: Env) -> Iterator[dict]:
    s = scheme_setting(env)
    groups = [(s["shape"], s["schemes"]), (s["long"], s["long_schemes"])]
    stalls = []
    for shape, group in groups:
        baseline = None
        for name, overrides in group.items():
            if reason := skip_reason(env, name):
                yield skipped(name, reason, shapes=shape_of(*shape))
                continue
            run = run_train(env, name, [*model_overrides(*shape), *overrides],
                            log_every=s["log_every"], intervals=s["intervals"],
                            swaps=int(name in SWAPPING))
            rate = run["tokens_per_sec"]
            baseline = rate if baseline is None else baseline
            stalls += run["swap_stall_s"]
            plan = run["final_plan"]
            yield {"name": name, "status": "ok", "dtype": "bfloat16", "shapes": shape_of(*shape),
                   "step_ms": 1e3 * shape[3] * shape[4] / rate if rate else None,
                   "tokens_per_sec": rate, "vs_without": rate / baseline if rate else None,
                   "swaps": run["swaps"], "last_swap_step": run["last_swap_step"],
                   "intervals": run["intervals"], "reached": run["reached"],
                   "swap_stall_s": run["swap_stall_s"],
                   "swap_compile_s": run["swap_compile_s"],
                   "final_state": final_state(plan), "overrides": " ".join(overrides)}
    name = "background recompile swap stall"
    if not stalls:
        yield skipped(name, "no background compile landed within the runs' steps")
        return
    yield {"name": name, "status": "ok", "swaps": len(stalls),
           "median_stall_s": statistics.median(stalls), "max_stall_s": max(stalls)}


def final_state(plan: dict) -> str:
    """What of a Plan the schemes change, compactly (frozen layers, parts' settings)."""
    keep = {k: v for k, v in plan.items() if k in ("frozen_layers", "parts") and v}
    return json.dumps(keep, separators=(",", ":"))[:300]


# Traces time the layers in the dtype GPU runs train in.
TRACE_DTYPE = "bfloat16"
TRACE_CASES = {
    "freezing": "freezing, half the layers",
    "pruning": "pruning 90%, block-sparse path",
    "MoD": "MoD, capacity 0.125",
    "early exit": "early exit, final buckets",
    "sparse attention": None,
    "MoE": None,
}


def traces(env: Env) -> Iterator[dict]:
    from dynmo_cases import record

    s = scheme_setting(env)
    shape, layers = s["shape"], s["shape"][0]
    extra = {
        "sparse attention": ["sparse_attention.enabled=True",
                             f"sparse_attention.kernel={'pallas' if env.on_gpu else 'xla'}",
                             f"sparse_attention.block={s['attn_block']}"],
        "MoE": ["moe.every=2", "moe.num_experts=8", "moe.top_k=2",
                f"moe.expert_mlp_dim={2 * shape[1]}"],
    }
    out = env.out / "traces"
    for case, scheme in TRACE_CASES.items():
        overrides = [*model_overrides(*shape), *(s["schemes"][scheme] if scheme else extra[case]),
                     f"pipeline.stage_layers=({layers},)",
                     f"pipeline.profile_every={s['log_every']}"]
        if reason := skip_reason(env, f"trace {case}"):
            yield skipped(case, reason, shapes=shape_of(*shape))
            continue
        run = run_train(env, f"trace {case}", overrides, log_every=s["log_every"],
                        intervals=s["intervals"], swaps=int(scheme in SWAPPING),
                        dtype=TRACE_DTYPE, keep_workdir=True)
        path = out / f"{case.replace(' ', '_')}.jsonl"
        record(run["workdir"], path, case, f"1x {jax.devices()[0].device_kind}",
               command=run["command"], note="gpu_suite" + (" --tiny" if env.tiny else ""))
        shutil.rmtree(run["workdir"])
        samples = [json.loads(line) for line in path.read_text().splitlines()[1:]]
        fwd = np.median([x["layer_forward_seconds"] for x in samples], axis=0)
        bwd = np.median([x["layer_backward_seconds"] for x in samples], axis=0)
        yield {"name": case, "status": "ok", "dtype": TRACE_DTYPE, "shapes": shape_of(*shape),
               "trace": str(path.relative_to(env.out)), "samples": len(samples),
               "swaps": run["swaps"], "reached": run["reached"],
               "median_layer_fwd_ms": [round(1e3 * float(x), 3) for x in fwd],
               "median_layer_bwd_ms": [round(1e3 * float(x), 3) for x in bwd],
               "overrides": " ".join(overrides)}


# -- the driver ---------------------------------------------------------------------------------

# name -> (function, budget seconds on one H100; the full suite's sum stays within 8 minutes,
# issue 29: a section past its budget records its remaining cases as skipped)
SECTIONS: dict[str, tuple[Callable[[Env], Iterator[dict]], float]] = {
    "kernels": (kernels, 25),
    "attention": (attention, 50),
    "spmm": (spmm, 40),
    "moe": (moe, 35),
    "train": (train, 150),
    "schemes": (schemes, 110),
    "traces": (traces, 70),
}


def run_section(name: str, env: Env, results: Results) -> None:
    fn, budget = SECTIONS[name]
    budget = budget * (4 if env.tiny else 1)  # interpreted kernels, 2 shared CPU cores
    print(f"[gpu_suite] {name}: budget {budget:.0f} s", flush=True)
    start = time.perf_counter()
    env.deadline = start + budget
    results.records = [r for r in results.records if r["section"] != name]  # a rerun replaces
    count, status = 0, {"status": "running", "budget_s": budget}
    results.section(name, **status)
    try:
        for record in fn(env):
            count += 1
            results.add(name, record)
            print(f"[gpu_suite] {name} {time.perf_counter() - start:6.1f}s "
                  f"{record.get('name')}: {record.get('status')}", flush=True)
        status["status"] = "done"
    except Exception as err:  # noqa: BLE001 - record it and go on to the next section
        status.update(status="error", error=f"{type(err).__name__}: {err}"[:2000])
        traceback.print_exc()
    status.update(seconds=round(time.perf_counter() - start, 1), records=count)
    results.section(name, **status)
    over = " (over budget)" if status["seconds"] > budget else ""
    print(f"[gpu_suite] {name}: {status['status']} in {status['seconds']} s{over}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the results")
    parser.add_argument("--only", default="", help=f"comma-separated, of {','.join(SECTIONS)}")
    parser.add_argument("--tiny", action="store_true", help="toy sizes on CPU (CI)")
    args = parser.parse_args(argv)
    only = [s for s in args.only.split(",") if s] or list(SECTIONS)
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {list(SECTIONS)}")
    # Before JAX starts its backend: this process and the dynjax.train runs it starts share the
    # GPU, so neither takes 75% of its memory up front (JAX's default); both grow on demand.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env = Env(tiny=args.tiny, out=args.out, repeats=2 if args.tiny else 10)
    results = Results(args.out, args.tiny)
    m = results.meta
    print(f"[gpu_suite] {m['device']} ({m['platform']}), jax {m['jax']}, flax {m['flax']}"
          f"{', TINY: numbers are not speed' if args.tiny else ''}; sections {only}", flush=True)
    for name in only:
        run_section(name, env, results)
    failed = [n for n in only if results.sections[n]["status"] != "done"]
    print(f"[gpu_suite] wrote {args.out / 'gpu_suite.json'} and gpu_suite.md"
          f"{'; errors in ' + ', '.join(failed) if failed else ''}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
