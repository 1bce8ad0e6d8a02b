"""LearningRateMonitor: constant rates read from the optimizer, an optimizer jaxlight built
(`--optimizer AdamW`) logged without a warning, and a warning that points at the user's
`configure_optimizers` (it pointed at a JAX source file, the frame tracing the step)."""

from __future__ import annotations

import warnings

import jax
import numpy as np
import optax
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks
from jaxlight.optim import torch as torch_optim


class Lin(jl.TrainModule):
    def __init__(self, make):
        super().__init__()
        self.make = make

    def configure_model(self, rngs):
        return nnx.Linear(4, 1, rngs=rngs)

    def configure_optimizers(self):
        return self.make()

    def training_step(self, model, batch):
        return ((model(batch["x"]) - 1.0) ** 2).mean()


def _run(make, epochs=3):
    logs = {}
    fit = jl.Fit("single", max_epochs=epochs, log_every_n_steps=1, enable_progress_bar=False,
                 enable_model_summary=False, logger=False, enable_checkpointing=False,
                 num_sanity_val_steps=0,
                 callbacks=[callbacks.LearningRateMonitor(), callbacks.LambdaCallback(
                     on_log=lambda f, m, metrics, step: logs.update(
                         {step: {k: v for k, v in metrics.items() if k.startswith("lr")}}))])
    data = jl.data.DataLoader({"x": np.ones((16, 4), np.float32)}, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit.fit(Lin(make), data)
    return logs, [w for w in caught if "LearningRateMonitor" in str(w.message)]


def test_an_optimizer_jaxlight_built_logs_its_effective_rate_without_a_warning():
    """The command line's `--optimizer AdamW --optimizer.lr 0.003 --lr_scheduler StepLR
    --lr_scheduler.step_size 1` with LearningRateMonitor: Lightning logs the rate, 3e-3 then
    3e-4 and 3e-5 (StepLR's gamma 0.1); jaxlight warned that the rate was not exposed."""
    logs, warned = _run(lambda: torch_optim.configure_optimizers(
        torch_optim.AdamW(lr=0.003), torch_optim.StepLR(step_size=1)))
    assert not warned, [str(w.message) for w in warned]
    # Two steps per epoch, logged at steps 1..6.
    np.testing.assert_allclose([logs[s]["lr"] for s in (1, 2, 3, 4, 5, 6)],
                               [3e-3, 3e-3, 3e-4, 3e-4, 3e-5, 3e-5], rtol=1e-6)


def _hidden(rate):
    """An optimizer whose rate no closure names as optax does (a hand-written transform)."""
    def update(updates, state, params=None):
        return jax.tree.map(lambda g: -rate * g, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def test_the_hidden_rate_warning_points_at_configure_optimizers():
    logs, warned = _run(lambda: _hidden(0.1), epochs=1)
    assert len(warned) == 1 and "logs nothing" in str(warned[0].message)
    assert warned[0].filename == __file__, warned[0].filename
    assert warned[0].lineno == Lin.configure_optimizers.__code__.co_firstlineno
    assert all(not row for row in logs.values())
