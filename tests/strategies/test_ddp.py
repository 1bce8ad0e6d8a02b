"""DDP (jax.pmap): same numbers as one device; no device axis leaks out."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import strategies
from jaxlight.data import ArrayLoader
from tests.models import Classifier, classification_data


def quiet_fit(strategy, **kw):
    return jl.Fit(strategy=strategy, max_steps=6, log_every_n_steps=1, enable_progress_bar=False,
                  enable_model_summary=False, logger=False, enable_checkpointing=False, **kw)


@pytest.fixture(scope="module")
def trained():
    data = classification_data(256)
    val = classification_data(40, seed=1)  # 40 = 5 per device; the last batch is padded
    out = {}
    for name, strategy in (("single", strategies.SingleDevice()), ("ddp", strategies.DDP())):
        module = Classifier()
        fit = quiet_fit(strategy)
        fit.fit(module, ArrayLoader(data, batch_size=32, shuffle=False))
        metrics = fit.validate(module, ArrayLoader(val, batch_size=24, shuffle=False))
        preds = fit.predict(module, [{"x": val["x"][:16]}])
        out[name] = (fit, module, metrics, preds)
    return out


@pytest.mark.slow
def test_ddp_matches_single_device(trained):
    single, ddp = trained["single"], trained["ddp"]
    assert ddp[0].compile_counts["train"] == 1
    assert ddp[0].logged_metrics["loss"] == pytest.approx(single[0].logged_metrics["loss"],
                                                          rel=1e-5)
    ref = nnx.to_pure_dict(nnx.state(single[1].model, nnx.Param))
    got = nnx.to_pure_dict(nnx.state(ddp[1].model, nnx.Param))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(ref),
                            strict=True):
        assert a.shape == b.shape, jax.tree_util.keystr(path)  # no leading device axis
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_ddp_validate_and_predict_match(trained):
    (_, _, m_single, p_single), (_, _, m_ddp, p_ddp) = trained["single"], trained["ddp"]
    assert set(m_ddp) == set(m_single)
    for key in m_single:
        assert m_ddp[key] == pytest.approx(m_single[key], rel=1e-5)
    assert p_ddp[0].shape == p_single[0].shape == (16, 4)
    np.testing.assert_allclose(p_ddp[0], p_single[0], rtol=1e-5, atol=1e-6)


def test_ddp_state_layout_and_round_trip(trained):
    fit = trained["ddp"][0]
    kernel = fit.state.params["l1"]["kernel"]
    assert kernel.shape == (8, 16, 32)  # one replica per device, internally
    assert len(kernel.sharding.device_set) == 8
    canonical = fit.strategy.to_canonical(fit.state)
    assert canonical.params["l1"]["kernel"].shape == (16, 32)
    assert canonical.step.shape == ()
    back = fit.strategy.from_canonical(canonical, fit.session.shardings)
    np.testing.assert_array_equal(np.asarray(back.params["l1"]["kernel"]), np.asarray(kernel))
    assert fit.strategy.describe()["mesh"] == {"ddp": 8}


def test_ddp_reductions_are_identity_outside_pmap():
    strategy = strategies.DDP()
    strategy.setup()
    grads = {"w": np.ones(3)}
    assert strategy.reduce_gradients(grads) is grads
    with pytest.raises(ValueError, match="'mean' or 'sum'"):
        strategy.reduce_metrics({}, op="max")
