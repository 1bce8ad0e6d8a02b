"""Your own post-training data: rows with a prompt (and any other columns) from a local file.

`read_rows(path)` reads a JSONL file (one object a line), a JSON list, a Parquet file (with
`pyarrow`), or a Hugging Face `datasets` directory saved with `save_to_disk` (with `datasets`);
nothing is downloaded. `prompt_rows` / `preference_rows` check the columns GRPO and DPO need and
turn each prompt into chat messages, as TRL takes them: a string is one user turn, a list of
`{"role", "content"}` messages is used as it is.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from jaxlight._errors import ConfigurationError, DataError

#: How to install the optional readers of Parquet files and `save_to_disk` directories.
INSTALL = "pip install 'jaxlight[posttrain]'"


def read_rows(path: str, locate: bool = False) -> list[dict[str, Any]] | tuple[list, list]:
    """Every row of a local dataset as a dict of its columns (with `locate`, also where each
    row is, for messages: `path:line` in a JSONL file, `path row i` elsewhere).

    Example:
        >>> import json, tempfile, os
        >>> d = tempfile.mkdtemp(); p = os.path.join(d, "x.jsonl")
        >>> _ = open(p, "w").write(json.dumps({"prompt": "2+2?", "answer": "4"}) + "\\n")
        >>> read_rows(p)
        [{'prompt': '2+2?', 'answer': '4'}]
    """
    if not os.path.exists(path):
        raise DataError(f"no dataset at {path!r}: give a .jsonl, .json or .parquet file, or a "
                        "directory written by datasets' save_to_disk.")
    if os.path.isdir(path):
        rows = _saved_dataset(path)
        return (rows, [f"{path} row {i}" for i in range(len(rows))]) if locate else rows
    if path.endswith(".parquet"):
        rows = _parquet(path)
        return (rows, [f"{path} row {i}" for i in range(len(rows))]) if locate else rows
    with open(path) as f:
        if path.endswith(".json"):
            rows = json.load(f)
            if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
                raise DataError(f"{path}: a .json dataset is a list of objects, one per row.")
            return (rows, [f"{path} row {i}" for i in range(len(rows))]) if locate else rows
        rows, places = [], []
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{path}:{number}: not JSON ({error}); a .jsonl dataset has one "
                                "object a line.") from None
            if not isinstance(record, dict):
                raise DataError(f"{path}:{number}: a row is a JSON object, got "
                                f"{type(record).__name__}.")
            rows.append(record)
            places.append(f"{path}:{number}")
    return (rows, places) if locate else rows


def _saved_dataset(path: str) -> list[dict[str, Any]]:
    """The rows of a directory written by `Dataset.save_to_disk` (its "train" split when it
    holds a `DatasetDict`)."""
    try:
        import datasets  # noqa: PLC0415 - optional
    except ImportError:
        raise ConfigurationError(
            f"{path} is a directory: reading a Hugging Face dataset saved with save_to_disk "
            f"needs the `datasets` package: {INSTALL} (or pip install datasets), or export it "
            "to JSONL (dataset.to_json('train.jsonl')).") from None
    try:
        data = datasets.load_from_disk(path)
    except FileNotFoundError as error:
        raise DataError(f"{path} is a directory but not one written by datasets' save_to_disk "
                        f"({error}): give that directory, or a .jsonl, .json or .parquet "
                        "file.") from None
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise DataError(f"{path} holds splits {sorted(data)} and no 'train': save the "
                            "split to train on alone.")
        data = data["train"]
    return [dict(r) for r in data]


def _parquet(path: str) -> list[dict[str, Any]]:
    try:
        import pyarrow  # noqa: PLC0415 - optional
        import pyarrow.parquet as pq  # noqa: PLC0415 - optional
    except ImportError:
        raise ConfigurationError(
            f"reading {path} needs `pyarrow`: {INSTALL} (or pip install pyarrow), or convert "
            "it to JSONL.") from None
    try:
        return pq.read_table(path).to_pylist()
    except pyarrow.ArrowException as error:
        raise DataError(f"{path}: not a readable Parquet file ({error}).") from None


def as_messages(prompt: Any, where: str) -> list[dict[str, str]]:
    """A prompt as chat messages: a string is one user turn."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if (isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in prompt)):
        return [{"role": m["role"], "content": m["content"]} for m in prompt]
    raise DataError(f"{where}: 'prompt' must be a string or a list of {{'role', 'content'}} "
                    f"messages, got {type(prompt).__name__} {str(prompt)[:80]!r}.")


def prompt_rows(rows: Sequence[dict], where: str = "dataset"
                ) -> tuple[list[list[dict[str, str]]], dict[str, list[Any]]]:
    """The prompts (as chat messages) and the other columns (one list per column, for the
    reward functions' keyword arguments) of GRPO rows."""
    if not rows:
        raise DataError(f"{where} has no rows.")
    keys = list(rows[0])
    if "prompt" not in keys:
        raise DataError(f"{where}: every row needs a 'prompt' column (a string or chat "
                        f"messages); the first row has {keys}.")
    prompts, columns = [], {k: [] for k in keys if k != "prompt"}
    for i, row in enumerate(rows):
        if set(row) != set(keys):
            raise DataError(f"{where}: row {i} has columns {sorted(row)}, row 0 has "
                            f"{sorted(keys)}: every row needs the same columns.")
        prompts.append(as_messages(row["prompt"], f"{where} row {i}"))
        for k in columns:
            columns[k].append(row[k])
    for reserved in ("completions", "completion_ids", "prompts"):
        if reserved in columns:
            raise DataError(f"{where}: column {reserved!r} would collide with the reward "
                            "functions' own argument of that name: rename it.")
    return prompts, columns


def preference_rows(rows: Sequence[dict], where: str = "dataset",
                    places: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """DPO rows: a prompt (string or messages) with `chosen` and `rejected` answers (strings);
    `places` (from `read_rows(..., locate=True)`) name the rows in messages."""
    if not rows:
        raise DataError(f"{where} has no rows.")
    out = []
    for i, row in enumerate(rows):
        place = places[i] if places is not None else f"{where} row {i}"
        wrong = [k for k in ("prompt", "chosen", "rejected") if k not in row] + [
            k for k in ("chosen", "rejected") if k in row and not isinstance(row[k], str)]
        if wrong:
            raise DataError(f"{place}: a preference pair needs 'prompt' (text or messages) and "
                            f"the strings 'chosen' and 'rejected'; {wrong} missing or not text "
                            f"(columns: {sorted(row)}).")
        out.append({**row, "prompt": as_messages(row["prompt"], place)})
    return out
