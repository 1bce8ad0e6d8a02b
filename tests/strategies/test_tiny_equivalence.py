"""The fast tier's proof that every strategy reproduces one device: each trains a tiny model three
AdamW steps on 8 simulated devices, and its losses and parameters equal SingleDevice's.

The whole suite (`make test-all`) runs the longer versions: tests/strategies/test_equivalence.py
(10 steps of a larger LM), test_gpipe.py, test_interleaved.py, test_context.py and
tests/nn/test_stages_mpmd.py. Here the sizes are the smallest that still shard every parameter
(4 layers for 2 stages × 2 repeats, 2 heads for tp = 2, 16 positions for context = 2).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxlight import strategies
from tests.nn.stages_mlp import StageMLP, stage_data
from tests.strategies.lm import TinyLM, token_batches
from tests.strategies.test_equivalence import assert_params_close, train

STEPS = 3
RTOL = 1e-5


def _tiny_lm():
    return TinyLM(vocab=32, embed=16, layers=4, heads=2, mlp=32)


def _lm_data():
    return token_batches(STEPS, batch=16, length=17, vocab=32)


def _stage_mlp():
    return StageMLP(packed=False)


def _stage_data():
    data = stage_data(16 * STEPS)
    return [{k: v[i * 16:(i + 1) * 16] for k, v in data.items()} for i in range(STEPS)]


#: name -> (strategy, module, data): every strategy of docs/strategies.md at a tiny size.
CASES = {
    "ddp": (strategies.DDP, _tiny_lm, _lm_data),
    "dp": (strategies.DataParallel, _tiny_lm, _lm_data),
    "fsdp": (lambda: strategies.FSDP(min_shard_size=1), _tiny_lm, _lm_data),
    "tp": (lambda: strategies.TensorParallel(2), _tiny_lm, _lm_data),
    "hybrid": (lambda: strategies.Hybrid({"data": 2, "fsdp": 2, "tp": 2}, min_shard_size=1),
               _tiny_lm, _lm_data),
    "gpipe": (lambda: strategies.GPipe(2, 2, devices=jax.devices()[:2]), _tiny_lm, _lm_data),
    "interleaved": (lambda: strategies.GPipe(2, 2, repeats=2, devices=jax.devices()[:2]),
                    _tiny_lm, _lm_data),
    "context": (lambda: strategies.Hybrid({"data": 4, "context": 2}), _tiny_lm, _lm_data),
    "mpmd": (lambda: strategies.GPipe(3, 4, mpmd=True, devices=jax.devices()[:3]),
             _stage_mlp, _stage_data),
}


@pytest.fixture(scope="module")
def references():
    return {make_module: train(strategies.SingleDevice(), make_module(), make_data(), STEPS)
            for make_module, make_data in ((_tiny_lm, _lm_data), (_stage_mlp, _stage_data))}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_device(name, references):
    make_strategy, make_module, make_data = CASES[name]
    fit, losses, params = train(make_strategy(), make_module(), make_data(), STEPS)
    _, ref_losses, ref_params = references[make_module]
    assert fit.compile_counts["train"] == 1
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=0)
    assert_params_close(name, params, ref_params, RTOL)
