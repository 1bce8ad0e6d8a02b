"""`jaxlight`, `jaxlight -h`, `jaxlight --help` and `jaxlight help`: the top-level help, printed
without importing JAX or any of jaxlight that does, so that it appears at once.

The commands are listed from `COMMANDS`, the recipes from `RECIPES`, their summaries as
`jaxlight.recipes` holds them; `jaxlight._cli._main` prints the same text from the recipes
themselves (`top_help`), and tests/test_cli_help.py fails when the two drift apart. Imports only
the standard library (layer 23 of docs/architecture.md, as `_cli/`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

#: The arguments answered here: the top-level help (no argument prints it too, exit status 2).
HELP_ARGS = ("-h", "--help", "help")

COMMANDS = {
    "fit": "train a recipe or your module (then report its final validation metrics)",
    "validate": "run the validation data through a model (from --ckpt_path)",
    "test": "run the test data through a model (from --ckpt_path)",
    "predict": "run predict_step over the prediction data (from --ckpt_path); --output saves it",
    "generate": "sample from a Hugging Face model directory (Llama 3, Qwen 2/3, Gemma 3) with "
                "a key/value cache: jaxlight generate PATH --prompt TEXT",
    "devices": "print devices, process index and count, and the mesh a strategy builds",
    "launch": "start N local processes of a command (multi-process training on one machine)",
}

#: Each recipe's summary (`jaxlight.recipes.get(name).summary`).
RECIPES = {
    "digits": "residual MLP on scikit-learn's 8x8 digits (offline); ~98% validation accuracy",
    "gpt": "byte-level transformer LM on the Python standard library; reports bits per byte",
    "sft": "fine-tune (LoRA by default) a gpt model to reverse words; exact match before/after",
    "dpo": "DPO of a pretrained Hugging Face model against a frozen copy; held-out reward "
           "accuracy before/after",
    "grpo": "GRPO of a pretrained Hugging Face model on your prompts and reward functions "
            "(TRL's contract) or a built-in verifiable task, KL to a frozen reference; held-out "
            "greedy reward before/after",
}


def top_help(recipes: Mapping[str, str]) -> str:
    """The help text, listing `recipes` (name -> summary)."""
    lines = ["usage: jaxlight <command> [recipe | PATH.py:Module --data PATH.py:Data] [options]"
             "   (jaxlight --version)", "", "commands:"]
    lines += [f"  {name:<9} {text}" for name, text in COMMANDS.items()]
    lines += ["", "recipes (jaxlight fit <recipe> --help lists every option and its default):"]
    lines += [f"  {name:<9} {summary}" for name, summary in recipes.items()]
    return "\n".join(lines)


TOP_HELP = top_help(RECIPES)


def is_top_help(argv: list[str]) -> bool:
    """Whether `argv` (the arguments after `jaxlight`) asks for the top-level help only."""
    return not argv or argv[0] in HELP_ARGS


def print_top_help(argv: list[str]) -> int:
    """Prints the help; the exit status `jaxlight._cli._main.main` gives (2 without arguments,
    141 when stdout's reader went away, as for `jaxlight --help | head -1`)."""
    try:
        print(TOP_HELP)
        sys.stdout.flush()
    except BrokenPipeError:
        quiet_stdout()
        return 141  # 128 + SIGPIPE, what a Unix tool killed by SIGPIPE reports
    return 0 if argv else 2


def quiet_stdout() -> None:
    """Points stdout at /dev/null once its reader is gone (`jaxlight devices | head`), so that
    neither later prints nor the interpreter's final flush raise BrokenPipeError again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
