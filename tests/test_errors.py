"""Every error jaxlight raises on purpose is a `JaxlightError` that also keeps its builtin type
(so `except ValueError` / `except TypeError` in user code keeps working)."""

from __future__ import annotations

import ast
import pathlib
import re

import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks, nn, strategies
from jaxlight._errors import JaxlightError
from jaxlight.callbacks._logdir import require
from jaxlight.hparams._hparams import AttributeDict
from jaxlight.nn._layers import annotated_param, apply_rope
from jaxlight.nn._scan import remat_policy
from jaxlight.sharding._layout import activation_sharding, constrain

ROOT = pathlib.Path(jl.__file__).parent


class _Bare(jl.TrainModule):
    """A module that implements nothing."""


def _two_loss_scales():
    """The optimizer state of two MixedPrecision("16-mixed") callbacks in one Fit."""
    tx = optax.sgd(0.1)
    for _ in range(2):
        tx = callbacks.MixedPrecision("16-mixed").transform_optimizer(tx)
    return tx.init({"w": jnp.zeros(2)})
# Raised and caught inside jaxlight (_verify, _flops): not errors a user can hit.
INTERNAL = {("_verify.py", "ValueError"), ("_flops.py", "ValueError")}


def test_no_bare_builtin_raise_in_jaxlight():
    bare = []
    for path in sorted(ROOT.rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            m = re.search(r"\braise (ValueError|TypeError|RuntimeError|KeyError|"
                          r"ModuleNotFoundError|ImportError|NotImplementedError|"
                          r"AttributeError)\b", line)
            if m and (path.name, m.group(1)) not in INTERNAL:
                bare.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not bare, "raise a JaxlightError subclass instead:\n" + "\n".join(bare)


#: `assert` statements allowed in jaxlight: (file, the asserted expression) -> why no user input
#: reaches them. Empty: a state a user can reach (a strategy used before setup) is a real error.
ALLOWED_ASSERTS: dict[tuple[str, str], str] = {}


def test_no_assert_in_jaxlight():
    """`assert` vanishes under `python -O` and says nothing a user can act on."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        text = path.read_text()
        if "assert" not in text:  # no assert statement without the keyword: nothing to parse
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Assert):
                key = (path.name, ast.unparse(node.test))
                if key not in ALLOWED_ASSERTS:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: assert {key[1]}")
    assert not found, "raise a JaxlightError subclass instead:\n" + "\n".join(found)


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
    "configure_model": (lambda: _Bare().configure_model(nnx.Rngs(0)), NotImplementedError,
                        r"_Bare must implement configure_model\(self, rngs\) -> nnx.Module"),
    "configure_optimizers": (lambda: _Bare().configure_optimizers(), NotImplementedError,
                             r"_Bare must implement configure_optimizers\(self\) -> "
                             r"optax.GradientTransformation \(for example optax.adamw"),
    "training_step": (lambda: _Bare().training_step(None, {}), NotImplementedError,
                      r"_Bare must implement training_step\(self, model, batch\) -> loss"),
    "validation_step": (lambda: _Bare().validation_step(None, {}), NotImplementedError,
                        r"_Bare has no validation_step\(self, model, batch\) -> dict; "
                        "implement it to pass validation data"),
    "model before fit": (lambda: _Bare().model, AttributeError,
                         r"_Bare.model is not built yet: call Fit\(...\).fit\(module, data\)"),
    "hyperparameter": (lambda: AttributeDict(lr=0.1, hidden=8).lrr, AttributeError,
                       r"no hyperparameter 'lrr'; recorded: \['hidden', 'lr'\]\. "
                       r"Did you mean 'lr'\?"),
    "del hyperparameter": (lambda: delattr(AttributeDict(lr=0.1), "lrr"), AttributeError,
                           r"no hyperparameter 'lrr' to delete; recorded: \['lr'\]\. "
                           r"Did you mean 'lr'\?"),
    "DDP before setup": (lambda: strategies.DDP().num_replicas, RuntimeError,
                         r"DDP.num_replicas needs the device mesh, which DDP.setup\(devices\) "
                         r"builds; call strategy.setup\(\) first"),
    "DDP batch before setup": (lambda: strategies.DDP().batch_shardings({}), RuntimeError,
                               r"DDP.batch_shardings\(\) needs the device mesh"),
    "DDP state before setup": (lambda: strategies.DDP().state_shardings({"w": 1}, None),
                               RuntimeError, r"DDP.state_shardings\(\) needs the device mesh"),
    "replicated before setup": (lambda: strategies.GPipe(2).replicated(), RuntimeError,
                                r"GPipe.replicated\(\) needs the device mesh"),
    "FSDP before setup": (lambda: strategies.FSDP().state_shardings(None, None), RuntimeError,
                          r"FSDP.state_shardings\(\) needs the device mesh"),
    "DataParallel before setup": (lambda: strategies.DataParallel().batch_shardings({}),
                                  RuntimeError, r"DataParallel.batch_shardings\(\) needs"),
    "data_parallel_size before setup": (lambda: strategies.FSDP().data_parallel_size,
                                        RuntimeError, r"FSDP.batch_axes needs the device mesh"),
    "spec_for before setup": (lambda: strategies.TensorParallel(2).spec_for("w", (4,), None),
                              RuntimeError, r"TensorParallel.spec_for\(\) needs"),
    # (One loss-scale state per named optimizer is now legitimate; two MixedPrecision
    # callbacks are refused when the Fit assembles its callbacks.)
    "two loss scales": (lambda: jl.Fit("single", max_steps=1, callbacks=[
                            callbacks.MixedPrecision("16-mixed"),
                            callbacks.MixedPrecision("16-mixed")]).fit(None, []),
                        ValueError, r"Fit got 2 MixedPrecision callbacks"),
    "axis_size before setup": (lambda: strategies.Hybrid({"data": 2}).axis_size("data"),
                               RuntimeError, r"Hybrid.axis_size\(\) needs the device mesh"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_user_errors_are_jaxlight_errors(name):
    fn, builtin, match = CASES[name]
    with pytest.raises(JaxlightError, match=match) as info:
        fn()
    assert isinstance(info.value, builtin)
