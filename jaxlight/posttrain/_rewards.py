"""Reward functions with TRL's contract: batched calls, `None` for "not applicable", weights.

A reward function is `f(prompts, completions, completion_ids, **columns) -> list[float | None]`
(TRL's `GRPOTrainer` signature): one call per generation batch with the decoded prompt and
completion of every row, the completions' token ids, and every extra column of the prompts'
data (answers, ids) as a keyword argument holding one value per row. It returns one reward
per row, `None` where it does not apply (a format check on a row of another task). A row's
reward is the weighted sum of its functions' rewards over those that apply (`nansum`, as TRL);
a row no function applies to is reported 0 (with a warning naming the prompt), left out of its
group's baseline and given advantage 0 (`rollout`), as TRL's GRPOTrainer does.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxlight._errors import ConfigurationError, DataError

RewardFunction = Callable[..., Sequence[float | None]]


def reward_name(fn: Any) -> str:
    """The name a reward function's metrics and messages use (`__name__`, else its class's)."""
    return getattr(fn, "__name__", None) or type(fn).__name__


def _short(text: Any, n: int = 120) -> str:
    text = text if isinstance(text, str) else str(text)
    return repr(text if len(text) <= n else text[:n] + "...")


def _call(fn, prompts, completions, completion_ids, columns, rows) -> Any:
    sub = {k: [v[i] for i in rows] for k, v in columns.items()}
    return fn(prompts=[prompts[i] for i in rows], completions=[completions[i] for i in rows],
              completion_ids=[completion_ids[i] for i in rows], **sub)


def score(reward_funcs: Sequence[RewardFunction], prompts: Sequence[str],
          completions: Sequence[str], completion_ids: Sequence[Sequence[int]],
          columns: Mapping[str, Sequence[Any]] | None = None) -> np.ndarray:
    """Every function's reward of every row: `[rows, functions]` float32, NaN where `None`.

    Refuses, naming the function, the row's prompt and completion and what to do: a function
    that raises, returns a number of values other than the rows', a value that is not a
    number, or NaN/inf (return `None` for "not applicable").

    Example:
        >>> def short(prompts, completions, completion_ids, **_):
        ...     return [1.0 if len(c) < 4 else None for c in completions]
        >>> score([short], ["p", "p"], ["ab", "abcdef"], [[1], [1, 2]]).tolist()
        [[1.0], [nan]]
    """
    if not reward_funcs:
        raise ConfigurationError("GRPO needs at least one reward function "
                                 "f(prompts, completions, completion_ids, **columns).")
    columns = dict(columns or {})
    n = len(completions)
    for key, values in columns.items():
        if len(values) != n:
            raise DataError(f"column {key!r} has {len(values)} values for {n} rows.")
    out = np.zeros((n, len(reward_funcs)), np.float32)
    rows = list(range(n))
    for j, fn in enumerate(reward_funcs):
        name = reward_name(fn)
        try:
            values = _call(fn, prompts, completions, completion_ids, columns, rows)
        except Exception as error:  # noqa: BLE001 - re-raised below with the row that fails
            _raise_for_row(fn, name, error, prompts, completions, completion_ids, columns)
        try:
            values = list(values)
        except TypeError:
            raise DataError(
                f"reward function {name} returned {type(values).__name__} for a batch of {n} "
                f"completions; it must return a list of {n} rewards (float, or None where it "
                "does not apply), one per completion in order (TRL's contract).") from None
        if len(values) != n:
            raise DataError(
                f"reward function {name} returned {len(values)} rewards for {n} completions; "
                f"it must return exactly {n}, one per completion in order (float, or None where "
                "it does not apply): it is called once per generation batch with lists of "
                "prompts, completions and completion_ids.")
        for i, v in enumerate(values):
            if v is None:
                out[i, j] = np.nan
                continue
            try:
                x = float(v)
            except (TypeError, ValueError):
                raise DataError(
                    f"reward function {name} returned {v!r} ({type(v).__name__}) for row {i} "
                    f"(prompt {_short(prompts[i])}, completion {_short(completions[i])}); "
                    "return a float, or None where the function does not apply.") from None
            if not math.isfinite(x):
                raise DataError(
                    f"reward function {name} returned {x} for row {i} (prompt "
                    f"{_short(prompts[i])}, completion {_short(completions[i])}); a non-finite "
                    "reward would make every advantage, the loss and the logged reward NaN. "
                    "Return a finite float, or None where the function does not apply.")
            out[i, j] = x
    return out


def _raise_for_row(fn, name, error, prompts, completions, completion_ids, columns):
    """Re-raises `error` naming the first row that makes `fn` fail on its own."""
    for i in range(len(completions)):
        try:
            _call(fn, prompts, completions, completion_ids, columns, [i])
        except Exception:  # noqa: BLE001, S112 - this row is the one to report
            raise DataError(
                f"reward function {name} raised {type(error).__name__}: {error} on row {i}: "
                f"prompt {_short(prompts[i])}, completion {_short(completions[i])}. Fix the "
                "function (return None for completions it cannot score).") from error
    raise DataError(f"reward function {name} raised {type(error).__name__}: {error} on a batch of "
                    f"{len(completions)} completions (no single row fails alone).") from error


def combine(by_fn: np.ndarray, weights: Sequence[float] | None = None,
            prompts: Sequence[str] | None = None) -> np.ndarray:
    """Each row's reward: the `weights`-weighted sum of its functions' rewards that are not
    NaN (`None`), as TRL's `nansum`; a row no function applies to gets 0 and a warning.

    Example:
        >>> combine(np.array([[1.0, np.nan], [0.5, 1.0]]), [1.0, 2.0]).tolist()
        [1.0, 2.5]
    """
    weights = check_weights(weights, by_fn.shape[1])
    none = np.isnan(by_fn).all(axis=1)
    if none.any():
        i = int(np.argmax(none))
        where = f" (first: row {i}, prompt {_short(prompts[i])})" if prompts is not None else ""
        warnings.warn(f"{int(none.sum())} completions got None from every reward function"
                      f"{where}: they are left out of their group's baseline, with advantage "
                      "0. Make at least one function apply to every prompt.", stacklevel=2)
    return np.nansum(by_fn * np.asarray(weights, np.float32)[None], axis=1).astype(np.float32)


def check_weights(weights: Sequence[float] | None, count: int) -> list[float]:
    """`weights` as a list of `count` floats (None: all 1), or a message with the numbers."""
    if weights is None:
        return [1.0] * count
    weights = [float(w) for w in weights]
    if len(weights) != count:
        raise ConfigurationError(
            f"reward_weights has {len(weights)} values for {count} reward functions: give one "
            "weight per function, in the same order.")
    if not all(math.isfinite(w) for w in weights):
        raise ConfigurationError(f"reward_weights {weights} must be finite numbers.")
    return weights


def reward_metrics(by_fn: np.ndarray, names: Sequence[str]) -> dict[str, float]:
    """Per function, the mean and standard deviation of its rewards over the rows it applies
    to (`rewards/<name>/mean`, `rewards/<name>/std`, TRL's names; NaN when it applies to none)."""
    out = {}
    for j, name in enumerate(names):
        kept = by_fn[:, j][~np.isnan(by_fn[:, j])]
        out[f"rewards/{name}/mean"] = float(kept.mean()) if kept.size else float("nan")
        out[f"rewards/{name}/std"] = float(kept.std(ddof=1)) if kept.size > 1 else 0.0
    return out
