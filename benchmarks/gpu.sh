#!/usr/bin/env bash
# The accelerator benchmarks in one command, for one NVIDIA GPU (H100/H200):
#   bash benchmarks/gpu.sh            # results in benchmarks/results/mfu_*_<device>.json
# Runs from a checkout without installing it (PYTHONPATH), with the machine's own jax, flax,
# optax and orbax (jaxlight's other dependencies are imported only by callbacks this run does
# not use). Copies the JSON files and the log to $OUT when it is set (the device machine's
# output folder). Takes about 5 minutes on an H100: two presets, Fit and a hand-written loop
# alternated three times each.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-}"
log="${out:-/tmp}/gpu_bench.log"
{
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv || true
  python3 -c "import jax, flax, optax, orbax.checkpoint; print('jax', jax.__version__, \
'flax', flax.__version__, 'optax', optax.__version__, jax.devices())" || exit 1
  status=0
  python3 benchmarks/mfu.py --preset 125m --compare-hand --rounds 3 || status=1
  # ~1B at batch 8 x 2048 tokens: fits without recomputation on 80 GB.
  python3 benchmarks/mfu.py --preset 1b --batch 8 --remat none --compare-hand --rounds 3 \
    || status=1
  if [ -n "$out" ]; then cp benchmarks/results/mfu_*.json "$out"/ 2>/dev/null; fi
  exit $status
} 2>&1 | tee "$log"
