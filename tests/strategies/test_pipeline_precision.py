"""Pipelines under `precision="bf16-mixed"`: they train, and as one device does.

With jax 0.10.2 an SPMD pipeline (GPipe over `Stacked` or `Stages`, the interleaved schedule)
under bf16-mixed aborted the whole process inside XLA ("Invalid binary instruction opcode
copy"): the schedule's bf16 all-reduces (the stage outputs handed to every device, the
parameters' gradients) are promoted to float32 by XLA:CPU, which rebuilds their reduction and
fails on the sharding constraint jax puts in it. The schedule now adds bf16 in float32.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxlight as jl
from jaxlight import callbacks, strategies
from tests.nn.stages_mlp import StageMLP, stage_data
from tests.strategies.interleaved_net import Regression, regression_data


def _losses(strategy, module, loader, steps=3) -> np.ndarray:
    got = []
    log = callbacks.LambdaCallback(on_log=lambda f, m, metrics, step: got.append(
        metrics["loss"]))
    fit = jl.Fit(strategy=strategy, max_steps=steps, log_every_n_steps=1, callbacks=[log],
                 enable_progress_bar=False, enable_model_summary=False, logger=False,
                 enable_checkpointing=False, precision="bf16-mixed")
    fit.fit(module, loader)
    return np.asarray(got)


def _regression_loader():
    batches = regression_data(3)
    arrays = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
    return jl.data.ArrayLoader(arrays, len(batches[0]["y"]))


CASES = {
    "gpipe_stacked": (lambda: strategies.GPipe(4, 4, devices=jax.devices()[:4]), Regression,
                      _regression_loader),
    "interleaved": (lambda: strategies.GPipe(4, 4, repeats=2, devices=jax.devices()[:4]),
                    Regression, _regression_loader),
    "gpipe_stages": (lambda: strategies.GPipe(3, 4, devices=jax.devices()[:6]), StageMLP,
                     lambda: jl.data.ArrayLoader(stage_data(72), 24)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_bf16_mixed_pipelines_train_as_one_device(case):
    make_strategy, module, loader = CASES[case]
    ref = _losses("single", module(), loader())
    got = _losses(make_strategy(), module(), loader())
    # The logged loss is computed in bf16: one bf16 rounding (2^-8) apart at most, from the
    # microbatches' partial sums.
    np.testing.assert_allclose(got, ref, rtol=2.0 ** -8)
