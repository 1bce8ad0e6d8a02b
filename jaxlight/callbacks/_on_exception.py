"""OnExceptionCheckpoint: Lightning's checkpoint of the state when a fit raises."""

from __future__ import annotations

import os
import sys

from jaxlight.callbacks._base import Callback
from jaxlight.checkpoint._writer import CheckpointWriter

__all__ = ["OnExceptionCheckpoint"]


class OnExceptionCheckpoint(Callback):
    """Saves the train state when an exception (KeyboardInterrupt included) ends a fit.

    The checkpoint is the directory `<dirpath>/<filename>.ckpt` (holding one step, the step
    reached), so Lightning's `ckpt_path="<dirpath>/on_exception.ckpt"` resumes from it as it
    is. A state the failed step had already given away (the exception came from inside the
    compiled step) cannot be saved; the callback then says so and the original exception
    stands.

    Args:
        dirpath: the folder for the checkpoint.
        filename: the checkpoint's name, without extension (Lightning's default).

    Example:
        >>> from jaxlight import callbacks
        >>> cb = callbacks.OnExceptionCheckpoint("checkpoints")
    """

    def __init__(self, dirpath: str | os.PathLike, filename: str = "on_exception"):
        self.dirpath = os.fspath(dirpath)
        self.filename = filename
        #: Where the checkpoint was written (None until an exception saved one).
        self.ckpt_path: str | None = None

    @property
    def path(self) -> str:
        """`<dirpath>/<filename>.ckpt`, the checkpoint directory."""
        return os.path.join(self.dirpath, self.filename + ".ckpt")

    def on_exception(self, fit, module, exception: BaseException) -> None:
        state = fit.state
        if state is None:
            return  # nothing trained yet
        writer = None
        try:
            writer = CheckpointWriter(self.path, save_top_k=1, save_last=True, async_save=False)
            writer.save(fit, module)
            writer.wait()
            self.ckpt_path = writer.step_dir(fit.global_step)
        except Exception as exc:  # noqa: BLE001 - the fit's own exception is the one raised
            print(f"OnExceptionCheckpoint: could not save the state at step {fit.global_step} "
                  f"after {type(exception).__name__}: {exc}", file=sys.stderr)
        finally:
            if writer is not None:
                writer.close()

    def __repr__(self) -> str:
        return f"OnExceptionCheckpoint(dirpath={self.dirpath!r}, filename={self.filename!r})"
