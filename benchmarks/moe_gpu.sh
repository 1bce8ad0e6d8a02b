#!/usr/bin/env bash
# MoE MFU on one NVIDIA GPU (H200): `bash benchmarks/moe_gpu.sh`; see benchmarks/moe_mfu.py.
# Runs from a checkout (PYTHONPATH) with the machine's own jax/flax/optax/orbax, under 270 s,
# 95% of the card for JAX, the persistent compilation cache for round 2; copies the JSON and
# the log to $OUT when it is set.
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/_gpu_env.sh
out="${OUT:-}"
log="${out:-/tmp}/moe_gpu.log"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  timeout 270 python3 benchmarks/moe_mfu.py --preset h200 "$@"
  status=$?
  [ -n "$out" ] && cp benchmarks/results/moe_mfu_h200_*.json "$out"/ 2>/dev/null
  exit $status
} 2>&1 | tee "$log"
