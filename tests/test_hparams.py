"""save_hyperparameters / hparams.x: the record, the loggers, checkpoints, rebuilding from them."""

import os

import jax
import numpy as np
import pytest
import yaml

import jaxlight as jl
from jaxlight import callbacks
from jaxlight.checkpoint._restore import read_meta
from tests.callbacks.wandb_records import find_runs, read_run
from tests.models import Classifier, classification_data


class Tagged(Classifier):
    """Records its arguments as they are when save_hyperparameters runs, without `scale`."""

    def __init__(self, hidden=24, lr=0.05, schedule="cosine", scale=None):
        schedule = schedule.lower()  # reassigned before the call: recorded so, as in Lightning
        super().__init__(hidden=hidden, lr=lr)
        self.scale = scale
        self.save_hyperparameters(ignore="scale")


class Parent(jl.TrainModule):
    def __init__(self, width=4, **kwargs):
        super().__init__()
        self.save_hyperparameters()


class Child(Parent):
    def __init__(self, depth=2, **kwargs):
        super().__init__(**kwargs)


def test_save_hyperparameters_records_init_arguments_with_attribute_access():
    module = Tagged(hidden=12, schedule="Cosine", scale=np.ones(3))
    assert module.hparams == {"hidden": 12, "lr": 0.05, "schedule": "cosine"}
    assert module.hparams.lr == 0.05 and module.hparams["hidden"] == 12
    module.hparams.lr = 0.3  # writable, as Lightning's AttributeDict
    assert module.hparams["lr"] == 0.3
    with pytest.raises(AttributeError, match=r"no hyperparameter 'hiden'.*Did you mean 'hidden'"):
        _ = module.hparams.hiden
    # Without a call every constructor argument is recorded, with attribute access too.
    assert Classifier(hidden=8).hparams.hidden == 8
    # A subclass calling the parent's __init__: arguments of both frames, **kwargs flattened.
    assert Child(depth=3, width=5, extra="e").hparams == {"depth": 3, "width": 5, "extra": "e"}


def test_save_hyperparameters_names_dict_and_misuse():
    class Named(jl.TrainModule):
        def __init__(self, a=1, b=2, c=3):
            super().__init__()
            self.save_hyperparameters("a", "c")

    assert Named(c=9).hparams == {"a": 1, "c": 9}

    class FromDict(jl.TrainModule):
        def __init__(self, config):
            super().__init__()
            self.save_hyperparameters(config)

    assert FromDict({"lr": 1.0}).hparams.lr == 1.0

    class Typo(jl.TrainModule):
        def __init__(self, hidden=1):
            super().__init__()
            self.save_hyperparameters(ignore=["hiden"])

    with pytest.raises(jl.ConfigurationError, match=r"\['hiden'\].*Did you mean 'hidden'"):
        Typo()
    with pytest.raises(jl.ConfigurationError, match="call it inside __init__"):
        Classifier().save_hyperparameters()


def _quiet_settings():
    import wandb

    return wandb.Settings(console="off", x_disable_stats=True, x_disable_meta=True)


@pytest.mark.slow
def test_hparams_reach_every_logger_and_checkpoint_and_rebuild_the_module(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    csv_logger = callbacks.CSVLogger(str(tmp_path / "logs"))
    tb_logger = callbacks.TensorBoardLogger(str(tmp_path / "logs"))
    wandb_logger = callbacks.WandbLogger("jaxlight-tests", mode="offline",
                                         save_dir=str(tmp_path / "runs"),
                                         settings=_quiet_settings())
    ckpt = callbacks.ModelCheckpoint(str(tmp_path / "ckpt"), every_n_steps=4)
    fit = jl.Fit("single", max_steps=4, log_every_n_steps=2, enable_progress_bar=False,
                 enable_model_summary=False, callbacks=[csv_logger, tb_logger, wandb_logger, ckpt])
    module = Tagged(hidden=12, schedule="LINEAR", scale=np.ones(3))
    fit.fit(module, jl.data.ArrayLoader(classification_data(64), 16, seed=1))
    wandb_logger.finish()  # the run stays open for a later validate/test until finish() or exit
    expected = {"hidden": 12, "lr": 0.05, "schedule": "linear"}

    with open(os.path.join(csv_logger.log_dir, "hparams.yaml")) as f:
        assert yaml.safe_load(f)["module"] == {"class": "Tagged", **expected}

    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.plugins.hparams import metadata

    acc = event_accumulator.EventAccumulator(tb_logger.log_dir)
    acc.Reload()
    content = acc.PluginTagToContent(metadata.PLUGIN_NAME)[metadata.SESSION_START_INFO_TAG]
    start = metadata.parse_session_start_info_plugin_data(content)
    assert start.hparams["module/hidden"].number_value == 12
    assert start.hparams["module/schedule"].string_value == "linear"
    assert "module/scale" not in start.hparams

    [path] = find_runs(str(tmp_path / "runs"))
    assert read_run(path).config["module"] == {"class": "Tagged", **expected}

    step_dir = str(tmp_path / "ckpt" / "4")
    assert read_meta(step_dir)["hparams"] == expected
    rebuilt = Tagged.load_from_checkpoint(step_dir)
    assert isinstance(rebuilt, Tagged) and rebuilt.hparams == expected
    trained = jax.tree.leaves(jax.device_get(module.model))
    for a, b in zip(trained, jax.tree.leaves(jax.device_get(rebuilt.model)), strict=True):
        np.testing.assert_array_equal(a, b)
    model = jl.load_checkpoint(step_dir, Tagged)  # a class: built from the record too
    for a, b in zip(trained, jax.tree.leaves(jax.device_get(model)), strict=True):
        np.testing.assert_array_equal(a, b)
    assert Tagged.load_from_checkpoint(step_dir, hidden=12, lr=7.0).hparams.lr == 7.0


class WithArray(Classifier):
    def __init__(self, hidden=8, init=None):
        super().__init__(hidden=hidden)
        self.init = init


def test_rebuild_refuses_hparams_recorded_only_as_text(tmp_path):
    fit = jl.Fit("single", max_steps=2, enable_progress_bar=False, enable_model_summary=False,
                 callbacks=[callbacks.ModelCheckpoint("ckpt", async_save=False)])
    fit.fit(WithArray(init=np.zeros(2)), jl.data.ArrayLoader(classification_data(32), 16))
    assert read_meta("ckpt/2")["hparams_unrestorable"] == ["init"]
    with pytest.raises(jl.CheckpointError, match=r"\['init'\].*load_from_checkpoint\(path, init="):
        WithArray.load_from_checkpoint("ckpt/2")
    assert WithArray.load_from_checkpoint("ckpt/2", init=None).hparams == {"hidden": 8,
                                                                           "init": None}
