"""Lightning's tuner: the learning-rate finder and the batch-size finder (`Tuner`,
`LearningRateFinder`, `BatchSizeFinder`).

The learning-rate sweep is a short fit of its own: the module's optimizer, built at a unit
learning rate, has its updates multiplied by the sweep's rate
(`jaxlight.schedules._scheduler.Scheduler`,
the way every jaxlight schedule is applied: Adam, SGD and AdamW updates are linear in the
rate), computed inside the one compiled step from the step counter. Its losses reach the host
one step late, as every logged metric does, so the early stop comes a step after Lightning's
(the extra step is cut from the results; the model is rebuilt afterwards anyway).

The batch-size search asks the compiled training step's memory analysis whether a batch size
fits in a device's memory, instead of running steps until one runs out; the sequence of tried
sizes is Lightning's (`search_batch_size`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxlight._errors import (
    ConfigurationError,
    DataError,
    JaxlightWarning,
    MissingDependency,
    ShardingError,
)
from jaxlight.callbacks._base import Callback, StepTransform
from jaxlight.schedules._configure import as_transformation
from jaxlight.schedules._scheduler import Scheduler

__all__ = ["BatchSizeFinder", "LRFinder", "LearningRateFinder", "Tuner", "search_batch_size"]

MODES = ("exponential", "linear")
LR_ATTRS = ("lr", "learning_rate")


# -- the learning-rate sweep -------------------------------------------------------------------


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
                num_sanity_val_steps=0, seed=fit.session.seed, prefetch_batches=0)
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


# -- the batch-size search ---------------------------------------------------------------------


def search_batch_size(fits: Callable[[int], bool], mode: str = "power", init_val: int = 2,
                      max_trials: int = 25, margin: float = 0.05, max_val: int = 8192,
                      dataset_length: int | None = None) -> int:
    """Lightning's `_run_power_scaling` / `_run_binsearch_scaling` with `fits(size)` in place of
    running steps until out of memory: the same sizes tried in the same order, the same answer.

    `power` doubles until a size does not fit (then halves once); `binsearch` doubles, then
    bisects between the last size that fit and the first that did not, and takes `margin` off
    the result. A size at or above `dataset_length` (a batch cannot grow past the data) or at
    `max_val` ends the search; `max_trials` bounds the sizes that fit.
    """
    size = int(init_val)

    def adjust(value: int) -> tuple[int, bool]:
        nonlocal size
        if dataset_length is not None and size >= dataset_length:
            return size, False
        new = min(int(value), max_val)
        changed, size = new != size, new
        return size, changed

    if mode == "power":
        any_success = False
        for i in range(max_trials):
            if size >= max_val:
                break
            if fits(size):
                last = size
                if i + 1 >= max_trials:
                    size = last
                    break
                _, changed = adjust(int(size * 2.0))
                if not changed:
                    break
                any_success = True
            else:
                adjust(int(size * 0.5))
                if any_success:
                    break
        return size
    low, high, count = 1, None, 0
    while True:
        if size >= max_val:
            break
        if fits(size):
            last = size
            count += 1
            if count >= max_trials:
                size = last
                break
            low = size
            if high:
                if high - low <= 1:
                    break
                _, changed = adjust((high + low) // 2)
            else:
                _, changed = adjust(int(size * 2.0))
            if not changed:
                break
        else:
            high = size
            adjust((high + low) // 2)
            if high - low <= 1:
                break
    if margin > 0:
        size = max(1, int(size * (1 - margin)))
    return size


def device_memory_limit() -> int:
    """Bytes one device may use: the device's own limit (GPU, TPU), else the host's memory
    shared by its local devices (CPU)."""
    device = jax.local_devices()[0]
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - a backend without memory stats
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(total // max(1, jax.local_device_count()))


def step_bytes(memory: dict[str, int]) -> int:
    """Peak per-device bytes of a compiled step from its memory analysis: arguments, outputs
    not aliased to (donated) arguments, temporaries and code."""
    return (memory.get("argument", 0) + memory.get("output", 0) - memory.get("alias", 0)
            + memory.get("temp", 0) + memory.get("generated_code", 0))


def _first_batch(train_data, datamodule, module, fresh: bool):
    source = train_data
    if source is None and datamodule is not None:
        if fresh:  # the tuner's own call; inside a fit, the fit has set it up
            datamodule.setup("fit")
        source = datamodule.train_dataloader()
    if source is None and callable(getattr(module, "train_dataloader", None)):
        source = module.train_dataloader()
    if source is None:
        raise ConfigurationError(
            "the batch-size finder needs training data: pass train_dataloaders= or "
            "datamodule=, whose train_dataloader() reads the batch size attribute.")
    return next(iter(source)), source


def _dataset_length(source) -> int | None:
    for name in ("num_examples", "dataset"):
        value = getattr(source, name, None)
        if isinstance(value, int):
            return value
        if value is not None:
            try:
                return len(value)
            except TypeError:
                pass
    return None


def _batch_holder(module, datamodule, name: str):
    for holder in (module, getattr(module, "hparams", None), datamodule):
        if holder is None:
            continue
        if isinstance(holder, dict) and isinstance(holder.get(name), int):
            return holder
        if not isinstance(holder, dict) and isinstance(getattr(holder, name, None), int):
            return holder
    raise ConfigurationError(
        f"the batch-size finder sets the batch size through an attribute named "
        f"{name!r} (batch_arg_name), which neither {type(module).__name__}, its hparams nor "
        "the datamodule has: add one that train_dataloader() reads, or name yours with "
        "batch_arg_name=.")


def run_scale_batch_size(fit, module, train_data, datamodule, *, mode: str, init_val: int,
                         max_trials: int, batch_arg_name: str, margin: float, max_val: int,
                         memory_limit: int | None = None,
                         fresh: bool = True) -> tuple[int, list[tuple[int, int]]]:
    """The largest batch size whose compiled training step fits in `memory_limit` bytes per
    device (default: `device_memory_limit()`), searched as Lightning's; sets the module's (or
    its hparams', or the datamodule's) `batch_arg_name`. Returns it and `(size, bytes)` per
    trial. Nothing runs: each trial compiles the step for that size and reads its analysis."""
    if mode not in ("power", "binsearch"):
        raise ConfigurationError(
            f"batch-size finder mode={mode!r}: use 'power' or 'binsearch'.")
    if not 0.0 <= margin < 1.0:
        raise ConfigurationError(f"batch-size finder margin={margin}: give 0 <= margin < 1.")
    if int(init_val) < 1 or int(max_trials) < 1:
        raise ConfigurationError(
            f"batch-size finder: init_val ({init_val}) and max_trials ({max_trials}) must be "
            ">= 1.")
    holder = _batch_holder(module, datamodule, batch_arg_name)
    batch, source = _first_batch(train_data, datamodule, module, fresh)
    length = _dataset_length(source)
    limit = device_memory_limit() if memory_limit is None else int(memory_limit)
    trials: list[tuple[int, int]] = []
    kept = module.assigned_model

    def fits(size: int) -> bool:
        rows = size if length is None else min(size, length)
        example = jax.tree.map(
            lambda x: np.broadcast_to(np.zeros((), np.asarray(x).dtype),
                                      (rows, *np.shape(x)[1:])), batch)
        try:
            used = step_bytes(fit.plan(module, example, verbose=False).memory)
        except (DataError, ShardingError) as err:
            raise type(err)(
                f"the batch-size finder cannot try a batch of {rows} under {fit.strategy.name}: "
                f"{err} A jaxlight batch is the global batch: give init_val a multiple of the "
                "data-parallel degree (mode='power' keeps it one; 'binsearch' may try "
                "midpoints that are not).") from err
        trials.append((rows, used))
        return used <= limit

    try:
        found = search_batch_size(fits, mode, int(init_val), int(max_trials), margin,
                                  int(max_val), length)
    finally:
        module.model = kept
    if isinstance(holder, dict):
        holder[batch_arg_name] = found
    else:
        setattr(holder, batch_arg_name, found)
        hparams = getattr(module, "hparams", None)
        if holder is module and isinstance(hparams, dict) and batch_arg_name in hparams:
            hparams[batch_arg_name] = found
    return found, trials


# -- the public names --------------------------------------------------------------------------


class Tuner:
    """Lightning's `Tuner(trainer)` for a `Fit`: `lr_find` and `scale_batch_size`.

    Example:
        >>> import jaxlight as jl
        >>> tuner = jl.Tuner(jl.Fit("single", max_epochs=1, enable_progress_bar=False))
    """

    def __init__(self, fit):
        self._fit = fit

    def lr_find(self, model, train_dataloaders=None, val_dataloaders=None, dataloaders=None,
                datamodule=None, method: str = "fit", min_lr: float = 1e-8, max_lr: float = 1,
                num_training: int = 100, mode: str = "exponential",
                early_stop_threshold: float | None = 4.0, update_attr: bool = True,
                attr_name: str = "") -> LRFinder | None:
        """Sweeps the learning rate from `min_lr` to `max_lr` over `num_training` steps
        (Lightning's arguments and meaning); returns an `LRFinder` (`results`, `suggestion()`,
        `plot()`), and with `update_attr` sets the module's `lr` (or `learning_rate`, or
        `attr_name`) to the suggestion. Validation data is not used by the sweep."""
        if method != "fit":
            raise ConfigurationError(
                f"Tuner.lr_find(method={method!r}): the learning-rate finder only works with "
                "method='fit' (as Lightning's).")
        data = train_dataloaders if train_dataloaders is not None else dataloaders
        return run_lr_find(self._fit, model, data, datamodule, min_lr=min_lr, max_lr=max_lr,
                           num_training=num_training, mode=mode,
                           early_stop_threshold=early_stop_threshold, update_attr=update_attr,
                           attr_name=attr_name)

    def scale_batch_size(self, model, train_dataloaders=None, val_dataloaders=None,
                         dataloaders=None, datamodule=None, method: str = "fit",
                         mode: str = "power", steps_per_trial: int = 3, init_val: int = 2,
                         max_trials: int = 25, batch_arg_name: str = "batch_size",
                         margin: float = 0.05, max_val: int = 8192, *,
                         memory_limit: int | None = None) -> int | None:
        """The largest batch size (Lightning's search, `mode` "power" or "binsearch") whose
        compiled training step fits in a device's memory, read from the step's memory
        analysis (`memory_limit`: bytes per device, default the device's limit); sets
        `batch_arg_name` on the module, its hparams or the datamodule, and returns it.
        `steps_per_trial` is accepted for Lightning's signature: no step runs."""
        if method != "fit":
            raise ConfigurationError(
                f"Tuner.scale_batch_size(method={method!r}): jaxlight measures the training "
                "step only; use method='fit'.")
        if self._fit.fast_dev_run:
            warnings.warn("Skipping the batch-size finder since fast_dev_run is on.",
                          JaxlightWarning, stacklevel=2)
            return None
        data = train_dataloaders if train_dataloaders is not None else dataloaders
        found, _ = run_scale_batch_size(
            self._fit, model, data, datamodule, mode=mode, init_val=init_val,
            max_trials=max_trials, batch_arg_name=batch_arg_name, margin=margin,
            max_val=max_val, memory_limit=memory_limit)
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


class BatchSizeFinder(Callback):
    """Lightning's `BatchSizeFinder`: before the fit's loaders are built, finds the largest
    batch size whose compiled training step fits in a device's memory (`Tuner.
    scale_batch_size`) and sets `batch_arg_name` on the module, its hparams or the
    datamodule, whose `train_dataloader()` then builds the fit's loader with it.

    Args:
        mode: "power" or "binsearch".
        steps_per_trial: accepted for Lightning's signature (no step runs: each trial reads
            the compiled step's memory analysis).
        init_val: the first size tried.
        max_trials: most sizes that fit before the search ends.
        batch_arg_name: the attribute holding the batch size.
        margin: binsearch's safety margin taken off the result.
        max_val: the largest size considered.
        memory_limit: bytes per device (default: the device's limit).

    Example:
        >>> from jaxlight import callbacks
        >>> finder = callbacks.BatchSizeFinder(mode="binsearch", init_val=8)
    """

    def __init__(self, mode: str = "power", steps_per_trial: int = 3, init_val: int = 2,
                 max_trials: int = 25, batch_arg_name: str = "batch_size",
                 margin: float = 0.05, max_val: int = 8192, *,
                 memory_limit: int | None = None):
        if mode not in ("power", "binsearch"):
            raise ConfigurationError(
                f"BatchSizeFinder(mode={mode!r}): use 'power' or 'binsearch'.")
        self._mode, self._steps_per_trial, self._init_val = mode, steps_per_trial, init_val
        self._max_trials, self._batch_arg_name = max_trials, batch_arg_name
        self._margin, self._max_val, self._memory_limit = margin, max_val, memory_limit
        #: The size found, and `(size, bytes per device)` for each trial.
        self.optimal_batch_size: int | None = None
        self.trials: list[tuple[int, int]] = []

    def setup(self, fit, module, stage: str) -> None:
        if stage != "fit" or fit.fast_dev_run:
            return
        datamodule = fit.datamodule
        if datamodule is None and not callable(getattr(module, "train_dataloader", None)):
            raise ConfigurationError(
                "BatchSizeFinder changes the batch size through train_dataloader(): give the "
                "fit a DataModule (Fit.fit(module, datamodule=dm)) whose train_dataloader() "
                f"reads its {self._batch_arg_name!r}, or use jl.Tuner(fit).scale_batch_size "
                "and build the loader with the size it returns.")
        self.optimal_batch_size, self.trials = run_scale_batch_size(
            fit, module, None, datamodule, mode=self._mode, init_val=self._init_val,
            max_trials=self._max_trials, batch_arg_name=self._batch_arg_name,
            margin=self._margin, max_val=self._max_val, memory_limit=self._memory_limit,
            fresh=False)
