"""EarlyStopping: patience, min_delta, non-finite values, bad monitor, state in checkpoints."""

import optax
import pytest

import jaxlight as jl
from jaxlight import callbacks
from jaxlight.checkpoint._restore import read_meta
from tests.checkpoint._common import loader, make_fit
from tests.models import Classifier, classification_data


class Frozen(Classifier):
    """Learning rate 0: the validation loss never changes (a plateau from the start)."""

    def configure_optimizers(self):
        return optax.sgd(0.0)


def _val():
    return jl.data.ArrayLoader(classification_data(64, seed=5), 32, shuffle=False)


def test_stops_after_patience_checks_without_improvement():
    stop = callbacks.EarlyStopping("val_loss", patience=2)
    fit = make_fit("single", 1000, [stop], max_epochs=20, limit_train_batches=2,
                   enable_checkpointing=False)
    fit.fit(Frozen(), loader(), _val())
    # Epoch 0 sets the best; epochs 1 and 2 do not improve: stop after the third validation.
    assert fit.current_epoch == 3 and fit.global_step == 6
    assert stop.wait_count == 2 and stop.stopped_step == 6
    assert "did not improve" in stop.stop_reason


#: PyTorch Lightning 2.6.6 on the same plateau (a constant val_loss, 2 batches per epoch,
#: max_epochs=10): patience -> (stopped_epoch, current_epoch, global_step) after the fit.
LIGHTNING_STOPS = {1: (1, 2, 4), 2: (2, 3, 6), 3: (3, 4, 8)}


@pytest.mark.parametrize("patience", list(LIGHTNING_STOPS))
def test_stopped_epoch_is_lightnings(patience):
    stop = callbacks.EarlyStopping("val_loss", patience=patience)
    fit = make_fit("single", 1000, [stop], max_epochs=10, limit_train_batches=2,
                   enable_checkpointing=False)
    fit.fit(Frozen(), loader(), _val())
    assert (stop.stopped_epoch, fit.current_epoch, fit.global_step) == LIGHTNING_STOPS[patience]
    assert stop.state_dict()["stopped_epoch"] == stop.stopped_epoch


def test_stopped_epoch_is_zero_when_training_was_not_stopped():
    stop = callbacks.EarlyStopping("val_loss", patience=50)
    make_fit("single", 1000, [stop], max_epochs=3, limit_train_batches=2,
                   enable_checkpointing=False).fit(
        Frozen(), loader(), _val())
    assert stop.stopped_epoch == 0 and stop.state_dict()["stopped_epoch"] == 0


def test_min_delta_counts_small_improvements_as_none():
    # A learning model improves every epoch, but by less than a huge min_delta.
    stop = callbacks.EarlyStopping("val_loss", patience=1, min_delta=10.0)
    fit = make_fit("single", 1000, [stop], max_epochs=20, limit_train_batches=2,
                   enable_checkpointing=False)
    fit.fit(Classifier(), loader(), _val())
    assert fit.current_epoch == 2
    no_delta = callbacks.EarlyStopping("val_loss", patience=1)
    fit = make_fit("single", 1000, [no_delta], max_epochs=4, limit_train_batches=2,
                   enable_checkpointing=False)
    fit.fit(Classifier(), loader(), _val())
    assert fit.current_epoch == 4 and no_delta.stopped_step is None


def test_non_finite_value_stops_at_once_on_a_training_metric():
    data = classification_data(256)
    data["x"][:] = float("nan")
    stop = callbacks.EarlyStopping("loss", patience=5, check_finite=True)
    fit = make_fit("single", 1000, [stop], max_epochs=5, limit_train_batches=2,
                   enable_checkpointing=False)
    fit.fit(Classifier(), jl.data.ArrayLoader(data, 32))
    assert fit.current_epoch == 1 and "is not finite" in stop.stop_reason


def test_monitor_never_logged_lists_logged_metrics():
    stop = callbacks.EarlyStopping("val_los")
    # Reported by the sanity check, before training (tests/callbacks/
    # test_monitor_at_sanity_check.py), with validation's metric names.
    with pytest.raises(jl.ConfigurationError,
                       match=r"'val_los'.*Validation metrics: \[.*'val_loss'\]\. Did you mean "
                             r"'val_loss'"):
        make_fit("single", 4, [stop], max_epochs=1, limit_train_batches=2).fit(
            Classifier(), loader(), _val())
    with pytest.raises(jl.ConfigurationError, match="got no val_data"):
        make_fit("single", 4, [callbacks.EarlyStopping("val_loss")]).fit(Classifier(), loader())
    with pytest.raises(jl.ConfigurationError, match="patience"):
        callbacks.EarlyStopping("val_loss", patience=0)
    with pytest.raises(jl.ConfigurationError, match=r"stopping_threshold='1'\): give a number"):
        callbacks.EarlyStopping("val_loss", stopping_threshold="1")
    with pytest.raises(jl.ConfigurationError, match=r"check_on_train_epoch_end='yes'\): give"):
        callbacks.EarlyStopping("val_loss", check_on_train_epoch_end="yes")


def test_state_is_checkpointed_and_restored(tmp_path):
    stop = callbacks.EarlyStopping("val_loss", patience=3)
    ckpt = callbacks.ModelCheckpoint("ckpt", every_n_epochs=1, save_top_k=-1)
    fit = make_fit("single", 1000, [stop, ckpt], max_epochs=2, limit_train_batches=2)
    fit.fit(Frozen(), loader(), _val())
    assert stop.wait_count == 1
    # The epoch-1 checkpoint is written after that epoch's validation, so it holds the count.
    saved = read_meta("ckpt/4")["callbacks"]["EarlyStopping{monitor='val_loss'}"]
    assert saved["wait_count"] == 1 and saved["best_score"] == stop.best_score

    resumed = callbacks.EarlyStopping("val_loss", patience=3)
    fit = make_fit("single", 1000, [resumed, callbacks.ModelCheckpoint("ckpt", every_n_epochs=1)],
                   max_epochs=10, limit_train_batches=2)
    fit.fit(Frozen(), loader(), _val(), ckpt_path="last")
    # Restored wait_count 1, then two more flat epochs reach patience 3.
    assert resumed.stopped_step == 8 and fit.current_epoch == 4
