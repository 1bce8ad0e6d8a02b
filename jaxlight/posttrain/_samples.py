"""GRPO's sampled completions as a text table for the loggers that take one (W&B, MLflow).

`sample_table` makes the table of one generation batch (prompt, completion, each reward
function's reward, the weighted reward, the advantage; TRL's `log_completions` columns), and
`log_samples` hands it to the run's loggers: a `WandbLogger` logs a `wandb.Table` under the key
(at the step, beside the metrics), an `MLFlowLogger` appends the rows to the run's table
artifact `<key>.json` (`MlflowClient.log_table`, which needs pandas; without it one JSON text
artifact per step, `<key>/step_<step>.json`). CSV and TensorBoard loggers get nothing: a CSV row
holds numbers, and jaxlight's TensorBoard writer writes scalars only.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxlight.callbacks._mlflow import MLFlowLogger
from jaxlight.callbacks._wandb import WandbLogger


def _text(value: Any) -> str:
    """A prompt or completion as table text (chat messages: `role: content` lines)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in value)
    return str(value)


def _number(x: float) -> float | None:
    return None if math.isnan(x) else float(x)


def sample_table(step: int, prompts: Sequence[Any], completions: Sequence[Any],
                 by_fn: np.ndarray, names: Sequence[str], rewards: np.ndarray,
                 advantages: np.ndarray, limit: int, generation: int = 0
                 ) -> tuple[list[str], list[list[Any]]]:
    """The first `limit` rows of a generation batch as `(columns, rows)`: the logging step, the
    generation batch's index, prompt, completion, one column per reward function (None where
    it did not apply), reward and advantage.

    Example:
        >>> columns, rows = sample_table(4, ["1+1?"], ["2"], np.array([[1.0, np.nan]]),
        ...                              ["right", "short"], np.array([1.0]), np.array([0.5]), 8)
        >>> columns
        ['step', 'generation', 'prompt', 'completion', 'right', 'short', 'reward', 'advantage']
        >>> rows
        [[4, 0, '1+1?', '2', 1.0, None, 1.0, 0.5]]
    """
    columns = ["step", "generation", "prompt", "completion", *names, "reward", "advantage"]
    rows = [[int(step), int(generation), _text(prompts[i]), _text(completions[i]),
             *(_number(x) for x in by_fn[i]), float(rewards[i]), float(advantages[i])]
            for i in range(min(limit, len(completions)))]
    return columns, rows


def log_samples(loggers: Sequence[Any], columns: list[str], rows: list[list[Any]], step: int,
                key: str = "completions") -> list[str]:
    """Logs the table to every logger that takes text tables; returns their class names."""
    took = []
    for logger in loggers:
        if isinstance(logger, WandbLogger) and logger.run is not None:
            import wandb  # noqa: PLC0415 - the logger exists, so wandb is installed

            logger.run.log({key: wandb.Table(columns=columns, data=rows)}, step=int(step))
            took.append(type(logger).__name__)
        elif isinstance(logger, MLFlowLogger) and logger.run_id is not None:
            client, run_id = logger.experiment, logger.run_id
            try:
                import pandas  # noqa: F401, PLC0415 - MLflow's log_table needs it
            except ImportError:
                client.log_text(run_id, json.dumps({"columns": columns, "data": rows}),
                                f"{key}/step_{int(step):06d}.json")
            else:
                with warnings.catch_warnings():  # MLflow 3.17's own use of pandas 3
                    warnings.filterwarnings("ignore", "For backward compatibility, 'str' dtypes")
                    client.log_table(run_id, {c: [r[j] for r in rows]
                                              for j, c in enumerate(columns)}, f"{key}.json")
            took.append(type(logger).__name__)
    return took
