"""Step assembly: the pure functions a fit compiles, built once from the module and callbacks.

A training step is `train_step(state, batch) -> (state, metrics)`, put together from pieces that
step-transforming callbacks may wrap, innermost first (each callback first sees the strategy in
`Callback.setup_step`; `Callback.transform_params` maps the parameters once, at state creation):

    loss_fn(params, rest, batch) -> (loss, (metrics, rest))           Callback.transform_loss
    grad_fn(params, rest, batch) -> ((loss, (metrics, rest)), grads)  Callback.transform_grad
    -- strategy.reduce_gradients / reduce_metrics (DDP's pmean; identity under SPMD) --
    process(grads, metrics) -> (grads, metrics)                       Callback.process_gradients
    tx (optax)                                                        Callback.transform_optimizer
    train_step(state, batch) -> (state, metrics)                      Callback.transform_step

Each callback contributes a small composable piece (optax style); none reaches into the loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxlight import _optim
from jaxlight._errors import StepOutputError
from jaxlight._state import TrainState
from jaxlight._user_step import call_user_step

LossFn = Callable[[Any, Any, Any], tuple[jax.Array, tuple[dict, Any]]]
GradFn = Callable[[Any, Any, Any], tuple[tuple[jax.Array, tuple[dict, Any]], Any]]
StepFn = Callable[[TrainState, Any], tuple[TrainState, dict]]


def split_loss_output(out: Any, where: str) -> tuple[jax.Array, dict]:
    """Normalizes `loss` or `(loss, metrics)`; refuses anything else with what it got."""
    metrics: dict = {}
    if isinstance(out, tuple | list):
        if len(out) != 2:
            raise StepOutputError(
                f"{where} returned a {type(out).__name__} of length {len(out)}; return a scalar "
                "loss or a pair (loss, {'metric': scalar, ...})."
            )
        if not isinstance(out[1], dict):
            second = out[1]
            kind = "array" if _is_array(second) else type(second).__name__
            raise StepOutputError(
                f"{where} returned (loss, {kind}): the second element must be a dict of scalar "
                f"metrics, got {_describe_value(second)}. Name each metric, for example "
                "return loss, {'accuracy': acc}; or return the loss alone."
            )
        out, metrics = out
    if not hasattr(out, "shape") or not hasattr(out, "dtype"):
        raise StepOutputError(
            f"{where} returned {type(out).__name__}; return a scalar loss array or a pair "
            "(loss, {'metric': scalar, ...})."
        )
    if out.shape != ():
        raise StepOutputError(
            f"{where} returned a loss of shape {tuple(out.shape)}; the loss must be a scalar "
            "(reduce it, for example with .mean())."
        )
    if not jnp.issubdtype(out.dtype, jnp.floating):
        raise StepOutputError(f"{where} returned a loss of dtype {out.dtype}; it must be floating.")
    check_scalar_metrics(metrics, where)
    return out, metrics


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _describe_value(x: Any) -> str:
    """'the float 3.0', 'a list of 1 element', 'an array of shape (4,) and dtype float32'."""
    if _is_array(x):
        return f"an array of shape {tuple(x.shape)} and dtype {x.dtype}"
    if isinstance(x, bool | int | float | complex | str):
        return f"the {type(x).__name__} {x!r}"
    if isinstance(x, tuple | list | set):
        n = len(x)
        return f"a {type(x).__name__} of {n} element{'s' if n != 1 else ''}"
    return f"a {type(x).__name__}"


def check_scalar_metrics(metrics: Any, where: str) -> None:
    if not isinstance(metrics, dict):
        raise StepOutputError(
            f"{where} returned metrics of type {type(metrics).__name__}; return a dict of scalars."
        )
    for name, value in metrics.items():
        shape = getattr(value, "shape", None)
        if shape is None and not isinstance(value, int | float):
            raise StepOutputError(
                f"{where} metric {name!r} is a {type(value).__name__}; metrics must be scalars."
            )
        if shape not in (None, ()):
            raise StepOutputError(
                f"{where} metric {name!r} has shape {tuple(shape)}; metrics must be scalars "
                "(reduce them over the batch, for example with .mean())."
            )


def make_loss_fn(module, graphdef) -> LossFn:
    def loss_fn(params, rest, batch):
        model = nnx.merge(graphdef, params, rest)
        where = f"{type(module).__name__}.training_step"
        loss, metrics = split_loss_output(
            call_user_step(module.training_step, where, model, batch), where
        )
        _, _, new_rest = nnx.split(model, module.trainable, ...)
        metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
        return loss.astype(jnp.float32), (metrics, nnx.to_pure_dict(new_rest))

    return loss_fn


def build_train_step(
    module, graphdef, tx: optax.GradientTransformation, callbacks: Sequence, strategy,
    frozen: Any = None,
) -> StepFn:
    """Assembles the training step from the module and callbacks.

    `tx` is the final optimizer (after `transform_optimizer`, see `build_optimizer`).
    `frozen` is `ModelSpec.frozen` (the untrained `nnx.Param` leaves of `rest`).
    """
    from jaxlight import _frozen

    for cb in callbacks:
        cb.setup_step(strategy)
    loss_fn = make_loss_fn(module, graphdef)
    for cb in callbacks:
        loss_fn = cb.transform_loss(loss_fn)

    grad_fn: GradFn = jax.value_and_grad(loss_fn, has_aux=True)
    for cb in callbacks:
        grad_fn = cb.transform_grad(grad_fn)
    if not any(getattr(cb, "computes_gradients", False) for cb in callbacks):
        # The strategy's own gradient layout (FSDP: gather once, reduce-scatter once), unless a
        # callback (GradientAccumulation) already asked the strategy for it.
        grad_fn = strategy.gradient_fn(grad_fn)

    def train_step(state: TrainState, batch) -> tuple[TrainState, dict]:
        (loss, (metrics, rest)), grads = grad_fn(state.params, state.rest, batch)
        metrics = {"loss": loss, **metrics}
        grads = strategy.reduce_gradients(grads)
        metrics = strategy.reduce_metrics(metrics)
        for cb in callbacks:
            grads, metrics = cb.process_gradients(grads, metrics)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        if _frozen.has_frozen(frozen):
            # Frozen parameters (a LoRA base) leave the step as they entered it, bit for bit:
            # a strategy's averaging of `rest` over replicas (meant for batch statistics) would
            # round them, and XLA drops that all-reduce of the whole base once it is unused.
            rest = _frozen.join(frozen, _frozen.select(rest, frozen, False),
                                _frozen.select(state.rest, frozen, True))
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                                  rest=rest)
        return new_state, metrics

    step: StepFn = train_step
    for cb in callbacks:
        step = cb.transform_step(step)
    return step


def build_params_transform(callbacks: Sequence) -> Callable | None:
    """The callbacks' `transform_params` chained in order, or None when none overrides it."""
    from jaxlight.callbacks._base import Callback

    active = [cb for cb in callbacks
              if type(cb).transform_params is not Callback.transform_params]
    if not active:
        return None

    def transform(params):
        for cb in active:
            params = cb.transform_params(params)
        return params

    return transform


def build_optimizer(module, callbacks: Sequence) -> tuple[optax.GradientTransformation, Any]:
    """The optimizer the step applies, and the `lr_scheduler` of configure_optimizers' dict.

    Returns `(tx, scheduler)`: `tx` includes the scheduler's factor and every callback's
    `transform_optimizer`; `scheduler` is a `jaxlight._optim.Scheduler` or None.
    """
    tx, scheduler = _optim.resolve(module)
    for cb in callbacks:
        tx = cb.transform_optimizer(tx)
    return tx, scheduler


def build_eval_step(module, eval_graphdef, method: str, strategy) -> tuple[Callable, Callable]:
    """`eval_step(state, batch, mask, totals) -> totals`: exact metric sums over real examples.

    Also returns `batch_sums(state, batch, mask)`, whose abstract output gives the zero totals.

    The user's step is vmapped over single examples so that every metric it returns (a batch
    mean) becomes a per-example value; padded examples are then masked out. The last partial
    batch is padded to the full size, so nothing recompiles.
    """
    user_fn = getattr(module, method)
    where = f"{type(module).__name__}.{method}"

    def per_example(params, rest, example):
        model = nnx.merge(eval_graphdef, params, rest)
        one = jax.tree.map(lambda x: x[None], example)
        out = call_user_step(user_fn, where, model, one)
        check_scalar_metrics(out, where)
        return {k: jnp.asarray(v, jnp.float32) for k, v in out.items()}

    def batch_sums(state: TrainState, batch, mask) -> dict:
        values = jax.vmap(per_example, in_axes=(None, None, 0))(state.params, state.rest, batch)
        # where, not multiply: a padded example's NaN must not leak into the sum.
        sums = {k: jnp.sum(jnp.where(mask, v, 0.0)) for k, v in values.items()}
        sums["__count__"] = jnp.sum(mask.astype(jnp.float32))
        return strategy.reduce_metrics(sums, op="sum")

    def eval_step(state: TrainState, batch, mask, totals: dict) -> dict:
        """Adds this batch's metric sums and example count to `totals` (kept on device)."""
        return jax.tree.map(jnp.add, totals, batch_sums(state, batch, mask))

    return eval_step, batch_sums


def build_predict_step(module, eval_graphdef) -> Callable:
    def predict_step(state: TrainState, batch):
        model = nnx.merge(eval_graphdef, state.params, state.rest)
        return call_user_step(module.predict_step, f"{type(module).__name__}.predict_step",
                              model, batch)

    return predict_step
