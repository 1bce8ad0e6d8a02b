"""TensorParallel(overlap=True): collective matmuls reproduce the synchronous path.

The rings (`jaxlight.nn._collective_matmul`) are checked against plain matmuls on sharded
inputs, forward and backward; then the tiny TransformerLM trains a few steps under
TensorParallel(2) and TensorParallel(4) with overlap on and off: losses and every parameter
agree to 1e-5, and the compiled step shows collective-permutes moving exactly the bytes of the
dense layers' all-reduces, which are gone.

The training comparison uses SGD with momentum: Adam divides each gradient coordinate by its
own running RMS (eps 1e-8), so a float-rounding difference on a coordinate whose gradient is
itself ~1e-8 becomes an O(learning rate) parameter difference, whatever the two paths compute.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxlight as jl
from jaxlight import callbacks, strategies
from jaxlight._errors import ShardingError
from jaxlight.analysis import _hlo
from jaxlight.callbacks import Callback
from jaxlight.nn import Dense
from jaxlight.nn._collective_matmul import collective_matmul_context
from tests.strategies.lm import TinyLM, token_batches

STEPS = 3
TOL = 1e-5
RULES = (("embed", None), ("heads", "tp"), ("mlp", "tp"), ("kv", None))


def _mesh(**shape: int) -> Mesh:
    size = int(np.prod(list(shape.values())))
    devices = np.asarray(jax.devices()[:size], dtype=object).reshape(tuple(shape.values()))
    return Mesh(devices, tuple(shape), axis_types=(AxisType.Auto,) * len(shape))


def _tp_collectives(text: str, tp: int, kinds=("all-reduce", "all-gather", "reduce-scatter")):
    """Collectives within tp groups whose JAX origin is a matmul (a dense layer)."""
    return [c for c in _hlo.collectives(text)
            if c.kind in kinds and c.group_size == tp and "dot_general" in c.op_name]


# -- the rings alone ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("data,fsdp,tp", [(2, 1, 4), (4, 1, 2), (2, 2, 2)])
def test_rings_match_matmul_forward_and_backward(data, fsdp, tp):
    """Attention-shaped column (E -> heads×kv) and row (heads×kv -> E) layers, with grads.

    Only `tp` is manual inside the rings: the batch stays split over `data` (and `fsdp`), and
    weights sharded over `fsdp` on their width are gathered by XLA as in the synchronous path.
    """
    mesh = _mesh(data=data, fsdp=fsdp, tp=tp)
    rng = np.random.default_rng(0)
    e, h, d = 16, 4, 8
    x = jnp.asarray(rng.normal(size=(8, 6, e)), jnp.float32)
    w_in = jnp.asarray(rng.normal(size=(e, h, d)) / np.sqrt(e), jnp.float32)
    w_out = jnp.asarray(rng.normal(size=(h, d, e)) / np.sqrt(h * d), jnp.float32)
    col_axes, row_axes = ("embed", "heads", "kv"), ("heads", "kv", "embed")

    def loss(x, w_in, w_out, cm):
        if cm is None:
            hid = jnp.einsum("ble,ehd->blhd", x, w_in)
            y = jnp.einsum("blhd,hde->ble", jnp.tanh(hid), w_out)
        else:
            hid = cm.dense(x, w_in, 1, col_axes)
            y = cm.dense(jnp.tanh(hid), w_out, 2, row_axes)
        return jnp.sum(jnp.sin(y)), y

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    (ref_loss, ref_y), ref_grads = jax.jit(lambda *a: grad(*a, None))(x, w_in, w_out)
    with jax.set_mesh(mesh), collective_matmul_context(mesh, RULES) as cm:
        args = (jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"), None, "tp"))),
                jax.device_put(w_in, NamedSharding(mesh, P("fsdp", "tp"))),
                jax.device_put(w_out, NamedSharding(mesh, P("tp", None, "fsdp"))))
        step = jax.jit(lambda *a: grad(*a, cm))
        (out_loss, out_y), grads = step(*args)
        text = step.lower(*args).compile().as_text()

    np.testing.assert_allclose(out_y, ref_y, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(out_loss, ref_loss, rtol=TOL)
    for got, want in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)
    # The row layer's output stays sharded over tp on its width (the reduce-scatter layout).
    assert out_y.sharding.spec[-1] == "tp"
    found = _hlo.collectives(text)
    # Forward: one all-gather ring and one reduce-scatter ring; backward: one of each again.
    permutes = [c for c in found if c.kind == "collective-permute"]
    assert sum(c.executions for c in permutes) == 4 * (tp - 1)
    assert not _tp_collectives(text, tp)


def test_indivisible_width_is_refused():
    """A contracted width the ring cannot split is refused with the numbers."""
    mesh = _mesh(data=2, tp=4)
    layer = Dense(6, 8, axes=("embed", "mlp"), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(layer)

    def apply(state, x):
        return nnx.merge(graphdef, state)(x)

    expected = r"first input dimension \(6\).*tp=4.*multiples of 4.*overlap=False"
    with (jax.set_mesh(mesh), collective_matmul_context(mesh, RULES),
          pytest.raises(ShardingError, match=expected)):
        jax.jit(apply).lower(state, jnp.ones((4, 6)))


# -- training: overlap on vs off ---------------------------------------------------------------


class SgdLM(TinyLM):
    def configure_optimizers(self):
        return optax.sgd(0.1, momentum=0.9)


class LossRecorder(Callback):
    def __init__(self):
        self.losses: dict[int, float] = {}
        self.val_loss: float | None = None

    def on_log(self, fit, module, metrics, step):
        if "val_loss" in metrics:
            self.val_loss = metrics["val_loss"]
        elif "loss" in metrics:
            self.losses[step] = metrics["loss"]


def train(tp: int, overlap: bool, *, accumulate: int = 1, validate: bool = False):
    recorder = LossRecorder()
    module = SgdLM()
    fit = jl.Fit(strategies.TensorParallel(tp, overlap=overlap), max_steps=STEPS,
                 log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
                 logger=False, enable_checkpointing=False,
                 callbacks=[recorder] + ([callbacks.Microbatches(accumulate)] if accumulate > 1
                                         else []))
    fit.fit(module, token_batches(STEPS), token_batches(1, seed=1) if validate else None)
    return {
        "fit": fit,
        "losses": np.array([recorder.losses[s] for s in range(1, STEPS + 1)]),
        "val_loss": recorder.val_loss,
        "params": jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(module.model, nnx.Param))),
        "hlo": fit.compiled_train_step.as_text(),
    }


@pytest.fixture(scope="module")
def runs():
    cache: dict = {}

    def get(tp: int, overlap: bool):
        if (tp, overlap) not in cache:
            # Validation once (tp=2): the per-example vmap of evaluation over the shard_maps.
            cache[tp, overlap] = train(tp, overlap, validate=tp == 2)
        return cache[tp, overlap]

    return get


def _assert_same_run(got, want):
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=0, atol=TOL)
    flat_got = jax.tree_util.tree_leaves_with_path(got["params"])
    for (path, a), b in zip(flat_got, jax.tree.leaves(want["params"]), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=TOL, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_overlap_matches_synchronous_training(tp, runs):
    sync, overlap = runs(tp, False), runs(tp, True)
    assert overlap["fit"].strategy.describe()["overlap"] is True
    assert np.all(np.diff(sync["losses"]) < 0)  # it trains
    _assert_same_run(overlap, sync)
    if tp == 2:
        assert abs(overlap["val_loss"] - sync["val_loss"]) <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_overlap_hlo_permutes_replace_dense_all_reduces(tp, runs):
    sync, overlap = runs(tp, False)["hlo"], runs(tp, True)["hlo"]
    config = TinyLM().config
    batch, length = token_batches(1)[0]["tokens"].shape
    rows = batch // (8 // tp)  # examples per data shard
    act_bytes = rows * (length - 1) * config.embed_dim * 4  # one f32 (b, s, E) activation

    # Synchronous: the dense layers all-reduce activations within tp groups, forward
    # (attention and MLP outputs) and backward (their inputs), in every layer.
    dense_sync = [(c, dims) for c in _tp_collectives(sync, tp, ("all-reduce",))
                  for dt, dims in c.shapes if dt == "f32" and 4 * np.prod(dims) == act_bytes]
    assert sum(c.executions for c, _ in dense_sync) >= 4 * config.num_layers
    sync_traffic = sum(2 * (tp - 1) / tp * act_bytes * c.executions for c, _ in dense_sync)

    # Overlapped: none of them is left; collective-permutes of activation blocks move the same
    # bytes (a ring all-gather plus a ring reduce-scatter is an all-reduce).
    assert not _tp_collectives(overlap, tp)
    permutes = [c for c in _hlo.collectives(overlap) if c.kind == "collective-permute"]
    assert permutes and all("ppermute" in c.op_name for c in permutes)
    assert all(c.buffer_bytes == act_bytes // tp for c in permutes)
    assert sum(c.total_traffic_bytes for c in permutes) == pytest.approx(sync_traffic, rel=1e-9)
    assert not [c for c in _hlo.collectives(sync) if c.kind == "collective-permute"]


@pytest.mark.slow
def test_overlap_with_gradient_accumulation(runs):
    """Accumulation scans microbatches inside a shard_map manual over `data`; the rings nest
    inside it. Two microbatches of a mean loss give the full batch's gradient."""
    accumulated = train(2, True, accumulate=2)
    assert accumulated["fit"].compile_counts["train"] == 1
    _assert_same_run(accumulated, runs(2, False))
