"""Block-sparse kernels against dense baselines timed in the same run: a table of medians.

Attention: ``block_sparse_attention`` at block densities 100/50/25/10% (of the causal blocks;
the diagonal is always kept) against ``jax.nn.dot_product_attention(is_causal=True)`` (cuDNN
flash attention on GPU) and a dense masked attention that materialises the scores. One more row
per length, density ``lsh8``: ``hashed_block_sparse_attention`` with 8 random buckets per token
(sorted by bucket and position, as the model sorts them; 000 §2.4), its block list built on
device, against the same two baselines (the masked one with the hashed element mask);
``causal_blocks`` is then its needed blocks over the causal ones.
SpMM: ``block_sparse_matmul`` at 50/75/90/95% sparsity against ``jnp.dot`` for 4096x4096 and
MLP-shaped (4096x14336, 14336x4096) weights.
Ratios are dense time / sparse time (> 1: sparse is faster). Targets on an H100/H200 (000 §4.2.2,
§4.2.4; 003 §C): attention at 25% density >= 3x faster than dense, SpMM faster than dense from
75% sparsity and >= 3x at 90%.

    PYTHONPATH=. python benchmarks/kernels.py            # full sizes, bf16 (meant for a GPU)
    PYTHONPATH=. python benchmarks/kernels.py --quick    # tiny fp32, interpret mode on CPU
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import (
    BlockSparseMatrix,
    block_sparse_attention,
    block_sparse_matmul,
    hashed_block_sparse_attention,
)
from pallas_kernels.block_index import range_blocks
from pallas_kernels.selector import random_block_mask
from pallas_kernels.timing import median_seconds

DENSITIES = (1.0, 0.5, 0.25, 0.1)
SPARSITIES = (0.5, 0.75, 0.9, 0.95)
FULL = dict(
    batch=1, heads=8, head_dim=128, seqs=(1024, 2048, 4096, 8192, 16384), attn_block=128,
    tokens=4096, weights=((4096, 4096), (4096, 14336), (14336, 4096)), spmm_block=128,
    dtype=jnp.bfloat16, repeats=20,
)
QUICK = dict(
    batch=1, heads=2, head_dim=16, seqs=(64, 128), attn_block=16,
    tokens=64, weights=((64, 64), (64, 128), (128, 64)), spmm_block=16,
    dtype=jnp.float32, repeats=10,
)


def causal_block_mask(n: int, density: float, seed: int = 0) -> np.ndarray:
    """Keep each block below the diagonal with probability ``density``; keep the diagonal."""
    keep = np.random.default_rng(seed).random((n, n)) < density
    return np.tril(keep, -1) | np.eye(n, dtype=bool)


def dense_masked_attention(q, k, v, mask):
    """Materialised scores, element mask, softmax: what the kernel avoids."""
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32)
    s = jnp.where(mask, s / np.sqrt(q.shape[-1]), -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1).astype(v.dtype), v)


def hashed_ids(shape: tuple[int, int, int], buckets: int, seed: int) -> tuple[np.ndarray, ...]:
    """Uniformly random buckets per token, sorted by (bucket, position): each sorted token's
    (position, bucket) for queries, then for keys, ``shape = (batch, heads, seq)`` each."""
    rng, seq = np.random.default_rng(seed), shape[-1]
    ids = []
    for _ in range(2):
        bucket = rng.integers(0, buckets, shape)
        perm = np.argsort(bucket * seq + np.arange(seq), axis=-1, kind="stable")
        ids += [perm.astype(np.int32), np.take_along_axis(bucket, perm, -1).astype(np.int32)]
    return tuple(ids)


def dpa_attention(q, k, v, implementation: str | None = None):
    """``jax.nn.dot_product_attention`` (causal) on our (batch, heads, seq, dim) layout."""
    to_bthd = lambda x: x.transpose(0, 2, 1, 3)
    out = jax.nn.dot_product_attention(
        to_bthd(q), to_bthd(k), to_bthd(v), is_causal=True, implementation=implementation
    )
    return to_bthd(out)


def _timed(fn: Callable, backward: bool, repeats: int, wrt: tuple[int, ...]) -> Callable:
    """Median seconds of ``fn(*args)``, or of its gradient in the arguments ``wrt`` too."""
    loss = lambda *args: jnp.sum(fn(*args).astype(jnp.float32))
    timed = jax.jit(jax.grad(loss, wrt, allow_int=True) if backward else fn)
    return lambda *args: median_seconds(timed, *args, repeats=repeats)


def bench_attention(cfg: dict, backward: bool, dpa_impl: str | None) -> list[dict]:
    block, repeats = cfg["attn_block"], cfg["repeats"]
    qkv = (0, 1, 2)
    dpa = _timed(functools.partial(dpa_attention, implementation=dpa_impl), backward, repeats, qkv)
    masked = _timed(dense_masked_attention, backward, repeats, qkv)
    sparse_fn = functools.partial(block_sparse_attention, block_size=block)
    sparse = _timed(sparse_fn, backward, repeats, qkv)
    hashed = _timed(functools.partial(hashed_block_sparse_attention, block_size=block), backward,
                    repeats, qkv)
    rows = []
    for seq in cfg["seqs"]:
        shape = (cfg["batch"], cfg["heads"], seq, cfg["head_dim"])
        keys = jax.random.split(jax.random.key(seq), 3)
        q, k, v = (jax.random.normal(key, shape, cfg["dtype"]) for key in keys)
        t_dpa = dpa(q, k, v)
        n = seq // block
        for density in DENSITIES:
            mask = causal_block_mask(n, density)
            dense_mask = np.kron(mask, np.ones((block, block), bool)) & np.tril(
                np.ones((seq, seq), bool)
            )
            t_masked = masked(q, k, v, jnp.asarray(dense_mask))
            t_sparse = sparse(q, k, v, jnp.asarray(mask))
            rows.append(dict(
                seq=seq, density=density, causal_blocks=float(mask.sum() / (n * (n + 1) / 2)),
                sparse_ms=1e3 * t_sparse, dpa_ms=1e3 * t_dpa, masked_ms=1e3 * t_masked,
                vs_dpa=t_dpa / t_sparse, vs_masked=t_masked / t_sparse,
            ))
        q_pos, q_bucket, k_pos, k_bucket = hashed_ids(shape[:3], 8, seed=seq)
        allowed = (q_bucket[..., :, None] == k_bucket[..., None, :]) & (
            k_pos[..., None, :] <= q_pos[..., :, None]
        )
        need = np.asarray(range_blocks(q_bucket, q_pos, k_bucket, k_pos, block))
        t_masked = masked(q, k, v, jnp.asarray(allowed))
        t_sparse = hashed(q, k, v, *map(jnp.asarray, (q_pos, q_bucket, k_pos, k_bucket)))
        rows.append(dict(
            seq=seq, density="lsh8", causal_blocks=float(need.mean() * 2 * n / (n + 1)),
            sparse_ms=1e3 * t_sparse, dpa_ms=1e3 * t_dpa, masked_ms=1e3 * t_masked,
            vs_dpa=t_dpa / t_sparse, vs_masked=t_masked / t_sparse,
        ))
    return rows


def bench_spmm(cfg: dict, backward: bool) -> list[dict]:
    dense = _timed(jnp.dot, backward, cfg["repeats"], (0, 1))
    sparse = _timed(block_sparse_matmul, backward, cfg["repeats"], (0, 1))
    block, rows = cfg["spmm_block"], []
    for shape in cfg["weights"]:
        keys = jax.random.split(jax.random.key(shape[0] + shape[1]), 2)
        x = jax.random.normal(keys[0], (cfg["tokens"], shape[0]), cfg["dtype"])
        dense_w = jax.random.normal(keys[1], shape, cfg["dtype"])
        t_dense = dense(x, dense_w)
        for sparsity in SPARSITIES:
            mask = random_block_mask((shape[0] // block, shape[1] // block), sparsity)
            t_sparse = sparse(x, BlockSparseMatrix.from_dense(dense_w, block, mask))
            rows.append(dict(
                shape=f"{cfg['tokens']}x{shape[0]} @ {shape[0]}x{shape[1]}", sparsity=sparsity,
                sparse_ms=1e3 * t_sparse, dense_ms=1e3 * t_dense, vs_dense=t_dense / t_sparse,
            ))
    return rows


def _table(rows: list[dict]) -> str:
    if not rows:
        return ""
    cells = [[f"{v:.3f}" if isinstance(v, float) else str(v) for v in r.values()] for r in rows]
    header = list(rows[0])
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    line = lambda vals: "| " + " | ".join(map(str.rjust, vals, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep, *map(line, cells)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny fp32 sizes (CPU, interpret)")
    parser.add_argument("--backward", action="store_true", help="time forward + backward")
    parser.add_argument("--only", choices=("attention", "spmm"), help="run one section")
    parser.add_argument("--seqs", type=int, nargs="*", help="override the sequence lengths")
    parser.add_argument("--repeats", type=int, help="timed calls per median")
    parser.add_argument("--dpa-impl", choices=("xla", "cudnn"),
                        help="jax.nn.dot_product_attention backend (default: cudnn on GPU)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    dpa_impl = args.dpa_impl or ("cudnn" if jax.default_backend() == "gpu" else "xla")
    cfg = dict(QUICK if args.quick else FULL)
    if args.seqs:
        cfg["seqs"] = tuple(args.seqs)
    if args.repeats:
        cfg["repeats"] = args.repeats
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}, "
          f"dtype {jnp.dtype(cfg['dtype']).name}, {'fwd+bwd' if args.backward else 'fwd'}, "
          f"median of {cfg['repeats']}, dot_product_attention={dpa_impl}; "
          "ratio = dense time / sparse time")
    results = {}
    if args.only in (None, "attention"):
        results["attention"] = bench_attention(cfg, args.backward, dpa_impl)
        print(f"\nblock-sparse attention, block {cfg['attn_block']}, (batch, heads, head_dim) = "
              f"{(cfg['batch'], cfg['heads'], cfg['head_dim'])}, causal\n")
        print(_table(results["attention"]))
    if args.only in (None, "spmm"):
        results["spmm"] = bench_spmm(cfg, args.backward)
        print(f"\nblock-sparse SpMM, block {cfg['spmm_block']}\n")
        print(_table(results["spmm"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device.device_kind, backward=args.backward, **results), f,
                      indent=1)


if __name__ == "__main__":
    main()
