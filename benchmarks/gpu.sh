#!/usr/bin/env bash
# The accelerator benchmarks in one command, for one NVIDIA GPU (H100/H200):
#   bash benchmarks/gpu.sh            # results in benchmarks/results/{mfu_*,gpu_paths}_<device>.json
# Runs from a checkout without installing it (PYTHONPATH), with the machine's own jax, flax,
# optax and orbax (jaxlight's other dependencies are imported only by callbacks this run does
# not use). Copies the JSON files, one profiler trace and the log to $OUT when it is set (the
# device machine's output folder). Sized for a 15-minute lease (about 8 minutes on an H200):
# the ~1B preset first (the MFU target), then the GPU-only code paths, then 125M; Fit and a
# hand-written loop alternated twice per preset, each part under its own time limit so that a
# slow or failing part does not take the others with it. ROUNDS=3 for a longer lease.
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/_gpu_env.sh
rounds="${ROUNDS:-2}"
out="${OUT:-}"
log="${out:-/tmp}/gpu_bench.log"
prof=/tmp/jaxlight_profile_1b
{
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv || true
  python3 -c "import jax, flax, optax, orbax.checkpoint; print('jax', jax.__version__, \
'flax', flax.__version__, 'optax', optax.__version__, jax.devices())" || exit 1
  status=0
  # ~1B at batch 8 x 2048 tokens: fits without recomputation on 80 GB. One more Fit round is
  # traced (not timed) with the Profiler callback, for reading where the step's time goes.
  timeout 330 python3 benchmarks/mfu.py --preset 1b --batch 8 --remat none --compare-hand \
    --rounds "$rounds" --steps 20 --profile-dir "$prof" || status=1
  timeout 150 python3 benchmarks/gpu_paths.py || status=1
  timeout 120 python3 benchmarks/mfu.py --preset 125m --compare-hand --rounds "$rounds" \
    || status=1
  if [ -n "$out" ]; then
    cp benchmarks/results/mfu_*_nvidia*.json benchmarks/results/gpu_paths_*.json "$out"/ \
      2>/dev/null
    trace=$(find "$prof" -name '*.trace.json.gz' -size -15M 2>/dev/null | head -n 1)
    [ -n "$trace" ] && cp "$trace" "$out"/trace_1b.json.gz
  fi
  exit $status
} 2>&1 | tee "$log"
