"""Lightning's learning-rate finder: the sweep (`run_lr_find`), what it found (`LRFinder`) and
the callback that runs it at the start of a fit (`LearningRateFinder`).

The learning-rate sweep is a short fit of its own: the module's optimizer, built at a unit
learning rate, has its updates multiplied by the sweep's rate
(`jaxlight.schedules._scheduler.Scheduler`,
the way every jaxlight schedule is applied: Adam, SGD and AdamW updates are linear in the
rate), computed inside the one compiled step from the step counter. Its losses reach the host
one step late, as every logged metric does, so the early stop comes a step after Lightning's
(the extra step is cut from the results; the model is rebuilt afterwards anyway).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax

from jaxlight._errors import ConfigurationError, JaxlightWarning, MissingDependency
from jaxlight.callbacks._base import Callback, StepTransform
from jaxlight.schedules._configure import as_transformation
from jaxlight.schedules._scheduler import Scheduler

__all__ = ["LRFinder", "LearningRateFinder"]

MODES = ("exponential", "linear")
LR_ATTRS = ("lr", "learning_rate")


def sweep_rate(mode: str, min_lr: float, max_lr: float, num_training: int) -> Callable:
    """The rate of sweep step `i` (traceable), as Lightning's `_ExponentialLR`/`_LinearLR`:
    `min_lr` at step 0, then `r = (i + 1) / num_training` of the way (geometric or linear) to
    `max_lr` (Lightning's schedulers count one ahead after their first step)."""
    def rate(i):
        r = (jnp.asarray(i, jnp.float32) + 1.0) / num_training
        if mode == "linear":
            value = min_lr + r * (max_lr - min_lr)
        else:
            value = min_lr * (max_lr / min_lr) ** r
        return jnp.where(i == 0, jnp.float32(min_lr), value)

    return rate


def suggest(lrs: list[float], losses: list[float], skip_begin: int = 10,
            skip_end: int = 1) -> int | None:
    """The index Lightning's `suggestion` picks: the steepest descent of the loss with respect
    to the rate (`torch.gradient(losses, spacing=[lrs])`, second-order central differences),
    over the points left after skipping `skip_begin` and `skip_end` and dropping non-finite
    losses; None with fewer than two points."""
    kept = np.arange(len(losses))[skip_begin:-skip_end]
    loss = np.asarray(losses, np.float64)[skip_begin:-skip_end]
    rate = np.asarray(lrs, np.float64)[skip_begin:-skip_end]
    finite = np.isfinite(loss)
    loss, rate, kept = loss[finite], rate[finite], kept[finite]
    if len(loss) < 2:
        return None
    return int(kept[int(np.argmin(np.gradient(loss, rate)))])


class LRFinder:
    """What a learning-rate sweep found (Lightning's `_LRFinder`).

    Attributes:
        results: `{"lr": [...], "loss": [...]}`, one entry per sweep step (the loss smoothed
            as Lightning's: a bias-corrected running average with `beta=0.98`).
        mode, lr_min, lr_max, num_training: the sweep's settings.
    """

    def __init__(self, mode: str, lr_min: float, lr_max: float, num_training: int):
        self.mode, self.lr_min, self.lr_max = mode, lr_min, lr_max
        self.num_training = num_training
        self.results: dict[str, list[float]] = {"lr": [], "loss": []}
        #: The sweep's compiles per step kind (one "train": the rate is computed in the step).
        self.compile_counts: dict[str, int] = {}
        self._optimal_idx: int | None = None

    def suggestion(self, skip_begin: int = 10, skip_end: int = 1) -> float | None:
        """The rate at the steepest descent of the loss (None when too few points remain:
        increase `num_training` or the data)."""
        self._optimal_idx = suggest(self.results["lr"], self.results["loss"], skip_begin,
                                    skip_end)
        if self._optimal_idx is None:
            warnings.warn(
                f"LRFinder.suggestion: fewer than 2 finite losses remain after skipping "
                f"{skip_begin} at the start and {skip_end} at the end of "
                f"{len(self.results['loss'])}; increase num_training or the data.",
                JaxlightWarning, stacklevel=2)
            return None
        return self.results["lr"][self._optimal_idx]

    def plot(self, suggest: bool = False, show: bool = False, ax: Any = None):
        """The loss against the rate (log scale in exponential mode), as a matplotlib figure
        (the `plot` extra); `suggest` marks the suggestion."""
        try:
            import matplotlib.pyplot as plt  # optional: the `plot` extra, only to draw
        except ImportError:
            raise MissingDependency("LRFinder.plot needs matplotlib: pip install "
                                    "'jaxlight[plot]'.") from None
        fig, ax = (plt.subplots() if ax is None else (ax.figure, ax))
        ax.plot(self.results["lr"], self.results["loss"])
        if self.mode == "exponential":
            ax.set_xscale("log")
        ax.set_xlabel("Learning rate")
        ax.set_ylabel("Loss")
        if suggest and self.suggestion() is not None:
            i = self._optimal_idx
            ax.plot(self.results["lr"][i], self.results["loss"][i], markersize=10, marker="o",
                    color="red")
        if show:
            plt.show()
        return fig


class _LossRecorder(Callback):
    """Collects the sweep's losses (smoothed as Lightning's `_LRCallback`) and stops the sweep
    when the smoothed loss exceeds `early_stop_threshold` times the best one."""

    def __init__(self, rate: Callable, early_stop_threshold: float | None, beta: float = 0.98):
        self.rate, self.threshold, self.beta = rate, early_stop_threshold, beta
        self.lrs: list[float] = []
        self.losses: list[float] = []
        self.avg_loss = 0.0
        self.best_loss = 0.0
        self.stopped = False

    def on_log(self, fit, module, metrics, step) -> None:
        if "loss" not in metrics or self.stopped:
            return
        i = len(self.losses)
        current_step = i + 1  # Lightning's global_step after this step
        self.avg_loss = self.beta * self.avg_loss + (1 - self.beta) * metrics["loss"]
        smoothed = self.avg_loss / (1 - self.beta ** (current_step + 1))
        if (self.threshold is not None and current_step > 1
                and smoothed > self.threshold * self.best_loss):
            self.stopped = True
            fit.request_stop("the learning-rate finder's loss diverged")
        if smoothed < self.best_loss or current_step == 1:
            self.best_loss = smoothed
        self.lrs.append(float(self.rate(i)))
        self.losses.append(float(smoothed))


def lr_attr_name(module, attr_name: str) -> str:
    """The module attribute holding the learning rate: `attr_name`, else `lr`, else
    `learning_rate` (Lightning's `_determine_lr_attr_name`)."""
    names = (attr_name,) if attr_name else LR_ATTRS
    for name in names:
        if isinstance(getattr(module, name, None), int | float):
            return name
    raise ConfigurationError(
        f"the learning-rate finder sets the rate through an attribute of "
        f"{type(module).__name__} that configure_optimizers reads, but it has no numeric "
        f"{' or '.join(repr(n) for n in names)}: add one (self.lr = 1e-3, and "
        "optax.adam(self.lr) in configure_optimizers), or name yours with attr_name=.")


def _set_attr(module, name: str, value: float) -> None:
    setattr(module, name, value)
    hparams = getattr(module, "hparams", None)
    if isinstance(hparams, dict) and name in hparams:
        hparams[name] = value


def _unit_rate_optimizer(module, attr: str) -> optax.GradientTransformation:
    """The module's optimizer with its rate attribute set to 1 (its own lr_scheduler left out,
    as Lightning replaces it during the sweep), checked to depend on that attribute."""
    where = f"{type(module).__name__}.configure_optimizers()"
    saved = getattr(module, attr)

    def build(value):
        object.__setattr__(module, attr, value)
        try:
            out = as_transformation(type(module).configure_optimizers(module))
        finally:
            object.__setattr__(module, attr, saved)
        if isinstance(out, dict) and "optimizer" in out:
            out = as_transformation(out["optimizer"])
        if not isinstance(out, optax.GradientTransformation):
            raise ConfigurationError(
                f"the learning-rate finder sweeps one optimizer's rate; {where} returned "
                f"{type(out).__name__} (several named optimizers, or no optax "
                "transformation). Find each rate with a module that returns one optimizer.")
        return out

    unit = build(1.0)
    try:  # the attribute must reach the optimizer, or the sweep would sweep nothing
        params, grads = {"w": jnp.ones(3)}, {"w": jnp.full(3, 0.5)}
        a = unit.update(grads, unit.init(params), params)[0]["w"]
        other = build(2.0)
        b = other.update(grads, other.init(params), params)[0]["w"]
        same = bool(jnp.allclose(a, b))
    except Exception:  # noqa: BLE001 - an optimizer that needs the real parameters: unchecked
        same = False
    if same:
        raise ConfigurationError(
            f"the learning-rate finder sets {type(module).__name__}.{attr}, but {where} does "
            f"not read it (its updates do not change with {attr}): build the optimizer from "
            f"self.{attr}, e.g. optax.adam(self.{attr}).")
    return unit


class _Sweep(Callback):
    """The sweep's rate, multiplied onto the unit-rate optimizer's updates inside the step."""

    def __init__(self, rate: Callable):
        self.rate = rate

    def transform_optimizer(self, tx):
        return Scheduler(schedule=self.rate, plateau=None, interval="step").wrap(tx)


def _transforms_step(cb: Callback) -> bool:
    """Whether `cb` contributes to the compiled step (precision, clipping, accumulation...):
    the sweep keeps those, as Lightning's keeps the trainer's, and drops host callbacks."""
    return any(getattr(type(cb), name) is not member for name, member in vars(StepTransform)
               .items() if callable(member) and not name.startswith("_"))


def run_lr_find(fit, module, train_data, datamodule, *, min_lr: float, max_lr: float,
                num_training: int, mode: str, early_stop_threshold: float | None,
                update_attr: bool, attr_name: str) -> LRFinder | None:
    """The sweep as a fit of its own under `fit`'s strategy, devices, seed, epoch and batch
    limits and step transforms; `module.model` is left as it was (the next fit starts from
    the initial model); with `update_attr` the module's rate attribute takes the
    suggestion."""
    if mode not in MODES:
        raise ConfigurationError(f"learning-rate finder mode={mode!r}: use one of {MODES}.")
    if not (0 < min_lr < max_lr) or int(num_training) < 1:
        raise ConfigurationError(
            f"learning-rate finder: need 0 < min_lr < max_lr and num_training >= 1, got "
            f"min_lr={min_lr}, max_lr={max_lr}, num_training={num_training}.")
    if fit.fast_dev_run:
        warnings.warn("Skipping the learning-rate finder since fast_dev_run is on.",
                      JaxlightWarning, stacklevel=3)
        return None
    attr = lr_attr_name(module, attr_name)
    unit = _unit_rate_optimizer(module, attr)
    rate = sweep_rate(mode, float(min_lr), float(max_lr), int(num_training))
    recorder = _LossRecorder(lambda i: float(rate(i)), early_stop_threshold)
    transforms = [cb for cb in fit.callbacks if _transforms_step(cb)]
    # A Fit of the fit's own class (callbacks do not import the core). As Lightning's, the
    # sweep keeps the fit's epoch and batch limits (2 epochs of 8 batches: at most 16 steps).
    sweep = type(fit)(fit.strategy, devices=fit.session.devices, max_steps=int(num_training),
                max_epochs=fit.max_epochs, limit_train_batches=fit.limit_train_batches,
                callbacks=[*transforms, _Sweep(rate), recorder], log_every_n_steps=1,
                enable_progress_bar=False, enable_model_summary=False, logger=False,
                enable_checkpointing=False, num_sanity_val_steps=0, seed=fit.session.seed,
                prefetch_batches=0)
    kept = module.assigned_model
    object.__setattr__(module, "configure_optimizers", lambda: unit)
    try:
        sweep.fit(module, train_data, datamodule=datamodule)
    finally:
        object.__delattr__(module, "configure_optimizers")
        module.model = kept
    found = LRFinder(mode, min_lr, max_lr, int(num_training))
    found.results = {"lr": recorder.lrs, "loss": recorder.losses}
    found.compile_counts = dict(sweep.session.compile_counts)
    if update_attr:
        lr = found.suggestion()
        if lr is not None:
            _set_attr(module, attr, lr)
    return found


class LearningRateFinder(Callback):
    """Lightning's `LearningRateFinder`: at the start of the fit, sweeps the learning rate
    (`Tuner.lr_find`), sets the module's rate attribute to the suggestion, and trains with it
    from the initial model.

    Args:
        min_lr, max_lr: the sweep's range.
        num_training_steps: steps of the sweep.
        mode: "exponential" or "linear".
        early_stop_threshold: stop when the smoothed loss exceeds this many times the best
            (None: never).
        update_attr: set the module's `lr` / `learning_rate` / `attr_name` to the suggestion.
        attr_name: the attribute holding the rate (default: `lr`, else `learning_rate`).

    Example:
        >>> from jaxlight import callbacks
        >>> finder = callbacks.LearningRateFinder(min_lr=1e-5, max_lr=1.0,
        ...                                       num_training_steps=50)
    """

    def __init__(self, min_lr: float = 1e-8, max_lr: float = 1, num_training_steps: int = 100,
                 mode: str = "exponential", early_stop_threshold: float | None = 4.0,
                 update_attr: bool = True, attr_name: str = ""):
        if mode not in MODES:
            raise ConfigurationError(f"LearningRateFinder(mode={mode!r}): use one of {MODES}.")
        self._min_lr, self._max_lr = min_lr, max_lr
        self._num_training_steps, self._mode = num_training_steps, mode
        self._early_stop_threshold = early_stop_threshold
        self._update_attr, self._attr_name = update_attr, attr_name
        #: The sweep's `LRFinder` once it ran.
        self.optimal_lr: LRFinder | None = None

    def on_fit_start(self, fit, module) -> None:
        self.optimal_lr = run_lr_find(
            fit, module, fit.train_data, None, min_lr=self._min_lr, max_lr=self._max_lr,
            num_training=self._num_training_steps, mode=self._mode,
            early_stop_threshold=self._early_stop_threshold, update_attr=self._update_attr,
            attr_name=self._attr_name)
        if self._update_attr and self.optimal_lr is not None:
            fit.session.rebuild(module)  # the optimizer reads the new rate
