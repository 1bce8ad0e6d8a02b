"""RichModelSummary: ModelSummary's parameter table drawn with `rich` (the `rich` extra)."""

from __future__ import annotations

import jax

from jaxlight._errors import MissingDependency
from jaxlight.callbacks._summary import ModelSummary, _bytes, parameter_rows, totals_line

__all__ = ["RichModelSummary"]


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
        try:
            import rich  # noqa: F401
        except ImportError:
            raise MissingDependency(
                "RichModelSummary needs rich: pip install 'jaxlight[rich]' (or use "
                "callbacks.ModelSummary, the same table as text).") from None
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
