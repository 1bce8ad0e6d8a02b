"""Lightning's public signatures: Trainer, LightningModule, LightningDataModule, Tuner, and every
class in `lightning.pytorch.callbacks` and `lightning.pytorch.loggers`, with each `__init__`
argument (and its default) and each public method (its arguments) or property that Lightning's
own classes define (not torch's `nn.Module`'s). No training: `tests/conformance/_coverage.py`
intersects these names with jaxlight's signatures, and each shared argument needs a case."""

import lightning.pytorch as L
from _common import write
from _coverage import arguments
from lightning.pytorch import callbacks, loggers
from lightning.pytorch.tuner import Tuner


def members(cls) -> dict:
    """Public methods (name -> their arguments) and properties (name -> "property") defined by
    Lightning's classes in `cls`'s MRO."""
    out = {}
    for klass in cls.__mro__:
        if not klass.__module__.startswith("lightning"):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_") or name in out:
                continue
            if isinstance(value, property):
                out[name] = "property"
            elif callable(value) or isinstance(value, (staticmethod, classmethod)):
                out[name] = arguments(getattr(cls, name))
    return out


owners = {"Trainer": L.Trainer, "LightningModule": L.LightningModule,
          "LightningDataModule": L.LightningDataModule, "Tuner": Tuner}
owners.update({f"callbacks.{n}": getattr(callbacks, n) for n in callbacks.__all__})
owners.update({f"loggers.{n}": getattr(loggers, n) for n in loggers.__all__})
cases = {name: {"init": arguments(cls.__init__), "members": members(cls)}
         for name, cls in sorted(owners.items()) if isinstance(cls, type)}
# A callback's overrides of Callback's hooks are listed once, under Callback; each class names
# its bases in this list (jaxlight's side lists a member under the base it shares with jaxlight).
hooks = cases["callbacks.Callback"]["members"]
for name, cls in owners.items():
    if name not in cases:
        continue
    cases[name]["bases"] = sorted(n for n, base in owners.items() if n in cases and base is not cls
                                  and isinstance(base, type) and issubclass(cls, base))
    if "callbacks.Callback" in cases[name]["bases"]:
        cases[name]["members"] = {k: v for k, v in cases[name]["members"].items()
                                  if k not in hooks}
write("signatures", cases)
