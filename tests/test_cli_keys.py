"""The command line's keys taken exactly (no abbreviations, every unknown key of a file named),
`--devices` kept in the printed config, and `--trainer.devices` on too few devices."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import yaml

from jaxlight._cli import main
from tests.test_cli_user import COUNTER

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _err(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("jaxlight: error: ") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("argv, bad, nearest", [
    (["--trainer.max_step", "7"], "--trainer.max_step", "--trainer.max_steps"),
    (["--model.hid", "8"], "--model.hid", "--model.hidden"),
])
def test_abbreviated_options_are_refused_with_the_full_name(capsys, argv, bad, nearest):
    # argparse's prefix matching read these as --trainer.max_steps / --model.hidden, silently.
    assert main(["fit", "digits", *argv, "--print_config"]) == 2
    assert f"unknown option '{bad}'. Did you mean '{nearest}'?" in _err(capsys)


def test_a_config_file_with_several_unknown_keys_names_each(tmp_path, capsys):
    path = tmp_path / "typos.yaml"
    path.write_text("trainer:\n  max_step: 10\nmodel:\n  hiden: 64\n  widht: 32\nfinetune: 1\n")
    assert main(["fit", "digits", "--config", str(path)]) == 2
    err = _err(capsys)
    assert f"config file {path}: unknown keys " in err
    for key, nearest in (("trainer.max_step", "trainer.max_steps"),
                         ("model.hiden", "model.hidden"), ("model.widht", "model.width")):
        assert f"'{key}' (did you mean '{nearest}'?)" in err, key
    assert "'finetune'" in err


def test_print_config_keeps_devices(capsys):
    assert main(["fit", "digits", "--devices", "8", "--print_config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["devices"] == 8


def test_trainer_flags_are_read_by_their_type(capsys):
    """As LightningCLI reads them (2.6.6 prints `default_root_dir: '007'`): a folder named by
    digits stays a string; a number stays a number."""
    assert main(["fit", "digits", "--trainer.default_root_dir", "007", "--trainer.max_epochs",
                 "3", "--print_config"]) == 0
    trainer = yaml.safe_load(capsys.readouterr().out)["trainer"]
    assert trainer["default_root_dir"] == "007"
    assert trainer["max_epochs"] == 3


@pytest.mark.slow
def test_a_printed_config_replays_on_its_devices(tmp_path, capsys):
    assert main(["fit", "digits", "--devices", "8", "--model.width", "16", "--model.hidden",
                 "16", "--trainer.max_steps", "1", "--trainer.logger", "false",
                 "--trainer.enable_progress_bar", "false", "--print_config"]) == 0
    (tmp_path / "saved.yaml").write_text(capsys.readouterr().out)
    # A fresh process with one CPU device: the file's `devices: 8` is applied before JAX starts.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-m", "jaxlight._cli", "fit", "digits", "--config",
                          "saved.yaml"], cwd=tmp_path,
                         env={**env, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "8 cpu devices, process 0 of 1" in out.stdout, out.stdout


def test_trainer_devices_beyond_the_cpu_devices_names_devices(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-m", "jaxlight._cli", "fit", "digits",
                          "--trainer.devices", "8", "--max-steps", "1"], cwd=tmp_path,
                         env={**env, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "--devices 8 --trainer.devices 8" in out.stderr, out.stderr


@pytest.mark.slow  # a fit; the fast tier parses callbacks in test_cli
def test_your_own_callback_class_appended_on_the_command_line(capsys):
    pathlib.Path("counter.py").write_text(COUNTER)  # CountSteps(label, every)
    assert main(["fit", "digits", "--model.width", "16", "--model.hidden", "16",
                 "--trainer.max_steps", "4", "--trainer.callbacks+=counter.py:CountSteps",
                 "--trainer.callbacks.label", "seen", "--trainer.callbacks.every", "2",
                 "--trainer.enable_progress_bar", "false", "--trainer.logger", "false",
                 "--trainer.enable_model_summary", "false"]) == 0
    out = capsys.readouterr().out
    assert "seen 2" in out and "seen 4" in out and "seen 1" not in out
