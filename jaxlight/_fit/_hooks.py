"""Callbacks of a Fit: assembling the list from Fit's shortcuts, calling hooks, the log queue."""

from __future__ import annotations

from jaxlight import callbacks as cbs
from jaxlight._errors import ConfigurationError
from jaxlight.callbacks._base import Callback, Logger


def loggers_into_callbacks(logger, callbacks) -> tuple[list, bool]:
    """Lightning's `Fit(logger=WandbLogger(...))` (or a list): the loggers join the callbacks
    and `logger` becomes True; True/False/None pass through. `callbacks=None` is Lightning's
    default, no callbacks."""
    callbacks = list(callbacks or ())
    if logger is None or isinstance(logger, bool):
        return callbacks, logger
    given = list(logger) if isinstance(logger, list | tuple) else [logger]
    bad = [type(x).__name__ for x in given if not isinstance(x, Logger)]
    if bad:
        raise ConfigurationError(
            f"Fit(logger=...) takes True / False (the default CSVLogger), or jaxlight "
            f"loggers (callbacks.CSVLogger, TensorBoardLogger, WandbLogger); got {bad}."
        )
    return [*callbacks, *given], True


#: Step transforms of which a fit takes one: two would both apply (a bf16 loss and fp16 loss
#: scaling; accumulation of accumulation; clipping at the smaller norm), never what was meant.
#: Each with the attribute that tells two apart in the message.
ONE_OF_EACH = {"MixedPrecision": "precision", "GradientAccumulation": "k",
               "GradientClipping": "max_norm"}


def refuse_duplicate_transforms(user: list) -> None:
    """Refuses two callbacks of one `ONE_OF_EACH` kind (their transforms would both apply)."""
    for name, attr in ONE_OF_EACH.items():
        cls = getattr(cbs, name, None)
        found = [(i, cb) for i, cb in enumerate(user) if cls is not None and isinstance(cb, cls)]
        if len(found) > 1:
            shown = ", ".join(f"callbacks[{i}] = {name}({getattr(cb, attr, '...')!r})"
                              for i, cb in found)
            raise ConfigurationError(
                f"Fit got {len(found)} {name} callbacks ({shown}); their step transforms would "
                f"all apply, one on top of the other. Keep one {name} with the setting you "
                "mean."
            )


def assemble_callbacks(user, config) -> list[Callback]:
    """The Fit's callback list: shortcut callbacks, then the user's, then the defaults.

    A shortcut (`precision`, `accumulate_grad_batches`, `gradient_clip_val`) given together
    with its callback is refused, not silently resolved.
    """
    for cb in user:
        if not isinstance(cb, Callback):
            raise ConfigurationError(
                f"callbacks must be jaxlight.callbacks.Callback objects; got "
                f"{type(cb).__name__}. Wrap plain functions in callbacks.LambdaCallback."
            )

    refuse_duplicate_transforms(user)

    def present(name: str) -> bool:
        cls = getattr(cbs, name, None)
        return cls is not None and any(isinstance(cb, cls) for cb in user)

    precision, accumulate = config.precision, config.accumulate_grad_batches
    clip_val, clip_algo = config.gradient_clip_val, config.gradient_clip_algorithm
    shortcuts: list[Callback] = []
    for arg, value, default, name, make in (
        ("precision", precision, None, "MixedPrecision",
         lambda: cbs.MixedPrecision(precision)),
        ("accumulate_grad_batches", accumulate, 1, "GradientAccumulation",
         lambda: cbs.GradientAccumulation(accumulate)),
        ("gradient_clip_val", clip_val, None, "GradientClipping",
         lambda: cbs.GradientClipping(clip_val, algorithm=clip_algo)),
        ("max_time", config.max_time, None, "Timer",
         lambda: cbs.Timer(duration=config.max_time, interval="step")),
    ):
        if value == default or (arg == "precision" and value in ("32-true", "32", 32)):
            continue
        if present(name):
            raise ConfigurationError(
                f"Fit({arg}={value!r}) and callbacks.{name} in callbacks both set the same "
                f"thing; keep one of them (the shortcut just adds callbacks.{name})."
            )
        if not hasattr(cbs, name):
            raise ConfigurationError(f"Fit({arg}=...) needs callbacks.{name}, not available.")
        shortcuts.append(make())
    defaults: list[Callback] = []
    if config.enable_model_summary and not present("ModelSummary"):
        defaults.append(cbs.ModelSummary())
    if config.enable_progress_bar and not present("TQDMProgressBar"):
        defaults.append(cbs.TQDMProgressBar())
    if config.logger and not any(isinstance(cb, Logger) for cb in user):
        defaults.append(cbs.CSVLogger())
    if present("ModelCheckpoint") and not config.enable_checkpointing:
        given = next(cb for cb in user if isinstance(cb, cbs.ModelCheckpoint))
        raise ConfigurationError(
            f"Fit(enable_checkpointing=False) turns checkpointing off, but callbacks has "
            f"{type(given).__name__}(dirpath={given.dirpath!r}, monitor={given.monitor!r}) "
            "(Lightning refuses the same pair). Drop enable_checkpointing=False to keep the "
            "callback, or remove the callback to save nothing.")
    if config.enable_checkpointing and not config.fast_dev_run and not present("ModelCheckpoint"):
        # Lightning's default: a ModelCheckpoint, last in the list (its hooks run after the
        # other callbacks', as Lightning orders checkpoint callbacks last); none under
        # fast_dev_run, where Lightning saves nothing.
        default = cbs.ModelCheckpoint()
        default.keeps_earlier_steps = True
        defaults.append(default)
    return shortcuts + user + defaults


#: Hooks the module runs before the callbacks (Lightning restores the model first).
MODULE_FIRST = frozenset({"on_load_checkpoint"})
#: Hooks where the monitoring callbacks run after the module (they see what its hook logged).
MONITORS_LAST = frozenset({"on_train_epoch_end"})


def _monitors(cb: Callback) -> bool:
    return isinstance(cb, cbs.ModelCheckpoint | cbs.EarlyStopping)


class Hooks:
    """Calls a hook on every callback, in list order, with `(fit, module, *args)`, and the
    module's own hook of that name (`jaxlight.module._hooks`) with `(*args)`, in Lightning's
    order: callbacks first, then the module, except for `MODULE_FIRST` and `MONITORS_LAST`."""

    def __init__(self, fit, callbacks: list[Callback]):
        self._fit = fit
        self.callbacks = callbacks
        self.module = None

    def __call__(self, hook: str, *args) -> None:
        module = self.module
        # Before any stage (fit.log_metrics called early) there is no module to call.
        module_hook = getattr(module, hook) if module is not None else (lambda *a: None)
        if hook in MODULE_FIRST:
            module_hook(*args)
        first = [cb for cb in self.callbacks if not (hook in MONITORS_LAST and _monitors(cb))]
        for cb in first:
            getattr(cb, hook)(self._fit, module, *args)
        if hook not in MODULE_FIRST:
            module_hook(*args)
        if hook in MONITORS_LAST:
            for cb in self.callbacks:
                if _monitors(cb):
                    getattr(cb, hook)(self._fit, module, *args)


    def on_log_split(self, metrics: dict, logged: dict, step: int) -> None:
        """`on_log` where some values are not for the loggers: each `Logger` gets `logged`,
        the other callbacks and the module every value, in `__call__`'s order."""
        for cb in self.callbacks:
            cb.on_log(self._fit, self.module, logged if isinstance(cb, Logger) else metrics, step)
        if self.module is not None:
            self.module.on_log(metrics, step)


class MetricLog:
    """Host metrics on their way to `on_log`: each round reaches every callback in step order."""

    def __init__(self, hooks: Hooks):
        self._hooks = hooks
        self._queue: list[tuple[dict, int]] = []
        self._logging = False
        #: Every metric sent to loggers, last value per key.
        self.logged_metrics: dict[str, float] = {}
        #: Latest training/validation metrics (what EarlyStopping and checkpoints monitor).
        self.callback_metrics: dict[str, float] = {}

    def record(self, metrics: dict[str, float], hidden=frozenset(), step: int | None = None
               ) -> None:
        """Updates `logged_metrics` only: Lightning's follow every step, where its loggers get
        the log intervals. "epoch" goes to the loggers but not here, as in Lightning. With
        `step` (a step read between log intervals), the callbacks that must see every read
        (`reads_every_step`, NonFiniteGuard's sticky streak) get it through `on_log`."""
        self.logged_metrics.update((k, v) for k, v in metrics.items()
                                   if k != "epoch" and k not in hidden)
        if step is not None:
            for cb in self._hooks.callbacks:
                if getattr(cb, "reads_every_step", False):
                    cb.on_log(self._hooks._fit, self._hooks.module, metrics, step)

    def log(self, metrics: dict[str, float], step: int, hidden=frozenset()) -> None:
        """Queues `metrics` at `step`; sends the queue unless a round is being sent already.
        Names in `hidden` (`self.log(..., logger=False)`) reach neither the loggers nor
        `logged_metrics`; the other callbacks (the progress bar) get them."""
        self._queue.append((dict(metrics), step, frozenset(hidden)))
        if self._logging:
            return
        self._logging = True
        try:
            while self._queue:
                queued, at, hide = self._queue.pop(0)
                logged = {k: v for k, v in queued.items() if k not in hide}
                self.record(logged)
                if len(logged) == len(queued):
                    self._hooks("on_log", queued, at)
                else:
                    self._hooks.on_log_split(queued, logged, at)
        finally:
            self._logging = False
