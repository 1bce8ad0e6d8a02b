"""Callback = host hooks (`HostHooks`) + step pieces (`StepTransform`), kept apart."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

from jaxlight._errors import ConfigurationTypeError


class StepTransform:
    """The pieces a callback may contribute to the compiled training step (identity by default).

    `jaxlight/step/_step.py` composes them, and nothing else does, in this order (innermost first):
    `transform_params` at state creation; `transform_loss_for_step` (`transform_loss`),
    `transform_grad`,
    `gradient_computation`, then the strategy's reduction, `process_gradients`,
    `transform_optimizer` and `transform_step` (the module docstring of `_step.py` shows the
    whole step). Each callback's pieces apply in the order of `Fit.callbacks`. They run once,
    before the step is compiled (the loss, gradient and gradient-computation pieces while it is
    traced), and never reach into the loop (optax style).

    A transform that keeps state on device keeps it where the step keeps all state: in the
    optimizer state through its own optax transformation (`NonFiniteGuard`'s
    `skip_nonfinite`, `MixedPrecision("16-mixed")`'s `dynamic_loss_scale`), so checkpoints
    carry it and every strategy shards it like the rest. Pieces read it from the states they
    are given (`transform_loss_for_step`, `transform_step`), never from attributes set while
    tracing.
    """

    def setup_step(self, strategy) -> None:
        """Called with the strategy just before the step is assembled from the pieces below.

        For pieces whose layout depends on the strategy; keep what you need, do not change the
        strategy (`gradient_computation` receives it too).
        """

    def transform_params(self, params: Any) -> Any:
        """Maps the trainable parameters as initialized to how the train state stores them.

        Runs once inside state creation, before the optimizer state is made from the result
        (and abstractly, on ShapeDtypeStructs, to fix the state's shapes and dtypes), so use
        only jax.numpy operations and keep the tree structure and shapes; `MixedPrecision(
        "bf16-true")` casts floating parameters to bfloat16 here.
        """
        return params

    def transform_loss(self, loss_fn: Callable) -> Callable:
        """Wraps `loss_fn(params, rest, batch) -> (loss, (metrics, rest))`."""
        return loss_fn

    def transform_loss_for_step(self, loss_fn: Callable, state: Any) -> Callable:
        """Wraps `loss_fn` for the step that starts from `state` (a traced `TrainState`).

        For a loss piece that depends on state this callback keeps in its own optax
        transformation: read it from `state.opt_state` (`MixedPrecision("16-mixed")` reads
        its loss scale). The step calls this, not `transform_loss`, while it is traced; the
        default applies `transform_loss(loss_fn)`, so override either.
        """
        del state
        return self.transform_loss(loss_fn)

    def transform_grad(self, grad_fn: Callable) -> Callable:
        """Wraps `grad_fn(params, rest, batch) -> ((loss, (metrics, rest)), grads)`.

        Runs before the cross-replica gradient reduction (per replica under DDP).
        """
        return grad_fn

    def gradient_computation(self, compute: Callable, strategy) -> Callable:
        """Chooses how the step computes gradients over its batch under `strategy`.

        `compute(grad_fn) -> grad_fn` is the choice so far: the strategy's own layout
        (`strategy.gradient_fn`: FSDP gathers once and reduce-scatters once) unless an earlier
        callback replaced it. `GradientAccumulation` returns a microbatch scan laid out by the
        strategy (`strategy.accumulate_gradients`). Return `compute` to keep it.
        """
        del strategy
        return compute

    def process_gradients(self, grads: Any, metrics: dict) -> tuple[Any, dict]:
        """Sees the global gradients after reduction; may change them and add metrics."""
        return grads, metrics

    def transform_optimizer(self, tx):
        """Chains onto or wraps the optax transformation."""
        return tx

    def transform_step(self, step_fn: Callable) -> Callable:
        """Wraps the whole `train_step(state, batch) -> (state, metrics)`."""
        return step_fn

    def evaluation_state(self, state: Any) -> Any:
        """The train state that validation inside a fit, and the model when training ends,
        read in place of `state` (identity by default).

        `WeightAveraging` returns the state with the averaged parameters it keeps in its
        optimizer state, as Lightning swaps them in for validation and copies them into the
        module at the end of training. Only rearrange arrays already in `state` (no compute):
        it runs on the host between steps.
        """
        return state


class HostHooks:
    """The host-side hooks, with Lightning's names; each receives `(fit, module, ...)`.

    `fit` is read-only for a hook (to stop training call `fit.request_stop(reason)`). Training
    metrics reach the host through `on_log` at log intervals, already as Python floats and one
    step late, so that no hook forces the loop to wait for the device. `on_train_batch_end`'s
    `outputs` holds the step's metrics as device arrays: reading them (`float(...)`) waits for
    that step.
    """

    # -- lifecycle ---------------------------------------------------------------------------
    def setup(self, fit, module, stage: str) -> None: ...
    def teardown(self, fit, module, stage: str) -> None: ...
    def on_fit_start(self, fit, module) -> None: ...
    def on_fit_end(self, fit, module) -> None: ...
    def on_exception(self, fit, module, exception: BaseException) -> None: ...

    # -- training ----------------------------------------------------------------------------
    def on_train_start(self, fit, module) -> None: ...
    def on_train_end(self, fit, module) -> None: ...
    def on_train_epoch_start(self, fit, module) -> None: ...
    def on_train_epoch_end(self, fit, module) -> None: ...
    def on_train_batch_start(self, fit, module, batch: Any, batch_idx: int) -> None: ...
    def on_train_batch_end(self, fit, module, outputs: Any, batch: Any, batch_idx: int) -> None: ...
    def on_log(self, fit, module, metrics: dict[str, float], step: int) -> None: ...

    # -- evaluation --------------------------------------------------------------------------
    # The sanity check (`Fit(num_sanity_val_steps=...)`) runs validation_step on the first
    # validation batches before training; it calls these two hooks and no validation hook.
    def on_sanity_check_start(self, fit, module) -> None: ...
    def on_sanity_check_end(self, fit, module) -> None: ...
    def on_validation_start(self, fit, module) -> None: ...
    def on_validation_end(self, fit, module) -> None: ...
    def on_validation_epoch_start(self, fit, module) -> None: ...
    def on_validation_epoch_end(self, fit, module) -> None: ...
    def on_validation_batch_end(self, fit, module, batch: Any, batch_idx: int) -> None: ...
    def on_test_start(self, fit, module) -> None: ...
    def on_test_end(self, fit, module) -> None: ...
    def on_predict_start(self, fit, module) -> None: ...
    def on_predict_end(self, fit, module) -> None: ...
    # `outputs`: the batch's predict_step output on the host (NumPy, the global rows).
    def on_predict_batch_end(self, fit, module, outputs: Any, batch: Any,
                             batch_idx: int) -> None: ...
    def on_predict_epoch_end(self, fit, module) -> None: ...

    # -- checkpoints -------------------------------------------------------------------------
    def on_save_checkpoint(self, fit, module, checkpoint: dict) -> None: ...
    def on_load_checkpoint(self, fit, module, checkpoint: dict) -> None: ...


class Callback(HostHooks, StepTransform):
    """Base class of all callbacks: host hooks (`HostHooks`) and step pieces (`StepTransform`).

    Override only what you need. A callback's `state_dict()` goes into checkpoints and comes
    back through `load_state_dict()`.
    """

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state saved in checkpoints (best score, patience counter, ...)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    @property
    def state_key(self) -> str:
        """Key of this callback's state in a checkpoint; unique per type by default."""
        return type(self).__qualname__


class Logger(Callback):
    """Base class of the loggers (CSV, TensorBoard, Weights & Biases): `Fit(logger=True)` adds a
    `CSVLogger` only when the callbacks hold no `Logger`."""

    #: Kept for code that asked `getattr(cb, "is_logger", False)`; jaxlight checks the type.
    is_logger = True


class LambdaCallback(Callback):
    """A callback from keyword functions, for quick hooks.

    Example:
        >>> seen = []
        >>> cb = LambdaCallback(on_log=lambda fit, module, metrics, step: seen.append(step))
    """

    def __init__(self, **hooks: Callable):
        for name, fn in hooks.items():
            if not name.startswith("on_") and name not in ("setup", "teardown"):
                raise ConfigurationTypeError(
                    f"LambdaCallback: {name!r} is not a hook name (hooks start 'on_').")
            if not callable(getattr(Callback, name, None)):
                close = difflib.get_close_matches(name, [n for n in dir(Callback)
                                                         if n.startswith("on_")], n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ConfigurationTypeError(f"LambdaCallback: unknown hook {name!r}.{hint}")
            setattr(self, name, fn)
