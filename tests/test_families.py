"""benchmarks/families.py: the Llama side matches GPT's parameter count within 2%, and a tiny run
prints its table and writes finite, positive figures for both families (no timing thresholds:
the figures say nothing at this size)."""

import json
import math
import os
import subprocess
import sys

from .helpers import ROOT

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def test_tiny_run_pairs_equal_parameters_and_reports_finite_rates(tmp_path):
    out = tmp_path / "families.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": FAST_COMPILE}
    done = subprocess.run(
        [sys.executable, "benchmarks/families.py", "--steps", "2", "--rounds", "2",
         "--set", "model.num_layers=1", "--set", "data.seq_len=32", "--set", "train.batch_size=4",
         "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "llama/gpt tokens/s" in done.stdout, done.stdout
    result = json.loads(out.read_text())
    gpt, llama = result["families"]["gpt"], result["families"]["llama"]
    assert abs(llama["params"] / gpt["params"] - 1) < 0.02, (llama["params"], gpt["params"])
    assert math.isclose(result["param_gap"], llama["params"] / gpt["params"] - 1)
    # the same shape but for the MLP: SwiGLU's three matrices are narrower than GELU's two
    for key in ("d_model", "layers", "heads"):
        assert llama[key] == gpt[key], key
    assert llama["mlp_dim"] < gpt["mlp_dim"] and llama["kv_heads"] < gpt["kv_heads"]
    for family in (gpt, llama):
        assert len(family["rounds_tokens_per_sec"]) == 2
        assert all(math.isfinite(r) and r > 0 for r in family["rounds_tokens_per_sec"])
        assert family["flops_per_token"] > 0
    assert len(result["ratios"]) == 2 and math.isfinite(result["ratio"]) and result["ratio"] > 0
    assert math.isclose(result["ratio"], sorted(result["ratios"])[0] / 2
                        + sorted(result["ratios"])[1] / 2)
