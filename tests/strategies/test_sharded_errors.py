"""Bad sharding input is refused before compiling, with the numbers and the parameter path."""

from __future__ import annotations

import warnings

import jax
import pytest

import jaxlight as jl
from jaxlight import strategies
from tests.models import Classifier, classification_data
from tests.strategies.lm import TinyLM, token_batches


def quiet_fit(strategy, **kw):
    return jl.Fit(strategy=strategy, max_steps=1, enable_progress_bar=False,
                  enable_model_summary=False, logger=False, **kw)


def test_mesh_shape_forms_and_fill():
    tunix = strategies.Hybrid([[2, 2, 2], ["data", "fsdp", "tp"]])
    tunix.setup()
    assert dict(tunix.mesh.shape) == {"data": 2, "fsdp": 2, "tp": 2}
    filled = strategies.Hybrid({"fsdp": -1, "tp": 2})
    filled.setup()
    assert dict(filled.mesh.shape) == {"fsdp": 4, "tp": 2}
    assert filled.data_parallel_size == 4
    tp = strategies.TensorParallel(2)
    tp.setup()
    assert dict(tp.mesh.shape) == {"data": 4, "tp": 2}
    assert strategies.resolve("tp").mesh_shape == {"tp": -1}
    assert isinstance(strategies.resolve("fsdp"), strategies.FSDP)
    assert isinstance(strategies.resolve("ddp"), strategies.DDP)


def test_mesh_size_must_match_devices():
    bad = strategies.Hybrid({"data": 3, "fsdp": 2})
    with pytest.raises(jl.ConfigurationError, match=r"has 6 devices but 8 are available"):
        bad.setup()
    with pytest.raises(jl.ConfigurationError, match=r"other axes use 3 devices.*8 devices"):
        strategies.Hybrid({"data": 3, "fsdp": -1}).setup()


def test_unknown_axis_name():
    with pytest.raises(jl.ConfigurationError,
                       match=r"unknown mesh axis 'dta'.*Did you mean 'data'"):
        strategies.Hybrid({"dta": 8})


def test_two_free_axes():
    with pytest.raises(jl.ConfigurationError, match=r"2 axes set to -1 \(\['data', 'fsdp'\]\)"):
        strategies.Hybrid([[-1, -1], ["data", "fsdp"]])


def test_bad_mesh_shape_forms():
    with pytest.raises(jl.ConfigurationError, match=r"2 sizes but 3 axis names"):
        strategies.Hybrid([[2, 4], ["data", "fsdp", "tp"]])
    with pytest.raises(jl.ConfigurationError, match=r"size 0"):
        strategies.Hybrid({"data": 0})
    with pytest.raises(jl.ConfigurationError, match=r"positive int"):
        strategies.TensorParallel(0)
    with pytest.raises(jl.ConfigurationError, match=r"a rule must be a pair"):
        strategies.FSDP(rules=[("mlp",)])


def test_indivisible_dimension_names_parameter():
    # TinyLM has 4 heads; 8-way tensor parallelism cannot split them.
    fit = quiet_fit(strategies.TensorParallel(8))
    with pytest.raises(jl.ShardingError, match=r"\['attn'\]\['out'\]\['kernel'\]: dimension of "
                                               r"size 4 \(logical axis 'heads'\) is not divisible "
                                               r"by mesh axes \('tp',\) of total size 8"):
        fit.fit(TinyLM(), token_batches(1))
    assert "train" not in fit.compile_counts


def test_tensor_parallel_needs_annotations():
    fit = quiet_fit(strategies.TensorParallel(2))
    with pytest.raises(jl.ShardingError, match=r"none of the model's 4 parameters is .*"
                                               r"\['l1'\]\['kernel'\] \(16, 32\).*"
                                               r"nnx.with_partitioning"):
        fit.fit(Classifier(), [classification_data(16)])
    assert "train" not in fit.compile_counts


def test_unused_rule_warns():
    fit = quiet_fit(strategies.FSDP(rules={"mpl": "fsdp"}))
    with pytest.warns(UserWarning, match=r"rule \('mpl' -> 'fsdp'\) names a logical axis no "
                                         r"parameter uses.*'mlp'"):
        fit.session.setup(TinyLM())


def test_used_and_activation_rules_do_not_warn():
    fit = quiet_fit(strategies.Hybrid({"fsdp": 4, "tp": 2},
                                      rules={"mlp": "tp", "activation_mlp": None}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit.session.setup(TinyLM())


def test_user_rules_override_defaults():
    fsdp = strategies.FSDP(rules={"embed": None, "mlp": "fsdp"})
    fit = quiet_fit(fsdp)
    fit.session.setup(TinyLM())
    specs = fit.session.shardings.params["blocks"]["layers"]["mlp"]
    assert tuple(specs["gate_up"]["kernel"].spec) == (None, None, None, "fsdp")
    assert tuple(specs["down"]["kernel"].spec) == (None, "fsdp", None)


def test_fsdp_unannotated_model_shards_largest_divisible_dim():
    fit = quiet_fit(strategies.FSDP(min_shard_size=16))
    fit.session.setup(Classifier(din=16, hidden=32))
    params = fit.session.shardings.params
    assert tuple(params["l1"]["kernel"].spec) == (None, "fsdp")  # (16, 32): 32 is largest
    assert tuple(params["l1"]["bias"].spec) == ("fsdp",)
    assert params["l2"]["bias"].is_fully_replicated  # 4 elements: replicated


def test_ddp_batch_not_divisible():
    fit = quiet_fit(strategies.DDP())
    with pytest.raises(jl.DataError, match=r"global batch size 12 .* not divisible by the "
                                           r"data-parallel degree 8"):
        fit.fit(Classifier(), [classification_data(12)])


def test_devices_are_eight():
    assert jax.device_count() == 8
