"""`import jaxlight` loads no optional dependency: they cost start-up time only where used.

Measured (`python -X importtime -c "import jaxlight"`, benchmarks/results/startup.json): the
import is jax, flax and optax; wandb, tensorboard, matplotlib or orbax would add 0.2-1 s each
to every run that does not use them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

OPTIONAL = ("orbax", "wandb", "tensorboard", "tensorboardX", "matplotlib", "clu", "grain",
            "sklearn", "torch", "datasets", "tensorflow", "tqdm", "pandas")


@pytest.mark.slow  # a fresh process; test_lazy_names checks a plain fit's imports fast
def test_import_jaxlight_loads_no_optional_dependency():
    loaded = f"{{m.split('.')[0] for m in sys.modules}} & {set(OPTIONAL)!r}"
    code = ("import sys, json, jaxlight, jaxlight.strategies, jaxlight.callbacks; "
            f"print(json.dumps(sorted({loaded})))")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
