#!/usr/bin/env bash
# Fetches, into ./.whl (ignored by git), every wheel a lent GPU machine needs to run dynjax and
# benchmarks/gpu_suite.py: ../shared/tools/gpu_wheels.sh's defaults (flax, ml-collections,
# tensorboardX) and benchmarks/gpu_wheels.txt (flax's own imports that the image lacks, tokamax
# and what it imports). Run it here, where the network is, before asking for the machine; then
# pass carry [".whl"] to the device calls (benchmarks/run_gpu_suite.sh installs them).
# manylinux_2_27 is xprof's tag (the image's glibc is newer); gpu_wheels.sh names 2_17 and 2_28.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl
# shellcheck disable=SC2046  # one requirement per word
bash "${DYNJAX_SHARED:-../shared}/tools/gpu_wheels.sh" --platform manylinux_2_27_x86_64 \
  $(grep -v '^#' benchmarks/gpu_wheels.txt)
