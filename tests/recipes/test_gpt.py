"""The gpt recipe: its corpus, its sampler, and its tiny preset learning."""

from __future__ import annotations

import math
import os
import shutil
import zlib

import numpy as np
import pytest
from flax import nnx

from jaxlight.recipes import gpt
from jaxlight.recipes._base import apply_overrides
from tests.recipes._small import quiet_fit, small


def test_corpus_is_the_standard_library_split_by_file():
    config = gpt.DataConfig()
    train, val = gpt.corpus_files(config)
    root = os.path.dirname(os.__file__)
    assert train and val and not set(train) & set(val)
    assert all(os.path.dirname(f) == root for f in train + val)
    assert all(zlib.crc32(os.path.relpath(f, root).encode()) % 20 == 0 for f in val)
    assert (train, val) == gpt.corpus_files(config)
    corpus = gpt.load_corpus(config)
    assert corpus["train"].shape[1] == config.seq_len + 1
    assert corpus["val"].shape == (config.val_windows, config.seq_len + 1)
    assert corpus["train"].dtype == np.uint8
    text = bytes(corpus["train"][0]).decode("utf-8", errors="replace")
    assert text.isprintable() or "\n" in text


def test_corpus_errors_name_the_directory(tmp_path):
    from jaxlight import DataError

    with pytest.raises(DataError, match=rf"no \*\.py files in '{tmp_path}'"):
        gpt.corpus_files(gpt.DataConfig(corpus=str(tmp_path)))


def test_presets_sizes():
    assert gpt.num_parameters(gpt.Config().model) == 229_952
    assert gpt.num_parameters(gpt.RECIPE.default_config("125m").model) == 113_462_016
    assert gpt.num_parameters(gpt.RECIPE.default_config("1b").model) == 1_074_333_696


@pytest.mark.slow
def test_tiny_preset_lowers_validation_loss_and_samples():
    # The preset's model and data; a smaller batch and a short run keep the test quick.
    config = apply_overrides(gpt.RECIPE.default_config("tiny"), {
        "data.val_windows": 64, "data.batch_size": 8, "sample.max_new_tokens": 16}, "test")
    steps = 30
    module, data = gpt.build(config, steps)
    fit = quiet_fit("single", max_steps=steps, log_every_n_steps=10)
    before = fit.validate(module, data.val)
    assert before["val_bits_per_byte"] == pytest.approx(before["val_loss"] / math.log(2))
    assert before["val_bits_per_byte"] > 7.0  # about log2(256) = 8 bits: nothing learned yet
    fit.fit(module, data.train, data.val)
    after = fit.validate(module, data.val)
    assert after["val_loss"] < before["val_loss"] - 1.0, (before, after)
    sample = gpt.after_fit(fit, module, data, config)["sample"]
    assert sample.startswith(config.sample.prompt)
    assert len(sample.encode("utf-8", errors="ignore")) > len(config.sample.prompt)


@pytest.mark.slow
def test_greedy_generation_is_deterministic_and_matches_argmax():
    import jax.numpy as jnp
    from flax import nnx

    _, config = small("gpt")
    with nnx.use_eager_sharding(False):
        model = gpt.make_module(config).configure_model(nnx.Rngs(0))
    window = config.data.seq_len
    a = gpt.generate_bytes(model, "import ", 4, temperature=0.0, window=window)
    b = gpt.generate_bytes(model, "import ", 4, temperature=0.0, window=window)
    assert a == b and len(a) == 4
    # Greedy decoding, replayed one byte at a time with the model itself.
    context = np.full(window, gpt.PAD_BYTE, np.int32)
    context[-len("import "):] = np.frombuffer(b"import ", np.uint8)
    expected = []
    for _ in range(4):
        expected.append(int(jnp.argmax(model(jnp.asarray(context)[None])[0, -1])))
        context = np.concatenate([context[1:], expected[-1:]])
    assert list(a) == expected
    sampled = gpt.generate_bytes(model, "import ", 4, temperature=1.0, seed=1, window=window)
    assert len(sampled) == 4


def test_flops_and_tokens_per_batch():
    module = gpt.make_module(gpt.Config())
    batch = {"tokens": np.zeros((32, 65), np.uint8)}
    assert module.tokens_per_batch(batch) == 32 * 64
    dense = gpt.num_parameters(gpt.Config().model) - 256 * 64
    assert module.flops_per_batch(batch) == 6 * dense * 2048 + 12 * 4 * 64 * 64 * 2048


@pytest.mark.slow
def test_remat_and_attention_overrides_reach_the_model():
    from jaxlight._errors import ConfigurationError

    config = apply_overrides(gpt.RECIPE.default_config("tiny"), {
        "model.remat": "dots", "model.attention": "xla"}, "test")
    assert (config.model.remat, config.model.attention) == ("dots", "xla")
    model = gpt.make_module(config).configure_model(nnx.Rngs(0))
    assert model.blocks.remat == "dots"
    assert model.blocks.layers.attn.attention == "xla"
    assert apply_overrides(gpt.Config(), {"model.remat": "true"}, "test").model.remat is True
    with pytest.raises(ConfigurationError, match=r"model.attention expects one of 'auto', "
                                                 r"'xla', 'cudnn', got 'flash'"):
        apply_overrides(gpt.Config(), {"model.attention": "flash"}, "test")


@pytest.mark.slow
def test_training_windows_stream_from_records_on_disk_through_grain(tmp_path):
    import grain

    _, config = small("gpt", **{"data.records_dir": str(tmp_path)})
    module, data = gpt.build(config, 10)
    path = tmp_path / "train.array_record"
    assert path.exists() and isinstance(data.train, grain.MapDataset)
    windows = gpt.train_windows(config.data)
    assert data.extras["train_bytes"] == windows.size
    # The stream's first len(windows) rows are every window once, shuffled; the next pass is
    # reshuffled.
    n, b = len(windows), config.data.batch_size
    it = iter(data.train)
    stream = np.concatenate([next(it)["tokens"] for _ in range(2 * n // b + 1)])
    first, second = stream[:n], stream[n:2 * n]
    assert sorted(map(bytes, first)) == sorted(map(bytes, windows))
    assert sorted(map(bytes, second)) == sorted(map(bytes, windows))
    assert not np.array_equal(first, windows) and not np.array_equal(first, second)
    # A second build reuses the records instead of writing them again.
    stamp = path.stat().st_mtime_ns
    gpt.build(config, 10)
    assert path.stat().st_mtime_ns == stamp


def test_grain_loader_needs_max_steps_and_the_memory_loader_counts_epochs():
    from jaxlight import ConfigurationError

    _, config = small("gpt")
    with pytest.raises(ConfigurationError, match="--max-steps.*--data.loader memory"):
        gpt.build(config, None)
    _, config = small("gpt", **{"data.loader": "memory"})
    _, data = gpt.build(config, None)
    assert len(data.train) == len(gpt.train_windows(config.data)) // config.data.batch_size


@pytest.mark.slow
def test_resumed_recipe_run_continues_the_grain_stream_bitwise(tmp_path):
    import jax

    import jaxlight as jl

    _, config = small("gpt", **{"data.records_dir": str(tmp_path / "records")})

    def run(steps, ckpt_path=None):
        module, data = gpt.build(config, 8)
        fit = quiet_fit("dp", max_steps=steps, callbacks=[
            jl.callbacks.ModelCheckpoint(str(tmp_path / "ckpt"), every_n_steps=4)])
        fit.fit(module, data.train, ckpt_path=ckpt_path)
        return jax.device_get(nnx.state(module.model, nnx.Param))

    whole = run(8)
    shutil.rmtree(tmp_path / "ckpt")
    run(4)
    resumed = run(8, ckpt_path="last")
    jax.tree.map(np.testing.assert_array_equal, whole, resumed)
