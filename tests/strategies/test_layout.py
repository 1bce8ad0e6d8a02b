"""The one logical-axis lookup, the one mesh-shape grammar, and strategies without hidden state."""

from __future__ import annotations

import pytest
from jax.sharding import PartitionSpec

import jaxlight as jl
from jaxlight import strategies
from jaxlight.sharding._layout import logical_to_spec, partition_spec, rule_axes
from jaxlight.strategies._rules import DEFAULT_RULES, fill_mesh_shape, parse_mesh_shape


def test_lookup_error_names_path_dimension_axes_and_sizes():
    with pytest.raises(jl.ShardingError) as err:
        partition_spec({"data": 2, "fsdp": 2, "tp": 2}, [("batchy", ("data", "fsdp"))],
                       (6, 3), ("batchy", None), path="['blocks']['w']")
    assert str(err.value).startswith(
        "parameter ['blocks']['w']: dimension of size 6 (logical axis 'batchy') is not divisible "
        "by mesh axes ('data', 'fsdp') of total size 4 (data=2, fsdp=2; dimension 0 of shape "
        "(6, 3)). Change the model dimension to a multiple of 4, or map 'batchy' to another axis "
        "with rules=[('batchy', None), ...].")


def test_lookup_first_rule_wins_and_small_or_used_axes_drop_out():
    rules = [("mlp", "tp"), ("mlp", "fsdp"), ("embed", ("fsdp", "tp"))]
    assert rule_axes(rules, "mlp") == ("tp",)
    assert rule_axes(rules, "nothing") == ()
    # tp is used by the first dimension, so the second keeps only fsdp; size-1 data drops out.
    spec = partition_spec({"data": 1, "fsdp": 4, "tp": 2}, rules, (8, 8), ("mlp", "embed"),
                          path="w")
    assert spec == PartitionSpec("tp", "fsdp")
    assert partition_spec({"fsdp": 4}, DEFAULT_RULES, (3, 5), None, path="b") == PartitionSpec(
        None, None)


def test_activations_use_the_same_lookup():
    class FakeMesh:  # logical_to_spec reads only the mesh's shape
        shape = {"data": 4, "tp": 2}

    rules = [("batch", "data"), ("activation_mlp", "tp")]
    # A size-1 dimension (one example under evaluation's vmap) stays unsharded.
    assert logical_to_spec(FakeMesh, rules, ("batch", "activation_mlp"), (1, 6)) == PartitionSpec(
        None, "tp")
    with pytest.raises(jl.ShardingError, match=r"activation of shape \(6, 6\).*dimension of size "
                                               r"6 \(logical axis 'batch'\).*data=4"):
        logical_to_spec(FakeMesh, rules, ("batch", "activation_mlp"), (6, 6))


@pytest.mark.parametrize("form", [
    {"fsdp": 4, "tp": 2},
    [[4, 2], ["fsdp", "tp"]],
    [["fsdp", "tp"], [4, 2]],
    '{"fsdp": 4, "tp": 2}',
    "{fsdp: 4, tp: 2}",
    "fsdp=4,tp=2",
    '[[4, 2], ["fsdp", "tp"]]',
    "[[4, 2], [fsdp, tp]]",
    {"fsdp": 4, "model": 2},
    [[4, 2], ["fsdp", "tensor"]],
])
def test_one_mesh_grammar(form):
    assert parse_mesh_shape(form) == {"fsdp": 4, "tp": 2}
    assert strategies.Hybrid(form).mesh_shape == {"fsdp": 4, "tp": 2}


def test_mesh_aliases_and_refusals():
    assert parse_mesh_shape({"data": -1, "pipeline": 2}) == {"data": -1, "pipe": 2}
    with pytest.raises(jl.ConfigurationError, match=r"unknown mesh axis 'modl'.*Did you mean"):
        parse_mesh_shape({"modl": 2})
    with pytest.raises(jl.ConfigurationError, match=r"repeats an axis name \('tp', given as "
                                                    r"'model'\)"):
        parse_mesh_shape([[2, 2], ["tp", "model"]])
    with pytest.raises(jl.ConfigurationError, match=r"2 axes set to -1"):
        parse_mesh_shape("data=-1,fsdp=-1")
    with pytest.raises(jl.ConfigurationError, match=r"size 'x' of axis 'tp' is not an integer"):
        parse_mesh_shape("tp=x")
    with pytest.raises(jl.ConfigurationError, match=r"mesh_shape must be a dict"):
        parse_mesh_shape(8)


def test_fill_mesh_shape():
    assert fill_mesh_shape({"data": -1, "tp": 2}, 8, "Hybrid") == {"data": 4, "tp": 2}
    with pytest.raises(jl.ConfigurationError, match=r"other axes use 3 devices.*8 devices"):
        fill_mesh_shape({"data": 3, "fsdp": -1}, 8, "Hybrid")
    with pytest.raises(jl.ConfigurationError, match=r"has 4 devices but 8 are available"):
        fill_mesh_shape({"data": 2, "fsdp": 2}, 8, "Hybrid")


def test_strategies_hold_no_call_order_state():
    # What a step needs is passed or derived when it is compiled, never stored by an earlier
    # call (state_shardings used to store parameter specs; DDP toggled a flag around lowering;
    # pipelined strategies kept the config of their last trace).
    for strategy in (strategies.FSDP(), strategies.Hybrid({"data": 2, "pipe": 4}),
                     strategies.DDP(), strategies.TensorParallel(2)):
        before = set(vars(strategy))
        strategy.setup()
        assert set(vars(strategy)) - before <= {"devices"}, type(strategy).__name__
        assert not {"_param_specs", "_in_pmap", "_pipeline"} & set(vars(strategy))
