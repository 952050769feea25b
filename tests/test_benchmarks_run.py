"""Every benchmark script still runs: each one's smallest mode, as a subprocess from the
repository root, exits 0 and prints its table. The numbers say nothing (tiny sizes, one round);
what fails here is a script the library's changes broke (an import, a renamed API, a file
format). benchmarks/gpu_suite.py and real_pipeline.py have their own tests (test_gpu_suite.py,
its ``--tiny`` mode; test_real_pipeline.py, one case at its smallest)."""

import os
import subprocess
import sys

import pytest

from .helpers import ROOT

FAKE_DEVICES = "--xla_force_host_platform_device_count=8"
# The tests' compile flags (conftest.py) without its fake device count: scripts that need fake
# devices either set their own count (moe_chunks 4, scan_compile 2, dynamic_step 8) or say in
# their docstring to run under FAKE_DEVICES (`devices=True` below).
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"

# A scheme's config shrunk, for the scripts that train one (`--set` overrides).
SMALL = ["--set", "model.num_layers=2", "--set", "data.seq_len=64"]
# script: (its smallest arguments, a line of the table it prints, whether it needs FAKE_DEVICES).
# "{tmp}" is a fresh directory of the test.
SCRIPTS: dict[str, tuple[list[str], str, bool]] = {
    "balance_overhead": (
        ["--layers", "4", "--stages", "2", "--data", "1", "--microbatches", "2", "--steps", "2",
         "--rounds", "1"],
        "case (cadence)",
        True,
    ),
    "balancers": ([], "Table 2: partition runtime", False),
    "checkpoint": (
        ["--layers", "2", "--experts", "4", "--d-model", "16", "--mlp-dim", "32", "--repeats",
         "1"],
        "restore",
        True,
    ),
    "checkpoint_pec": (
        ["--layers", "2", "--experts", "4", "--d-model", "16", "--repeats", "1"],
        "PEC K=1, async",
        True,
    ),
    "checkpoint_plt": (["--steps", "12", "--faults", "4,8"], "dynamic K: PLT", False),
    "checkpoint_twolevel": (
        ["--layers", "2", "--steps", "8", "--every", "2", "--repeats", "1"],
        "two_level",
        False,
    ),
    "config_losses": (
        ["--record", "{tmp}/losses.json", "--steps", "2", "--configs", "quickstart"],
        "pipeline  2 steps, last loss",
        False,
    ),
    "data_pipeline": (["--steps", "5", "--rounds", "1"], "after, prefetch 2", False),
    "dynamic_step": (
        ["--rounds", "1", "--steps", "1", "--pipeline-steps", "1", "--stages", "2", "--data",
         "1", *SMALL],
        "pipeline step",
        False,
    ),
    "dynmo_cases": (["--no-deep"], "Speedup over the best static layout", False),
    "early_exit": (
        ["--steps", "10", "--rounds", "1", *SMALL, "--set", "early_exit.first=1"],
        "exits, final buckets",
        False,
    ),
    "generate": (
        ["--layers", "3", "--d-model", "32", "--first", "1", "--new", "8", "--rounds", "1"],
        "early exit",
        False,
    ),
    "families": (
        ["--steps", "2", "--rounds", "1", "--set", "model.num_layers=1", "--set",
         "data.seq_len=32"],
        "llama/gpt tokens/s",
        False,
    ),
    "fsdp_memory": (["--d-model", "32", "--layers", "2", "--data", "1,2"], "FSDP temp", True),
    "hf_import": (  # sets its own fake device count
        ["--params", "3e5", "--baseline-params", "1e5", "--shard-gib", "0.0005"],
        "increment / checkpoint",
        False,
    ),
    "kernels": (["--quick"], "block-sparse SpMM", False),
    "mod": (["--steps", "10", "--rounds", "1", *SMALL], "1 (no MoD)", False),
    "mod_eval": (["--steps", "20", "--every", "20", *SMALL], "eval predictor", False),
    "moe_chunks": (["--rounds", "1", "--quick"], "Alg. 1", False),
    "moe_ragged": (
        ["--rounds", "1", "--steps", "2", "--sim-steps", "10", "--experts", "8", "--layers",
         "1"],
        "ragged recompiles",
        False,
    ),
    "moe_routing": (["--steps", "10", "--rates", "1e-2"], "| expert choice |", False),
    "moe_skewed_capacity": (
        ["--steps", "6", "--workdir", "{tmp}", "--dispatch", "ragged"],
        "dynamic, ragged",
        False,
    ),
    "pipeline": (
        ["--stages", "2", "--data", "1", "--microbatches", "2", "--steps", "1", "--rounds", "1",
         "--maxtext", "A", "--maxtext-steps", "6"],
        "MaxText overrides, shape A",
        True,
    ),
    # One table, caching's (two training runs of a 2-layer model, then one round of two steps of
    # each interleaved timing): the capacity table's five runs and the pipeline's 4-stage run are
    # too long for the suite.
    "recompile": (
        ["--quick", "--only", "caching", "--cache-steps", "8", "--time-rounds", "1",
         "--time-steps", "2", *SMALL, "--workdir", "{tmp}"],
        "Table 3",
        False,
    ),
    "repack_freezing": (
        ["--steps", "12", "--freeze-at", "2", "--layers", "4", "--microbatches", "4",
         "--workdir", "{tmp}"],
        "freeze + re-pack",
        True,
    ),
    "schedules": (["--stages", "2", "--microbatches", "4"], "zb_h1", False),
    "scan_compile": (
        ["--layers", "2", "--repeats", "1", "--steps", "1", "--models", "dense", "--step-layers",
         "2"],
        "Table 3",
        False,
    ),
    "stage_compile": (["--layers", "2", "--repeats", "1"], "target: a stage's forward", False),
    "sparse_attention": (
        ["--seq", "256", "--block", "64", "--rounds", "1", "--steps", "0"],
        "dense causal",
        False,
    ),
    "sparse_matmul": (
        ["--tokens", "128", "--repeats", "1", "--shapes", "256x256", "--densities", "0.5"],
        "fwd+bwd",
        False,
    ),
    "step_throughput": (["--steps", "3", "--rounds", "1"], "configs/quickstart.py", False),
    "tensor_parallel": (["--tensor", "1,2", "--steps", "1"], "/ tensor 1", True),
}


def test_every_benchmark_script_is_run_here():
    """A new script gets its smallest mode above (or is the GPU suite, tested on its own)."""
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    assert scripts - {"gpu_suite", "real_pipeline"} == set(SCRIPTS)


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_benchmark_script_runs(script, tmp_path):
    args, table_line, devices = SCRIPTS[script]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = f"{FAST_COMPILE} {FAKE_DEVICES}" if devices else FAST_COMPILE
    done = subprocess.run(
        [sys.executable, f"benchmarks/{script}.py", *(a.format(tmp=tmp_path) for a in args)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert table_line in done.stdout, done.stdout[-3000:]
