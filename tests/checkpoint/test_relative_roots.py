"""Relative roots (issue 17 item 2): `ckpt_path="last"` from a relative `default_root_dir`,
from Python and from the command line, in an empty folder (the requeue path)."""

import os

import pytest

from jaxlight import callbacks
from jaxlight._cli import main, run
from jaxlight.checkpoint._restore import complete_steps
from tests.checkpoint._common import loader, make_fit
from tests.models import Classifier

CLI = ["--model.width", "32", "--model.hidden", "32", "--logger", "none",
       "--enable-progress-bar", "false", "--enable-model-summary", "false"]


def test_last_under_a_relative_default_root_dir_resumes_and_validates(capsys):
    # The conftest runs every test in an empty temporary folder: "runs/x" is relative to it.
    first = make_fit("single", 4, [callbacks.ModelCheckpoint(every_n_steps=4)],
                     default_root_dir="runs/x")
    trained = Classifier()
    first.fit(trained, loader())
    expected = first.validate(trained, loader())
    assert complete_steps("runs/x/checkpoints") == [4]

    # No ModelCheckpoint (as after a preemption): "last" looks in <default_root_dir>/checkpoints.
    # (enable_checkpointing=False: the default one would save step 6 there.)
    resumed = make_fit("single", 6, default_root_dir="runs/x", enable_checkpointing=False)
    resumed.fit(Classifier(), loader(), ckpt_path="last")
    assert resumed.global_step == 6
    assert "resumed from " + os.path.abspath("runs/x/checkpoints/4") in capsys.readouterr().out

    evaluated = make_fit("single", 6, default_root_dir="runs/x")
    metrics = evaluated.validate(Classifier(), loader(), ckpt_path="last")
    assert metrics["val_loss"] == expected["val_loss"]  # step 4's parameters, not a fresh init


@pytest.mark.slow
def test_cli_requeue_with_last_in_an_empty_folder(capsys):
    assert main(["fit", "digits", "--max-steps", "10", "--checkpoint-every-n-steps", "10",
                 *CLI]) == 0
    assert complete_steps("jaxlight_logs/checkpoints") == [10]
    resumed = run("fit", "digits", ["--max-steps", "20", "--ckpt-path", "last", *CLI])
    assert resumed.fit.global_step == 20
    assert "resumed from " + os.path.abspath("jaxlight_logs/checkpoints/10") in \
        capsys.readouterr().out
    assert main(["validate", "digits", "--ckpt-path", "last", *CLI]) == 0
    assert "val_accuracy" in capsys.readouterr().out
