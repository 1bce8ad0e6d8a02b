"""curves.png's layout: fixed margins (no layout engine measuring every text at each fit's end),
and still every label inside the figure and no two panels overlapping."""

import math
import os

import pytest

from jaxlight.callbacks import _plot

pytest.importorskip("matplotlib")


def _rows(keys: list[str], steps: int = 40) -> list[tuple[int, dict[str, float]]]:
    rows = []
    for i in range(steps):
        metrics = {k: (1e-4 * (1 + i) if k == "lr" else 12_345.0 + i if k == "grad_norm"
                       else 2.3 / math.sqrt(i + 1)) for k in keys if not k.startswith("val_")}
        if i % 10 == 0:
            metrics.update({k: 0.5 for k in keys if k.startswith("val_")})
        rows.append((10 * i, metrics))
    return rows


@pytest.mark.parametrize("keys, title", [
    (["loss"], None),
    (["loss", "val_loss", "accuracy", "val_accuracy"], "Classifier"),
    (["loss", "val_loss", "accuracy", "val_accuracy", "lr", "grad_norm", "val_bits_per_byte"],
     "DigitsClassifier"),
])
def test_panels_fit_the_figure_without_a_layout_engine(keys, title, tmp_path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = _plot.curve_names(dict.fromkeys(k for _, m in _rows(keys) for k in m))
    fig = _plot.curves_figure(_rows(keys), panels, title, Figure)
    assert fig.get_layout_engine() is None  # no second pass over every text at savefig
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    cols = min(3, len(panels))
    # The figure keeps its size: 450 x 320 pixels per panel at the PNG's 100 dpi.
    assert tuple(fig.get_size_inches() * 100) == pytest.approx(
        (450 * cols, 320 * math.ceil(len(panels) / cols)))
    whole = fig.bbox
    boxes = [ax.get_tightbbox(renderer) for ax in fig.axes]  # ticks, labels, title, legend
    assert len(boxes) == len(panels)
    for ax, box in zip(fig.axes, boxes, strict=True):
        assert (box.x0 >= whole.x0 and box.y0 >= whole.y0 and box.x1 <= whole.x1
                and box.y1 <= whole.y1), (ax.get_title(), box, whole)
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert not a.overlaps(b), (a, b)
    if title:
        sup = fig._suptitle.get_window_extent(renderer)
        assert sup.y1 <= whole.y1 and all(sup.y0 >= b.y1 for b in boxes[:cols])
    out = _plot.plot_curves(_rows(keys), tmp_path / "curves.png", title=title)
    assert out is not None and os.path.getsize(out) > 5000
