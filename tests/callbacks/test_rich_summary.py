"""RichModelSummary: ModelSummary's table drawn with rich (the `rich` extra)."""

from __future__ import annotations

import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks

pytest.importorskip("rich")


class Lin(jl.TrainModule):
    def configure_model(self, rngs):
        return nnx.Linear(8, 16, rngs=rngs)

    def configure_optimizers(self):
        return optax.sgd(0.1)

    def training_step(self, model, batch):
        return (model(batch["x"]) ** 2).mean()


def test_rich_summary_shows_modelsummarys_rows_and_totals(capsys):
    plain, rich_summary = callbacks.ModelSummary(), callbacks.RichModelSummary()
    data = jl.data.DataLoader({"x": np.ones((16, 8), np.float32)}, batch_size=16)
    fit = jl.Fit("fsdp", max_steps=1, callbacks=[plain, rich_summary],
                 enable_progress_bar=False, logger=False, enable_checkpointing=False)
    fit.fit(Lin(), data)
    out = capsys.readouterr().out
    assert rich_summary.totals == plain.totals == {
        "parameters": 8 * 16 + 16, "bytes": (8 * 16 + 16) * 4,
        "bytes_per_device": plain.totals["bytes_per_device"]}
    assert rich_summary.table.row_count == 2
    assert "['kernel']" in out and "Per device" in out and rich_summary.text in out
