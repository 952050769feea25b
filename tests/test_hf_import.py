"""benchmarks/hf_import.py: the checkpoint it writes tensor by tensor is a Hugging Face Llama
directory that dynjax's reader reads back (sharded, with its index), and a tiny run of the whole
benchmark prints its table and writes finite figures (no memory or timing thresholds: at this
size the figures are the jax runtime's)."""

import json
import math
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from dynjax.checkpoint.huggingface import SafeTensors, read_hf_config
from dynjax.hf.architectures import dynjax_overrides

from .helpers import ROOT, benchmark_script

bench = benchmark_script("hf_import")


def test_the_default_shape_is_about_a_billion_parameters():
    config = bench.llama_shape(1e9)
    assert abs(bench.count(config) / 1e9 - 1) < 0.03
    assert (config["hidden_size"], config["num_key_value_heads"]) == (2048, 4)
    assert bench.llama_shape(1e5)["num_hidden_layers"] == 2


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_written_checkpoint_reads_back_sharded(tmp_path, dtype):
    config = bench.llama_shape(2e5)
    facts = bench.write_checkpoint(tmp_path, config, dtype, shard_bytes=100_000)
    assert facts["shards"] >= 2 and facts["params"] == bench.count(config)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == facts["shards"]
    assert index["metadata"]["total_size"] == facts["bytes"]
    files = sum(p.stat().st_size for p in tmp_path.glob("model-*.safetensors"))
    assert facts["bytes"] < files < facts["bytes"] + 4096 * facts["shards"]  # headers only
    dynjax_overrides(read_hf_config(tmp_path))  # a Llama the import accepts
    src = SafeTensors(tmp_path)
    shapes = dict(bench.tensors(config))
    assert set(src.files) == set(shapes)
    want = {"bf16": ml_dtypes.bfloat16, "f32": np.float32}[dtype]
    for name, shape in shapes.items():
        assert src.shape(name) == shape, name
    norm = src.read("model.norm.weight", (slice(None),))
    assert norm.dtype == want and np.all(norm.astype(np.float32) == 1)
    head = src.read("lm_head.weight", (slice(None), slice(None))).astype(np.float32)
    assert head.dtype == np.float32 and 0.015 < head.std() < 0.025 and abs(head.mean()) < 0.005


@pytest.mark.slow  # three jax processes: about 15 s on two cores
def test_tiny_run_reports_finite_figures(tmp_path):
    out = tmp_path / "hf_import.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT),
           "XLA_FLAGS": "--xla_backend_optimization_level=0"}
    done = subprocess.run(
        [sys.executable, "benchmarks/hf_import.py", "--params", "3e5", "--baseline-params", "1e5",
         "--shard-gib", "0.0005", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "increment / checkpoint" in done.stdout, done.stdout
    result = json.loads(out.read_text())
    assert result["devices"] == 8 and result["overrides"] == ["mesh.data=8"]
    base, model = result["runs"]["baseline"], result["runs"]["model"]
    assert model["shards"] >= 2 and model["params"] > base["params"]
    for run in (base, model):
        assert "--config.mesh.data=8" in run["command"]
        for key in ("seconds", "peak_rss", "peak_anon", "saved_bytes", "bytes", "state_bytes"):
            assert math.isfinite(run[key]) and run[key] > 0, (key, run)
        assert run["peak_rss"] >= run["peak_anon"]
    assert set(result["ratios"]) == {"peak_rss / checkpoint", "increment / checkpoint",
                                     "anon increment / state", "file increment / checkpoint"}
    assert all(math.isfinite(v) for v in result["ratios"].values())
    phases = model["phases"]
    assert [p["phase"] for p in phases] == ["set-up", "read and place (params + AdamW)",
                                            "checksums (every save's)"]
    assert all(p["peak_anon"] >= p["anon_after"] > 0 for p in phases) and not model["killed"]
