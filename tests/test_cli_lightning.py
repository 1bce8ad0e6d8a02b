"""LightningCLI's form of the command line (jsonargparse): what the conformance group `cli`
does not cover. Parses only, but for one 3-step fit of a recipe in this form."""

from __future__ import annotations

import pathlib

import pytest
import yaml

from jaxlight import strategies
from jaxlight._cli import main, run

PORT = pathlib.Path(__file__).resolve().parent / "conformance" / "_cli_port.py"
TARGET = [f"{PORT}:LitClassifier", "--data", f"{PORT}:MyDataModule"]


def _err(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("jaxlight: error: ") and "Traceback" not in err, err
    return err


def test_help_lists_the_sections(capsys):
    assert main(["fit", *TARGET, "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--trainer.max_steps", "--trainer.callbacks", "--seed_everything",
                 "--model.backbone", "--model.learning_rate", "--data.batch_size",
                 "--optimizer", "--lr_scheduler", "--ckpt_path", "--print_config"):
        assert flag in out, flag


def test_print_config_reads_back_with_the_file_s_class_paths(capsys, tmp_path):
    argv = [*TARGET, "--trainer.max_steps", "3", "--model.backbone", "Backbone",
            "--model.backbone.hidden_dim", "5",
            "--trainer.callbacks+=lightning.pytorch.callbacks.LearningRateMonitor",
            "--optimizer", "SGD", "--optimizer.momentum", "0.9"]
    assert main(["fit", *argv, "--print_config"]) == 0
    first = capsys.readouterr().out
    printed = yaml.safe_load(first)
    assert printed["model"]["backbone"] == {"class_path": "_cli_port.Backbone",
                                            "init_args": {"hidden_dim": 5}}
    assert printed["trainer"]["callbacks"][0]["class_path"] == \
        "jaxlight.callbacks.LearningRateMonitor"
    assert printed["optimizer"]["class_path"] == "jaxlight.optim.torch.SGD"
    path = tmp_path / "config.yaml"
    path.write_text(first)
    assert main(["fit", *TARGET, "--config", str(path), "--print_config"]) == 0
    assert capsys.readouterr().out == first


@pytest.mark.parametrize("argv, message", [
    (["--trainer.max_steps", "2", "--callbacks", "EarlyStoping(monitor='val_loss')"],
     "unknown callback 'EarlyStoping'; jaxlight.callbacks has"),
    (["--trainer.callbacks+=NoSuchCallback"], "NoSuchCallback"),
    (["--trainer.max_stepz", "2"], "Did you mean '--trainer.max_steps'?"),
    (["--trainer.num_nodes", "2"], None),
])
def test_mistakes_are_named(capsys, argv, message):
    if message is None:  # a key without a jaxlight meaning, at another value: a warning
        with pytest.warns(UserWarning, match=r"trainer.num_nodes: 2 \(several hosts"):
            assert main(["fit", *TARGET, *argv, "--print_config"]) == 0
        return
    assert main(["fit", *TARGET, *argv]) == 2
    assert message in _err(capsys)


def test_lightning_callback_paths_map_by_name_and_unknown_ones_are_refused(capsys, tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"callbacks": [
        {"class_path": "lightning.pytorch.callbacks.LearningRateMonitor",
         "init_args": {"logging_interval": None, "log_momentum": False}},
        {"class_path": "lightning.pytorch.callbacks.BatchSizeFinderX"}]}}))
    assert main(["fit", *TARGET, "--config", str(path)]) == 2
    err = _err(capsys)
    assert "trainer.callbacks[1]: lightning.pytorch.callbacks.BatchSizeFinderX has no jaxlight " \
           "counterpart in jaxlight.callbacks" in err and "LearningRateMonitor" in err


def test_a_config_given_as_text(capsys):
    assert main(["fit", *TARGET, "--config", "{trainer: {max_steps: -1, max_epochs: 3, "
                 "check_val_every_n_epoch: null}}",
                 "--config={model: {learning_rate: 0.5}}", "--print_config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["max_steps"] is None and printed["trainer"]["max_epochs"] == 3
    # Lightning keeps this None (val_check_interval then counts steps across epochs).
    assert printed["trainer"]["check_val_every_n_epoch"] is None
    assert printed["model"]["learning_rate"] == 0.5


def test_evaluating_without_a_checkpoint_is_refused(capsys):
    assert main(["validate", *TARGET, "--trainer.max_steps", "1"]) == 2
    assert "without --ckpt_path would evaluate a randomly initialized model" in _err(capsys)


def test_recipes_take_lightning_spellings(capsys, tmp_path):
    """A recipe in LightningCLI's form: its config sections beside `trainer`, the recipe's Fit
    defaults and a preset's as `trainer` defaults, and a printed config that reads back."""
    assert main(["fit", "digits", "--trainer.max_steps", "7", "--seed_everything", "3",
                 "--model.width", "24", "--print-config"]) == 0
    first = capsys.readouterr().out
    printed = yaml.safe_load(first)
    assert printed["trainer"]["max_steps"] == 7 and printed["seed_everything"] == 3
    assert printed["trainer"]["log_every_n_steps"] == 20  # the recipe's, not Fit's 50
    assert printed["model"]["width"] == 24 and printed["optim"]["lr"] == 0.002
    path = tmp_path / "config.yaml"
    path.write_text(first)
    assert main(["fit", "digits", "--config", str(path), "--print_config"]) == 0
    assert capsys.readouterr().out == first
    assert main(["fit", "gpt", "--preset", "125m", "--trainer.max_steps", "5",
                 "--print_config"]) == 0
    preset = yaml.safe_load(capsys.readouterr().out)
    assert preset["model"]["num_layers"] == 12 and preset["trainer"]["max_steps"] == 5
    assert preset["trainer"]["precision"] == "bf16-mixed"  # the preset's fit: values
    assert main(["fit", "digits", "--trainer.max_steps", "2", "--model.widht", "3"]) == 2
    assert "Did you mean '--model.width'?" in _err(capsys)


def test_a_recipe_trains_in_lightning_s_form():
    result = run("fit", "digits", [
        "--trainer.max_steps", "3", "--trainer.strategy", "dp", "--model.width", "16",
        "--model.hidden", "16", "--optim.lr", "0.01", "--trainer.logger", "false",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--trainer.num_sanity_val_steps", "0", "--trainer.val_check_interval", "3"])
    assert isinstance(result.fit.strategy, strategies.DataParallel)
    assert result.fit.global_step == 3 and result.fit.seed == 0
    assert result.module.width == 16 and result.module.lr == 0.01
    assert result.config.model.hidden == 16 and "val_accuracy" in result.metrics


def test_data_from_a_function_takes_its_arguments(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "fn_data.py").write_text(
        f"import sys\nsys.path.insert(0, {str(PORT.parent)!r})\n"
        "from _cli_port import MyDataModule\n\n\n"
        "def make_data(batch_size: int = 8):\n    return MyDataModule(batch_size)\n")
    assert main(["fit", TARGET[0], "--data", "fn_data.py:make_data", "--data.batch_size", "4",
                 "--trainer.max_steps", "1", "--print_config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["data"] == {"batch_size": 4}


def test_a_subclass_mode_config_names_the_classes(capsys, tmp_path, monkeypatch):
    """LightningCLI's subclass mode with importable classes: `jaxlight fit --config` alone."""
    monkeypatch.chdir(PORT.parent)  # `_cli_port.LitClassifier`, as `python main.py` imports it
    backbone = {"class_path": "_cli_port.Backbone", "init_args": {"hidden_dim": 7}}
    config = {"model": {"class_path": "_cli_port.LitClassifier",
                        "init_args": {"learning_rate": 0.5, "backbone": backbone}},
              "data": {"class_path": "_cli_port.MyDataModule", "init_args": {"batch_size": 8}}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["fit", "--config", str(path), "--print_config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["learning_rate"] == 0.5
    assert printed["model"]["backbone"] == {"class_path": "_cli_port.Backbone",
                                            "init_args": {"hidden_dim": 7}}
    assert printed["data"]["batch_size"] == 8
    config["model"]["learning_rate"] = 0.1  # beside init_args: refused, named
    path.write_text(yaml.safe_dump(config))
    assert main(["fit", "--config", str(path)]) == 2
    assert ("model: has class_path and init_args, so its arguments go under init_args (as "
            "LightningCLI writes them); got ['learning_rate'] beside them") in _err(capsys)
