"""The command line as a new user meets it: user errors end as `jaxlight: error: ...` with exit
status 2 (never a traceback), --version, output piped into `head`, and the choices the command
makes for the user (sizes of bare strategies, what validate evaluates), each said in one line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import jaxlight as jl
from jaxlight import strategies
from jaxlight._cli import main, run
from jaxlight._cli._build import size_bare_strategy
from tests.recipes._small import small

QUIET = ["--enable-progress-bar", "false", "--enable-model-summary", "false", "--logger", "none"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.Popen([sys.executable, "-m", "jaxlight._cli", *args], env=env, **kw)


def test_model_config_error_is_a_user_error(capsys):
    assert main(["fit", "gpt", "--model.num_heads", "3", "--max-steps", "1", *QUIET]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxlight: error: TransformerConfig: embed_dim 64 is not divisible "
                          "by num_heads 3"), err
    assert "nearest: 2 or 4" in err and "Traceback" not in err


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip().startswith(f"jaxlight {jl.__version__} (jax ")


@pytest.mark.slow  # a fresh process starting JAX (the fast tier runs `devices` in this one)
def test_devices_into_a_closed_pipe_ends_without_a_traceback():
    """`jaxlight devices | head -0`: the reader is gone before the first line is written."""
    read, write = os.pipe()
    proc = _cli("devices", stdout=write, stderr=subprocess.PIPE)
    os.close(write)
    os.close(read)
    _, err = proc.communicate(timeout=120)
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()
    assert proc.returncode == 141


# -- values that would run and do nothing (item 8) -----------------------------------------------


def test_limit_train_batches_zero_is_refused(capsys):
    assert main(["fit", "digits", "--max-steps", "2", "--limit-train-batches", "0", *QUIET]) == 2
    err = capsys.readouterr().err
    assert "limit_train_batches=0 would train on no batch" in err
    assert "--limit-train-batches" in err and "Traceback" not in err


@pytest.mark.parametrize("kw", [{"limit_train_batches": 0}, {"limit_val_batches": -1},
                                {"limit_train_batches": -2}, {"limit_val_batches": 1.5},
                                {"limit_train_batches": 0.0}, {"limit_train_batches": "3"}])
def test_fit_refuses_batch_limits_that_select_nothing(kw):
    [(name, value)] = kw.items()
    with pytest.raises(jl.ConfigurationError, match=rf"{name}={value!r} would"):
        jl.Fit("single", max_steps=1, **kw)


def test_fit_reads_a_whole_float_batch_limit_as_batches():
    # Lightning's Trainer(limit_train_batches=2.0) runs 2 batches (trainer/setup.py's
    # _determine_batch_limits); a config's `2` that jsonargparse types `int | float` is 2.0.
    fit = jl.Fit("single", max_steps=1, limit_train_batches=2.0, limit_val_batches=3.0)
    assert (fit.limit_train_batches, fit.limit_val_batches) == (2, 3)
    assert isinstance(fit.limit_train_batches, int) and isinstance(fit.limit_val_batches, int)


def test_fit_takes_lightnings_callbacks_none():
    # Lightning's Trainer(callbacks=None), its default: no callbacks of the user's.
    assert jl.Fit("single", max_steps=1, callbacks=None).max_steps == 1


def test_devices_in_a_config_file_must_be_positive(capsys):
    # Read by the parser (the config's `devices:` key), checked before JAX starts a backend.
    assert main(["fit", "digits", "--config", "devices: 0"]) == 2
    err = capsys.readouterr().err
    assert "devices: 0" in err and "give a positive number of CPU devices to simulate" in err


def test_checkpoint_every_zero_steps_is_refused(capsys):
    assert main(["fit", "digits", "--max-steps", "2", "--checkpoint-every-n-steps", "0",
                 *QUIET]) == 2
    assert "--checkpoint_every_n_steps 0 would save no checkpoint" in capsys.readouterr().err
    with pytest.raises(jl.ConfigurationError, match=r"every_n_steps=0"):
        jl.callbacks.ModelCheckpoint("ckpt", every_n_steps=0)


# -- validate without a checkpoint (item 9) ------------------------------------------------------


@pytest.mark.parametrize("command", ["validate", "test"])
def test_evaluating_without_a_checkpoint_is_refused(command, capsys):
    assert main([command, "digits", *QUIET]) == 2
    err = capsys.readouterr().err
    assert f"jaxlight {command} digits without --ckpt_path would evaluate a randomly " \
           "initialized model" in err
    assert "--checkpoint_every_n_steps N" in err and "--ckpt_path none" in err
    # With checkpoints under the default root, the message names the flag that finds them.
    os.makedirs("jaxlight_logs/checkpoints")
    assert main([command, "digits", *QUIET]) == 2
    assert "pass --ckpt_path last (the newest checkpoint under jaxlight_logs/checkpoints)" \
        in capsys.readouterr().err


def test_evaluating_the_initialization_on_purpose(capsys):
    result = run("validate", "digits", ["--ckpt-path", "none", "--model.width", "16",
                                        "--model.hidden", "16", *QUIET])
    assert "val_loss" in result.metrics
    assert "warning: --ckpt_path none: validate evaluates the model as configure_model " \
           "initializes it" in capsys.readouterr().out


# -- bare strategies on every recipe (item 11) ---------------------------------------------------


@pytest.mark.parametrize("recipe, kind, size", [
    ("digits", "tp", None), ("digits", "gpipe", 2), ("gpt", "tp", 4), ("gpt", "gpipe", 4),
    ("sft", "tp", 4), ("sft", "gpipe", 4)])
def test_bare_strategy_takes_the_largest_size_the_model_allows(recipe, kind, size):
    """4 heads and 4 layers over 8 devices: tp 4 and 4 stages (digits: an MLP of 2 blocks)."""
    mod, config = small(recipe, **({} if recipe == "digits" else
                                   {"model.num_heads": 4, "model.num_layers": 4}))
    module, _ = mod.build(config, 2)
    strategy, note = size_bare_strategy(kind, None, module)
    if size is None:  # every device fits as it is: the bare strategy stays
        assert strategy is None and note is None
        return
    keyword, what, axis = (("size", "tensor-parallel size", "tp") if kind == "tp" else
                           ("stages", "pipeline stages", "pipe"))
    assert getattr(strategy, keyword) == size
    assert dict(strategy.mesh.shape) == {"data": 8 // size, axis: size}
    assert note == (f"--strategy {kind}: {what} {size}, the largest that this model splits "
                    f"into on 8 devices, with data parallelism over the other {8 // size}; "
                    f"choose with --strategy '{kind}({keyword}=N)'.")
    # A size given is kept as it is; other arguments are kept.
    assert size_bare_strategy(f"{kind}({keyword}=2)", None, module) == (None, None)
    if kind == "tp" and recipe == "gpt":
        with_rules, note = size_bare_strategy("tp(rules='NNX')", None, module)
        assert with_rules.size == 4 and with_rules.user_rules == strategies.rules.NNX
        assert note.endswith("choose with --strategy 'tp(size=N, rules='NNX')'.")


@pytest.mark.slow
def test_bare_gpipe_trains_a_recipe_from_the_command_line(capsys):
    result = run("fit", "digits", ["--strategy", "gpipe", "--max-steps", "1", "--model.width",
                                   "16", "--model.hidden", "16", *QUIET])
    assert result.fit.global_step == 1 and result.fit.strategy.stages == 2
    assert "--strategy gpipe: pipeline stages 2, the largest" in capsys.readouterr().out
