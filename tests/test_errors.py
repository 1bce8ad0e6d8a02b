"""Every error jaxlight raises on purpose is a `JaxlightError` that also keeps its builtin type
(so `except ValueError` / `except TypeError` in user code keeps working)."""

from __future__ import annotations

import pathlib
import re

import jax.numpy as jnp
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks, nn
from jaxlight._errors import JaxlightError
from jaxlight._layout import activation_sharding, constrain
from jaxlight.callbacks._logdir import require
from jaxlight.nn._layers import annotated_param, apply_rope
from jaxlight.nn._scan import remat_policy

ROOT = pathlib.Path(jl.__file__).parent
# Raised and caught inside jaxlight (_verify, _flops): not errors a user can hit.
INTERNAL = {("_verify.py", "ValueError"), ("_flops.py", "ValueError")}


def test_no_bare_builtin_raise_in_jaxlight():
    bare = []
    for path in sorted(ROOT.rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            m = re.search(r"\braise (ValueError|TypeError|RuntimeError|KeyError|"
                          r"ModuleNotFoundError|ImportError)\(", line)
            if m and (path.name, m.group(1)) not in INTERNAL:
                bare.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not bare, "raise a JaxlightError subclass instead:\n" + "\n".join(bare)


def _mesh_constrain():
    import jax
    from jax.sharding import Mesh

    mesh = Mesh(jax.devices()[:1], ("data",))
    with activation_sharding(mesh, (("batch", "data"),)):
        constrain(jnp.ones((2, 3)), ("batch",))


CASES = {
    "TransformerConfig heads": (lambda: nn.TransformerConfig(embed_dim=64, num_heads=3),
                                ValueError, "nearest: 2 or 4"),
    "TransformerConfig layers": (lambda: nn.TransformerConfig(num_layers=0), ValueError,
                                 "num_layers must be a positive int"),
    "Stacked": (lambda: nn.Stacked(lambda rngs: nnx.Linear(2, 2, rngs=rngs), 0,
                                   rngs=nnx.Rngs(0)), ValueError, "num_layers >= 1"),
    "remat": (lambda: remat_policy("some"), ValueError, "remat='some'"),
    "axes": (lambda: annotated_param(jnp.ones((2, 3)), ("embed",)), ValueError, "one name"),
    "Embed dtype": (lambda: nn.Embed(8, 4, rngs=nnx.Rngs(0))(jnp.ones((2,))), TypeError,
                    "integer token ids"),
    "rotary": (lambda: apply_rope(jnp.ones((1, 2, 1, 3)), jnp.arange(2)), ValueError, "even head"),
    "LambdaCallback": (lambda: callbacks.LambdaCallback(on_fitt_end=print), TypeError,
                       "unknown hook 'on_fitt_end'"),
    "constrain": (_mesh_constrain, ValueError, r"1 names \('batch',\) for a 2-d array"),
    "missing extra": (lambda: require("jaxlight_no_such_package", "x", "Thing"),
                      ModuleNotFoundError, r"pip install 'jaxlight\[x\]'"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_user_errors_are_jaxlight_errors(name):
    fn, builtin, match = CASES[name]
    with pytest.raises(JaxlightError, match=match) as info:
        fn()
    assert isinstance(info.value, builtin)
