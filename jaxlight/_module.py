"""TrainModule: what a user subclasses."""

from __future__ import annotations

import inspect
from typing import Any

import optax
from flax import nnx

from jaxlight import _checkpoint, _hparams
from jaxlight._errors import PortingError
from jaxlight._module_hooks import ModuleHooks
from jaxlight._porting import GUIDE

Batch = Any
Metrics = dict[str, Any]


class TrainModule(ModuleHooks):
    """The user's side of training, with PyTorch Lightning's names.

    Subclass it, build the model in `configure_model`, the optimizer in `configure_optimizers`,
    and write `training_step`. Step methods are pure: they are traced once and compiled, so they
    must not read host state that changes between steps.

    Hooks with Lightning's names (`on_train_epoch_end(self)`, `setup(self, stage)`, ...; see
    `jaxlight._module_hooks`) run when defined here, after the callbacks' hooks of that name.

    Constructor arguments are recorded as hyperparameters (`module.hparams`, attribute access
    like `module.hparams.lr`) without any call from the subclass; `self.save_hyperparameters()`
    narrows the record as in Lightning (`ignore=`, argument names).

    Example:
        >>> import jaxlight as jl, optax
        >>> from flax import nnx
        >>> class Regressor(jl.TrainModule):
        ...     def __init__(self, lr=0.1):
        ...         super().__init__()
        ...         self.lr = lr
        ...     def configure_model(self, rngs):
        ...         return nnx.Linear(3, 1, rngs=rngs)
        ...     def configure_optimizers(self):
        ...         return optax.sgd(self.lr)
        ...     def training_step(self, model, batch):
        ...         return ((model(batch["x"]) - batch["y"]) ** 2).mean()
        >>> Regressor(lr=0.5).hparams
        {'lr': 0.5}
    """

    #: Which variables the optimizer updates. `nnx.LoRAParam` trains only LoRA adapters.
    trainable: Any = nnx.Param

    def __new__(cls, *args, **kwargs):
        self = super().__new__(cls)
        object.__setattr__(self, "_hparams", _hparams.init_arguments(cls, args, kwargs))
        object.__setattr__(self, "_model", None)
        object.__setattr__(self, "_model_source", None)
        return self

    def __init__(self):
        pass

    def save_hyperparameters(self, *names, ignore=None) -> None:
        """Records the `__init__` arguments as `self.hparams`, as Lightning does.

        Reads the arguments of the `__init__` that calls it (and of subclass `__init__`s above
        it) as they are at the call (an argument reassigned before the call is recorded as
        reassigned, and `load_from_checkpoint` passes that value back to `__init__`). Without a
        call, every constructor argument is recorded as given.

        Args:
            *names: record only these arguments; or one dict / Namespace to record as it is.
            ignore: argument names (or one name) to leave out, e.g. a backbone module.
        """
        frame = inspect.currentframe().f_back
        try:
            object.__setattr__(self, "_hparams", _hparams.collect(self, names, ignore, frame))
        finally:
            del frame  # no reference cycle through the caller's frame

    @property
    def hparams(self) -> _hparams.AttributeDict:
        """The hyperparameters (constructor arguments, defaults filled in): `hparams.lr` or
        `hparams["lr"]`. Checkpoints and loggers record them."""
        return self._hparams

    @classmethod
    def load_from_checkpoint(cls, path, strategy=None, **hparams):
        """Rebuilds the module from a checkpoint's hyperparameters and loads its parameters.

        Returns the module with `module.model` set. `hparams` override recorded values (or give
        the ones recorded only as text, like arrays or a backbone passed to `__init__`).

        Example:
            >>> module = Classifier.load_from_checkpoint("checkpoints/100")  # doctest: +SKIP
            >>> logits = module.model(x)  # doctest: +SKIP
        """
        step_dir = _checkpoint.resolve_checkpoint(None, path)
        if step_dir is None:
            raise _checkpoint.CheckpointError(f"{path!r}: no checkpoint has been saved there yet.")
        module = _hparams.rebuild(cls, _checkpoint.read_meta(step_dir), step_dir, hparams)
        _checkpoint.load_checkpoint(step_dir, module, strategy)
        return module

    @property
    def model(self) -> nnx.Module:
        """The `nnx.Module`: the current one while a fit, validate, test or predict runs (in
        every callback and module hook), the trained one afterwards.

        During a stage it is built from the train state on first access after each step
        (cached until the next): its arrays are the state's, in the strategy's layout, valid
        until the next step (which donates them), so call it there, e.g. `module.model(x)`,
        and copy what you keep. Assigning to its variables does not change training.
        """
        source = self._model_source
        live = source() if source is not None else None
        if live is not None:
            return live
        if self._model is None:
            raise AttributeError(
                f"{type(self).__name__}.model is not built yet: call Fit(...).fit(module, data) "
                "(or jaxlight.load_checkpoint) first."
            )
        return self._model

    @model.setter
    def model(self, value: nnx.Module) -> None:
        object.__setattr__(self, "_model", value)

    def attach_model_source(self, source) -> None:
        """Used by `Fit` while a stage runs: `model` reads the current model from `source()`
        (None when there is no state yet); `attach_model_source(None)` detaches it."""
        object.__setattr__(self, "_model_source", source)

    @property
    def assigned_model(self) -> nnx.Module | None:
        """The model last assigned to `module.model` (None if none), ignoring the live one."""
        return self._model

    def __call__(self, *args, **kwargs):
        # Lightning's self(x) runs forward; here the model is the step's argument. Setup finds
        # self(x) in the step's source (jaxlight._porting); this catches it where no source is.
        raise PortingError(
            f"{type(self).__name__}(...) was called, Lightning's self(x); a TrainModule holds no "
            f"model: call the model the step receives, model(x). See {GUIDE}."
        )

    # -- what a user implements -------------------------------------------------------------

    def configure_model(self, rngs: nnx.Rngs) -> nnx.Module:
        """Builds the model. Called abstractly first (`nnx.eval_shape`), then materialized."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement configure_model(self, rngs) -> nnx.Module."
        )

    def configure_optimizers(self) -> optax.GradientTransformation:
        """Returns the optax transformation; the learning rate may be a schedule."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement configure_optimizers(self) -> "
            "optax.GradientTransformation (for example optax.adamw(1e-3))."
        )

    def training_step(self, model: nnx.Module, batch: Batch):
        """Returns a scalar loss, or `(loss, {"name": scalar, ...})`."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement training_step(self, model, batch) -> loss "
            "or (loss, metrics)."
        )

    def validation_step(self, model: nnx.Module, batch: Batch) -> Metrics:
        """Returns a dict of scalar metrics averaged over the batch."""
        raise NotImplementedError(
            f"{type(self).__name__} has no validation_step(self, model, batch) -> dict; "
            "implement it to pass validation data to Fit."
        )

    def test_step(self, model: nnx.Module, batch: Batch) -> Metrics:
        """Returns a dict of scalar metrics; defaults to `validation_step`."""
        return self.validation_step(model, batch)

    def predict_step(self, model: nnx.Module, batch: Batch):
        """Returns a pytree of arrays with the batch as leading dimension; defaults to model(x)."""
        return model(batch["x"] if isinstance(batch, dict) else batch)

    # -- optional ---------------------------------------------------------------------------

    def tokens_per_batch(self, batch: Batch) -> int | None:
        """Tokens in one global batch, for throughput; None when the notion does not apply."""
        return None

    def flops_per_batch(self, batch: Batch) -> float | None:
        """Model FLOPs of one training step on this batch, if known analytically."""
        return None
