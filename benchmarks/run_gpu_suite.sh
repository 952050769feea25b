#!/usr/bin/env bash
# benchmarks/gpu_suite.py on a lent H100/H200, in two device calls of under 10 minutes each.
#
# Before the session asks for the machine, on this machine (it has the network):
#   bash benchmarks/fetch_gpu_wheels.sh        # the wheels the image lacks, into ./.whl
# Then two `run` calls with carry [".whl"] and timeout_s 600, in the repository root:
#   bash benchmarks/run_gpu_suite.sh kernels    # kernels, attention, spmm, moe
#   bash benchmarks/run_gpu_suite.sh training   # train, schemes, traces
# Each writes $OUT/gpu_suite/gpu_suite.{json,md} (the second adds to the first's when the
# machine stayed warm; otherwise merge the two JSON files' records) and, the second, the GPU
# traces $OUT/gpu_suite/traces/<case>.jsonl for benchmarks/dynmo_cases.py (8 files in all: what
# comes back from $OUT). `timeout` stops a hang before the call's limit; the JSON and .md are
# rewritten after every record, so what finished comes back. A task is lent 15 minutes of device
# time in all, the machine's start included: the second call runs under what is left.
# Rehearsal on a CPU: `OUT=DIR GPU_SUITE_ARGS=--tiny bash benchmarks/run_gpu_suite.sh kernels`
# (then `training`) in an environment of only the image's packages; on 2026-12-07, with jax
# 0.11.2 and a cp313 pydantic_core in place of the image's cp312 wheel, both halves ran every
# section (49 s and 149 s).
set -uo pipefail
half=${1:?"which half: kernels or training"}
cd "$(dirname "$0")/.."
if ! python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; then
  echo "error: the wheels in .whl do not install here (above); fetch them for this image's" \
    "Python with benchmarks/fetch_gpu_wheels.sh and carry .whl" >&2
  exit 2
fi
export PYTHONPATH=/tmp/site:$PWD
export JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache  # a warm machine's second call reuses compiles
out=${OUT:-/tmp/out}/gpu_suite
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import jax, jaxlib; print(jax.__version__, jaxlib.__version__, jax.devices())"
# Seconds, not the call's minutes: a module the image lacks fails here, before any compile.
if ! python3 -c "import dynjax.train, dynjax.report"; then
  echo "error: dynjax does not import on this image (the missing module is named above):" \
    "add its wheel to benchmarks/gpu_wheels.txt and rerun benchmarks/fetch_gpu_wheels.sh" >&2
  exit 2
fi
python3 -c "import tokamax" 2>/dev/null \
  || echo "tokamax does not import: the moe section skips its ragged_dot, saying why"
case $half in
  kernels) only=kernels,attention,spmm,moe ;;
  training) only=train,schemes,traces ;;
  *) echo "unknown half '$half': kernels or training" >&2; exit 2 ;;
esac
# GPU_SUITE_ARGS: more arguments for the suite; "--tiny" rehearses this script on a CPU.
# shellcheck disable=SC2086
timeout -k 10 560 python3 benchmarks/gpu_suite.py --out "$out" --only "$only" ${GPU_SUITE_ARGS:-}
status=$?
tail -n 60 "$out/gpu_suite.md"
exit $status
