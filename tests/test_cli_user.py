"""The command line on the user's own code: `jaxlight fit PATH.py:Module --data PATH.py:Data`,
options from `__init__` signatures, config files, `predict`, and Lightning's
fit -> test(best) -> predict(best) flow in three commands."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import yaml

from jaxlight._cli import main, run
from jaxlight.checkpoint._paths import complete_steps, read_meta

QUIET = ["--enable-progress-bar", "false", "--enable-model-summary", "false", "--logger", "none"]

USER_CODE = textwrap.dedent('''
    """A user's module and its data."""
    from typing import Literal

    import numpy as np
    import optax
    from flax import nnx

    import jaxlight as jl


    class Regressor(jl.TrainModule):
        """Linear regression onto the sum of the features.

        Args:
            features: input features.
            lr: SGD learning rate.
        """

        def __init__(self, features: int, lr: float = 0.05, head: str | None = None,
                     widths: tuple[int, ...] = (4, 4), loss: Literal["mse", "mae"] = "mse",
                     scale=1.0):
            super().__init__()
            self.features, self.lr, self.scale = features, lr, scale

        def configure_model(self, rngs):
            return nnx.Linear(self.features, 1, rngs=rngs)

        def configure_optimizers(self):
            return optax.sgd(self.lr)

        def training_step(self, model, batch):
            return ((model(batch["x"]) - batch["y"]) ** 2).mean()

        def validation_step(self, model, batch):
            return {"loss": ((model(batch["x"]) - batch["y"]) ** 2).mean()}

        test_step = validation_step

        def predict_step(self, model, batch):
            return {"y": model(batch["x"])}


    class Sums(jl.DataModule):
        """64 rows of normal features; the target is their sum."""

        def __init__(self, batch_size: int = 16, features: int = 4, seed: int = 0):
            super().__init__()
            self.batch_size, self.features, self.seed = batch_size, features, seed

        def setup(self, stage):
            x = np.random.default_rng(self.seed).normal(size=(64, self.features))
            self.arrays = {"x": x.astype(np.float32),
                           "y": x.sum(1, keepdims=True).astype(np.float32)}

        def train_dataloader(self):
            return jl.data.ArrayLoader(self.arrays, self.batch_size, shuffle=True)

        def val_dataloader(self):
            return jl.data.ArrayLoader(self.arrays, self.batch_size, shuffle=False)

        test_dataloader = predict_dataloader = val_dataloader


    def make_sums(batch_size: int = 32):
        return Sums(batch_size=batch_size)


    def make_nothing():
        return 3


    class NeedsAModel(jl.TrainModule):
        def __init__(self, encoder: nnx.Module):
            super().__init__()
''')

TARGET = ["user.py:Regressor", "--data", "user.py:Sums"]


@pytest.fixture(autouse=True)
def _user_code():
    pathlib.Path("user.py").write_text(USER_CODE)


def _err(capsys) -> str:
    return capsys.readouterr().err


# -- options from signatures ---------------------------------------------------------------------


def test_help_lists_module_and_data_arguments_with_types_and_defaults(capsys):
    assert main(["fit", *TARGET, "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the help wraps lines
    assert "Linear regression onto the sum of the features." in out  # the class's docstring
    assert "--model.features FEATURES input features. (required, type: int)" in out
    assert "--model.lr LR SGD learning rate. (type: float, default: 0.05)" in out
    assert "--model.head HEAD (type: str | null, default: null)" in out
    assert "(type: tuple[int, ...], default: (4, 4))" in out
    assert "--model.loss {mse,mae} (type: Literal['mse', 'mae'], default: mse)" in out
    assert "--model.scale SCALE (type: Union[float, Untyped], default: 1.0)" in out
    assert "64 rows of normal features; the target is their sum" in out
    assert "--data.batch_size BATCH_SIZE (type: int, default: 16)" in out
    assert "--trainer.strategy STRATEGY" in out and "--ckpt_path CKPT_PATH" in out
    assert "--strategy = --trainer.strategy" in out and "--ckpt-path = --ckpt_path" in out


def test_arguments_reach_the_module_and_the_datamodule(capsys):
    printed = _printed(capsys, [*TARGET, "--model.features", "3", "--model.widths", "[8, 2]",
                                "--data.batch_size", "8", "--model.head", "null",
                                "--model.loss", "mae", "--strategy", "fsdp"])
    assert printed["model"] == {"features": 3, "lr": 0.05, "head": None, "widths": [8, 2],
                                "loss": "mae", "scale": 1.0}
    assert printed["data"] == {"batch_size": 8, "features": 4, "seed": 0}
    assert printed["trainer"]["strategy"] == "fsdp"


def test_bad_value_names_the_expected_type(capsys):
    assert main(["fit", *TARGET, "--model.features", "3", "--model.lr", "fast"]) == 2
    assert "jaxlight fit user.py:Regressor --data user.py:Sums: --model.lr expects float, got " \
           "'fast'." in _err(capsys)
    assert main(["fit", *TARGET, "--model.features", "3", "--model.loss", "maee"]) == 2
    assert "--model.loss expects one of 'mse', 'mae', got 'maee'. Did you mean 'mae'?" \
        in _err(capsys)


def test_unknown_option_suggests_the_nearest(capsys):
    assert main(["fit", *TARGET, "--model.featurs", "3"]) == 2
    err = _err(capsys)
    assert "jaxlight fit user.py:Regressor --data user.py:Sums: unknown option " \
           "'--model.featurs'. Did you mean '--model.features'?" in err
    assert "--data.batch_size" in err and "--max-steps" in err


def test_a_parameter_without_default_is_required(capsys):
    assert main(["fit", *TARGET, "--max-steps", "1"]) == 2
    assert "the following arguments are required: model.features. Give each on the command " \
           "line" in _err(capsys)


def test_print_config_reads_back_to_the_same_run(capsys, tmp_path):
    printed = _printed(capsys, [*TARGET, "--model.features", "4", "--model.lr", "0.1",
                                "--data.batch_size", "32", "--max-steps", "7",
                                "--strategy", "fsdp"])
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(printed, sort_keys=False))
    assert _printed(capsys, [*TARGET, "--config", str(path)]) == printed
    result = run("fit", "user.py:Regressor", ["--data", "user.py:Sums", "--config", str(path),
                                              *QUIET])
    assert result.fit.global_step == 7 and result.module.lr == 0.1
    assert result.data.batch_size == 32 and type(result.data).__name__ == "Sums"
    capsys.readouterr()
    # The command line still wins over the file.
    assert _printed(capsys, [*TARGET, "--config", str(path), "--model.lr",
                             "0.5"])["model"]["lr"] == 0.5
    # The earlier form of a file names the classes: --data is not needed with it, and a file
    # naming another model than the command line is refused.
    path.write_text("max_steps: 7\nmodel: {class_path: user.py:Regressor, features: 4}\n"
                    "data: {class_path: user.py:Sums, batch_size: 32}\n")
    earlier = _printed(capsys, ["user.py:Regressor", "--config", str(path)])
    assert earlier["data"]["batch_size"] == 32 and earlier["trainer"]["max_steps"] == 7
    assert main(["fit", "user.py:Sums", "--config", str(path)]) == 2
    assert "model.class_path is 'user.py:Regressor', but the command line names " \
           "'user.py:Sums'" in _err(capsys)


def _printed(capsys, argv) -> dict:
    assert main(["fit", *argv, "--print-config"]) == 0
    return yaml.safe_load(capsys.readouterr().out)


# -- what the target names -----------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["usr.py:Regressor"], "usr.py:Regressor: no such file 'usr.py' (looked for {cwd}/usr.py); "
                           "give PATH.py:NAME"),
    (["user.py:Regresor"], "target 'user.py:Regresor': user.py has no 'Regresor'. Did you mean "
                           "'Regressor'? It defines: NeedsAModel, Regressor, Sums, make_nothing,"),
    (["user.py:Sums"], "target 'user.py:Sums' is a class deriving from DataModule, not a "
                       "jaxlight.TrainModule subclass"),
    (["user.py:make_sums"], "target 'user.py:make_sums' is a function, not a "
                            "jaxlight.TrainModule subclass"),
    (["no_such_package.mod:X"], "target 'no_such_package.mod:X': cannot import "
                                "'no_such_package.mod' (No module named 'no_such_package')"),
    (["user.py:"], "target 'user.py:' is not of the form PATH.py:NAME or package.module:NAME"),
    (["user.py:Regressor", "--data", "user.py:Regressor"],
     "--data 'user.py:Regressor' is a class deriving from TrainModule, not a "
     "jaxlight.DataModule subclass (or a function returning a DataModule)."),
    # A class-typed argument is set in LightningCLI's form (jsonargparse's subclass mode).
    (["user.py:NeedsAModel"], "jaxlight fit user.py:NeedsAModel: the following arguments are "
                              "required: model.encoder. Give each on the command line"),
    (["user.py:Regressor", "--model.features", "3"],
     "jaxlight fit user.py:Regressor needs its data: add --data PATH.py:NAME"),
])
def test_bad_targets_are_named(capsys, argv, message):
    assert main(["fit", *argv, "--max-steps", "1"]) == 2
    err = _err(capsys)
    assert err.startswith("jaxlight: error: ") and "Traceback" not in err
    assert message.format(cwd=os.getcwd()) in err


def test_a_file_that_fails_to_import_names_its_line(capsys):
    pathlib.Path("broken.py").write_text("import numpy\n\nraise RuntimeError('no GPU here')\n")
    assert main(["fit", "broken.py:Model"]) == 2
    assert _err(capsys) == ("jaxlight: error: broken.py:Model: importing broken.py, line 3 "
                            "raised RuntimeError: no GPU here\n")


def test_data_from_a_function_and_a_package_module(capsys):
    printed = _printed(capsys, ["user.py:Regressor", "--data", "user.py:make_sums",
                                "--model.features", "4"])
    assert printed["data"] == {"batch_size": 32}
    result = run("fit", "user.py:Regressor", ["--data", "user.py:make_sums", "--model.features",
                                              "4", "--max-steps", "2", "--strategy", "single",
                                              *QUIET])
    assert result.data.batch_size == 32 and result.fit.global_step == 2
    assert main(["fit", "user.py:Regressor", "--data", "user.py:make_nothing",
                 "--model.features", "4", "--max-steps", "1", *QUIET]) == 2
    assert "--data 'user.py:make_nothing' returned a int, not a jaxlight.DataModule." \
        in _err(capsys)
    # package.module:NAME imports; a recipe's module is a TrainModule like any other.
    printed = _printed(capsys, ["jaxlight.recipes.digits:DigitsClassifier"])
    assert printed["model"]["hidden"] == 256


# -- validate, test and predict ------------------------------------------------------------------


def test_fit_then_test_best_then_predict_best(capsys):
    """Lightning's flow in three commands on one root directory: `--ckpt-path best` finds the
    fit's best checkpoint by its recorded val_loss, from a fresh start of the command."""
    common = [*TARGET, "--model.features", "4", "--strategy", "single", *QUIET]
    assert main(["fit", *common, "--strategy", "fsdp", "--max-steps", "8",
                 "--val-check-interval", "2", "--checkpoint-every-n-steps", "2",
                 "--checkpoint-monitor", "val_loss"]) == 0
    capsys.readouterr()
    root = os.path.abspath("jaxlight_logs/checkpoints")
    recorded = {s: read_meta(f"{root}/{s}")["monitor"]["value"] for s in complete_steps(root)}
    best = min(recorded, key=recorded.get)

    tested = run("test", *common[:1], [*common[1:], "--ckpt-path", "best"])
    assert f"--ckpt_path best: {root}/{best}\n" in capsys.readouterr().out
    # The test data is the validation data: the best checkpoint's loss, measured again.
    assert tested.metrics["test_loss"] == pytest.approx(recorded[best], rel=1e-5)

    assert main(["predict", *common, "--ckpt-path", "best", "--output", "pred.npz"]) == 0
    out = capsys.readouterr().out
    assert "predictions: 4 batches\n  y  shape (64, 1)  float32\nsaved 1 arrays to pred.npz" \
        in out
    with np.load("pred.npz") as saved:
        pred = saved["y"]
    x = np.random.default_rng(0).normal(size=(64, 4))
    y = x.sum(1, keepdims=True).astype(np.float32)
    assert float(((pred - y) ** 2).mean()) == pytest.approx(tested.metrics["test_loss"],
                                                           rel=1e-5)


@pytest.mark.parametrize("command", ["validate", "test", "predict"])
def test_evaluating_a_target_without_a_checkpoint_is_refused(command, capsys):
    assert main([command, *TARGET, "--model.features", "4", *QUIET]) == 2
    assert f"jaxlight {command} user.py:Regressor without --ckpt_path would evaluate a " \
           "randomly initialized model" in (err := _err(capsys))
    assert "`jaxlight fit user.py:Regressor --data ... --checkpoint_every_n_steps N`" in err


def test_best_and_last_without_checkpoints_are_refused(capsys):
    common = [*TARGET, "--model.features", "4", "--strategy", "single", *QUIET]
    assert main(["test", *common, "--ckpt-path", "last"]) == 2
    assert "--ckpt_path last: no complete checkpoint in " in (err := _err(capsys))
    assert "fit with --checkpoint_every_n_steps N (or --checkpoint_monitor) first" in err
    # Checkpoints without a monitored value: there is no "best".
    assert main(["fit", *common, "--max-steps", "2", "--checkpoint-every-n-steps", "2"]) == 0
    assert main(["predict", *common, "--ckpt-path", "best"]) == 2
    err = _err(capsys)
    assert "--ckpt_path best: ckpt_path='best': no checkpoint in" in err
    assert "records a finite monitored value" in err
    assert "On the command line: fit with --checkpoint_monitor val_loss" in err


def test_predict_a_recipe_and_save_the_output(capsys):
    result = run("predict", "digits", ["--ckpt-path", "none", "--model.width", "16",
                                       "--model.hidden", "16", "--output", "digits.npz", *QUIET])
    out = capsys.readouterr().out
    assert "warning: --ckpt_path none: predict runs the model as configure_model initializes " \
           "it" in out
    assert "predictions: 4 batches\n  predictions  shape (250,)  int32\n" in out
    with np.load("digits.npz") as saved:
        np.testing.assert_array_equal(saved["predictions"], np.concatenate(result.predictions))


def test_predict_output_must_be_an_npz_file_in_an_existing_folder(capsys):
    argv = ["predict", "digits", "--ckpt-path", "none", *QUIET]
    assert main([*argv, "--output", "pred.csv"]) == 2
    assert "--output pred.csv: predictions are saved with numpy.savez; give a file name ending " \
           "in .npz (such as pred.npz)." in _err(capsys)
    assert main([*argv, "--output", "missing/pred.npz"]) == 2
    assert f"the folder {os.getcwd()}/missing does not exist." in _err(capsys)
    assert main(["fit", "digits", "--output", "pred.npz"]) == 2
    assert "unknown option '--output'" in _err(capsys)


def test_predict_a_recipe_without_predict_data(capsys):
    assert main(["predict", "gpt", "--ckpt-path", "none", "--model.num_layers", "1", *QUIET]) == 2
    assert "recipe 'gpt' has no predict data." in _err(capsys)


def test_checkpoint_mode_is_checked(capsys):
    assert main(["fit", "digits", "--checkpoint-monitor", "val_accuracy", "--checkpoint-mode",
                 "highest"]) == 2
    assert "--checkpoint_mode 'highest': give 'min'" in _err(capsys)


# -- your own callback ---------------------------------------------------------------------------


#: A user's callback in its own file (`counter.py`): prints `label step` every `every` steps.
COUNTER = textwrap.dedent('''
    import jaxlight as jl


    class CountSteps(jl.callbacks.Callback):
        def __init__(self, label: str = "steps", every: int = 1):
            self.label, self.every = label, every

        def on_train_batch_end(self, fit, module, outputs, batch, batch_idx):
            if fit.global_step % self.every == 0:
                print(f"{self.label} {fit.global_step}")
''')


def test_your_own_callback_by_path_runs_with_its_arguments(capsys):
    pathlib.Path("counter.py").write_text(COUNTER)
    assert main(["fit", *TARGET, "--model.features", "4", "--max-steps", "4",
                 "--callbacks",
                 "counter.py:CountSteps(label='seen', every=2), LearningRateMonitor()",
                 "--enable-progress-bar", "false", "--logger", "none"]) == 0
    out = capsys.readouterr().out
    assert "seen 2" in out and "seen 4" in out and "seen 1" not in out


@pytest.mark.parametrize("spec, message", [
    ("user.py:Sums()", r"--callbacks 'user.py:Sums' is type <class '.*Sums'>, not a subclass of "
                       r"jaxlight.callbacks.Callback\."),
    ("user.py:Summs()", r"--callbacks 'user.py:Summs': user.py has no 'Summs'\. Did you mean "
                        r"'Sums'\?"),
    ("nowhere.py:Sampler()", r"no such file 'nowhere.py'"),
    ("EarlyStoping()", r"unknown callback 'EarlyStoping'.*Your own callback class: "
                       r"PATH\.py:Name\(\.\.\.\)\."),
])
def test_a_bad_callback_by_path_says_what_it_found(capsys, spec, message):
    import re

    assert main(["fit", *TARGET, "--model.features", "4", "--max-steps", "1",
                 "--callbacks", spec]) == 2
    assert re.search(message, _err(capsys)), _err(capsys)


@pytest.mark.slow
def test_devices_apply_before_the_module_file_starts_jax(tmp_path):
    # A module file that makes an array when imported starts JAX's backend then: `--devices`
    # (and a config file's `devices:`) is read before the file is imported, which is why the
    # command line is read once before the parser (built from the file's classes) exists.
    arrays = f"{USER_CODE}\nimport jax.numpy as jnp\n\nONE = jnp.ones(())\n"
    (tmp_path / "arrays.py").write_text(arrays)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    root = str(pathlib.Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-m", "jaxlight._cli", "fit", "arrays.py:Regressor",
                          "--data", "arrays.py:Sums", "--model.features", "4", "--devices", "2",
                          "--trainer.max_steps", "1", "--save_config_callback", "null", *QUIET],
                         cwd=tmp_path, env={**env, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "2 cpu devices, process 0 of 1" in out.stdout, out.stdout
