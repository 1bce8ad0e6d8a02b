"""The tokenizer and chat template of a Hugging Face model directory, without transformers.

`tokenizer.json` is read by the `tokenizers` package and the chat template (from
`tokenizer_config.json` or `chat_template.jinja`) is rendered by jinja2 in a sandbox, as
transformers does (`trim_blocks`, `lstrip_blocks`, `raise_exception`, `tojson`). Both are the
optional extra `jaxlight[pretrained]`.

For fine-tuning on chat data, `encode_chat` marks the assistant's tokens: the conversation is
rendered turn by turn, and the text each assistant message adds (its content and the template's
end-of-turn marker) is the part the loss sees.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxlight._errors import CheckpointError, ConfigurationError, DataError, MissingDependency


def _require(name: str):
    try:
        return __import__(name)
    except ImportError:
        raise MissingDependency(
            f"reading a model directory's tokenizer needs the {name!r} package: pip install "
            "'jaxlight[pretrained]'.") from None


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
        return value.get("content")
    return value


class Tokenizer:
    """A model directory's tokenizer (`tokenizer.json`) and chat template.

    Args:
        path: the model directory.

    Example:
        >>> tok = Tokenizer("tests/nn/pretrained/fixtures/llama")  # doctest: +SKIP
        >>> tok.decode(tok.encode("The capital of France"))  # doctest: +SKIP
        'The capital of France'
    """

    def __init__(self, path: str):
        tokenizers = _require("tokenizers")
        file = os.path.join(path, "tokenizer.json")
        if not os.path.exists(file):
            raise CheckpointError(
                f"{path} has no tokenizer.json (files: {sorted(os.listdir(path))[:12]}); jaxlight "
                "reads fast tokenizers only: save one with transformers' "
                "AutoTokenizer.from_pretrained(dir).save_pretrained(dir).")
        self.path = path
        self.backend = tokenizers.Tokenizer.from_file(file)
        config: dict = {}
        config_file = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(config_file):
            with open(config_file) as f:
                config = json.load(f)
        self.config = config
        self.special = {k: _token_text(config.get(k)) for k in
                        ("bos_token", "eos_token", "pad_token", "unk_token")}
        template = config.get("chat_template")
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.exists(jinja_file):
            with open(jinja_file) as f:
                template = f.read()
        if isinstance(template, list):  # named templates: use "default"
            template = {t["name"]: t["template"] for t in template}.get("default")
        self.chat_template: str | None = template
        self._compiled = None

    # -- ids -----------------------------------------------------------------------------------

    def token_id(self, text: str | None) -> int | None:
        return None if text is None else self.backend.token_to_id(text)

    @property
    def eos_id(self) -> int | None:
        return self.token_id(self.special["eos_token"])

    @property
    def pad_id(self) -> int | None:
        return self.token_id(self.special["pad_token"])

    @property
    def bos_id(self) -> int | None:
        return self.token_id(self.special["bos_token"])

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (with the tokenizer's own special tokens, e.g. Llama 3's BOS)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # -- chat ----------------------------------------------------------------------------------

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False,
               **kwargs) -> str:
        """The chat template applied to `messages` (a list of `{"role", "content"}`)."""
        if self.chat_template is None:
            raise ConfigurationError(
                f"{self.path}: the tokenizer has no chat template (tokenizer_config.json's "
                "chat_template or chat_template.jinja); fine-tune on plain text or add one.")
        if self._compiled is None:
            jinja2 = _require("jinja2")
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise jinja2.exceptions.TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(
                x, ensure_ascii=False, indent=indent)
            env.globals["raise_exception"] = raise_exception
            self._compiled = env.from_string(self.chat_template)
        values = {k: v for k, v in self.special.items() if v is not None}
        values.update(kwargs)
        return self._compiled.render(messages=list(messages),
                                     add_generation_prompt=add_generation_prompt, **values)

    def apply_chat_template(self, messages: Sequence[dict],
                            add_generation_prompt: bool = False) -> list[int]:
        """Token ids of the rendered conversation (as transformers' `apply_chat_template`:
        the template writes the special tokens, so none are added)."""
        return self.encode(self.render(messages, add_generation_prompt),
                           add_special_tokens=False)

    def encode_chat(self, messages: Sequence[dict]) -> tuple[list[int], list[bool]]:
        """Token ids of a conversation and, per token, whether it is the assistant's.

        The template is rendered after each message; the text a message adds is tokenized on
        its own, so the ids are the concatenation of the turns' ids (the template's turn markers
        are special tokens, where a tokenizer splits anyway). An assistant turn's text starts
        after the generation prompt (`add_generation_prompt=True` of the turns before it).
        """
        ids: list[int] = []
        mask: list[bool] = []
        done = ""
        for i, message in enumerate(messages):
            if message.get("role") == "assistant":
                prompt = self.render(messages[:i], add_generation_prompt=True)
                if not prompt.startswith(done):
                    raise DataError(self._unstable(i))
                piece = self.encode(prompt[len(done):], add_special_tokens=False)
                ids += piece
                mask += [False] * len(piece)
                done = prompt
            text = self.render(messages[:i + 1])
            if not text.startswith(done):
                raise DataError(self._unstable(i))
            piece = self.encode(text[len(done):], add_special_tokens=False)
            ids += piece
            mask += [message.get("role") == "assistant"] * len(piece)
            done = text
        return ids, mask

    def _unstable(self, i: int) -> str:
        return (f"{self.path}: the chat template renders the first {i} messages differently "
                f"once message {i} follows them, so the assistant's tokens cannot be marked turn "
                "by turn; fine-tune with a template whose earlier turns do not change.")


def encode_chats(tokenizer: Tokenizer, conversations: Sequence[Sequence[dict]], length: int
                 ) -> dict[str, np.ndarray]:
    """`{"tokens": int32[n, length], "mask": float32[n, length - 1]}` for next-token training.

    `mask[i, t]` is 1 where token `t + 1` is the assistant's (the loss's targets); sequences are
    right-padded with the pad token (or EOS) and longer ones are cut at `length`.
    """
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else (tokenizer.eos_id or 0)
    tokens = np.full((len(conversations), length), pad, np.int32)
    mask = np.zeros((len(conversations), length - 1), np.float32)
    for row, messages in enumerate(conversations):
        ids, own = tokenizer.encode_chat(messages)
        ids, own = ids[:length], own[:length]
        tokens[row, :len(ids)] = ids
        mask[row, :len(ids) - 1] = np.asarray(own[1:], np.float32)
    return {"tokens": tokens, "mask": mask}


def read_jsonl_chats(path: str) -> list[list[dict]]:
    """Conversations from a JSONL file: one `{"messages": [{"role", "content"}, ...]}` a line."""
    out = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{number}: not JSON ({err}).") from None
            messages = record.get("messages") if isinstance(record, dict) else None
            if not isinstance(messages, list) or not all(
                    isinstance(m, dict) and "role" in m and "content" in m for m in messages):
                raise DataError(
                    f"{path}:{number}: each line needs {{\"messages\": [{{\"role\": ..., "
                    f"\"content\": ...}}, ...]}}; got {line.strip()[:80]!r}.")
            if not any(m["role"] == "assistant" for m in messages):
                raise DataError(f"{path}:{number}: the conversation has no assistant message, "
                                "so nothing to learn from it.")
            out.append(messages)
    if not out:
        raise DataError(f"{path}: no conversations.")
    return out
