"""Checkpoints of a LoRA module hold only what it trains; its frozen base comes from
configure_model on restore (sft recipe, tiny model)."""

import functools
import os

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks
from jaxlight.checkpoint._restore import complete_steps, read_meta
from jaxlight.recipes import sft
from jaxlight.state._state import model_spec
from tests.checkpoint._common import AnnotatedClassifier, assert_bitwise, make_fit, make_strategy
from tests.recipes._small import TINY_LM

MODEL = {k.split(".", 1)[1]: v for k, v in TINY_LM.items()}
TASK = sft.TaskConfig(min_len=3, max_len=3, train_examples=64, val_examples=16)
STEPS = 4


@functools.cache
def _base() -> dict:
    """Base weights unlike configure_model's own initialization (seed 1, not the fit's 0), so
    a restore that took the frozen weights from anywhere but `base_params` would show."""
    plain = sft.FineTuner(model=MODEL, lora_rank=0)
    with nnx.use_eager_sharding(False):
        model = plain.configure_model(nnx.Rngs(1))
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


#: `_tuner`'s default base: `_base()`, built on first use (not at collection, in every worker).
BASE = object()


def _tuner(base=BASE, rank=4) -> sft.FineTuner:
    base = _base() if base is BASE else base
    return sft.FineTuner(model=MODEL, base_params=base, lora_rank=rank, lr=1e-2, warmup_steps=1)


def _loader() -> jl.data.ArrayLoader:
    data = sft.task_data(TASK)["train"]
    return jl.data.ArrayLoader({k: data[k] for k in ("tokens", "mask")}, 16, seed=3)


def _tokens() -> np.ndarray:
    return sft.task_data(TASK)["val"]["tokens"][:, :-1].astype(np.int32)


def _paths(tree) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]


def _nbytes(tree) -> int:
    return sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A LoRA fit of STEPS steps saving every 2 steps: (module, fit, checkpoint directory)."""
    ckpt = str(tmp_path_factory.mktemp("lora") / "ckpt")
    module = _tuner()
    fit = make_fit("fsdp", STEPS, [callbacks.ModelCheckpoint(ckpt, every_n_steps=2,
                                                             save_top_k=-1)])
    fit.fit(module, _loader())
    assert complete_steps(ckpt) == [2, STEPS]
    return module, fit, ckpt


@pytest.mark.slow
def test_lora_checkpoint_holds_only_the_adapters(trained):
    module, fit, ckpt = trained
    step_dir = os.path.abspath(os.path.join(ckpt, str(STEPS)))
    state = ocp.StandardCheckpointer().restore(os.path.join(step_dir, "state"))
    assert set(state) == {"step", "params", "opt_state", "rest"}
    # The adapters and their AdamW moments, nothing of the base: no kernel, embedding or scale.
    params = _paths(state["params"])
    assert params and all(p.endswith(("['lora_a']", "['lora_b']")) for p in params)
    assert state["rest"] == {}  # this model's rest is all frozen base weights
    saved = _paths(state)
    assert not [p for p in saved if "['base']" in p or "embed" in p or "scale" in p], saved
    assert_bitwise(state["params"], jax.device_get(fit.state.params))
    # Its arrays are exactly the adapters, their optimizer state and the step: the base's
    # bytes (2.7x those here, rank 4 of width 32; ~1000x for rank 8 of a 1B model) are not.
    base_bytes = _nbytes(nnx.state(module.model, nnx.Not(nnx.LoRAParam)))
    assert _nbytes(state) == _nbytes(fit.state.params) + _nbytes(fit.state.opt_state) + 4
    assert base_bytes > 2 * _nbytes(state)
    # The meta record names every frozen parameter with its shape and fingerprint.
    frozen = read_meta(step_dir)["frozen_params"]
    assert sorted(frozen) == sorted("['rest']" + p for p in _paths(fit.state.rest))
    embed = frozen["['rest']['embed']['embedding']"]
    assert embed["shape"] == list(_base()["embed"]["embedding"].shape)
    assert embed["dtype"] == "float32"


@pytest.mark.slow
def test_load_checkpoint_rebuilds_the_base_and_matches_the_trained_model(trained):
    module, _, ckpt = trained
    step_dir = os.path.join(ckpt, str(STEPS))
    loaded = jl.load_checkpoint(step_dir, _tuner())  # one device
    assert_bitwise(jax.device_get(nnx.to_pure_dict(nnx.state(loaded))),
                   jax.device_get(nnx.to_pure_dict(nnx.state(module.model))))
    # Laid out as in training (FSDP), it computes exactly what the trained model does.
    loaded = jl.load_checkpoint(step_dir, _tuner(), strategy=make_strategy("fsdp"))
    tokens = _tokens()
    np.testing.assert_array_equal(np.asarray(loaded(tokens)), np.asarray(module.model(tokens)))
    # The adapters moved away from zero: the outputs differ from the base model's.
    base_only = _tuner()
    base_only.model = base_only.configure_model(nnx.Rngs(0))
    assert not np.array_equal(np.asarray(base_only.model(tokens)), np.asarray(loaded(tokens)))


@pytest.mark.slow
def test_resume_from_a_lora_checkpoint_is_bitwise_exact(trained):
    module, fit, ckpt = trained
    resumed = _tuner()
    again = make_fit("fsdp", STEPS)
    again.fit(resumed, _loader(), ckpt_path=os.path.join(ckpt, "2"))
    assert again.global_step == STEPS
    assert_bitwise(jax.device_get(again.state.params), jax.device_get(fit.state.params))
    assert_bitwise(jax.device_get(again.state.opt_state), jax.device_get(fit.state.opt_state))
    assert_bitwise(jax.device_get(nnx.to_pure_dict(nnx.state(resumed.model))),
                   jax.device_get(nnx.to_pure_dict(nnx.state(module.model))))


@pytest.mark.slow
def test_other_base_weights_are_refused_with_their_paths(trained):
    _, _, ckpt = trained
    # configure_model's own random base (no base_params): adapters trained for BASE would
    # silently compute something else.
    with pytest.raises(jl.CheckpointError, match=r"trained on other frozen parameters(.|\n)*"
                       r"\['rest'\]\['embed'\]\['embedding'\] \(256, 32\): other values"):
        jl.load_checkpoint(os.path.join(ckpt, str(STEPS)), _tuner(base=None))
    with pytest.raises(jl.CheckpointError, match=r"--base.checkpoint"):
        make_fit("single", STEPS).fit(_tuner(base=None), _loader(),
                                      ckpt_path=os.path.join(ckpt, "2"))


@pytest.mark.slow
def test_another_lora_rank_is_refused_naming_paths_and_shapes(trained):
    _, _, ckpt = trained
    # Only the parameters differ (the frozen base in `rest` is the same): only they are named.
    with pytest.raises(jl.CheckpointError, match=r"does not match FineTuner's params:"
                       r"(.|\n)*shape differs: \['params'\](.|\n)*\['lora_a'\] checkpoint "
                       r"\(2, 32, 4\) vs model \(2, 32, 2\)"):
        jl.load_checkpoint(os.path.join(ckpt, str(STEPS)), _tuner(rank=2))


def test_modules_training_every_parameter_have_no_frozen_ones():
    # Their checkpoints stay exactly as before: whole `rest`, no `frozen_params` record.
    for module in (AnnotatedClassifier(), _tuner(rank=0)):
        spec = model_spec(module, optax.sgd(0.1), 0)
        assert not any(jax.tree.leaves(spec.frozen))
    spec = model_spec(_tuner(), optax.sgd(0.1), 0)
    assert jax.tree.structure(spec.frozen) == jax.tree.structure(spec.abstract_state.rest)
    assert all(jax.tree.leaves(spec.frozen))
