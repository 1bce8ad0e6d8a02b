"""The last partial training batch of an epoch: one more compiled step kind of its shape."""

from __future__ import annotations

from typing import Any

from jaxlight._errors import DataError, ShardingError
from jaxlight._fit._session import Session, abstract_global_batch
from jaxlight.sharding import _batch


class PartialStep:
    """The one more compiled step kind for a loader's last partial batch.

    torch's `DataLoader(drop_last=False)` (and `jaxlight.data.DataLoader`) ends an epoch with a
    short batch, which Lightning trains on. Its shape gets its own compiled step (compiled at
    its first use, kept for the fit, counted as `compile_counts["train_partial"]`); every full
    batch still runs the one main step. A partial batch the strategy cannot split (its
    data-parallel degree, GPipe's microbatches, `Microbatches`' n) is refused with the sizes,
    and so is one inside a group of `accumulate_grad_batches` (the loop stacks the group).
    Measured against padding the batch with zero-weight rows (benchmarks/partial_batch.py):
    padding cannot keep a user's `.mean()` loss exact without changing `training_step`, while
    one more compile costs once per fit and nothing per step.
    """

    def __init__(self, session: Session, reference: _batch.BatchSignature, full_rows: int):
        self.session, self.reference, self.full_rows = session, reference, full_rows
        self.rows: int | None = None
        self.abstract = self.shardings = self.compiled = None

    def _refuse(self, rows: int, where: str, exc: Exception) -> DataError:
        need = getattr(exc, "need", None)
        if need is None:  # not a divisibility refusal: the strategy's own words
            return DataError(
                f"{where} is a partial batch of {rows} examples (full batches have "
                f"{self.full_rows}), which is trained on as in Lightning, but it cannot be "
                f"split here: {exc} Drop it (jaxlight.data.DataLoader(..., drop_last=True)), "
                "or train on one device (Fit(devices=1)).")
        pad = -rows % need
        return DataError(
            f"{where} is a partial batch of {rows} examples (full batches have "
            f"{self.full_rows}), the epoch's last. Lightning trains on it, and so does jaxlight, "
            f"but this fit "
            f"splits every training batch over {exc.divisor}, and {rows} is not a multiple "
            f"of {need} (the full batches of {self.full_rows} are fine). Choose one: drop it "
            f"(jaxlight.data.DataLoader(..., drop_last=True); its {rows} examples then miss "
            f"this epoch); train on one device (Fit(devices=1)), which splits nothing; pad "
            f"the data with {pad} more examples (weighted 0 in your loss) so that the last "
            f"batch has {rows + pad}; or pick a batch size that leaves a last batch divisible "
            f"by {need} (or none).")

    def accepts(self, batch: Any, where: str) -> bool:
        """True for a partial batch (checked, its shardings fixed); False for any other."""
        rows = _batch.partial_rows(batch, self.reference)
        if rows is None:
            return False
        if self.rows is None:
            abstract = abstract_global_batch(batch)
            try:
                self.session.strategy.check_batch(abstract)
            except (DataError, ShardingError) as exc:
                raise self._refuse(rows, where, exc) from None
            self.shardings = self.session.strategy.batch_shardings(abstract)
            _batch.check_batch_layout(self.shardings, abstract, "partial training batch")
            self.abstract, self.rows = abstract, rows
        elif rows != self.rows:
            raise DataError(
                f"{where} has {rows} examples, a second partial batch size after {self.rows} "
                f"(full batches have {self.full_rows}): one partial batch size per fit is "
                "compiled (a loader's last batch). Give every epoch the same length.")
        return True

    def step(self, where: str):
        if self.compiled is None:
            try:
                self.compiled, _ = self.session.compile_train_step(self.abstract,
                                                                   kind="train_partial")
            except (DataError, ShardingError) as exc:
                raise self._refuse(self.rows, where, exc) from None
        return self.compiled
