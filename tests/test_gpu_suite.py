"""benchmarks/gpu_suite.py --tiny: every section's code path runs on CPU, so the suite a lent GPU
machine runs at once (benchmarks/run_gpu_suite.sh) keeps working. The kernel sections are fast;
the sections that start training runs (a dynjax.train subprocess each) are slow."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VERSION_FIELDS = ("device", "platform", "jax", "jaxlib", "flax", "tiny")


def run_suite(out: Path, only: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_suite.py", "--tiny", "--out", str(out), "--only", only],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
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
def test_training_sections(tmp_path):
    """train, schemes and traces through dynjax.train subprocesses; the traces are in the
    format benchmarks/dynmo_cases.py reads (one sample per profiled step)."""
    data = run_suite(tmp_path, "train,schemes,traces")
    names = {r["name"] for r in data["records"] if r["section"] == "train"}
    assert {"GPT-2 small shape", "dispatch vs device"} <= names
    remat = {r["name"]: r for r in data["records"] if r["name"].startswith("remat ")}
    assert set(remat) == {"remat none", "remat full", "remat save_proj", "remat offload_proj"}
    assert remat["remat offload_proj"]["status"] == "skipped"  # CPU: no memory apart from host
    assert remat["remat none"]["vs_none"] == 1.0
    assert remat["remat full"]["temp_bytes"] < remat["remat none"]["temp_bytes"]
    assert all(r["mfu"] == "n/a" for r in data["records"] if "mfu" in r)
    traces = [r for r in data["records"] if r["section"] == "traces"]
    assert len(traces) == 6
    for r in traces:
        lines = (tmp_path / r["trace"]).read_text().splitlines()
        meta, sample = json.loads(lines[0]), json.loads(lines[1])
        assert meta["num_layers"] == len(sample["layer_forward_seconds"])
