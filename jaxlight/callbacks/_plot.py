"""Training and validation curves as a PNG, written by the loggers at the end of a fit.

Each panel is one metric: the training curve (`loss`) and, when there is one, its validation
counterpart (`val_loss`) against the optimizer step. Monitor metrics (names with a `/`, such as
`throughput/mfu`) and `epoch` are left out: they are not learning curves.

matplotlib is an optional extra (`pip install 'jaxlight[plot]'`); without it the loggers print
one line and carry on.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterable

_NOTED = False


class MetricRows:
    """Logged metrics as `(step, metrics)` rows, one per step (same-step rounds merged)."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []

    def add(self, step: int, metrics: dict[str, float]) -> None:
        if self.rows and self.rows[-1][0] == step:
            self.rows[-1][1].update(metrics)
        else:
            self.rows.append((int(step), dict(metrics)))


def curve_names(keys: Iterable[str]) -> list[tuple[str, str | None, str | None]]:
    """Panels as (title, training key, validation key), loss first.

    Example:
        >>> curve_names(["loss", "accuracy", "val_loss", "epoch", "throughput/mfu"])
        [('loss', 'loss', 'val_loss'), ('accuracy', 'accuracy', None)]
    """
    keys = [k for k in keys if "/" not in k and k != "epoch"]
    train = [k for k in keys if not k.startswith(("val_", "test_"))]
    val = [k for k in keys if k.startswith("val_")]
    panels = [(k, k, f"val_{k}" if f"val_{k}" in val else None) for k in train]
    panels += [(k, None, k) for k in val if k[len("val_"):] not in train]
    panels.sort(key=lambda p: (p[0] != "loss", p[0].removeprefix("val_") != "loss"))
    return panels


def plot_curves(rows: list[tuple[int, dict[str, float]]], path: str | os.PathLike,
                title: str | None = None) -> str | None:
    """Writes the curves of logged `(step, metrics)` rows to `path` (PNG); returns the path.

    Returns None, after a one-line note on stderr, when matplotlib is not installed, and None
    when there is nothing to plot.

    Example:
        >>> import tempfile, os
        >>> rows = [(10, {"loss": 1.0}), (20, {"loss": 0.5, "val_loss": 0.6})]
        >>> out = plot_curves(rows, os.path.join(tempfile.mkdtemp(), "curves.png"))
    """
    global _NOTED
    keys: dict[str, None] = {}
    for _, metrics in rows:
        keys.update(dict.fromkeys(metrics))
    panels = curve_names(keys)
    if not panels:
        return None
    try:  # optional dependency (jaxlight[plot]): without it no PNG is written
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        if not _NOTED:
            print("jaxlight: matplotlib is not installed, so no training-curve PNG was written "
                  "(pip install 'jaxlight[plot]').", file=sys.stderr)
            _NOTED = True
        return None

    fig = curves_figure(rows, panels, title, Figure)
    FigureCanvasAgg(fig)
    path = os.fspath(path)
    fig.savefig(path, dpi=100)
    return path


#: Fixed margins in inches (left, right, bottom, top; the suptitle's band; between panels):
#: room for tick labels, the "step" label and panel titles. A layout engine measuring every
#: text first ("constrained") took as long again as drawing the figure, at every fit's end.
_MARGINS = {"left": 0.7, "right": 0.2, "bottom": 0.55, "top": 0.35, "suptitle": 0.3,
            "wspace": 0.8, "hspace": 0.9}
_PANEL_W, _PANEL_H = 4.5, 3.2


def curves_figure(rows: list[tuple[int, dict[str, float]]], panels, title: str | None,
                  figure_class):
    """The curves as a `figure_class` (matplotlib's `Figure`): one panel per `panels` entry,
    at most three per row, laid out with fixed margins (`_MARGINS`)."""
    cols = min(3, len(panels))
    nrows = math.ceil(len(panels) / cols)
    width, height = _PANEL_W * cols, _PANEL_H * nrows
    margin = _MARGINS
    top = margin["top"] + (margin["suptitle"] if title else 0.0)
    axes_w = (width - margin["left"] - margin["right"] - margin["wspace"] * (cols - 1)) / cols
    axes_h = (height - margin["bottom"] - top - margin["hspace"] * (nrows - 1)) / nrows
    # The object API (no pyplot): no global backend switch, safe inside notebooks and threads.
    fig = figure_class(figsize=(width, height))
    fig.subplots_adjust(left=margin["left"] / width, right=1 - margin["right"] / width,
                        bottom=margin["bottom"] / height, top=1 - top / height,
                        wspace=margin["wspace"] / axes_w, hspace=margin["hspace"] / axes_h)
    for i, (name, train_key, val_key) in enumerate(panels):
        ax = fig.add_subplot(nrows, cols, i + 1)
        for key, label, style in ((train_key, "train", "-"), (val_key, "validation", "o-")):
            if key is None:
                continue
            points = [(s, m[key]) for s, m in rows if key in m and math.isfinite(m[key])]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, style, label=label, markersize=3)
        ax.set_title(name, y=1.0)  # where the automatic position puts it, without measuring
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if train_key is not None and val_key is not None:
            ax.legend()
    if title:
        fig.suptitle(title, y=1 - 0.08 / height, va="top")
    return fig
