"""RichModelSummary and RichProgressBar: the summary table and the training bar drawn with `rich`
(the `rich` extra)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax

from jaxlight._errors import ConfigurationError, MissingDependency
from jaxlight.callbacks._progress import TQDMProgressBar
from jaxlight.callbacks._summary import ModelSummary, _bytes, parameter_rows, totals_line

__all__ = ["RichModelSummary", "RichProgressBar", "RichProgressBarTheme"]


class RichModelSummary(ModelSummary):
    """Lightning's `RichModelSummary`: the parameter table of `ModelSummary` (name, shape,
    dtype, bytes, bytes per device) as a `rich` table, with the totals below it.

    Needs `rich` (`pip install 'jaxlight[rich]'`).

    Args:
        max_depth: as `ModelSummary`'s.
        header_style: the rich style of the header row (Lightning's default).

    Example:
        >>> from jaxlight import callbacks
        >>> summary = callbacks.RichModelSummary()
    """

    def __init__(self, max_depth: int = -1, header_style: str = "bold magenta"):
        _require_rich("RichModelSummary", "callbacks.ModelSummary, the same table as text")
        super().__init__(max_depth=-1 if max_depth is None else max_depth)
        self.header_style = header_style

    def on_fit_start(self, fit, module) -> None:
        # rich is an optional extra (jaxlight[rich]): imported where the table is drawn.
        from rich.console import Console
        from rich.table import Table

        spec = fit.session.spec
        shardings = fit.session.shardings.params if fit.session.shardings is not None else None
        rows, self.totals = parameter_rows(spec.abstract_state.params, shardings, fit.strategy)
        table = Table(header_style=self.header_style)
        for column, justify in (("Name", "left"), ("Shape", "left"), ("Dtype", "left"),
                                ("Bytes", "right"), ("Per device", "right")):
            table.add_column(column, justify=justify)
        for name, shape, dtype, nbytes, per_device in rows:
            table.add_row(name, str(shape), dtype, _bytes(nbytes), _bytes(per_device))
        self.table = table
        self.text = totals_line(self.totals)
        if jax.process_index() == 0:
            console = Console()
            console.print(table)
            console.print(self.text)


def _require_rich(who: str, instead: str) -> None:
    try:
        import rich  # noqa: F401 - optional (jaxlight[rich]): only checked here
    except ImportError:
        raise MissingDependency(
            f"{who} needs rich: pip install 'jaxlight[rich]' (or use {instead}).") from None


@dataclasses.dataclass
class RichProgressBarTheme:
    """Lightning's `RichProgressBarTheme`: the styles of RichProgressBar's columns (rich style
    strings) and how metric values are formatted."""

    description: str = ""
    progress_bar: str = "#6206E0"
    progress_bar_finished: str = "#6206E0"
    progress_bar_pulse: str = "#6206E0"
    batch_progress: str = ""
    time: str = "dim"
    processing_speed: str = "dim underline"
    metrics: str = "italic"
    metrics_text_delimiter: str = " "
    metrics_format: str = ".3f"


class RichProgressBar(TQDMProgressBar):
    """Lightning's `RichProgressBar`: TQDMProgressBar's behaviour (process 0 only, plain lines
    in a log file, the reason training stopped) with a `rich` bar on a terminal: epoch,
    bar, steps done/total, elapsed time, steps/s and the shown metrics (the loss and what the
    module logs with `prog_bar=True`). Like every jaxlight bar it reads no device value: the
    count is the loop's step counter and the metrics come from the log intervals.

    Needs `rich` (`pip install 'jaxlight[rich]'`).

    Args:
        refresh_rate: redraws per second at most (Lightning's meaning); 0 shows no bar.
        leave: keep the bar on the terminal after training.
        theme: a `RichProgressBarTheme`.
        console_kwargs: arguments of `rich.console.Console` (e.g. `{"force_terminal": True}`
            to draw the bar where stderr is not a terminal, `file=` to draw elsewhere).

    Example:
        >>> from jaxlight import callbacks
        >>> bar = callbacks.RichProgressBar(refresh_rate=10, leave=True)
    """

    def __init__(self, refresh_rate: int = 100, leave: bool = False,
                 theme: RichProgressBarTheme | None = None,
                 console_kwargs: dict[str, Any] | None = None):
        _require_rich("RichProgressBar", "callbacks.TQDMProgressBar")
        if isinstance(refresh_rate, bool) or not isinstance(refresh_rate, int) or \
                refresh_rate < 0:
            raise ConfigurationError(
                f"RichProgressBar(refresh_rate={refresh_rate!r}): give redraws per second, an "
                "int >= 0 (0: no bar).")
        super().__init__(refresh_rate=1, leave=leave,
                         mininterval=1.0 / refresh_rate if refresh_rate else 0.0)
        self.theme = theme if theme is not None else RichProgressBarTheme()
        self.metrics_format = self.theme.metrics_format
        self.console_kwargs = dict(console_kwargs or {})
        self._enabled = refresh_rate > 0

    def on_train_start(self, fit, module) -> None:
        if self._enabled:
            super().on_train_start(fit, module)

    def _is_terminal(self) -> bool:
        if "force_terminal" in self.console_kwargs:
            return bool(self.console_kwargs["force_terminal"])
        return super()._is_terminal()

    def _make_bar(self, fit):
        # rich is an optional extra (jaxlight[rich]): imported where the bar is drawn.
        from rich.console import Console

        console = Console(**{"file": self._stream, **self.console_kwargs})
        return _RichBar(console, self._total, fit.global_step, f"epoch {fit.current_epoch}",
                        self.leave, self.theme, self.mininterval)


class _RichBar:
    """A rich `Progress` with the few methods TQDMProgressBar calls on its tqdm bar; it redraws
    at most once per `mininterval` seconds (no refresh thread)."""

    def __init__(self, console, total: int | None, initial: int, desc: str, leave: bool,
                 theme: RichProgressBarTheme, mininterval: float):
        # rich is an optional extra (jaxlight[rich]): imported where the bar is drawn.
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.n, self.desc, self.total = initial, desc, total
        self._theme, self._mininterval = theme, mininterval
        self._progress = Progress(
            TextColumn("{task.description}", style=theme.description),
            BarColumn(complete_style=theme.progress_bar,
                      finished_style=theme.progress_bar_finished,
                      pulse_style=theme.progress_bar_pulse),
            TextColumn("{task.fields[count]}", style=theme.batch_progress),
            TimeElapsedColumn(),
            TextColumn("{task.fields[speed]}", style=theme.processing_speed),
            TextColumn("{task.fields[metrics]}", style=theme.metrics),
            console=console, auto_refresh=False, transient=not leave)
        self._progress.start()
        self._task = self._progress.add_task(desc, total=total, completed=initial,
                                             count=self._count(), speed="", metrics="")
        self._drawn = time.perf_counter()
        self._progress.refresh()

    def _count(self) -> str:
        return f"{self.n}/{self.total}" if self.total else str(self.n)

    def update(self, k: int) -> None:
        self.n += k
        self._progress.update(self._task, completed=self.n, count=self._count())
        if time.perf_counter() - self._drawn >= self._mininterval:
            self.refresh()

    def set_description(self, desc: str, refresh: bool = True) -> None:
        self.desc = desc
        self._progress.update(self._task, description=desc)

    def set_postfix(self, shown: dict[str, str], refresh: bool = True) -> None:
        shown = dict(shown)
        speed = shown.pop("steps/s", "")
        self._progress.update(
            self._task, speed=f"{speed} steps/s" if speed else "",
            metrics=self._theme.metrics_text_delimiter.join(f"{k}: {v}"
                                                            for k, v in shown.items()))

    def refresh(self) -> None:
        self._progress.refresh()
        self._drawn = time.perf_counter()

    def close(self) -> None:
        self._progress.stop()
