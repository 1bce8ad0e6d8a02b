"""Group `cli`: LightningCLI's command line on Lightning's backbone example. The `config.yaml`
that Lightning's own LightningCLI printed (`fixtures/cli.json`) runs unchanged under
`jaxlight fit`, parses to the values Lightning parsed, and trains to Lightning's weights."""

from __future__ import annotations

import pathlib
import warnings

import numpy as np
import pytest
import yaml

from jaxlight._cli import main
from jaxlight._cli._lightning_form import parse
from jaxlight._cli._run import run
from jaxlight._errors import ConfigurationError
from tests.conformance._cases import case, claim, departure
from tests.conformance._cli_problem import FLAGS, OPTIMIZER_FLAGS

G = "cli"
HERE = pathlib.Path(__file__).resolve().parent
PORT = str(HERE / "_cli_port.py")
TARGET = [f"{PORT}:LitClassifier", "--data", f"{PORT}:MyDataModule"]
# lightning_side/cli.py's QUIET (no default checkpoint either) and no sanity check.
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
         "--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
         "--trainer.num_sanity_val_steps", "0"]


@pytest.fixture
def lightning_config(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(case(G, "print_config_reads_back")["config_yaml"])
    return str(path)


def _observed(argv, target=TARGET) -> dict:
    """jaxlight's parse of a command, in the fixture's terms (Lightning's `None` for "the
    default" read as the default Lightning applies: 50 steps between logs, no step limit)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no key of Lightning's own file may be named as ignored
        _, cfg, _, _, notes = parse("fit", target[0], [*target[1:], *argv])
        notes.report()
    t = cfg.trainer
    return {
        "seed_everything": cfg.seed_everything,
        "trainer": {"max_epochs": t.max_epochs, "max_steps": t.max_steps,
                    "limit_val_batches": t.limit_val_batches,
                    "check_val_every_n_epoch": t.check_val_every_n_epoch,
                    "log_every_n_steps": t.log_every_n_steps,
                    "accumulate_grad_batches": t.accumulate_grad_batches,
                    "gradient_clip_val": t.gradient_clip_val},
        "callbacks": [{"class": cb.class_path.rsplit(".", 1)[1],
                       "init_args": {k: cb.init_args[k] for k in
                                     ("monitor", "patience", "mode", "min_delta")}}
                      for cb in t.callbacks],
        "model": {"learning_rate": cfg.model.learning_rate,
                  "backbone": cfg.model.backbone.class_path.rsplit(".", 1)[1],
                  "hidden_dim": cfg.model.backbone.init_args.hidden_dim},
        "data": {"batch_size": cfg.data.batch_size},
    }


def _lightning_terms(parsed: dict) -> dict:
    out = {**parsed, "trainer": dict(parsed["trainer"])}
    t = out["trainer"]
    t["max_steps"] = None if t["max_steps"] == -1 else t["max_steps"]
    t["log_every_n_steps"] = 50 if t["log_every_n_steps"] is None else t["log_every_n_steps"]
    t["limit_val_batches"] = int(t["limit_val_batches"])  # Lightning reads 2.0 as 2 batches
    return out


@claim("Lightning's own --print_config config.yaml (subclass-mode backbone, a callback, a "
       "seed) parses under jaxlight to the trainer, model and data values LightningCLI parses")
def test_print_config_reads_back(lightning_config):
    expected = _lightning_terms(case(G, "print_config_reads_back")["parsed"])
    assert _observed(["--config", lightning_config]) == expected


@claim("the same LightningCLI flags (--trainer.*, --seed_everything, callbacks+=, --model."
       "backbone NAME --model.backbone.ARG) parse to the values LightningCLI parses")
def test_flags_parse():
    assert case(G, "flags_parse")["flags"] == FLAGS
    assert _observed(FLAGS) == _lightning_terms(case(G, "flags_parse")["parsed"])


def _train(argv, target=TARGET) -> dict:
    result = run("fit", target[0], [*target[1:], *argv, *QUIET])
    net = result.module.model
    return {"global_step": result.fit.global_step,
            "valid_loss": result.metrics["val_loss"] if "val_loss" in result.metrics
            else float(result.fit.callback_metrics["valid_loss"]),
            "weights": {name: {"kernel": np.asarray(getattr(net, name).kernel.value),
                               "bias": np.asarray(getattr(net, name).bias.value)}
                        for name in ("l1", "l2")}}


def _assert_trained_like(observed: dict, expected: dict) -> None:
    assert observed["global_step"] == expected["global_step"]
    np.testing.assert_allclose(observed["valid_loss"], expected["valid_loss"], rtol=1e-5)
    for name, params in expected["weights"].items():
        for key, value in params.items():
            np.testing.assert_allclose(observed["weights"][name][key], np.asarray(value),
                                       rtol=1e-5, atol=1e-6, err_msg=f"{name}.{key}")


@claim("jaxlight fit --config <Lightning's config.yaml> trains the backbone classifier to "
       "Lightning's weights and validation loss (same initial weights and batches)")
def test_config_trains(lightning_config):
    _assert_trained_like(_train(["--config", lightning_config]), case(G, "config_trains"))


@claim("--optimizer Adam (with weight_decay) and --lr_scheduler StepLR replace "
       "configure_optimizers as LightningCLI's do, and train to Lightning's weights")
def test_optimizer_flags_train(lightning_config):
    with pytest.warns(UserWarning, match="configure_optimizers is replaced by --optimizer"):
        observed = _train(["--config", lightning_config, *OPTIMIZER_FLAGS])
    _assert_trained_like(observed, case(G, "optimizer_flags_train"))


@claim("LightningCLI's subclass mode (subclass_mode_model/data=True): the config.yaml it "
       "prints, model: and data: as class_path/init_args, runs unchanged under jaxlight fit "
       "PATH.py:Class --config (its __main__ classes found in that file), parses to the values "
       "LightningCLI parses and trains to Lightning's weights")
def test_subclass_mode_config(tmp_path, capsys):
    fixture = case(G, "subclass_mode_config")
    assert (fixture["model_class_path"], fixture["data_class_path"]) == (
        "__main__.LitClassifier", "__main__.MyDataModule")
    path = tmp_path / "config.yaml"
    path.write_text(fixture["config_yaml"])
    model_only = [TARGET[0]]  # the data class comes from the file's data: section
    assert _observed(["--config", str(path)], model_only) == _lightning_terms(fixture["parsed"])
    # The same values as config_trains' flags: the same training, to Lightning's weights.
    assert fixture["parsed"] == case(G, "print_config_reads_back")["parsed"]
    _assert_trained_like(_train(["--config", str(path)], model_only), case(G, "config_trains"))
    # With no class on the command line, __main__ (the script that ran LightningCLI) is named.
    assert main(["fit", "--config", str(path)]) == 2
    assert ("model.class_path is '__main__.LitClassifier', a class of the script that ran "
            "LightningCLI; name its file on the command line: jaxlight fit "
            "PATH.py:LitClassifier --config") in capsys.readouterr().err


@departure("a Lightning Trainer key without a jaxlight meaning is named: a warning at a value "
           "that changes nothing jaxlight computes (accelerator), an error where ignoring it "
           "would change the training (min_epochs)", section="The command line")
def test_keys_without_meaning_are_named(lightning_config):
    with pytest.warns(UserWarning, match=r"trainer.accelerator: 'gpu' \(jaxlight runs on"):
        _, _, _, _, notes = parse("fit", TARGET[0], [*TARGET[1:], "--config", lightning_config,
                                                     "--trainer.accelerator", "gpu"])
        notes.report()
    _, _, _, _, notes = parse("fit", TARGET[0], [*TARGET[1:], "--config", lightning_config,
                                                 "--trainer.min_epochs", "3"])
    with pytest.raises(ConfigurationError, match=r"trainer.min_epochs: 3 \(not supported"):
        notes.report()


@claim("docs/cli.md's config.yaml is the file Lightning's LightningCLI printed, unchanged")
def test_docs_show_lightnings_own_config():
    page = (HERE.parent.parent / "docs" / "cli.md").read_text()
    block = page.split("<!-- file: config.yaml -->\n```yaml\n", 1)[1].split("```", 1)[0]
    assert block == case(G, "print_config_reads_back")["config_yaml"]


SAVE_ARGS = ["--trainer.max_steps", "1", "--trainer.enable_progress_bar", "false",
             "--trainer.enable_model_summary", "false", "--trainer.num_sanity_val_steps", "0",
             "--trainer.logger", "CSVLogger", "--trainer.logger.name", "run",
             "--model.learning_rate", "0.02", "--seed_everything", "1234",
             "--model.backbone", "Backbone", "--model.backbone.hidden_dim", "16"]


@pytest.mark.slow
@claim("SaveConfigCallback: fit writes the parsed config as config.yaml into the logger's run "
       "directory (a new version each fit), refuses a run directory that holds one unless "
       "save_config_kwargs overwrite is given, and the file holds the run's values")
def test_save_config(tmp_path):
    expected = case(G, "save_config")

    def fit(*extra):
        return run("fit", TARGET[0], [*TARGET[1:], *SAVE_ARGS, "--trainer.logger.save_dir",
                                      str(tmp_path), *extra])

    fit()
    fit()
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("config.yaml")) == \
        expected["after_two_fits"]
    with pytest.raises(ConfigurationError) as refused:
        fit("--trainer.logger.version", "0")
    # Lightning's words, then what to do in jaxlight's.
    assert str(refused.value).startswith(
        expected["refused"].replace("<save_dir>", str(tmp_path)).rstrip(".") + ":")
    fit("--trainer.logger.version", "0", "--save_config_kwargs", '{"overwrite": true}')
    saved = yaml.safe_load((tmp_path / "run" / "version_0" / "config.yaml").read_text())
    # Lightning's sections (`weights_only` among them, torch.load's switch for --ckpt_path),
    # and jaxlight's own keys beside them.
    lightning = set(expected["overwritten_sections"])
    assert lightning <= set(saved)
    assert set(saved) - lightning == {"devices", "mesh_shape", "checkpoint_every_n_steps",
                                      "checkpoint_monitor", "checkpoint_mode"}
    assert {"max_steps": saved["trainer"]["max_steps"],
            "learning_rate": saved["model"]["learning_rate"],
            "seed_everything": saved["seed_everything"]} == expected["saved"]


@claim("LightningCLI's environment variables (JSONARGPARSE_DEFAULT_ENV=true, then "
       "PL_FIT__TRAINER__MAX_EPOCHS, PL_FIT__MODEL__LEARNING_RATE) set jaxlight fit's values "
       "as they set a LightningCLI script's fit; PL_TRAINER__MAX_STEPS is read by neither")
def test_default_env(monkeypatch):
    expected = case(G, "default_env")
    for key, value in expected["env"].items():
        monkeypatch.setenv(key, value)
    _, cfg, _, _, _ = parse("fit", TARGET[0], TARGET[1:])
    observed = {"max_epochs": cfg.trainer.max_epochs,
                "max_steps": -1 if cfg.trainer.max_steps is None else cfg.trainer.max_steps,
                "learning_rate": cfg.model.learning_rate}
    assert observed == {k: expected[k] for k in observed}


@departure("SaveConfigCallback without a logger's run directory: Lightning writes "
           "<default_root_dir>/config.yaml and refuses the next fit there; jaxlight saves none, "
           "so a validate after a fit (or a second fit) in one root runs",
           section="The command line")
def test_save_config_without_a_logger(tmp_path):
    expected = case(G, "save_config")
    assert expected["no_logger_written"] == ["config.yaml"]
    assert expected["no_logger_second_refused"] is True
    argv = [*TARGET[1:], *SAVE_ARGS, "--trainer.logger", "false",
            "--trainer.default_root_dir", str(tmp_path)]
    run("fit", TARGET[0], argv)
    run("fit", TARGET[0], argv)  # not refused
    assert list(tmp_path.rglob("config.yaml")) == []
