"""Device prefetch: same results at every depth, reads ahead within budget, exact positions."""

from __future__ import annotations

import threading
import time

import pytest

import jaxlight as jl
from jaxlight import callbacks
from jaxlight.checkpoint._restore import read_meta
from jaxlight.data._prefetch import prefetch_depth
from tests.checkpoint._common import assert_bitwise, loader, make_fit, params_of
from tests.models import Classifier, classification_data


class Counting:
    """A re-iterable of 8 batches that counts the batches it has handed out."""

    def __init__(self, fail_at: int | None = None, bad_at: int | None = None):
        data = classification_data(256)
        self.batches = [{k: v[i:i + 32] for k, v in data.items()} for i in range(0, 256, 32)]
        self.read = 0
        self.fail_at, self.bad_at = fail_at, bad_at

    def __iter__(self):
        for i, batch in enumerate(self.batches):
            if i == self.fail_at:
                raise ValueError(f"broken record in batch {i}")
            self.read += 1
            # Only x shrinks: a whole short batch is a partial batch, which trains.
            yield dict(batch, x=batch["x"][:16]) if i == self.bad_at else batch


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "jaxlight-prefetch"]


@pytest.mark.parametrize("depth", [0, 2, 5])
def test_every_depth_trains_bitwise_like_the_default(depth):
    got, want = Classifier(), Classifier()
    make_fit("dp", 12, prefetch_batches=depth).fit(got, loader())
    # The default for an ArrayLoader: read in the loop's thread, host arrays into the step.
    make_fit("dp", 12).fit(want, loader())
    assert_bitwise(params_of(got.model), params_of(want.model))


def test_the_default_reads_in_memory_batches_in_the_loops_thread_and_others_ahead():
    seen = {}

    def threads_at_step_1(name):
        def at_end(fit, module, outputs, batch, batch_idx):
            if fit.global_step == 1:  # 5 batches still to read: a reading thread would wait
                seen[name] = len(_prefetch_threads())
        return callbacks.LambdaCallback(on_train_batch_end=at_end)

    for name, data in (("array", loader()), ("list", Counting().batches),
                       ("generator", Counting())):
        make_fit("single", 6, [threads_at_step_1(name)]).fit(Classifier(), data)
    assert seen == {"array": 0, "list": 0, "generator": 1}
    assert not _prefetch_threads()


def test_the_default_depth_of_each_kind_of_data():
    in_memory = classification_data(64)
    assert prefetch_depth(jl.data.ArrayLoader(in_memory, 16), None) == 0
    assert prefetch_depth(jl.data.DataLoader(in_memory, batch_size=16), None) == 0
    assert prefetch_depth([{"x": 1}], None) == 0
    assert prefetch_depth(Counting(), None) == 2
    assert prefetch_depth(jl.data.ArrayLoader(in_memory, 16), 3) == 3  # asked: as asked
    assert prefetch_depth(Counting(), 0) == 0

    class Live(Counting):
        reads_live_model = True

    assert prefetch_depth(Live(), 4) == 0  # samples from the live model: never ahead


def test_the_next_batches_are_read_while_the_step_runs():
    data, counts = Counting(), {}

    def at_end(fit, module, outputs, batch, batch_idx):
        if fit.global_step == 1:
            # With prefetching, wait (up to 10 s) for the reader to get ahead; without, a
            # second's wait in which nothing may be read.
            deadline = time.monotonic() + (10 if fit.prefetch_batches else 1)
            while data.read < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
        counts.setdefault(fit.prefetch_batches, {})[fit.global_step] = data.read

    for depth in (0, 2):
        data.read = 0
        make_fit("single", 4, [callbacks.LambdaCallback(on_train_batch_end=at_end)],
                 prefetch_batches=depth).fit(Classifier(), data)
    assert counts[0][1] == 1  # without prefetching, only the batch being trained
    # With depth 2: two transferred batches queued, while step 1 had not been waited on.
    assert counts[2][1] >= 3
    assert not _prefetch_threads()


def test_no_batch_is_read_beyond_max_steps_or_the_batch_limit():
    data = Counting()
    make_fit("single", 5).fit(Classifier(), data)
    assert data.read == 5
    data = Counting()
    make_fit("single", 7, limit_train_batches=3).fit(Classifier(), data)
    assert data.read == 7  # 3 + 3 + 1


def test_a_checkpoint_saves_the_position_of_the_last_trained_batch(tmp_path):
    fit = make_fit("single", 11, [callbacks.ModelCheckpoint(str(tmp_path / "c"), every_n_steps=1,
                                                            save_top_k=-1)])
    fit.fit(Classifier(), loader())
    for step, (epoch, position) in {3: (0, 3), 8: (0, 8), 11: (1, 3)}.items():
        meta = read_meta(str(tmp_path / "c" / str(step)))
        assert (meta["loader"]["epoch"], meta["loader"]["position"]) == (epoch, position)


def test_a_loader_error_reaches_the_caller_and_stops_the_thread():
    with pytest.raises(ValueError, match="broken record in batch 3"):
        make_fit("single", 8).fit(Classifier(), Counting(fail_at=3))
    assert not _prefetch_threads()


def test_a_mismatched_batch_names_its_own_index():
    with pytest.raises(jl.DataError,
                       match=r"training batch 4 of epoch 0 has leaf \['x'\] of shape \(16, 16\)"):
        make_fit("single", 8).fit(Classifier(), Counting(bad_at=4))
    assert not _prefetch_threads()


def test_prefetch_batches_must_be_a_non_negative_integer():
    for bad in (-1, 1.5, "2"):
        with pytest.raises(jl.ConfigurationError,
                           match=r"prefetch_batches must be an integer >= 0 or None, got"):
            jl.Fit(max_steps=1, prefetch_batches=bad)
    assert jl.Fit(max_steps=1).prefetch_batches is None
