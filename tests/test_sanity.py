"""Sanity validation before training (`Fit(num_sanity_val_steps=2)`, issue 17 item 5)."""

import pytest

import jaxlight as jl
from jaxlight import callbacks
from tests.models import Classifier, classification_data

BATCH = 32


def _fit(**kw):
    kw.setdefault("max_steps", 8)
    return jl.Fit("single", enable_progress_bar=False, enable_model_summary=False,
                  logger=False, enable_checkpointing=False, **kw)


class Counted:
    """A re-iterable of batches that counts the batches read from it."""

    def __init__(self, data, n=5):
        self.batches = [{k: v[i * BATCH:(i + 1) * BATCH] for k, v in data.items()}
                        for i in range(n)]
        self.read = 0

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        for batch in self.batches:
            self.read += 1
            yield batch


class Seen(callbacks.Callback):
    """Records hook names, logged keys, and what the validation data had given at train start."""

    def __init__(self, val=None):
        self.hooks, self.logged, self.val, self.read_at_train_start = [], [], val, None

    def on_fit_start(self, fit, module):
        self.hooks.append("on_fit_start")

    def on_sanity_check_start(self, fit, module):
        self.hooks.append("on_sanity_check_start")

    def on_sanity_check_end(self, fit, module):
        self.hooks.append("on_sanity_check_end")

    def on_train_start(self, fit, module):
        self.hooks.append("on_train_start")
        self.read_at_train_start = self.val.read if self.val is not None else None
        self.metrics_at_train_start = dict(fit.callback_metrics)

    def on_validation_start(self, fit, module):
        self.hooks.append("on_validation_start")

    def on_log(self, fit, module, metrics, step):
        self.logged.append(sorted(metrics))


@pytest.fixture(scope="module")
def data():
    return classification_data(256)


def test_validation_data_lacking_y_fails_before_training(data):
    seen = Seen()
    fit = _fit(max_steps=50, callbacks=[seen])
    val = {"x": data["x"][:64]}
    with pytest.raises(jl.UserStepError, match=(
            r"Classifier\.validation_step raised KeyError: 'y' while jaxlight traced it on "
            r"validation batch 0 \(sanity check before training\) of val_data, a batch "
            r"\{\['x'\]: \(32, 16\) float32\}.*num_sanity_val_steps=0")) as info:
        fit.fit(Classifier(), jl.data.ArrayLoader(data, BATCH),
                jl.data.ArrayLoader(val, BATCH, shuffle=False))
    assert isinstance(info.value.__cause__, KeyError)
    assert "on_train_start" not in seen.hooks
    assert "train" not in fit.compile_counts  # failed before the training step was compiled


@pytest.mark.parametrize("n, read", [(2, (2, 3)), (-1, (5,)), (0, (0,))])
def test_sanity_check_reads_the_first_batches_compiles_once_and_logs_nothing(data, n, read):
    val = Counted(data)
    seen = Seen(val)
    fit = _fit(max_steps=8, val_check_interval=4, num_sanity_val_steps=n, callbacks=[seen])
    fit.fit(Classifier(), jl.data.ArrayLoader(data, BATCH), val)
    assert seen.read_at_train_start in read
    sanity = ["on_sanity_check_start", "on_sanity_check_end"] if n else []
    assert seen.hooks == ["on_fit_start", *sanity, "on_train_start",
                          "on_validation_start", "on_validation_start"]
    # Not logged, not in callback_metrics: only the two real validations log val_loss.
    assert not any(k.startswith("val_") for k in seen.metrics_at_train_start)
    assert sum("val_loss" in keys for keys in seen.logged) == 2
    # The sanity check's compiled validation step is the one validation reuses.
    assert fit.compile_counts["eval:validation_step"] == 1


def test_sanity_check_respects_limit_val_batches(data):
    val = Counted(data)
    seen = Seen(val)
    _fit(max_steps=2, num_sanity_val_steps=-1, limit_val_batches=1, callbacks=[seen]).fit(
        Classifier(), jl.data.ArrayLoader(data, BATCH), val)
    assert seen.read_at_train_start in (1, 2)


def test_num_sanity_val_steps_is_checked():
    with pytest.raises(jl.ConfigurationError, match=r"num_sanity_val_steps=-2.*-1 \(all\), 0 "):
        _fit(num_sanity_val_steps=-2)


def test_fit_signature_documents_the_default():
    import inspect

    assert inspect.signature(jl.Fit).parameters["num_sanity_val_steps"].default == 2


def test_cli_flag_reaches_fit(capsys):
    from jaxlight._cli import main

    assert main(["fit", "digits", "--num-sanity-val-steps", "0", "--print-config"]) == 0
    assert "num_sanity_val_steps: 0" in capsys.readouterr().out
