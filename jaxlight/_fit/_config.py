"""FitConfig: Fit's keyword arguments, checked once and frozen.

`Fit.__init__` builds one `FitConfig.create(...)`; everything downstream (the loop, evaluation,
callbacks reading `fit.config`) reads it and nothing changes it. `fast_dev_run` is applied here,
so the rest of the core never sees it as a special case.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from jaxlight._errors import ConfigurationError


def _check_batch_limit(name: str, value: Any, verb: str) -> None:
    """A batch limit is None, a positive int (batches) or a float fraction in (0, 1]; the
    validation limit may also be 0 (Lightning's way to turn validation off)."""
    if value is None or (name == "limit_val_batches" and not isinstance(value, bool)
                         and value in (0, 0.0)):
        return
    bad = (isinstance(value, bool) or not isinstance(value, int | float)
           or (isinstance(value, int) and value < 1)
           or (isinstance(value, float) and not 0.0 < value <= 1.0))
    if bad:
        skip = ("0 or no validation data to skip validation" if "val" in name
                else "set max_steps or max_epochs to train less")
        raise ConfigurationError(
            f"{name}={value!r} would {verb} no batch (or is not a batch count): give a positive "
            f"int (batches per epoch), a float fraction of an epoch in (0, 1], or None for "
            f"every batch; {skip}. (On the command line: --{name.replace('_', '-')}.)"
        )


@dataclasses.dataclass(frozen=True)
class FitConfig:
    """Validated `Fit` settings (see `Fit`'s docstring for each field's meaning)."""

    max_steps: int | None
    max_epochs: int | None
    max_time: Any
    precision: str | None
    accumulate_grad_batches: int
    gradient_clip_val: float | None
    gradient_clip_algorithm: str
    val_check_interval: int | float | None
    check_val_every_n_epoch: int | None
    limit_train_batches: int | float | None
    limit_val_batches: int | float | None
    num_sanity_val_steps: int
    log_every_n_steps: int
    enable_progress_bar: bool
    enable_model_summary: bool
    enable_checkpointing: bool
    logger: bool
    default_root_dir: str
    seed: int
    fast_dev_run: bool | int
    prefetch_batches: int | None

    @classmethod
    def create(
        cls,
        *,
        max_steps: int | None = None,
        max_epochs: int | None = None,
        max_time: Any = None,
        precision: str | None = None,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        val_check_interval: int | float | None = None,
        check_val_every_n_epoch: int | None = 1,
        limit_train_batches: int | float | None = None,
        limit_val_batches: int | float | None = None,
        num_sanity_val_steps: int = 2,
        log_every_n_steps: int = 50,
        enable_progress_bar: bool = True,
        enable_model_summary: bool = True,
        enable_checkpointing: bool | None = None,
        logger: bool = True,
        default_root_dir: str | os.PathLike = "jaxlight_logs",
        seed: int = 0,
        fast_dev_run: bool | int = False,
        prefetch_batches: int | None = None,
    ) -> FitConfig:
        """Checks the arguments (raising `ConfigurationError` with what to change) and applies
        `fast_dev_run` (1 or n training and validation batches, no loggers, no summary, no
        sanity check; `assemble_callbacks` adds no default checkpoint)."""
        if enable_checkpointing is None:  # Lightning's default, meaning True
            enable_checkpointing = True
        if not isinstance(enable_checkpointing, bool):
            raise ConfigurationError(
                f"enable_checkpointing={enable_checkpointing!r}: give True or None (the default: "
                "a ModelCheckpoint saving every epoch into <default_root_dir>/checkpoints unless "
                "callbacks has one) or False (no checkpoint).")
        if (isinstance(num_sanity_val_steps, bool) or not isinstance(num_sanity_val_steps, int)
                or num_sanity_val_steps < -1):
            raise ConfigurationError(
                f"num_sanity_val_steps={num_sanity_val_steps!r} is not a batch count: give the "
                "number of validation batches to run before training (the default 2), -1 (all), "
                "0 (none). (On the command line: --num-sanity-val-steps.)"
            )
        if fast_dev_run:
            n = 1 if fast_dev_run is True else int(fast_dev_run)
            max_steps, max_epochs = n, 1
            limit_train_batches, limit_val_batches, val_check_interval = n, n, None
            logger, enable_model_summary = False, False
            num_sanity_val_steps = 0  # as Lightning: the run itself validates n batches
        max_steps = None if max_steps == -1 else max_steps  # Lightning's "no step limit"
        for name, value in (("max_steps", max_steps), ("max_epochs", max_epochs),
                            ("log_every_n_steps", log_every_n_steps)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigurationError(f"{name} must be a positive integer, got {value!r}.")
        # Lightning's Trainer reads a whole float above 1 (a config's `2` that a parser typed
        # `int | float` as 2.0) as that many batches.
        limit_train_batches, limit_val_batches = (
            int(v) if isinstance(v, float) and v > 1 and v.is_integer() else v
            for v in (limit_train_batches, limit_val_batches))
        _check_batch_limit("limit_train_batches", limit_train_batches, "train on")
        _check_batch_limit("limit_val_batches", limit_val_batches, "validate on")
        if isinstance(val_check_interval, float) and not 0.0 < val_check_interval <= 1.0:
            raise ConfigurationError(
                f"val_check_interval={val_check_interval} as a float is a fraction of an epoch "
                "and must be in (0, 1]; pass an int to validate every N steps."
            )
        if prefetch_batches is not None and (not isinstance(prefetch_batches, int)
                                             or prefetch_batches < 0):
            raise ConfigurationError(
                f"prefetch_batches must be an integer >= 0 or None, got {prefetch_batches!r} (0 "
                "turns prefetching off; None, the default, reads 2 ahead in a thread unless the "
                "batches are in memory already, as an ArrayLoader's)."
            )
        return cls(
            max_steps=max_steps, max_epochs=max_epochs, max_time=max_time, precision=precision,
            accumulate_grad_batches=accumulate_grad_batches,
            gradient_clip_val=gradient_clip_val, gradient_clip_algorithm=gradient_clip_algorithm,
            val_check_interval=val_check_interval,
            check_val_every_n_epoch=check_val_every_n_epoch,
            limit_train_batches=limit_train_batches, limit_val_batches=limit_val_batches,
            num_sanity_val_steps=num_sanity_val_steps,
            log_every_n_steps=log_every_n_steps, enable_progress_bar=enable_progress_bar,
            enable_model_summary=enable_model_summary,
            enable_checkpointing=enable_checkpointing, logger=logger,
            default_root_dir=os.fspath(default_root_dir), seed=seed, fast_dev_run=fast_dev_run,
            prefetch_batches=prefetch_batches,
        )

    @property
    def validation_off(self) -> bool:
        """`limit_val_batches=0`: no validation at all (no sanity check, no hooks), as in
        Lightning."""
        return self.limit_val_batches is not None and self.limit_val_batches == 0

    def require_length(self) -> None:
        """`Fit.fit` needs a length; a Fit used only to validate, test or predict does not."""
        if self.max_steps is None and self.max_epochs is None and self.max_time is None:
            raise ConfigurationError(
                "Fit.fit needs max_steps, max_epochs or max_time (all are None): say how long to "
                "train, for example Fit(max_steps=1000), Fit(max_epochs=10) or "
                "Fit(max_time=\"00:12:00:00\"). (Lightning would silently train 1000 epochs; "
                "jaxlight asks.)"
            )

    def summary(self, strategy_name: str) -> dict[str, Any]:
        """The settings loggers record as the run's config (`Fit.config`)."""
        return {
            "strategy": strategy_name, "max_steps": self.max_steps,
            "max_epochs": self.max_epochs, "precision": self.precision,
            "accumulate_grad_batches": self.accumulate_grad_batches,
            "gradient_clip_val": self.gradient_clip_val,
            "log_every_n_steps": self.log_every_n_steps,
            "val_check_interval": self.val_check_interval, "seed": self.seed,
        }


def batch_limit(limit: int | float | None, data: Any) -> int | None:
    """A batch limit (`limit_*_batches`: an int, or a fraction of `len(data)`) as a count."""
    if limit is None:
        return None
    if isinstance(limit, float):
        try:
            return max(1, int(len(data) * limit))
        except TypeError:
            raise ConfigurationError(
                f"a fractional batch limit ({limit}) needs data with len(); this iterable "
                "has none. Pass an integer number of batches instead."
            ) from None
    return int(limit)


def validation_interval(config: FitConfig, train_data: Any) -> int | None:
    """Training steps between validations from `val_check_interval` (None: at epoch ends)."""
    v = config.val_check_interval
    if v is None:
        return None
    if isinstance(v, float):
        try:
            per_epoch = len(train_data)
        except TypeError:
            raise ConfigurationError(
                f"val_check_interval={v} (a fraction of an epoch) needs training data with "
                "len(); pass an integer number of steps instead."
            ) from None
        limit = batch_limit(config.limit_train_batches, train_data)
        per_epoch = min(per_epoch, limit) if limit else per_epoch
        return max(1, int(per_epoch * v))
    return int(v)


def validates_after_step(config: FitConfig, every: int | None, global_step: int, epoch: int,
                         batch_idx: int, taken: int) -> bool:
    """Whether `val_check_interval` (`every`, from `validation_interval`) validates after the
    step that just took `taken` loader batches, ending at `batch_idx` of `epoch`.

    As Lightning: with `check_val_every_n_epoch` set, every `every`-th batch of the epoch (its
    index within the epoch: an 8-batch epoch and interval 3 validate at batches 3 and 6 of each
    epoch), only in the epochs that validate; with `check_val_every_n_epoch=None`, every
    `every`-th step counted across epochs."""
    if not every:
        return False
    n_epochs = config.check_val_every_n_epoch
    if n_epochs is None:
        return global_step % every == 0
    if (epoch + 1) % n_epochs:
        return False
    return batch_idx // every > (batch_idx - taken) // every


def check_validation_interval(config: FitConfig, train_data: Any) -> None:
    """Refuses an int `val_check_interval` longer than an epoch (validation would never run),
    as Lightning does, unless `check_val_every_n_epoch=None` counts steps across epochs."""
    v = config.val_check_interval
    if not isinstance(v, int) or config.check_val_every_n_epoch is None:
        return
    per_epoch = epoch_length(config, train_data)
    if per_epoch is not None and v > per_epoch:
        raise ConfigurationError(
            f"val_check_interval={v} is more than the {per_epoch} training batches of an epoch "
            "(after limit_train_batches), so validation would never run: with "
            f"check_val_every_n_epoch={config.check_val_every_n_epoch} the interval counts "
            f"batches within an epoch, as in Lightning. Give val_check_interval <= {per_epoch} "
            "(or a float fraction of the epoch), set check_val_every_n_epoch=None to count "
            "training batches across epochs, or pass no val_data to skip validation."
        )


def epoch_length(config: FitConfig, data: Any) -> int | None:
    """Training batches per epoch (after limit_train_batches); None when unknown (no len())."""
    try:
        n = len(data)
    except TypeError:
        n = None
    limit = config.limit_train_batches
    if isinstance(limit, float):
        limit = batch_limit(limit, data) if n is not None else None
    elif limit is not None:
        limit = int(limit)
    if n is None:
        return limit
    return min(n, limit) if limit else n
