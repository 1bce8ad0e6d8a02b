"""Callback: host-side hooks with Lightning's names, plus optional step-transforming pieces."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxlight._errors import ConfigurationTypeError


class Callback:
    """Base class of all callbacks. Override only the hooks you need.

    Host hooks receive the `Fit` (read-only: to stop training call `fit.request_stop(reason)`)
    and the `TrainModule`. Training metrics reach the host through `on_log` at log intervals,
    already as Python floats and one step late, so that no hook forces the loop to wait for the
    device. `on_train_batch_end`'s `outputs` holds the step's metrics as device arrays: reading
    them (`float(...)`) waits for that step.

    Step-transforming callbacks override the `transform_*` / `process_gradients` methods; they
    are applied once, before the step is compiled.
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

    # -- checkpoints -------------------------------------------------------------------------
    def on_save_checkpoint(self, fit, module, checkpoint: dict) -> None: ...
    def on_load_checkpoint(self, fit, module, checkpoint: dict) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state saved in checkpoints (best score, patience counter, ...)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    @property
    def state_key(self) -> str:
        """Key of this callback's state in a checkpoint; unique per type by default."""
        return type(self).__qualname__

    # -- step-transforming pieces (identity by default) --------------------------------------
    def setup_step(self, strategy) -> None:
        """Called with the strategy just before the step is assembled from the pieces below.

        For pieces whose layout depends on the strategy (`GradientAccumulation` asks it how to
        scan microbatches); keep what you need, do not change the strategy.
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

    def transform_grad(self, grad_fn: Callable) -> Callable:
        """Wraps `grad_fn(params, rest, batch) -> ((loss, (metrics, rest)), grads)`.

        Runs before the cross-replica gradient reduction (per replica under DDP).
        """
        return grad_fn

    def process_gradients(self, grads: Any, metrics: dict) -> tuple[Any, dict]:
        """Sees the global gradients after reduction; may change them and add metrics."""
        return grads, metrics

    def transform_optimizer(self, tx):
        """Chains onto or wraps the optax transformation."""
        return tx

    def transform_step(self, step_fn: Callable) -> Callable:
        """Wraps the whole `train_step(state, batch) -> (state, metrics)`."""
        return step_fn


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
                import difflib

                close = difflib.get_close_matches(name, [n for n in dir(Callback)
                                                         if n.startswith("on_")], n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ConfigurationTypeError(f"LambdaCallback: unknown hook {name!r}.{hint}")
            setattr(self, name, fn)
