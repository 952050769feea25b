"""benchmarks/gpu_suite.py --tiny: every section's code path runs on CPU, so the suite a lent GPU
machine runs at once (benchmarks/run_gpu_suite.sh) keeps working. The kernel sections are fast;
the sections that start training runs (a dynjax.train subprocess each) are slow."""

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
VERSION_FIELDS = ("device", "platform", "jax", "jaxlib", "flax", "tiny")
LLAMA_RUN = "Llama family, GPT-2 small's parameters"  # gpu_suite.LLAMA_RUN
# What the lent GPU machine's image holds (DEVELOPERS.md, "A GPU when one is lent"), and the
# wheels ../shared/tools/gpu_wheels.sh fetches for it unasked.
IMAGE = ("jax", "jaxlib", "optax", "orbax-checkpoint", "chex", "tqdm", "matplotlib")
DEFAULT_WHEELS = ("flax", "ml-collections", "tensorboardx")


def skipped_as_tiny(record: dict) -> bool:
    """Recorded as skipped by a tiny run: the same code path as a run it keeps (TINY_SKIPS)."""
    return record["status"] == "skipped" and record["reason"].startswith("tiny: the same code")


def run_suite(out: Path, only: str) -> dict:
    scratch = out / "tmp"  # the suite's temporary files: its training runs' workdirs
    scratch.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(scratch)}
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_suite.py", "--tiny", "--out", str(out), "--only", only],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not list(scratch.glob("gpu_suite_*")), "a run's workdir was left behind"
    data = json.loads((out / "gpu_suite.json").read_text())
    assert data["meta"]["tiny"] is True
    assert "numbers say nothing about speed" in (out / "gpu_suite.md").read_text()
    for name in only.split(","):
        assert data["sections"][name]["status"] == "done", data["sections"][name]
        records = [r for r in data["records"] if r["section"] == name]
        assert records, name
        for r in records:
            assert all(r.get(k) is not None for k in VERSION_FIELDS), r
            assert r["status"] in ("ok", "pass", "skipped"), r
            assert r["status"] != "skipped" or r["reason"], r
    return data


def test_kernels_spmm_moe_attention(tmp_path):
    """Each kernel passes against its reference with small errors; the timed sections record
    times with dtype and shapes, and cuDNN attention is skipped on CPU with its reason."""
    data = run_suite(tmp_path, "kernels,spmm,moe,attention")
    kernels = [r for r in data["records"] if r["section"] == "kernels"]
    assert len(kernels) == 5
    for r in kernels:
        assert r["status"] == "pass", r
        assert r["fwd_rel_err"] < 1e-4 and r["grad_rel_err"] < 1e-4, r
    timed = [r for r in data["records"] if r["section"] in ("spmm", "moe", "attention")
             and r["status"] == "ok"]
    assert timed and all(r["ms"] > 0 and r["dtype"] and r["shapes"] for r in timed)
    cudnn = [r for r in data["records"] if r["name"] == "dpa cudnn"]
    assert cudnn and all(r["status"] == "skipped" and "GPU" in r["reason"] for r in cudnn)


@pytest.mark.slow
def test_train_section(tmp_path):
    """The train section's dynjax.train subprocesses and its in-process rows (dispatch, remat)."""
    data = run_suite(tmp_path, "train")
    records = {r["name"]: r for r in data["records"] if r["section"] == "train"}
    assert {"GPT-2 small shape", "dispatch vs device", LLAMA_RUN} <= set(records)
    assert skipped_as_tiny(records["large dense"])  # the small shape's path
    remat = {n: r for n, r in records.items() if n.startswith("remat ")}
    assert set(remat) == {"remat none", "remat full", "remat save_proj", "remat offload_proj"}
    assert remat["remat offload_proj"]["status"] == "skipped"  # CPU: no memory apart from host
    assert remat["remat none"]["vs_none"] == 1.0
    assert remat["remat full"]["temp_bytes"] < remat["remat none"]["temp_bytes"]
    assert all(r["mfu"] == "n/a" for r in records.values() if "mfu" in r)
    # the training runs' dense attention: cuDNN's only on a GPU
    assert {records[n]["attention"] for n in ("GPT-2 small shape", LLAMA_RUN)} == {"einsum"}


@pytest.mark.slow
def test_schemes_and_traces_sections(tmp_path):
    """Every scheme's run, and traces in the format benchmarks/dynmo_cases.py reads (one sample
    per profiled step) from a case that swaps its Plan (freezing) and one that does not (MoE)."""
    data = run_suite(tmp_path, "schemes,traces")
    schemes = [r for r in data["records"] if r["section"] == "schemes"]
    assert all(r["status"] == "ok" for r in schemes) and len(schemes) == 8  # 7 runs, the stall
    traces = {r["name"]: r for r in data["records"] if r["section"] == "traces"}
    assert len(traces) == 6
    kept = {n for n, r in traces.items() if r["status"] == "ok"}
    assert kept == {"freezing", "MoE"}
    assert all(skipped_as_tiny(traces[n]) for n in set(traces) - kept)
    assert traces["freezing"]["swaps"] >= 1
    for name in kept:
        lines = (tmp_path / traces[name]["trace"]).read_text().splitlines()
        meta, sample = json.loads(lines[0]), json.loads(lines[1])
        assert meta["num_layers"] == len(sample["layer_forward_seconds"])


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(names) -> set[str]:
    """``names`` and everything they require (no extras), as this environment's metadata says;
    a package not installed here counts, but its own requirements are unknown."""
    seen, todo = set(), [_canonical(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(_canonical(req.name))
    return seen


def test_gpu_wheels_cover_what_flax_imports():
    """benchmarks/gpu_wheels.txt lists every package that dynjax's wheels (flax, ml-collections,
    tensorboardX) require and the GPU image lacks: the wheels install there with --no-deps, and
    flax 0.12.12 imports rich and treescope, which the default wheels left out (`import flax`
    failed on an image of only those packages, 2026-12-07)."""
    listed = {_canonical(Requirement(line).name)
              for line in (ROOT / "benchmarks" / "gpu_wheels.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")}
    missing = _closure(DEFAULT_WHEELS) - _closure(IMAGE) - set(DEFAULT_WHEELS) - listed
    assert not missing, f"add {sorted(missing)} to benchmarks/gpu_wheels.txt"
