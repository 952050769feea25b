"""Seconds and peak host memory of ``python -m dynjax.hf import`` on a Llama checkpoint of about
1B parameters made on the spot, sharded over 8 fake CPU devices (issue 30, "Benchmarks").

The checkpoint (`write_checkpoint`) is a Hugging Face Llama directory: ``config.json``,
``model-0000i-of-0000n.safetensors`` shards of at most ``--shard-gib`` and their
``model.safetensors.index.json``, in bfloat16 (``--dtype``; Hugging Face's usual) with random
N(0, 0.02) weights and unit norms. Its shape is TinyLlama-1.1B's (d_model 2048, 32 heads, 4
key/value heads, SwiGLU 5632, vocabulary 32000) with the depth that comes closest to
``--params``; smaller targets halve the width (`llama_shape`). The safetensors files are written
row chunk by row chunk (`_write_shard`): the writer never holds a tensor whole, let alone the
checkpoint (its own peak RSS is printed).

The import runs as ``python -m dynjax.hf import DIR --workdir W --config.mesh.data=8`` (FSDP,
``parallel.fsdp``, is on by default: every parameter and Adam moment split over the 8 data
devices) in a subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``; its peak
RSS is the kernel's (``wait4``'s ``ru_maxrss``), and its anonymous and file-backed parts are
polled from ``/proc/PID/status`` (the safetensors files are memory-mapped: the pages read count
as file-backed RSS while the files are open). The same import of a tiny checkpoint
(``--baseline-params``) is the baseline: Python, jax and the run's set-up. The increment over it
is compared with the checkpoint's bytes and with the training state the 8 devices hold after an
import (float32 parameters and AdamW's two float32 moments: 12 bytes a parameter). A second
process (`phases_of`, skipped with ``--no-phases``) runs the import's two heavy steps one at a
time on the large checkpoint and prints each one's peak: reading and placing the state, and the
checksums every checkpoint save computes. The 8 fake devices live in this one process, so it
holds all 8 shards: what FSDP saves a real host (its devices' 1/8 of the state) cannot show
here; what can is whether the import holds more than the state it places plus the pages it
maps, e.g. a host-side copy of the checkpoint or of whole leaves. A guard kills a run when the
machine's available memory falls under ``--guard-gib``; the table then says so and shows the
figures up to then.

    python benchmarks/hf_import.py [--params 1e9] [--dtype bf16|f32] [--shard-gib 0.5]
        [--baseline-params 1e6] [--devices 8] [--set mesh.data=8 ...] [--no-phases]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 30
DTYPES = {"bf16": ("BF16", ml_dtypes.bfloat16), "f32": ("F32", np.float32)}
STATE_BYTES = 12  # a parameter's float32 value and AdamW's two float32 moments, after an import
CHUNK = 1 << 23  # elements of a tensor generated and written at once
POLL_S = 0.02


def llama_shape(params: float) -> dict[str, Any]:
    """A Llama ``config.json`` with about ``params`` parameters: TinyLlama-1.1B's width, heads
    and vocabulary, halved in width (vocabulary 1024 under d_model 1024) until at least two
    layers fit, with the depth that comes closest (two at least: the import's base config,
    configs/finetune.py, freezes up to half the layers)."""
    for d in (2048, 1024, 512, 256, 128, 64):
        heads, vocab = d // 64, 32000 if d >= 1024 else 1024
        kv, mlp = max(1, heads // 8), 11 * d // 4
        config = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d,
            "intermediate_size": mlp, "num_attention_heads": heads, "num_key_value_heads": kv,
            "vocab_size": vocab, "num_hidden_layers": 1, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "max_position_embeddings": 2048, "hidden_act": "silu",
            "tie_word_embeddings": False, "attention_bias": False,
        }
        fixed = count(config) - layer_count(config)
        layers = round((params - fixed) / layer_count(config))
        if layers >= 2 or d == 64:
            return {**config, "num_hidden_layers": max(layers, 2)}
    raise AssertionError("unreachable: the last width always returns")


def tensors(config: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor of a Hugging Face Llama checkpoint of ``config``: name and shape."""
    d, m, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    dh = d // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * dh
    yield "model.embed_tokens.weight", (v, d)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (d,)
        yield p + "self_attn.q_proj.weight", (d, d)
        yield p + "self_attn.k_proj.weight", (kv, d)
        yield p + "self_attn.v_proj.weight", (kv, d)
        yield p + "self_attn.o_proj.weight", (d, d)
        yield p + "post_attention_layernorm.weight", (d,)
        yield p + "mlp.gate_proj.weight", (m, d)
        yield p + "mlp.up_proj.weight", (m, d)
        yield p + "mlp.down_proj.weight", (d, m)
    yield "model.norm.weight", (d,)
    yield "lm_head.weight", (v, d)


def count(config: dict[str, Any]) -> int:
    return sum(math.prod(shape) for _, shape in tensors(config))


def layer_count(config: dict[str, Any]) -> int:
    return sum(math.prod(s) for n, s in tensors(config) if n.startswith("model.layers.0."))


def write_checkpoint(directory: Path, config: dict[str, Any], dtype: str, shard_bytes: int,
                     seed: int = 0) -> dict[str, Any]:
    """``config.json``, the safetensors shards and their index in ``directory``; a tensor is
    generated and written a row chunk at a time."""
    name, np_dtype = DTYPES[dtype]
    size = np.dtype(np_dtype).itemsize
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    used = 0
    for tensor, shape in tensors(config):
        nbytes = math.prod(shape) * size
        if shards[-1] and used + nbytes > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append((tensor, shape))
        used += nbytes
    rng = np.random.default_rng(seed)
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _write_shard(directory / file, shard, name, np_dtype, rng)
        weight_map.update(dict.fromkeys((t for t, _ in shard), file))
    total = count(config) * size
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    torch_dtype = {"bf16": "bfloat16", "f32": "float32"}[dtype]
    (directory / "config.json").write_text(
        json.dumps({**config, "torch_dtype": torch_dtype}, indent=2) + "\n")
    return {"bytes": total, "shards": len(shards), "params": count(config)}


def _write_shard(path: Path, shard: list[tuple[str, tuple[int, ...]]], dtype_name: str,
                 np_dtype: Any, rng: np.random.Generator) -> None:
    """One safetensors file (an 8-byte header length, the JSON header, the tensors' bytes in
    header order), each tensor streamed in row chunks of random N(0, 0.02) values (norms: 1)."""
    size = np.dtype(np_dtype).itemsize
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for tensor, shape in shard:
        end = offset + math.prod(shape) * size
        header[tensor] = {"dtype": dtype_name, "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for _, shape in shard:
            if len(shape) == 1:
                f.write(np.ones(shape, np_dtype).tobytes())
                continue
            rows = max(1, CHUNK // shape[1])
            for start in range(0, shape[0], rows):
                n = min(rows, shape[0] - start)
                chunk = rng.standard_normal((n, shape[1]), dtype=np.float32) * np.float32(0.02)
                f.write(chunk.astype(np_dtype).tobytes())


def _status(pid: int) -> dict[str, int]:
    """``/proc/PID/status``'s memory lines in bytes (empty once the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line")


def _watch(command: list[str], log: Path, devices: int, guard_bytes: int) -> dict[str, Any]:
    """Run ``command`` (Python from the repository root, ``devices`` fake CPU devices): its
    seconds, the kernel's peak RSS of it (``wait4``) and the polled peaks of its anonymous and
    file-backed RSS; killed (``killed``) when the machine's available memory falls under
    ``guard_bytes``."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"]),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    peaks = {"RssAnon": 0, "RssFile": 0}
    killed = False
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            for key, value in _status(proc.pid).items():
                if key in peaks:
                    peaks[key] = max(peaks[key], value)
            if _available() < guard_bytes:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                killed = True
                break
            time.sleep(POLL_S)
    seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    if proc.returncode and not killed:
        tail = log.read_text().splitlines()[-5:]
        raise SystemExit(f"error: {' '.join(command)} exited {proc.returncode}: "
                         + " / ".join(tail))
    return {"seconds": seconds, "peak_rss": usage.ru_maxrss * 1024,
            "peak_anon": peaks["RssAnon"], "peak_file": peaks["RssFile"], "killed": killed,
            "command": " ".join(command[1:])}


def run_import(source: Path, workdir: Path, overrides: Sequence[str], devices: int,
               guard_bytes: int) -> dict[str, Any]:
    """``python -m dynjax.hf import`` watched (`_watch`), and the bytes of the step-0
    checkpoint it wrote (Orbax compresses: Adam's zero moments take almost none)."""
    command = [sys.executable, "-m", "dynjax.hf", "import", str(source), "--workdir",
               str(workdir), *(f"--config.{o}" for o in overrides)]
    run = _watch(command, workdir.parent / f"{workdir.name}.log", devices, guard_bytes)
    saved = sum(f.stat().st_size for f in workdir.glob("checkpoints/**/*") if f.is_file())
    return {**run, "saved_bytes": saved}


def phases_of(source: Path, overrides: Sequence[str], out: Path) -> None:
    """In this process (`--phases-of`): the import's two heavy steps one after the other, each
    phase's peak anonymous RSS (polled) and the RSS after it appended to ``out`` as a JSON line:
    reading and placing the state (`Experiment.init_state`: parameters read slice by slice,
    AdamW's moments) and the checksums every save computes (`dynjax.checkpoint.layout`)."""
    import threading

    import jax

    from dynjax.checkpoint.huggingface import read_hf_config
    from dynjax.checkpoint.layout import checksums, flatten
    from dynjax.checkpoint.rows import NO_ROWS
    from dynjax.config import load_run
    from dynjax.experiment import Experiment
    from dynjax.hf.__main__ import DEFAULT_BASE
    from dynjax.hf.architectures import dynjax_overrides

    peak = [0]

    def poll() -> None:
        while True:
            peak[0] = max(peak[0], _status(os.getpid())["RssAnon"])
            time.sleep(POLL_S / 2)

    def mark(phase: str, began: float) -> None:
        anon = _status(os.getpid())["RssAnon"]
        record = {"phase": phase, "seconds": time.perf_counter() - began,
                  "peak_anon": max(peak[0], anon), "anon_after": anon}
        with open(out, "a") as f:
            f.write(json.dumps(record) + "\n")
        peak[0] = 0

    threading.Thread(target=poll, daemon=True).start()
    mapped = [f"{k}={v}" for k, v in dynjax_overrides(read_hf_config(source)).items()]
    cfg, schemes = load_run(ROOT / DEFAULT_BASE, [*mapped, f"train.init_from={source}",
                                                  *overrides])
    began = time.perf_counter()
    exp = Experiment.from_config(cfg, schemes)
    mark("set-up", began)
    began = time.perf_counter()
    state = jax.block_until_ready(exp.init_state())
    mark("read and place (params + AdamW)", began)
    began = time.perf_counter()
    checksums(flatten(state), NO_ROWS)
    mark("checksums (every save's)", began)


def measure(name: str, params: float, args: argparse.Namespace, tmp: Path,
            phases: bool) -> dict[str, Any]:
    """Write a checkpoint of about ``params`` parameters, import it (and with ``phases`` run
    `phases_of` on it in a subprocess of its own)."""
    source, workdir = tmp / f"{name}_hf", tmp / f"{name}_run"
    source.mkdir()
    config = llama_shape(params)
    start = time.perf_counter()
    checkpoint = write_checkpoint(source, config, args.dtype, int(args.shard_gib * GIB))
    checkpoint["write_seconds"] = time.perf_counter() - start
    checkpoint["shape"] = (f"d{config['hidden_size']} L{config['num_hidden_layers']} "
                           f"h{config['num_attention_heads']} kv{config['num_key_value_heads']} "
                           f"mlp{config['intermediate_size']} vocab{config['vocab_size']}")
    guard = int(args.guard_gib * GIB)
    run = run_import(source, workdir, args.set, args.devices, guard)
    result = {**checkpoint, **run, "state_bytes": checkpoint["params"] * STATE_BYTES}
    if phases:
        out = tmp / f"{name}_phases.jsonl"
        command = [sys.executable, str(Path(__file__).resolve()), "--phases-of", str(source),
                   "--phases-out", str(out), *(f"--set={o}" for o in args.set)]
        watched = _watch(command, tmp / f"{name}_phases.log", args.devices, guard)
        result["phases"] = ([json.loads(line) for line in out.read_text().splitlines()]
                            if out.is_file() else [])
        result["phases_killed"] = watched["killed"]
    return result


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=float, default=1e9, help="the checkpoint's parameters")
    parser.add_argument("--baseline-params", type=float, default=1e6)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--shard-gib", type=float, default=0.5, help="most GiB in one file")
    parser.add_argument("--devices", type=int, default=8, help="fake CPU devices of the import")
    parser.add_argument("--set", action="append", default=None, metavar="KEY=VALUE",
                        help="the import's config overrides (default: mesh.data=8)")
    parser.add_argument("--guard-gib", type=float, default=1.0,
                        help="kill the import when the machine has less available memory")
    parser.add_argument("--no-phases", action="store_true",
                        help="skip the per-phase run of the large checkpoint")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--phases-of", type=Path, help=argparse.SUPPRESS)  # `phases_of`'s child
    parser.add_argument("--phases-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.set = args.set if args.set is not None else [f"mesh.data={args.devices}"]
    if args.phases_of:
        phases_of(args.phases_of, args.set, args.phases_out)
        return None
    with tempfile.TemporaryDirectory(prefix="hf_import_") as tmp:
        runs = {"baseline": measure("baseline", args.baseline_params, args, Path(tmp), False),
                "model": measure("model", args.params, args, Path(tmp), not args.no_phases)}
    writer_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    base, model = runs["baseline"], runs["model"]
    increment = {k: model[k] - base[k] for k in ("seconds", "peak_rss", "peak_anon", "peak_file")}
    ratios = {
        "peak_rss / checkpoint": model["peak_rss"] / model["bytes"],
        "increment / checkpoint": increment["peak_rss"] / model["bytes"],
        "anon increment / state": increment["peak_anon"] / (model["state_bytes"]
                                                            - base["state_bytes"]),
        "file increment / checkpoint": increment["peak_file"] / model["bytes"],
    }
    gib = lambda b: f"{b / GIB:.2f}"  # noqa: E731
    print(f"checkpoint: Llama {model['shape']}, {model['params']:,} parameters, {args.dtype}, "
          f"{model['shards']} safetensors shards, {gib(model['bytes'])} GiB, written in "
          f"{model['write_seconds']:.0f} s (writer's peak RSS {gib(writer_peak)} GiB); "
          f"baseline: {base['shape']}, {base['params']:,} parameters")
    print(f"import: python {model['command']}  ({args.devices} fake CPU devices)")
    if model["killed"]:
        print(f"KILLED after {model['seconds']:.0f} s: the machine's available memory fell under "
              f"--guard-gib={args.guard_gib:g} (the figures below are up to then)")
    print(f"{'':<12}{'import s':>10}{'peak RSS':>10}{'anon':>8}{'file':>8}{'checkpoint':>12}"
          f"{'state':>8}{'saved':>8}   (GiB; state: f32 params + AdamW moments)")
    for name, r in [*runs.items(), ("increment", None)]:
        r = r or {**increment, "bytes": model["bytes"] - base["bytes"],
                  "state_bytes": model["state_bytes"] - base["state_bytes"],
                  "saved_bytes": model["saved_bytes"] - base["saved_bytes"]}
        print(f"{name:<12}{r['seconds']:>10.1f}{gib(r['peak_rss']):>10}{gib(r['peak_anon']):>8}"
              f"{gib(r['peak_file']):>8}{gib(r['bytes']):>12}{gib(r['state_bytes']):>8}"
              f"{gib(r['saved_bytes']):>8}")
    print("; ".join(f"{k}: {v:.3f}" for k, v in ratios.items()))
    if model.get("phases") is not None:
        killed = " (KILLED in the next phase)" if model["phases_killed"] else ""
        print(f"phases of the import, in one process{killed}:")
        print(f"{'phase':<34}{'s':>7}{'peak anon GiB':>15}{'anon after':>12}")
        for ph in model["phases"]:
            print(f"{ph['phase']:<34}{ph['seconds']:>7.1f}{gib(ph['peak_anon']):>15}"
                  f"{gib(ph['anon_after']):>12}")
    result = {"runs": runs, "increment": increment, "ratios": ratios, "dtype": args.dtype,
              "devices": args.devices, "overrides": args.set, "writer_peak_rss": writer_peak}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
