"""TrainModule: what a user subclasses."""

from __future__ import annotations

from typing import Any

import optax
from flax import nnx

from jaxlight._errors import (
    ConfigurationError,
    MissingAttributeError,
    MissingMethodError,
    PortingError,
)
from jaxlight.callbacks._base import Logger
from jaxlight.checkpoint import _restore
from jaxlight.hparams import _hparams
from jaxlight.metrics import _metrics
from jaxlight.module._hooks import ModuleHooks
from jaxlight.module._porting import GUIDE
from jaxlight.step import _guards

Batch = Any
Metrics = dict[str, Any]


class TrainModule(ModuleHooks, _hparams.HyperparametersMixin):
    """The user's side of training, with PyTorch Lightning's names.

    Subclass it, build the model in `configure_model`, the optimizer in `configure_optimizers`,
    and write `training_step`. Step methods are pure: they are traced once and compiled, so they
    must not read host state that changes between steps.

    Hooks with Lightning's names (`on_train_epoch_end(self)`, `setup(self, stage)`, ...; see
    `jaxlight.module._hooks`) run when defined here, after the callbacks' hooks of that name.

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
        self = super().__new__(cls, *args, **kwargs)  # records the hyperparameters
        object.__setattr__(self, "_model", None)
        object.__setattr__(self, "_model_source", None)
        object.__setattr__(self, "_trainer", None)
        return self

    def __init__(self):
        pass

    @classmethod
    def load_from_checkpoint(cls, path, strategy=None, **hparams):
        """Rebuilds the module from a checkpoint's hyperparameters and loads its parameters.

        Returns the module with `module.model` set, in eval mode (`nnx.Module.eval()`: dropout
        off, batch statistics read, not updated), ready for inference; call
        `module.model.train()` for the training behaviour. (Lightning returns its module in
        train mode and its docs call `.eval()` before inference; jaxlight does that for you.)
        `hparams` override recorded values (or give the ones recorded only as text, like arrays
        or a backbone passed to `__init__`).

        Example:
            >>> module = Classifier.load_from_checkpoint("checkpoints/100")  # doctest: +SKIP
            >>> logits = module.model(x)  # doctest: +SKIP
        """
        step_dir = _restore.resolve_checkpoint(None, path)
        if step_dir is None:
            raise _restore.CheckpointError(f"{path!r}: no checkpoint has been saved there yet.")
        module = _hparams.rebuild(cls, _restore.read_meta(step_dir), step_dir, hparams)
        _restore.load_checkpoint(step_dir, module, strategy)
        module.model.eval()
        return module

    @property
    def model(self) -> nnx.Module:
        """The `nnx.Module`: the current one while a fit, validate, test or predict runs (in
        every callback and module hook), the trained one afterwards.

        During a stage it is built from the train state on first access after each step
        (cached until the next): its arrays are the state's, in the strategy's layout, valid
        until the next step (which donates them), so call it there, e.g. `module.model(x)`,
        and copy what you keep. Assigning to its variables does not change training.

        After a multi-process fit that splits parameters across processes (FSDP), no process
        holds a whole parameter and `jax.device_get` refuses them: read the model with
        `jaxlight.distributed.gather(module.model)`, called on every process (a collective).
        """
        source = self._model_source
        live = source() if source is not None else None
        if live is not None:
            return live
        if self._model is None:
            raise MissingAttributeError(
                f"{type(self).__name__}.model is not built yet: call Fit(...).fit(module, data) "
                "(or jaxlight.load_checkpoint) first."
            )
        return self._model

    @model.setter
    def model(self, value: nnx.Module) -> None:
        object.__setattr__(self, "_model", value)

    def __setattr__(self, name: str, value: Any) -> None:
        # A compiled step holds what it read from self as constants: an assignment inside a
        # step runs once (noted for the trace-time check), one from a hook to an attribute a
        # compiled step read never reaches it (refused). See jaxlight.step._guards.
        if _guards.watching():
            _guards.note_assignment(name)
        elif self._model_source is not None:  # a stage runs
            _guards.refuse_assignment(self, name, value)
        super().__setattr__(name, value)

    # -- the run, as a LightningModule reaches it ---------------------------------------------

    def attach_trainer(self, fit) -> None:
        """Used by `Fit` when a stage starts: `self.trainer` is that Fit from then on."""
        object.__setattr__(self, "_trainer", fit)

    @property
    def trainer(self):
        """The `jaxlight.Fit` running (or that last ran) this module: Lightning's
        `self.trainer`, for module hooks (`self.trainer.callback_metrics`, ...)."""
        if self._trainer is None:
            raise MissingAttributeError(
                f"{type(self).__name__}.trainer: the module is not attached to a Fit yet; it is "
                "once Fit(...).fit/validate/test/predict(module, ...) starts."
            )
        return self._trainer

    def _run_value(self, name: str) -> Any:
        if _metrics.in_step():
            raise PortingError(
                f"{type(self).__name__}.{name} was read inside a step: the step is traced once "
                f"and compiled, so {name} would be the constant of the first trace, not the "
                "current value. Read it in a hook (on_train_batch_end, on_train_epoch_end, ...); "
                "for a step-dependent value inside the step, put an optax schedule in "
                f"configure_optimizers. See {GUIDE}."
            )
        return 0 if self._trainer is None else getattr(self._trainer, name)

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far (Lightning's `self.global_step`; 0 before a fit)."""
        return self._run_value("global_step")

    @property
    def current_epoch(self) -> int:
        """The current epoch (Lightning's `self.current_epoch`; 0 before a fit)."""
        return self._run_value("current_epoch")

    @property
    def loggers(self) -> list:
        """The run's logger callbacks (CSV, TensorBoard, Weights & Biases), in order."""
        if self._trainer is None:
            return []
        return [cb for cb in self._trainer.callbacks if isinstance(cb, Logger)]

    @property
    def logger(self):
        """The run's first logger (Lightning's `self.logger`), or None."""
        loggers = self.loggers
        return loggers[0] if loggers else None

    def attach_model_source(self, source) -> None:
        """Used by `Fit` while a stage runs: `model` reads the current model from `source()`
        (None when there is no state yet); `attach_model_source(None)` detaches it."""
        object.__setattr__(self, "_model_source", source)

    @property
    def assigned_model(self) -> nnx.Module | None:
        """The model last assigned to `module.model` (None if none), ignoring the live one."""
        return self._model

    # -- logging from inside steps (Lightning's self.log) -----------------------------------

    def log(self, name: str, value: Any, prog_bar: bool = False, logger: bool = True,
            on_step: bool | None = None, on_epoch: bool | None = None, reduce_fx: Any = "mean",
            sync_dist: bool = False, batch_size: Any = None, **ignored: Any) -> None:
        """Reports `value` (traced) from `training_step`, `validation_step` or `test_step`.

        The value joins the step's metrics; nothing is read on the host per step.

        - `training_step` (defaults `on_step=True, on_epoch=False`): `on_step` values reach the
          loggers every `log_every_n_steps`; `on_epoch=True` sums them on device over the epoch
          and logs the (batch_size-weighted) epoch mean at the epoch's end (named `name_step` /
          `name_epoch` when both are set, as in Lightning).
        - `validation_step` / `test_step` (default `on_epoch=True`): the exact mean over the whole
          evaluation, each batch weighted by its number of examples, or by `batch_size` (which
          may be traced, e.g. `mask.sum()` for a token-weighted loss). A `clu.metrics.Metric` or
          `Collection` is merged over every batch and computed once at the end.

        Args:
            name: the metric's name, used as given (no prefix).
            value: a scalar (array or number), or in evaluation a clu-style metric.
            prog_bar: show it on the progress bar (`TQDMProgressBar`).
            logger: False keeps the value from the loggers and `fit.logged_metrics`; it still
                reaches `fit.callback_metrics` (and the progress bar with `prog_bar`).
            on_step, on_epoch: see above; None picks the step kind's default.
            reduce_fx: how a training epoch's `on_epoch` values combine: "mean" (default),
                "max" or "min" (or jnp.mean / jnp.max / jnp.min); evaluation takes "mean"
                only (log a clu metric there for other aggregations).
            sync_dist: accepted and unnecessary: every value is already global (computed over
                the global batch, or reduced over replicas under DDP).
            batch_size: the weight of this value in means (default: the batch's leading
                dimension in evaluation, equal steps in training).

        Example:
            >>> # inside training_step: self.log("train_acc", acc, prog_bar=True, on_epoch=True)
        """
        del sync_dist
        if ignored:
            raise ConfigurationError(
                f"{type(self).__name__}.log got unsupported arguments {sorted(ignored)}; "
                "jaxlight's self.log takes name, value, prog_bar, on_step, on_epoch, reduce_fx, "
                "sync_dist and batch_size."
            )
        _metrics.active(type(self).__name__).add(
            name, value, prog_bar=prog_bar, on_step=on_step, on_epoch=on_epoch,
            batch_size=batch_size, reduce_fx=reduce_fx, logger=logger)

    def log_dict(self, dictionary: dict[str, Any], prog_bar: bool = False, logger: bool = True,
                 on_step: bool | None = None, on_epoch: bool | None = None,
                 reduce_fx: Any = "mean", sync_dist: bool = False, batch_size: Any = None,
                 **ignored: Any) -> None:
        """`self.log` for every `name: value` of `dictionary`, with the same options."""
        items = dictionary.items() if isinstance(dictionary, dict) else None
        if items is None:
            raise ConfigurationError(
                f"{type(self).__name__}.log_dict takes a dict of name -> value, got "
                f"{type(dictionary).__name__}; to log a clu Collection use self.log(name, it)."
            )
        for name, value in items:
            self.log(name, value, prog_bar=prog_bar, logger=logger, on_step=on_step,
                     on_epoch=on_epoch, reduce_fx=reduce_fx, sync_dist=sync_dist,
                     batch_size=batch_size, **ignored)

    def __call__(self, *args, **kwargs):
        # Lightning's self(x) runs forward; here the model is the step's argument. Setup finds
        # self(x) in the step's source (jaxlight.module._porting); this catches it where no source
        # is.
        raise PortingError(
            f"{type(self).__name__}(...) was called, Lightning's self(x); a TrainModule holds no "
            f"model: call the model the step receives, model(x). See {GUIDE}."
        )

    # Lightning's manual optimization, called from a step: refused with the jaxlight form.
    def optimizers(self, *args, **kwargs):
        self._manual_optimization("optimizers")

    def lr_schedulers(self, *args, **kwargs):
        self._manual_optimization("lr_schedulers")

    def toggle_optimizer(self, *args, **kwargs):
        self._manual_optimization("toggle_optimizer")

    def untoggle_optimizer(self, *args, **kwargs):
        self._manual_optimization("untoggle_optimizer")

    def manual_backward(self, *args, **kwargs):
        self._manual_optimization("manual_backward")

    def _manual_optimization(self, name: str):
        raise PortingError(
            f"{type(self).__name__}.training_step called self.{name}(...), Lightning's manual "
            "optimization; a TrainModule holds no optimizer objects. Set automatic_optimization "
            "= False and write training_step(self, model, batch, opt): opt.step('name', loss_fn) "
            "takes the gradient of loss_fn(model) for the parameters bound to that optimizer and "
            "applies its update (toggle_optimizer, manual_backward, step and untoggle_optimizer "
            "in one call); its learning rate follows the optimizer's own schedule. See "
            f"{GUIDE} ('A whole example: Lightning's GAN')."
        )

    # -- what a user implements -------------------------------------------------------------

    def configure_model(self, rngs: nnx.Rngs) -> nnx.Module:
        """Builds the model. Called abstractly first (`nnx.eval_shape`), then materialized."""
        raise MissingMethodError(
            f"{type(self).__name__} must implement configure_model(self, rngs) -> nnx.Module."
        )

    def configure_optimizers(self) -> optax.GradientTransformation:
        """Returns the optax transformation; the learning rate may be a schedule."""
        raise MissingMethodError(
            f"{type(self).__name__} must implement configure_optimizers(self) -> "
            "optax.GradientTransformation (for example optax.adamw(1e-3))."
        )

    def training_step(self, model: nnx.Module, batch: Batch):
        """Returns a scalar loss, or `(loss, {"name": scalar, ...})`."""
        raise MissingMethodError(
            f"{type(self).__name__} must implement training_step(self, model, batch) -> loss "
            "or (loss, metrics)."
        )

    def validation_step(self, model: nnx.Module, batch: Batch) -> Metrics:
        """Evaluates one whole batch (as the loader yields it, never padded).

        Returns a dict of scalar batch means (each weighted by the batch's examples over the
        evaluation) and clu metrics (merged over every batch), a clu `Collection`, or nothing
        after `self.log(...)`. Keys are prefixed `val_` (`test_` under `Fit.test`).
        """
        raise MissingMethodError(
            f"{type(self).__name__} has no validation_step(self, model, batch) -> dict; "
            "implement it to pass validation data to Fit."
        )

    def test_step(self, model: nnx.Module, batch: Batch) -> Metrics:
        """Like `validation_step` (its default), for `Fit.test`."""
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
