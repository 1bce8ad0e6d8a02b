"""The GRPO recipe's built-in verifiable tasks and its reward functions from the command line.

Both tasks make rows as a user's dataset has them (a `prompt` and answer columns), and their
rewards have TRL's contract `f(prompts, completions, completion_ids, **columns) ->
list[float | None]`:

- `reversal`: "Reverse abc"; `reversal_reward` 1 for exactly "cba", `format_reward` 0.5 for
  lowercase letters as long as the word;
- `arithmetic`: word problems with one integer answer, generated offline from a seed
  (`arithmetic_rows`); `answer_reward` 1 when the completion's last integer is the answer,
  `integer_format_reward` 0.5 when the completion is one integer and nothing else.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxlight._errors import ConfigurationError

# -- reversal ----------------------------------------------------------------------------------


def _text(completion: Any) -> str:
    """A completion's text: TRL passes conversational completions as assistant messages."""
    if isinstance(completion, list):
        return "".join(m.get("content", "") for m in completion)
    return completion


def reversal_reward(prompts, completions, completion_ids=None, *, word, **_) -> list[float]:
    """1 when the completion is exactly the reversal of the row's `word`."""
    return [float(_text(c).strip() == w[::-1]) for c, w in zip(completions, word, strict=True)]


def format_reward(prompts, completions, completion_ids=None, *, word, **_) -> list[float]:
    """0.5 for an answer of lowercase letters only, as long as the row's `word`."""
    return [0.5 * float(len(_text(c).strip()) == len(w)
                        and re.fullmatch(r"[a-z]+", _text(c).strip()) is not None)
            for c, w in zip(completions, word, strict=True)]


def reversal_rows(words: Sequence[str]) -> list[dict[str, str]]:
    """The reversal task's rows: `{"prompt": "Reverse abc", "word": "abc"}`."""
    return [{"prompt": f"Reverse {w}", "word": w} for w in words]


# -- arithmetic word problems ------------------------------------------------------------------

_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana")
_THINGS = ("apples", "books", "coins", "pens", "shells", "stamps")


def arithmetic_rows(n: int, seed: int = 0, max_operand: int = 9) -> list[dict[str, str]]:
    """`n` word problems with an integer answer (addition, subtraction, multiplication of
    operands up to `max_operand`), the same for the same seed: `{"prompt", "answer"}`.

    Example:
        >>> arithmetic_rows(1, seed=0)[0]["answer"].isdigit()
        True
    """
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        name, thing = _NAMES[rng.integers(len(_NAMES))], _THINGS[rng.integers(len(_THINGS))]
        a, b = (int(x) for x in rng.integers(1, max_operand + 1, 2))
        kind = int(rng.integers(3))
        if kind == 0:
            text, answer = f"{name} has {a} {thing} and gets {b} more. How many now?", a + b
        elif kind == 1:
            a, b = max(a, b), min(a, b)
            text, answer = f"{name} has {a} {thing} and gives away {b}. How many are left?", a - b
        else:
            text, answer = f"{name} buys {a} bags of {b} {thing}. How many {thing}?", a * b
        rows.append({"prompt": text + " Answer with the number.", "answer": str(answer)})
    return rows


_INT = re.compile(r"-?\d+")


def answer_reward(prompts, completions, completion_ids=None, *, answer, **_) -> list[float]:
    """1 when the completion's last integer equals the row's `answer` exactly."""
    out = []
    for c, a in zip(completions, answer, strict=True):
        found = _INT.findall(_text(c))
        out.append(float(bool(found) and found[-1] == str(a).strip()))
    return out


def integer_format_reward(prompts, completions, completion_ids=None, **_) -> list[float]:
    """0.5 when the completion is one integer and nothing else."""
    return [0.5 * float(re.fullmatch(r"\s*-?\d+\s*", _text(c)) is not None)
            for c in completions]


TASKS: dict[str, list[Callable]] = {"reversal": [reversal_reward, format_reward],
                                    "arithmetic": [answer_reward, integer_format_reward]}


# -- reward functions named on the command line ------------------------------------------------


def load_function(spec: str) -> Callable:
    """A reward function named `PATH.py:name` (a file) or `package.module:name`."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ConfigurationError(
            f"reward function {spec!r}: name it as PATH.py:function (a Python file) or "
            "package.module:function, e.g. --grpo.reward_funcs rewards.py:correct.")
    if where.endswith(".py"):
        if not os.path.isfile(where):
            raise ConfigurationError(f"reward function {spec!r}: no file {where!r} "
                                     f"(from {os.getcwd()}).")
        module_name = "jaxlight_rewards_" + re.sub(r"\W", "_", os.path.abspath(where))
        loaded = importlib.util.spec_from_file_location(module_name, where)
        module = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as error:
            raise ConfigurationError(f"reward function {spec!r}: cannot import {where!r} "
                                     f"({error}).") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items()
                       if callable(v) and not k.startswith("_"))
        raise ConfigurationError(f"reward function {spec!r}: {where} has no function {name!r} "
                                 f"(it has {found}).")
    return fn


def parse_reward_funcs(text: str, task: str) -> list[Callable]:
    """`--grpo.reward_funcs`: comma-separated specs, or empty for the task's own rewards."""
    specs = [s.strip() for s in text.split(",") if s.strip()]
    if not specs:
        return list(TASKS[task])
    return [load_function(s) for s in specs]


def parse_weights(text: str) -> list[float] | None:
    """`--grpo.reward_weights`: comma-separated numbers, or empty for all 1."""
    parts = [s.strip() for s in text.split(",") if s.strip()]
    if not parts:
        return None
    try:
        return [float(p) for p in parts]
    except ValueError:
        raise ConfigurationError(f"--grpo.reward_weights {text!r}: give comma-separated numbers, "
                                 "one per reward function, e.g. 1.0,0.5.") from None
