"""The run the MoE SIGKILL test resumes (the tiny MoE LM with the auxiliary-loss-free bias, 8
steps), shared by the test and its subprocess (tests/checkpoint/_child.py, `"module": "moe"`,
under the `data2_expert4` strategy of tests/checkpoint/_common.py)."""

from __future__ import annotations

from tests.strategies.lm import token_batches
from tests.strategies.moe_lm import TinyMoELM

STEPS = 8
STRATEGY = "data2_expert4"


def module() -> TinyMoELM:
    return TinyMoELM(bias_update_rate=1e-3)


def batches():
    return token_batches(STEPS, batch=16)
