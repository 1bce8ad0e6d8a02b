"""The sft recipe: the task's encoding, LoRA adapters, and exact match rising."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jaxlight import callbacks
from jaxlight.recipes import gpt, sft
from tests.recipes._small import quiet_fit, small


def test_encoding_masks_exactly_the_answer():
    task = sft.TaskConfig(min_len=3, max_len=5)
    enc = sft.encode(["abc", "hgfed"], task)
    assert enc["tokens"].shape == (2, 12) and enc["mask"].shape == (2, 11)
    assert bytes(enc["tokens"][0]).decode() == "abc=cba\n" + "\n" * 4
    targets = enc["tokens"][:, 1:]
    assert bytes(targets[0][enc["mask"][0] == 1]).decode() == "cba\n"
    assert bytes(targets[1][enc["mask"][1] == 1]).decode() == "defgh\n"
    assert list(enc["prompt_len"]) == [4, 6]


def test_task_sets_are_disjoint_and_fixed():
    task = sft.TaskConfig(train_examples=500, val_examples=50)
    a, b = sft.task_data(task), sft.task_data(task)
    assert a["val_words"] == b["val_words"]
    train_words = {bytes(r).decode().split("=")[0] for r in a["train"]["tokens"]}
    assert not train_words & set(a["val_words"])
    with pytest.raises(Exception, match="distinct words asked for but only"):
        sft.task_data(sft.TaskConfig(min_len=1, max_len=1, train_examples=100))


def _base_params(config):
    module = gpt.make_module(gpt.Config(model=config.model))
    with nnx.use_eager_sharding(False):
        model = module.configure_model(nnx.Rngs(1))
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


@pytest.mark.slow
def test_lora_adapters_start_at_the_base_model_and_carry_logical_axes():
    _, config = small("sft")
    base = _base_params(config)
    tuner = sft.FineTuner(model=vars(config.model), base_params=base, lora_rank=4)
    assert tuner.trainable is nnx.LoRAParam
    model = tuner.configure_model(nnx.Rngs(0))
    lora = nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam))
    blocks = lora["blocks"]["layers"]
    qkv = blocks["attn"]["qkv"]
    layers, embed = config.model.num_layers, config.model.embed_dim
    assert qkv["lora_a"].shape == (layers, embed, 4)
    assert qkv["lora_b"].shape == (layers, 4, 3, config.model.num_heads,
                                   embed // config.model.num_heads)
    axes = nnx.get_partition_spec(nnx.state(model, nnx.LoRAParam))
    spec = axes["blocks"]["layers"]["attn"]["qkv"]["lora_b"].get_value()
    assert tuple(spec) == ("layers", None, None, "heads", "kv")
    # B = 0: the adapted model computes exactly the base model.
    plain = gpt.make_module(gpt.Config(model=config.model)).configure_model(nnx.Rngs(5))
    state = nnx.state(plain, nnx.Param)
    nnx.replace_by_pure_dict(state, base)
    nnx.update(plain, state)
    tokens = np.arange(24, dtype=np.int32).reshape(2, 12) + 97
    np.testing.assert_array_equal(np.asarray(model(tokens)), np.asarray(plain(tokens)))


class _Snapshot(callbacks.Callback):
    def on_train_start(self, fit, module):
        self.rest = jax.tree.map(np.asarray, fit.state.rest)


@pytest.mark.slow
def test_lora_fine_tuning_raises_exact_match_and_freezes_the_base():
    _, config = small("sft", **{"task.max_len": 4, "task.alphabet": "abcdef",
                                "task.train_examples": 1000, "task.val_examples": 64,
                                "data.batch_size": 32, "optim.lr": 1e-2})
    steps = 150
    module, data = sft.build(config, steps)
    snapshot = _Snapshot()
    fit = quiet_fit("single", max_steps=steps, log_every_n_steps=50, callbacks=[snapshot])
    before = sft.before_fit(fit, module, data, config)
    assert before["val_exact_match"] == 0.0
    fit.fit(module, data.train)
    after = fit.validate(module, data.val)
    assert after["val_exact_match"] >= 0.3, (before, after)  # 0.56 measured
    # Only the adapters were optimized: the train state's parameters are LoRA factors.
    names = {jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_leaves_with_path(fit.state.params)}
    assert names and all("lora_a" in n or "lora_b" in n for n in names)
    # The frozen base weights ride in the state's `rest`, bit for bit as initialized.
    assert jax.tree.leaves(snapshot.rest)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, fit.state.rest),
                 snapshot.rest)
    # Free-running greedy generation agrees with the teacher-forced exact match.
    report = sft.after_fit(fit, module, data, config)
    assert report["generated_exact_match"] == pytest.approx(after["val_exact_match"])


def test_full_fine_tuning_without_lora_trains_every_parameter():
    import optax

    from jaxlight.state._state import model_spec

    _, config = small("sft", **{"lora.rank": 0})
    module = sft.FineTuner(model=vars(config.model), lora_rank=0)
    assert module.trainable is nnx.Param
    spec = model_spec(module, optax.adamw(1e-3), 0)
    assert "lora_a" not in str(jax.tree_util.tree_structure(spec.abstract_state.params))
    assert "embed" in spec.abstract_state.params and not jax.tree.leaves(spec.abstract_state.rest)


@pytest.mark.slow
def test_base_from_a_gpt_checkpoint(tmp_path):
    gmod, gconfig = small("gpt")
    module, data = gmod.build(gconfig, 2)
    fit = quiet_fit("single", max_steps=2,
                    callbacks=[callbacks.ModelCheckpoint(tmp_path / "ckpt", every_n_steps=2)])
    fit.fit(module, data.train)
    trained = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(module.model, nnx.Param)))
    _, config = small("sft", **{"base.checkpoint": str(tmp_path / "ckpt")})
    loaded = sft.pretrained_params(config)
    jax.tree.map(np.testing.assert_array_equal, loaded, trained)


@pytest.mark.slow
def test_in_process_pretraining_gives_the_base():
    _, config = small("sft", **{"base.pretrain_steps": 2})
    params = sft.pretrained_params(config)
    random = _base_params(config)
    assert jax.tree.structure(params) == jax.tree.structure(random)
    assert sft.pretrained_params(small("sft")[1]) is None  # pretrain_steps 0: random base
