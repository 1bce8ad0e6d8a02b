"""Building what the options name: the strategy, loggers and callbacks, looked up in
`jaxlight.strategies` and `jaxlight.callbacks` when the command runs."""

from __future__ import annotations

import ast
import inspect
from collections.abc import Mapping, Sequence

import jax
import optax

from jaxlight import callbacks, strategies
from jaxlight._cli._target import import_object
from jaxlight._errors import ConfigurationError, ShardingError, suggest
from jaxlight.callbacks._base import Logger
from jaxlight.state._state import model_spec
from jaxlight.strategies._rules import MESH_FORMS
from jaxlight.strategies._rules import parse_mesh_shape as _parse_mesh_shape


def _parse_call(text: str, what: str) -> tuple[str, list, dict]:
    """`"tp(size=4)"` -> `("tp", [], {"size": 4})`; a bare name has no arguments."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as err:
        raise ConfigurationError(
            f"{what} {text!r} does not parse ({err.msg}); write a name, or a call with literal "
            "arguments such as \"tp(size=4)\"."
        ) from None
    if isinstance(node, ast.Name):
        return node.id, [], {}
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        try:
            args = [ast.literal_eval(a) for a in node.args]
            kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        except ValueError:
            raise ConfigurationError(
                f"{what} {text!r}: arguments must be literals (numbers, strings, lists, dicts)."
            ) from None
        return node.func.id, args, kwargs
    raise ConfigurationError(
        f"{what} {text!r} is not a name or a call such as \"tp(size=4)\"."
    )


def split_calls(text: str) -> list[str]:
    """Splits `"a(x=1, y=2), b"` at top-level commas."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _call(target, args, kwargs, what: str):
    try:
        return target(*args, **kwargs)
    except TypeError as err:
        try:
            sig = str(inspect.signature(target))
        except (TypeError, ValueError):
            sig = "(...)"
        raise ConfigurationError(f"{what}: {err}; the signature is {sig}.") from None



def parse_mesh_shape(value: str | Sequence | Mapping, who: str = "--mesh-shape") -> dict[str, int]:
    """`--mesh-shape` (or a config file's `mesh_shape`) in any form of the one mesh grammar
    (`strategies._rules.parse_mesh_shape`); every error lists the accepted forms."""
    try:
        return _parse_mesh_shape(value, who)
    except ConfigurationError as err:
        text = str(err)
        raise ConfigurationError(text if MESH_FORMS in text else f"{text}\n{MESH_FORMS}") from None


def _strategy_class(key: str):
    """A class of `jaxlight.strategies` named in call form (`TensorParallel(size=4)`), or None."""
    obj = getattr(strategies, key, None)
    if inspect.isclass(obj) and issubclass(obj, strategies.Strategy) \
            and not inspect.isabstract(obj):
        return obj
    return None


def build_strategy(name: str = "auto", mesh_shape: str | Sequence | Mapping | None = None):
    """The strategy an option pair names: a `strategies.resolve` alias, a class of
    `jaxlight.strategies`, either in call form (`"tp(size=4)"`), or `Hybrid` from a mesh shape."""
    key, args, kwargs = _parse_call(name or "auto", "--strategy")
    lower = key.lower()
    if mesh_shape is not None:
        if lower not in ("auto", "hybrid"):
            raise ConfigurationError(
                f"--mesh-shape builds strategies.Hybrid, but --strategy is {name!r}; drop one of "
                "them, or use --strategy hybrid (the mesh axes data, fsdp, tp and pipe express "
                "every other strategy)."
            )
        shape = parse_mesh_shape(mesh_shape)
        return _call(strategies.Hybrid, [shape, *args], kwargs, "--strategy hybrid")
    if lower == "hybrid":
        if not args and "mesh_shape" not in kwargs:
            raise ConfigurationError(
                "--strategy hybrid needs a mesh: add --mesh-shape, for example 'data=2,fsdp=4'."
                f"\n{MESH_FORMS}"
            )
        if args:
            args = [parse_mesh_shape(args[0]), *args[1:]]
        else:
            kwargs = {**kwargs, "mesh_shape": parse_mesh_shape(kwargs["mesh_shape"])}
        return _call(strategies.Hybrid, args, kwargs, f"--strategy {name}")
    target = strategies.ALIASES.get(lower) or _strategy_class(key)
    if target is None:
        try:
            strategies.resolve(key)
        except ConfigurationError as err:
            raise ConfigurationError(
                f"{err} On the command line also: 'hybrid' (with --mesh-shape), and any class of "
                "jaxlight.strategies, with arguments in call form such as \"tp(size=4)\"."
            ) from None
    return _call(target, args, kwargs, f"--strategy {name}")


#: Bare strategies that span every device on one axis: (class, sizing keyword, what it sizes).
_SIZED = {
    "tp": (strategies.TensorParallel, "size", "tensor-parallel size"),
    "tensorparallel": (strategies.TensorParallel, "size", "tensor-parallel size"),
    "gpipe": (strategies.GPipe, "stages", "pipeline stages"),
}


def size_bare_strategy(name: str, mesh_shape, module, seed: int = 0):
    """For `--strategy tp` / `gpipe` given without a size: the largest size the model allows.

    A bare `tp` puts every device on the `tp` axis and a bare `gpipe` makes every device a
    stage, which a small model often cannot split (4 heads over 8 devices, 2 layers in 8
    stages). This tries the divisors of the device count from the largest down against the
    model's abstract shapes (no arrays, no compile), keeps data parallelism over the rest, and
    returns `(strategy, one line saying so)`; `(None, None)` when a size was given, the strategy
    is another one, or every device fits as it is. Other arguments (`tp(rules='NNX')`) are kept.
    """
    if mesh_shape is not None:
        return None, None
    key, args, kwargs = _parse_call(name or "auto", "--strategy")
    if key.lower() not in _SIZED or args or _SIZED[key.lower()][1] in kwargs:
        return None, None
    cls, keyword, what = _SIZED[key.lower()]
    n = jax.device_count()
    spec = model_spec(module, optax.identity(), seed)
    for size in sorted((d for d in range(1, n + 1) if n % d == 0), reverse=True):
        strategy = _call(cls, [], {**kwargs, keyword: size}, f"--strategy {name}")
        strategy.setup(None)
        try:
            strategy.state_shardings(spec.abstract_state, spec.logical_axes)
        except (ShardingError, ConfigurationError):
            continue
        if size == n:
            return None, None
        others = "".join(f", {k}={v!r}" for k, v in kwargs.items())
        return strategy, (
            f"--strategy {key}: {what} {size}, the largest that this model splits into on {n} "
            f"devices, with data parallelism over the other {n // size}; choose with "
            f"--strategy '{key}({keyword}=N{others})'."
        )
    return None, None  # not even size 1: let the fit say why, with the numbers


_LOGGERS = {"csv": "CSVLogger", "wandb": "WandbLogger", "tensorboard": "TensorBoardLogger",
            "tb": "TensorBoardLogger"}


def _bind(cls, args, kwargs, what: str) -> dict:
    """The keyword arguments of a call, positional ones named (checked against the signature)."""
    try:
        bound = inspect.signature(cls).bind(*args, **kwargs)
    except TypeError as err:
        raise ConfigurationError(
            f"{what}: {err}; the signature is {inspect.signature(cls)}.") from None
    return dict(bound.arguments)


def logger_calls(text: str) -> list[tuple[type, dict]]:
    """The logger classes and keyword arguments of `csv,wandb(project='x'),...`."""
    out = []
    for part in split_calls(text):
        name, args, kwargs = _parse_call(part, "--logger")
        cls_name = _LOGGERS.get(name.lower(), name)
        cls = getattr(callbacks, cls_name, None)
        if not (isinstance(cls, type) and issubclass(cls, Logger)):
            available = [k for k, v in _LOGGERS.items() if hasattr(callbacks, v) and k != "tb"]
            raise ConfigurationError(
                f"unknown logger {name!r}; available loggers are {available} (or 'none')."
                f"{suggest(name.lower(), _LOGGERS)}"
            )
        out.append((cls, _bind(cls, args, kwargs, f"--logger {part}")))
    return out


def build_loggers(text: str | None) -> list | None:
    """Logger callbacks from `csv,wandb,...`; None when no logger is wanted."""
    if text is None or text.strip().lower() in ("", "none", "false", "off"):
        return None
    return [cls(**kwargs) for cls, kwargs in logger_calls(text)]


def build_callbacks(text: str | None) -> list:
    """Callbacks from `"EarlyStopping(monitor='val_loss'), LearningRateMonitor()"`.

    A name is a `jaxlight.callbacks` class; your own callback class is named by where it lives,
    as the module and data are: `"sampler.py:ImageSampler(num_samples=4)"` or
    `"package.module:ImageSampler"`.
    """
    return [cls(**kwargs) for cls, kwargs in callback_calls(text or "")]


def callback_calls(text: str) -> list[tuple[type, dict]]:
    """The classes and keyword arguments of callbacks in call form (`EarlyStopping(...)`,
    `PATH.py:Name(...)`), checked against their signatures."""
    out = []
    for part in split_calls(text):
        head, paren, rest = part.partition("(")
        if ":" in head:  # PATH.py:Name(...) or package.module:Name(...)
            cls = import_object(head.strip(), "--callbacks")
            _, args, kwargs = _parse_call("cls" + paren + rest, f"--callbacks {part!r}:")
            if not (inspect.isclass(cls) and issubclass(cls, callbacks.Callback)):
                raise ConfigurationError(
                    f"--callbacks {head.strip()!r} is {type(cls).__name__} {cls!r}, not a "
                    "subclass of jaxlight.callbacks.Callback.")
        else:
            name, args, kwargs = _parse_call(part, "--callbacks")
            cls = getattr(callbacks, name, None)
            if not (inspect.isclass(cls) and issubclass(cls, callbacks.Callback)):
                valid = [n for n in getattr(callbacks, "__all__", ()) if n != "Callback"]
                raise ConfigurationError(
                    f"unknown callback {name!r}; jaxlight.callbacks has {valid}."
                    f"{suggest(name, valid)} Your own callback class: PATH.py:Name(...).")
        out.append((cls, _bind(cls, args, kwargs, f"--callbacks {part}")))
    return out
