"""Named optimizers: `configure_optimizers` returning several optax transformations, each bound
to part of the model, each with its own `lr_scheduler` dict.

    def configure_optimizers(self):
        return [
            {"name": "generator", "params": "generator", "optimizer": optax.adam(2e-4, b1=0.5)},
            {"name": "discriminator", "params": "discriminator",
             "optimizer": optax.adam(2e-4, b1=0.5),
             "lr_scheduler": {"scheduler": optax.exponential_decay(1.0, 100, 0.5),
                              "interval": "step"}},
        ]

This is Lightning's list-of-dicts form with one more key, `"params"` (which parameters the
optimizer updates; `jaxlight.optim._select`), and a `"name"` (defaults to `"params"` when that
is a string). Together they are one `optax.partition` over the parameters, so the optimizer
state is one pytree: each optimizer's slots hold its own parameters (the others are
`optax.MaskedNode`), sharded like them, checkpointed and restored with the train state.

With automatic optimization the step applies every optimizer to the one loss's gradients.
With `automatic_optimization = False` the step hands `training_step` an `Optimizers` handle
(`jaxlight.optim._manual`) that applies them one at a time, in the order the step calls them.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import jax
import optax
from flax import nnx

from jaxlight._errors import ConfigurationError, suggest
from jaxlight.optim._select import owner_labels
from jaxlight.schedules import _configure, _scheduler
from jaxlight.state._state import abstract_model

#: Keys of one named optimizer's dict.
KEYS = ("name", "params", "optimizer", "lr_scheduler", "monitor")

#: The name of the one optimizer of a manual-optimization module that returns a single optax
#: transformation.
DEFAULT_NAME = "optimizer"


@dataclasses.dataclass(frozen=True, eq=False)
class NamedOptimizers:
    """The optimizers of `configure_optimizers`, in its order, with the parameters of each.

    Attributes:
        names: the optimizer names, in the order configure_optimizers gave them.
        txs: name -> optax transformation (its scheduler's factor included).
        schedulers: name -> its `lr_scheduler` (`jaxlight.schedules._scheduler.Scheduler`) or None.
        labels: per parameter (a pure dict like the train state's params), its optimizer's name.
    """

    names: tuple[str, ...]
    txs: dict[str, optax.GradientTransformation]
    schedulers: dict[str, _scheduler.Scheduler | None]
    labels: Any

    def mask(self, name: str) -> Any:
        """Per parameter, whether optimizer `name` updates it."""
        return jax.tree.map(lambda label: label == name, self.labels)

    def transformation(self) -> optax.GradientTransformation:
        """All of them as one optax transformation (an `optax.partition`)."""
        tx = optax.partition(self.txs, self.labels)
        _REGISTRY[tx.update] = self
        return tx

    def scheduler(self, where: str) -> _scheduler.Scheduler | None:
        """The one scheduler the loop runs between steps (see `check_schedulers`)."""
        found = [s for s in self.schedulers.values() if s is not None]
        check_schedulers(found, where)
        return found[0] if found else None


#: The partition transformation -> the NamedOptimizers it was made from (for the manual step
#: and LearningRateMonitor, which receive only the transformation).
_REGISTRY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def named_optimizers(tx: Any) -> NamedOptimizers | None:
    """The NamedOptimizers that `tx` (an optimizer a fit built) was made from, or None."""
    update = getattr(tx, "update", None)
    try:
        return _REGISTRY.get(update)
    except TypeError:  # not weak-referenceable: not ours
        return None


def check_schedulers(schedulers: list, where: str) -> None:
    """Several schedulers advance together between steps: they must agree on the interval,
    and a plateau (which reads a metric) must be the only scheduler."""
    if len(schedulers) < 2:
        return
    if any(s.plateau is not None for s in schedulers):
        raise ConfigurationError(
            f"{where}: {len(schedulers)} optimizers have an lr_scheduler and one of them is "
            "reduce_on_plateau; a plateau scheduler must be the only one. Give the others a "
            "fixed schedule inside their optax transformation (optax.adam(schedule))."
        )
    intervals = sorted({s.interval for s in schedulers})
    if len(intervals) > 1:
        raise ConfigurationError(
            f"{where}: the optimizers' lr_schedulers mix intervals {intervals}; use one "
            "interval for all of them (or put a step schedule inside an optax transformation, "
            "optax.adam(optax.cosine_decay_schedule(...)))."
        )


def is_named_form(out: Any) -> bool:
    """Whether configure_optimizers returned the list-of-dicts form (Lightning's, with
    `"params"`)."""
    return (isinstance(out, list | tuple) and len(out) > 0
            and all(isinstance(entry, dict) for entry in out))


def read_named(out: list, module: Any, where: str) -> NamedOptimizers:
    """Checks the list-of-dicts form and binds each optimizer to its parameters."""
    names, txs, schedulers, bindings = [], {}, {}, {}
    for i, entry in enumerate(out):
        at = f"{where}[{i}]"
        bad = [k for k in entry if k not in KEYS]
        if bad:
            hints = "".join(suggest(k, KEYS) for k in bad)
            raise ConfigurationError(
                f"{at} has unknown key(s) {bad}; a named optimizer takes {list(KEYS)}.{hints}"
            )
        if "params" not in entry:
            raise ConfigurationError(
                f"{at} has no 'params' entry: say which parameters this optimizer updates, "
                "for example {'name': 'generator', 'params': 'generator', 'optimizer': tx} "
                "('params': a sub-module attribute, a path regex or an nnx filter)."
            )
        name = entry.get("name", entry["params"] if isinstance(entry["params"], str) else None)
        if not isinstance(name, str) or not name:
            raise ConfigurationError(
                f"{at} needs a 'name' (a string) when 'params' is not a string; the name is "
                "how training_step's opt.step(name, ...) and LearningRateMonitor's "
                "'lr-<name>' refer to it."
            )
        if name in txs:
            raise ConfigurationError(f"{where}: two optimizers are named {name!r}; names must "
                                     "be unique.")
        if "optimizer" not in entry:
            raise ConfigurationError(f"{at} ({name!r}) has no 'optimizer' (an optax "
                                     "transformation such as optax.adam(1e-3)).")
        single = {k: v for k, v in entry.items() if k in _configure.OPTIMIZER_KEYS}
        tx, scheduler = _configure.resolve_output(single, f"{where}[{name!r}]")
        if scheduler is not None and scheduler.name is None:
            scheduler = dataclasses.replace(scheduler, name=f"lr-{name}")
            tx = scheduler.wrap(_configure.as_transformation(single["optimizer"]))
        names.append(name)
        txs[name], schedulers[name], bindings[name] = tx, scheduler, entry["params"]
    _, _, params_state, _ = abstract_model(module)
    labels = owner_labels(bindings, params_state, where)
    named = NamedOptimizers(tuple(names), txs, schedulers, labels)
    check_schedulers([s for s in schedulers.values() if s is not None], where)
    return named


def single_named(tx: optax.GradientTransformation, scheduler, module: Any) -> NamedOptimizers:
    """A single optimizer as the one named optimizer `"optimizer"` over every parameter."""
    _, _, params_state, _ = abstract_model(module)
    labels = jax.tree.map(lambda _: DEFAULT_NAME, nnx.to_pure_dict(params_state))
    return NamedOptimizers((DEFAULT_NAME,), {DEFAULT_NAME: tx}, {DEFAULT_NAME: scheduler},
                           labels)


def resolve(module: Any) -> tuple[optax.GradientTransformation, _scheduler.Scheduler | None,
                                   NamedOptimizers | None]:
    """Reads `configure_optimizers()`: one optax transformation, Lightning's dict, or named
    optimizers. Returns `(tx, scheduler, named)`; `named` is None for a single optimizer under
    automatic optimization."""
    where = f"{type(module).__name__}.configure_optimizers()"
    out = module.configure_optimizers()
    manual = getattr(module, "automatic_optimization", True) is False
    if is_named_form(out) and not (len(out) == 1 and "params" not in out[0]):
        named = read_named(out, module, where)
        return named.transformation(), named.scheduler(where), named
    if isinstance(out, list | tuple) and len(out) == 1:
        out = out[0]
    tx, scheduler = _configure.resolve_output(out, where)
    if not manual:
        return tx, scheduler, None
    named = single_named(tx, scheduler, module)
    return named.transformation(), scheduler, named
