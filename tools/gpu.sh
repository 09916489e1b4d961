#!/usr/bin/env bash
# What this machine has for CUDA, for the other tools' defaults:
#   tools/gpu.sh arch         the CMake architecture of the first NVIDIA GPU ("90a-real" on a Hopper), or nothing
#   tools/gpu.sh cuda-major   the major version of the CUDA toolkit's nvcc ($CUDACXX, else nvcc on PATH), or nothing
set -euo pipefail

gpu_arch() {
  command -v nvidia-smi >/dev/null 2>&1 || return 0
  local cap
  cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' .') || return 0
  [[ $cap =~ ^[0-9]+$ ]] || return 0
  case $cap in
    # The Hopper family uses wgmma and setmaxnreg, which exist only in sm_90a's instruction set; every other GPU
    # runs the portable family, compiled for its own architecture.
    90) echo "90a-real" ;;
    *) echo "${cap}-real" ;;
  esac
}

cuda_major() {
  local nvcc=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
  [ -x "$nvcc" ] || return 0
  "$nvcc" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p' | head -n 1
}

case ${1:-} in
  arch) gpu_arch ;;
  cuda-major) cuda_major ;;
  *) echo "usage: tools/gpu.sh arch|cuda-major" >&2; exit 2 ;;
esac
