"""Lightning 2.6's callback and logger names that jaxlight does not have (yet), each with what
to use instead: `jaxlight.callbacks.<Name>` raises `MissingAttributeError` with it, and
docs/porting.md's callback table lists the same (tests/callbacks/test_lightning_names.py keeps
the two in step)."""

from __future__ import annotations

from jaxlight._errors import MissingAttributeError

#: Lightning name -> what a jaxlight user does instead.
NOT_IN_JAXLIGHT = {
    "Checkpoint": "subclass callbacks.Callback; ModelCheckpoint and OnExceptionCheckpoint are "
                  "the checkpoint callbacks",
    "ModelPruning": "not yet",
    "ProgressBar": "subclass callbacks.Callback (TQDMProgressBar is the progress bar)",
    "CometLogger": "not yet: CSVLogger, TensorBoardLogger, WandbLogger",
    "LitLogger": "not yet: CSVLogger, TensorBoardLogger, WandbLogger",
    "Logger": "subclass callbacks.Callback and implement on_log(fit, module, metrics, step)",
}


def missing(name: str) -> MissingAttributeError:
    return MissingAttributeError(
        f"jaxlight.callbacks has no {name} (Lightning's lightning.pytorch.callbacks/loggers "
        f"name): {NOT_IN_JAXLIGHT[name]}. See docs/porting.md (section 'Lightning's callbacks "
        "and loggers').")
