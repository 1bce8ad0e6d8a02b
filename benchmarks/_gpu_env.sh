# Sourced by the accelerator scripts (gpu.sh, moe_gpu.sh) after they cd to the checkout: run
# from it without installing (PYTHONPATH), with the machine's own jax, flax, optax and orbax.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Later rounds load their compiled steps from the persistent cache instead of compiling again.
export JAXLIGHT_COMPILATION_CACHE="${JAXLIGHT_COMPILATION_CACHE:-/tmp/jaxlight_xla_cache}"
# JAX's default pool is 75% of the card; the ~1B step's 44 GiB activation buffer did not find
# a contiguous free block in it on an H200 (BFC fragmentation), so give it 95%.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}"
