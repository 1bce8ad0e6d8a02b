"""GRPO across processes, resumed: a checkpoint taken inside a generation batch by 2 processes
does not resume in 1. (The 2-process SIGKILL and resume, bitwise, is
tests/posttrain/test_grpo_processes.py's: it shares that file's uninterrupted 2-process job.)"""

import numpy as np
import pytest

from jaxlight import CheckpointError
from jaxlight.recipes import grpo
from tests.posttrain import _grpo_processes as script


def test_another_process_count_cannot_resume_inside_a_generation_batch():
    config = grpo.Config()
    config.model.pretrained = script.FIXTURE
    config.data.prompts_per_step, config.grpo.group_size = 2, 4
    config.grpo.max_new_tokens, config.grpo.updates = 4, 2
    _, data = grpo.build(config)
    rows = {"tokens": np.zeros((4, 6), np.int32)}
    state = {"generation": 2, "taken": 1, "batch": None,
             "batches": [grpo._encode_batch(rows)] * 2}
    with pytest.raises(CheckpointError, match=r"GRPO generation batch 1 \(1 of its 2 updates "
                       r"taken\), whose rows 2 process\(es\) held, but this run has 1"):
        data.train.load_state_dict(state)
    state["batches"] = [grpo._encode_batch(rows)]  # one process's: its own rows
    data.train.load_state_dict(state)
    np.testing.assert_array_equal(data.train.batch["tokens"], rows["tokens"])
