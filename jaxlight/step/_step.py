"""Step assembly: the pure functions a fit compiles, built once from the module and callbacks.

This is the one place where step transforms (`jaxlight.callbacks.StepTransform`, which every
`Callback` is) are composed. A training step is `train_step(state, batch) -> (state, metrics)`,
put together from pieces that callbacks may wrap, innermost first, each piece applied in the
order of `Fit.callbacks` (each callback first sees the strategy in `setup_step`;
`transform_params` maps the parameters once, at state creation):

    loss_fn(params, rest, batch) -> (loss, (metrics, rest))           transform_loss_for_step
    grad_fn(params, rest, batch) -> ((loss, (metrics, rest)), grads)  transform_grad
    the gradient computation over the batch: strategy.gradient_fn     gradient_computation
        (Microbatches, GradientAccumulation: strategy.accumulate_gradients)
    -- strategy.reduce_gradients / reduce_metrics (DDP's pmean; identity under SPMD) --
    process(grads, metrics) -> (grads, metrics)                       process_gradients
    tx (optax; state a transform keeps lives in its optax state)      transform_optimizer
    train_step(state, batch) -> (state, metrics)                      transform_step

Each callback contributes a small composable piece (optax style); none reaches into the loop.

State a transform keeps on the device lives in the optimizer state, in an optax transformation
of its own (`transform_optimizer`). The pieces inside the step may read it from the state the
step starts from: the loss, gradient and gradient-computation pieces are composed while
`train_step(state, batch)` is traced, and `transform_loss_for_step(loss_fn, state)` receives
that `state` (its default applies `transform_loss(loss_fn)`). `MixedPrecision("16-mixed")`
reads its loss scale there (its loss piece scales the backward pass and unscales the gradients
leaving it); its optax `dynamic_loss_scale` skips overflowing updates and adjusts the scale; its
`transform_step` reads the verdict from the old and new optimizer states. No piece keeps
trace-time state on the callback, and no private metric carries values between pieces.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxlight._errors import StepOutputError
from jaxlight.metrics import _eval_totals, _metrics
from jaxlight.nn._pipeline import any_batch_size
from jaxlight.schedules import _configure
from jaxlight.sharding._layout import activation_sharding
from jaxlight.state import _frozen
from jaxlight.state._state import TrainState
from jaxlight.step import _guards
from jaxlight.step._user_step import call_user_step

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


def make_loss_fn(module, graphdef, log_spec: _metrics.LogSpec | None = None,
                 frozen: Any = None) -> LossFn:
    """The user's `training_step` as `loss_fn`; `self.log` values join its metrics (and their
    options `log_spec`). A write to a frozen parameter (`frozen`) is refused at the trace."""
    where = f"{type(module).__name__}.training_step"

    def loss_fn(params, rest, batch):
        model = nnx.merge(graphdef, params, rest)
        with _metrics.collecting("train", where) as logs:
            out = call_user_step(module.training_step, where, model, batch)
        loss, metrics = split_loss_output(out, where)
        metrics = _metrics.merge_training_logs(metrics, logs, log_spec, where)
        _, _, new_rest = nnx.split(model, module.trainable, ...)
        new_rest = nnx.to_pure_dict(new_rest)
        if _frozen.has_frozen(frozen):
            _guards.check_frozen_writes(rest, new_rest, frozen, where, module.trainable)
        metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
        return loss.astype(jnp.float32), (metrics, new_rest)

    return loss_fn


def build_train_step(
    module, graphdef, tx: optax.GradientTransformation, callbacks: Sequence, strategy,
    frozen: Any = None, log_spec: _metrics.LogSpec | None = None,
) -> StepFn:
    """Assembles the training step from the module and callbacks.

    `tx` is the final optimizer (after `transform_optimizer`, see `build_optimizer`).
    `frozen` is `ModelSpec.frozen` (the untrained `nnx.Param` leaves of `rest`).
    `log_spec`, when given, receives the options of every `self.log` call when the step is
    traced (the loop reads it after compiling).
    """
    for cb in callbacks:
        cb.setup_step(strategy)
    user_loss_fn = make_loss_fn(module, graphdef, log_spec, frozen)

    def gradients(state: TrainState) -> GradFn:
        """The step's gradient function, built while the step starting from `state` is traced
        (a loss piece may read state its callback keeps in the optimizer state)."""
        loss_fn = user_loss_fn
        for cb in callbacks:
            loss_fn = cb.transform_loss_for_step(loss_fn, state)
        grad_fn: GradFn = jax.value_and_grad(loss_fn, has_aux=True)
        for cb in callbacks:
            grad_fn = cb.transform_grad(grad_fn)
        # The strategy's own gradient layout (FSDP: gather once, reduce-scatter once), unless a
        # callback chooses another (GradientAccumulation: a microbatch scan the strategy lays
        # out).
        compute = strategy.gradient_fn
        for cb in callbacks:
            compute = cb.gradient_computation(compute, strategy)
        return compute(grad_fn)

    def train_step(state: TrainState, batch) -> tuple[TrainState, dict]:
        batch = strategy.relayout_batch(batch)
        (loss, (metrics, rest)), grads = gradients(state)(state.params, state.rest, batch)
        metrics = {"loss": loss, **metrics}  # a self.log("loss", ...) replaces the entry
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


def build_params_transform(callbacks: Sequence) -> Callable:
    """The callbacks' `transform_params` chained in order (the identity for most)."""

    def transform(params):
        for cb in callbacks:
            params = cb.transform_params(params)
        return params

    return transform


def build_optimizer(module, callbacks: Sequence) -> tuple[optax.GradientTransformation, Any]:
    """The optimizer the step applies, and the `lr_scheduler` of configure_optimizers' dict.

    Returns `(tx, scheduler)`: `tx` includes the scheduler's factor and every callback's
    `transform_optimizer`; `scheduler` is a `jaxlight.schedules._scheduler.Scheduler` or None.
    """
    tx, scheduler = _configure.resolve(module)
    for cb in callbacks:
        tx = cb.transform_optimizer(tx)
    return tx, scheduler


def build_eval_step(module, eval_graphdef, method: str, strategy, spec: _eval_totals.EvalSpec, *,
                    sharded: bool = True, dataloader_idx: int | None = None
                    ) -> tuple[Callable, Callable]:
    """`eval_step(state, batch, totals, first) -> totals`: one whole batch added to the totals.

    Also returns `batch_totals(state, batch)`, whose abstract output gives the totals' shapes.

    The user's step sees the batch as the loader yielded it (never padded). A returned scalar is
    weighted by the batch's leading dimension (one replica's share under DDP, then summed over
    replicas), a `self.log(..., batch_size=w)` value by `w`; mergeable (clu) metrics are merged.
    `first` starts a fresh evaluation (the zero `totals` are dropped, not merged).

    `sharded=False` is for a batch every device holds whole (a short last batch that the
    data-parallel degree does not divide): no cross-replica reduction, and no activation
    sharding constraints (they would ask to split its odd batch dimension).
    """
    user_fn = getattr(module, method)
    if dataloader_idx is not None:  # several loaders: the step is told which (as Lightning)
        user_fn = functools.partial(user_fn, dataloader_idx=dataloader_idx)
    where = f"{type(module).__name__}.{method}"

    def batch_totals(state: TrainState, batch) -> dict:
        model = nnx.merge(eval_graphdef, state.params, state.rest)
        rows = int(jax.tree.leaves(batch)[0].shape[0])
        with _metrics.collecting("eval", where) as logs, any_batch_size():
            out = call_user_step(user_fn, where, model, batch)
        totals = _eval_totals.eval_outputs(out, logs, spec, rows, where)
        return _eval_totals.gather_replicas(totals, strategy) if sharded else totals

    def unconstrained(state: TrainState, batch) -> dict:
        with activation_sharding(None):
            return batch_totals(state, batch)

    totals_fn = batch_totals if sharded else unconstrained

    def eval_step(state: TrainState, batch, totals: dict, first) -> dict:
        """Adds this batch's totals to `totals` (kept on device)."""
        return _eval_totals.accumulate(totals, totals_fn(state, batch), first, where)

    return eval_step, totals_fn


def build_predict_step(module, eval_graphdef, *, sharded: bool = True) -> Callable:
    """`predict_step(state, batch) -> outputs` on a whole batch (`sharded` as in
    `build_eval_step`)."""
    where = f"{type(module).__name__}.predict_step"

    def predict_step(state: TrainState, batch):
        model = nnx.merge(eval_graphdef, state.params, state.rest)
        with any_batch_size():
            if sharded:
                return call_user_step(module.predict_step, where, model, batch)
            with activation_sharding(None):
                return call_user_step(module.predict_step, where, model, batch)

    return predict_step
