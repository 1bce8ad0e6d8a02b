"""The `jaxlight` command line: options, defaults, precedence, names resolved at run time,
and a message for every kind of bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest
import yaml

from jaxlight import ConfigurationError, callbacks, strategies
from jaxlight._cli import (
    ALIASES,
    build_callbacks,
    build_loggers,
    build_strategy,
    main,
    parse_mesh_shape,
    run,
)
from jaxlight.recipes import digits, gpt
from jaxlight.recipes._base import fields

QUIET = ["--enable-progress-bar", "false", "--enable-model-summary", "false"]
SMALL_DIGITS = ["--model.width", "32", "--model.hidden", "32"]


def _err(capsys) -> str:
    return capsys.readouterr().err


# -- running -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_fit_digits_reports_final_validation_metrics(capsys):
    assert main(["fit", "digits", "--max-steps", "20", "--val-check-interval", "10",
                 "--seed", "3", *SMALL_DIGITS, *QUIET]) == 0
    out = capsys.readouterr().out
    assert "final validation metrics (step 20" in out
    assert "val_accuracy" in out and "val_loss" in out
    # The default CSV logger wrote under the default root directory.
    assert os.path.isfile("jaxlight_logs/csv/version_0/metrics.csv")


@pytest.mark.slow
def test_options_reach_fit_and_recipe():
    result = run("fit", "digits", ["--max-steps", "3", "--log-every-n-steps", "1", "--seed", "7",
                                   "--strategy", "fsdp", "--logger", "none", "--optim.lr",
                                   "1e-2", *SMALL_DIGITS, *QUIET])
    assert result.fit.max_steps == 3 and result.fit.seed == 7
    assert result.fit.log_every_n_steps == 1
    assert isinstance(result.fit.strategy, strategies.FSDP)
    assert result.module.width == 32 and result.module.lr == 1e-2
    assert not any(getattr(cb, "is_logger", False) for cb in result.fit.callbacks)
    assert result.metrics["global_step"] == 3


@pytest.mark.slow
def test_checkpoint_then_validate_and_resume(capsys):
    """--checkpoint-every-n-steps writes, `validate --ckpt-path` reads, `fit` resumes."""
    common = [*SMALL_DIGITS, *QUIET, "--logger", "none"]
    first = run("fit", "digits", ["--max-steps", "4", "--checkpoint-every-n-steps", "2",
                                  *common])
    ckpt = os.path.abspath("jaxlight_logs/checkpoints")
    assert sorted(os.listdir(ckpt))[-1] == "4"
    evaluated = run("validate", "digits", ["--ckpt-path", f"{ckpt}/4", *common])
    assert evaluated.metrics["val_accuracy"] == pytest.approx(first.metrics["val_accuracy"])
    assert evaluated.metrics["val_loss"] == pytest.approx(first.metrics["val_loss"], rel=1e-6)
    resumed = run("fit", "digits", ["--max-steps", "6", "--ckpt-path", f"{ckpt}/4",
                                    "--checkpoint-every-n-steps", "2", *common])
    assert resumed.fit.global_step == 6
    assert "6" in os.listdir(ckpt)


def test_devices_prints_processes_and_mesh(capsys):
    assert main(["devices", "--mesh-shape", '[[4,2],["fsdp","tp"]]']) == 0
    out = capsys.readouterr().out
    assert "process 0 of 1; 8 local devices, 8 global" in out
    assert "mesh {'fsdp': 4, 'tp': 2}" in out
    assert out.count("  id ") == 8


@pytest.mark.slow  # a fresh process; test_cli_keys checks --devices fast
def test_devices_flag_sets_xla_flags_before_jax_starts():
    """A fresh process: --devices 4 wins over the 8 that XLA_FLAGS asks for."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-m", "jaxlight._cli", "devices", "--devices", "4",
                          "--strategy", "dp"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "4 local devices, 4 global" in out.stdout
    assert "mesh {'data': 4}" in out.stdout


def test_devices_flag_after_jax_started_is_refused(capsys):
    jax.devices()  # JAX has started in this process, whichever test ran before
    flags = os.environ["XLA_FLAGS"]
    assert main(["devices", "--devices", "4"]) == 2
    err = _err(capsys)
    assert "--devices 4 asked for 4 devices per process but this process has 8 cpu" in err
    assert "fresh process" in err
    # Refused, it leaves the environment as it was: processes started later still get 8.
    assert os.environ["XLA_FLAGS"] == flags


def test_launch_is_dispatched(capsys):
    assert main(["launch", "--help"]) == 0
    assert "--nprocs" in capsys.readouterr().out


# -- help and precedence -------------------------------------------------------------------------


def test_help_lists_every_option_with_its_default(capsys):
    assert main(["fit", "gpt", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the help wraps lines
    for old, new in ALIASES.items():  # the earlier options, with the key each is read as
        assert f"--{old} = --{new}" in out, old
    for dotted in fields(gpt.Config):
        assert f"--{dotted} " in out, dotted
    assert "--model.num_layers NUM_LAYERS transformer blocks" in out
    assert "(type: int, default: 4)" in out  # num_layers
    assert "(type: int | null, default: 300)" in out  # the recipe's steps, not Fit's None
    assert "--preset NAME" in out


def test_top_level_help_lists_commands_and_recipes(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for word in ("fit", "validate", "test", "devices", "launch", "digits", "gpt", "sft"):
        assert f"  {word} " in out


def _printed(capsys, argv) -> dict:
    assert main(argv + ["--print-config"]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def test_earlier_form_keys_take_lightning_s_meaning_in_a_file_and_on_the_line(tmp_path, capsys):
    """An earlier name is renamed to its `trainer.` key before the parser, so Lightning's values
    get their jaxlight meaning there too: `max_steps: -1` is no step limit (Lightning's 1000
    epochs), `precision: 32` is float32 (the parser types it `str | None`: the int 32 alone is
    refused). jsonargparse could read the names as aliases of the keys, but after that."""
    path = tmp_path / "old.yaml"
    path.write_text("max_steps: -1\nprecision: 32\n")
    trainer = _printed(capsys, ["fit", "digits", "--config", str(path)])["trainer"]
    assert (trainer["max_steps"], trainer["max_epochs"], trainer["precision"]) == (None, 1000, None)
    argv = ["fit", "digits", "--max-steps", "-1", "--precision", "32"]
    trainer = _printed(capsys, argv)["trainer"]
    assert (trainer["max_steps"], trainer["precision"]) == (None, None)


def test_precedence_defaults_preset_file_command_line(tmp_path, capsys):
    assert _printed(capsys, ["fit", "gpt"])["model"]["num_layers"] == 4
    preset = _printed(capsys, ["fit", "gpt", "--preset", "125m"])
    assert preset["model"]["num_layers"] == 12 and preset["trainer"]["max_steps"] == 5000
    assert preset["trainer"]["precision"] == "bf16-mixed"
    path = tmp_path / "run.yaml"  # the earlier form: options at the top level
    path.write_text("preset: 125m\nmax_steps: 77\nmodel:\n  num_layers: 6\n")
    from_file = _printed(capsys, ["fit", "gpt", "--config", str(path)])
    assert from_file["model"]["num_layers"] == 6 and from_file["trainer"]["max_steps"] == 77
    assert from_file["model"]["embed_dim"] == 768  # still the preset's
    cli = _printed(capsys, ["fit", "gpt", "--config", str(path), "--model.num_layers", "8",
                            "--max_steps", "5"])
    assert cli["model"]["num_layers"] == 8 and cli["trainer"]["max_steps"] == 5
    # LightningCLI's form of the same file reads the same.
    path.write_text("trainer:\n  max_steps: 77\nmodel:\n  num_layers: 6\n")
    lightning = _printed(capsys, ["fit", "gpt", "--preset", "125m", "--config", str(path)])
    assert lightning == from_file


def test_printed_config_is_a_valid_config_file(tmp_path, capsys):
    printed = _printed(capsys, ["fit", "digits", "--model.hidden", "64", "--strategy", "fsdp"])
    path = tmp_path / "again.json"
    path.write_text(json.dumps(printed))
    again = _printed(capsys, ["fit", "digits", "--config", str(path)])
    assert again == printed


# -- names resolved at run time ------------------------------------------------------------------


def test_strategies_by_name_and_call_form():
    assert isinstance(build_strategy("single"), strategies.SingleDevice)
    assert isinstance(build_strategy("DDP"), strategies.DDP)
    assert isinstance(build_strategy("TensorParallel"), strategies.TensorParallel)
    tp = build_strategy("tp(size=4)")
    tp.setup(None)
    assert dict(tp.mesh.shape) == {"data": 2, "tp": 4}
    pipe = build_strategy("gpipe(stages=2, microbatches=4)")
    assert isinstance(pipe, strategies.GPipe)
    hybrid = build_strategy("auto", '{"data": 2, "fsdp": -1}')
    hybrid.setup(None)
    assert dict(hybrid.mesh.shape) == {"data": 2, "fsdp": 4}


def test_mesh_shape_forms():
    assert parse_mesh_shape('{"data": 4, "tp": 2}') == {"data": 4, "tp": 2}
    assert parse_mesh_shape("{data: 4, tp: 2}") == {"data": 4, "tp": 2}
    assert parse_mesh_shape("data=4,tp=2") == {"data": 4, "tp": 2}
    assert parse_mesh_shape('[[4,2],["fsdp","tp"]]') == {"fsdp": 4, "tp": 2}
    assert parse_mesh_shape("[[2, -1], [data, fsdp]]") == {"data": 2, "fsdp": -1}


def test_loggers_and_callbacks_by_name(tmp_path):
    loggers = build_loggers("csv,tensorboard,wandb(project='demo')")
    assert [type(cb).__name__ for cb in loggers] == ["CSVLogger", "TensorBoardLogger",
                                                     "WandbLogger"]
    assert build_loggers("none") is None
    extra = build_callbacks("EarlyStopping(monitor='val_loss', patience=2), LearningRateMonitor()")
    assert isinstance(extra[0], callbacks.EarlyStopping) and extra[0].patience == 2
    assert isinstance(extra[1], callbacks.LearningRateMonitor)


@pytest.mark.slow
def test_precision_accumulation_and_clipping_add_their_callbacks():
    result = run("fit", "digits", ["--max-steps", "2", "--precision", "bf16-mixed",
                                   "--accumulate-grad-batches", "2", "--gradient-clip-val", "1.0",
                                   "--logger", "none", *SMALL_DIGITS, *QUIET])
    kinds = {type(cb).__name__ for cb in result.fit.callbacks}
    assert {"MixedPrecision", "GradientAccumulation", "GradientClipping"} <= kinds


# -- bad input -----------------------------------------------------------------------------------


def test_unknown_recipe_lists_valid_ones_and_suggests(capsys):
    assert main(["fit", "digit"]) == 2
    err = _err(capsys)
    assert ("unknown recipe 'digit'; valid recipes are ['digits', 'gpt', 'sft', 'dpo', 'grpo']"
            in err)
    assert "Did you mean 'digits'?" in err


def test_unknown_command_suggests(capsys):
    assert main(["fitt", "digits"]) == 2
    assert "unknown command 'fitt'" in (err := _err(capsys)) and "Did you mean 'fit'?" in err


@pytest.mark.parametrize("bad, nearest", [("--max-step", "--max-steps"),
                                          ("--model.hiden", "--model.hidden"),
                                          ("--optim.lr_", "--optim.lr")])
def test_unknown_option_lists_valid_ones_and_suggests(capsys, bad, nearest):
    assert main(["fit", "digits", bad, "5"]) == 2
    err = _err(capsys)
    assert f"unknown option '{bad}'. Did you mean '{nearest}'?" in err
    assert "Valid options:" in err and "--strategy" in err and "--model.width" in err


def test_bad_option_value_names_the_expected_type(capsys):
    assert main(["fit", "digits", "--max-steps", "many"]) == 2
    assert "--trainer.max_steps expects int | None, got 'many'" in _err(capsys)
    assert main(["fit", "gpt", "--model.dtype", "float16"]) == 2
    assert "model.dtype expects one of 'float32', 'bfloat16', got 'float16'" in _err(capsys)


def test_unknown_strategy_suggests(capsys):
    assert main(["fit", "digits", "--strategy", "fsdq"]) == 2
    err = _err(capsys)
    assert "unknown strategy 'fsdq'; valid names are" in err and "Did you mean 'fsdp'?" in err


def test_unknown_logger_and_callback(capsys):
    with pytest.raises(ConfigurationError, match=r"unknown logger 'wandbb'.*Did you mean"):
        build_loggers("csv,wandbb")
    with pytest.raises(ConfigurationError,
                       match=r"unknown callback 'EarlyStoping'.*Did you mean 'EarlyStopping'"):
        build_callbacks("EarlyStoping(monitor='val_loss')")
    with pytest.raises(ConfigurationError, match=r"EarlyStopping.*the signature is \("):
        build_callbacks("EarlyStopping(monitr='val_loss')")


def test_yaml_config_that_does_not_parse_names_file_line_and_reason(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("max_steps: 10\nmodel:\n  hidden: [64, 128\n  width: 32\n")
    assert main(["fit", "digits", "--config", str(path)]) == 2
    err = _err(capsys)
    assert f"config file {path}, line 4, column 8: expected ',' or ']', but got ':'" in err


def test_json_config_that_does_not_parse_names_file_line_and_reason(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "max_steps": 10,\n  "model": {"hidden": 64,}\n}\n')
    assert main(["fit", "digits", "--config", str(path)]) == 2
    err = _err(capsys)
    assert f"config file {path}, line 3, column 26: Expecting property name" in err


def test_config_file_with_unknown_keys(tmp_path, capsys):
    path = tmp_path / "typo.yaml"
    path.write_text("max_steps: 10\nmodel:\n  hiden: 64\n")
    assert main(["fit", "digits", "--config", str(path)]) == 2
    err = _err(capsys)
    assert f"config file {path}: unknown key 'model.hiden'" in err
    assert "Did you mean 'model.hidden'?" in err
    path.write_text("max_step: 10\n")
    assert main(["fit", "digits", "--config", str(path)]) == 2
    assert "unknown key 'max_step'. Did you mean 'max_steps'?" in _err(capsys)
    path.write_text("- 1\n- 2\n")
    assert main(["fit", "digits", "--config", str(path)]) == 2
    assert "the top level is a list; it must be a mapping" in _err(capsys)
    assert main(["fit", "digits", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml: no such file" in _err(capsys)


@pytest.mark.parametrize("text", ["data:4", "[[4,2],[data]]", "data=four", "{data: 4", "4x2", ""])
def test_mesh_shape_that_does_not_parse_shows_accepted_forms(capsys, text):
    assert main(["fit", "digits", "--mesh-shape", text]) == 2
    err = _err(capsys)
    assert "jaxlight: error: mesh_shape: " in err  # the one mesh grammar's message, then:
    assert "accepted forms of a mesh shape:" in err
    assert '[[4, 2], ["data", "tp"]]      the Tunix form' in err


def test_mesh_shape_with_another_strategy_is_refused(capsys):
    assert main(["fit", "digits", "--strategy", "fsdp", "--mesh-shape", "data=8"]) == 2
    assert "--mesh-shape builds strategies.Hybrid, but --strategy is 'fsdp'" in _err(capsys)


def test_recipe_is_required(capsys):
    assert main(["fit"]) == 2
    assert "jaxlight fit needs a recipe" in _err(capsys)


def test_unknown_preset_lists_presets(capsys):
    assert main(["fit", "gpt", "--preset", "1B"]) == 2
    err = _err(capsys)
    assert "recipe 'gpt' has no preset '1B'; valid presets are ['125m', '1b', 'tiny']" in err


def test_recipe_config_defaults_match_the_command_line():
    """Every digits config field is an option whose default is the dataclass default."""
    printed = run("fit", "digits", ["--print-config"])
    assert printed is None  # printing exits without training
    assert fields(digits.Config)["model.hidden"].default == 256


def test_hybrid_without_mesh_is_refused(capsys):
    assert main(["fit", "digits", "--strategy", "hybrid"]) == 2
    assert "--strategy hybrid needs a mesh: add --mesh-shape" in _err(capsys)


@pytest.mark.slow
def test_sft_checkpoints_rebuild_a_lora_base_and_skip_it_for_full_fine_tuning():
    """A LoRA checkpoint holds the adapters only: `validate` rebuilds the base as the fit did
    and refuses another base. A full fine-tuning checkpoint holds every weight: the base is
    neither pretrained nor loaded again."""
    from jaxlight import CheckpointError

    small = ["--model.num_layers", "2", "--model.embed_dim", "32", "--model.num_heads", "2",
             "--model.mlp_dim", "64", "--task.train_examples", "64", "--task.val_examples",
             "16", "--data.batch_size", "16", "--logger", "none", *QUIET]
    trained = run("fit", "sft", ["--max-steps", "4", "--base.pretrain_steps", "0",
                                 "--checkpoint-every-n-steps", "4", *small])
    assert "before_val_exact_match" in trained.metrics
    assert "generated_exact_match" in trained.metrics
    evaluated = run("validate", "sft", ["--ckpt-path", "jaxlight_logs/checkpoints",
                                        "--base.pretrain_steps", "0", *small])
    assert evaluated.metrics["val_loss"] == pytest.approx(trained.metrics["val_loss"], rel=1e-5)
    # A base pretrained for 2 steps is not the one the adapters were trained on.
    with pytest.raises(CheckpointError, match=r"trained on other frozen parameters(.|\n)*"
                       r"\['rest'\]\['embed'\]\['embedding'\] \(256, 32\): other values"):
        run("validate", "sft", ["--ckpt-path", "jaxlight_logs/checkpoints",
                                "--base.pretrain_steps", "2", *small])

    full = [*small, "--lora.rank", "0", "--default-root-dir", "full"]
    trained = run("fit", "sft", ["--max-steps", "4", "--base.pretrain_steps", "0",
                                 "--checkpoint-every-n-steps", "4", *full])
    evaluated = run("validate", "sft", ["--ckpt-path", "full/checkpoints",
                                        "--base.pretrain_steps", "2", *full])
    # --base.pretrain_steps 2 would pretrain a base first; the checkpoint supplies it instead.
    assert evaluated.module.base_params is None
    assert evaluated.metrics["val_loss"] == pytest.approx(trained.metrics["val_loss"], rel=1e-5)
