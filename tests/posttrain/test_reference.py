"""Two models in one fit: a frozen reference beside the trained policy (`PolicyAndReference`,
`trainable = POLICY`), with a KL penalty to it in the loss. Its outputs never change over the
steps, it has no optimizer state, checkpoints hold only its fingerprint (it is rebuilt from its
source on resume), and a resume is bitwise equal to the uninterrupted run (FSDP, tiny LM)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks, nn, posttrain
from jaxlight.checkpoint._restore import complete_steps, read_meta
from tests.checkpoint._common import assert_bitwise, make_fit
from tests.strategies.lm import TinyLM, token_batches

STEPS = 4


class KLRegularizedLM(TinyLM):
    """Next-token loss of the policy plus beta * KL to the reference, both built from one
    source (`base_seed`), as a post-training run builds both from one pretrained checkpoint."""

    trainable = posttrain.POLICY

    def __init__(self, base_seed: int = 7, beta: float = 0.5):
        super().__init__(vocab=32, embed=16, layers=1, heads=2, mlp=32, lr=1e-2)
        self.base_seed, self.beta = base_seed, beta

    def configure_model(self, rngs):
        def build():
            return nn.TransformerLM(self.config, rngs=nnx.Rngs(self.base_seed))
        return posttrain.PolicyAndReference(build(), build())

    def training_step(self, model, batch):
        inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
        logits, ref_logits = model.policy(inputs), model.reference(inputs)
        kl = posttrain.kl_penalty(posttrain.token_log_probs(logits, targets),
                                  posttrain.token_log_probs(ref_logits, targets), "low_var_kl")
        lm = nn.lm_loss(logits, targets)
        probe = jnp.arange(8, dtype=jnp.int32)[None]  # the same input every step
        return lm + self.beta * kl.mean(), {"kl": kl.mean(),
                                            "ref_logits": model.reference(probe).sum(),
                                            "logits": model.policy(probe).sum()}


class Recorder(callbacks.Callback):
    def __init__(self):
        self.metrics = {}

    def on_log(self, fit, module, metrics, step):
        self.metrics[step] = dict(metrics)


def _data():
    return token_batches(STEPS, batch=8, length=9, vocab=32)


def _paths(tree) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("ref") / "ckpt")
    recorder = Recorder()
    fit = make_fit("fsdp", STEPS, [recorder, callbacks.ModelCheckpoint(
        ckpt, every_n_steps=2, save_top_k=-1)], log_every_n_steps=1)
    module = KLRegularizedLM()
    fit.fit(module, _data())
    assert complete_steps(ckpt) == [2, STEPS]
    return module, fit, ckpt, recorder.metrics


@pytest.mark.slow
def test_reference_is_frozen_and_outside_the_optimizer(trained):
    module, fit, _, metrics = trained
    ref_sums = [metrics[s]["ref_logits"] for s in range(1, STEPS + 1)]
    assert len(set(ref_sums)) == 1, ref_sums  # the reference computes the same every step
    assert len({metrics[s]["logits"] for s in range(1, STEPS + 1)}) == STEPS  # the policy moves
    assert metrics[1]["kl"] == 0.0 and metrics[STEPS]["kl"] > 0  # starts at the reference
    built = KLRegularizedLM().configure_model(nnx.Rngs(0))
    initial = jax.device_get(nnx.to_pure_dict(nnx.state(built.reference, nnx.Param)))
    assert_bitwise(jax.device_get(fit.state.rest["reference"]), initial)
    assert set(fit.state.params) == {"policy"} and "policy" not in fit.state.rest
    opt_paths = _paths(fit.state.opt_state)
    assert opt_paths and not [p for p in opt_paths if "reference" in p]
    # Adam's two moments per policy parameter: as many bytes as the reference twice over.
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
    assert nbytes(fit.state.opt_state) < 2 * nbytes(fit.state.params) + 64
    # Laid out like the policy: the same spec for every parameter of the same path.
    specs = lambda tree: [x.sharding.spec for x in jax.tree.leaves(tree)]  # noqa: E731
    assert specs(fit.state.rest["reference"]) == specs(fit.state.params["policy"])
    assert any(any(s) for s in specs(fit.state.params["policy"]))  # FSDP really shards them


@pytest.mark.slow
def test_checkpoint_holds_only_the_reference_fingerprint(trained):
    _, fit, ckpt, _ = trained
    step_dir = os.path.abspath(os.path.join(ckpt, str(STEPS)))
    state = ocp.StandardCheckpointer().restore(os.path.join(step_dir, "state"))
    saved = _paths(state)
    assert not [p for p in saved if "reference" in p], saved
    assert_bitwise(state["params"], jax.device_get(fit.state.params))
    frozen = read_meta(step_dir)["frozen_params"]
    assert sorted(frozen) == sorted("['rest']" + p for p in _paths(
        {"reference": fit.state.rest["reference"]}))
    assert all(isinstance(r["fingerprint"], int) for r in frozen.values())


@pytest.mark.slow
def test_resume_rebuilds_the_reference_and_is_bitwise(trained):
    module, fit, ckpt, metrics = trained
    recorder = Recorder()
    again = make_fit("fsdp", STEPS, [recorder], log_every_n_steps=1,
                     enable_checkpointing=False)
    again.fit(KLRegularizedLM(), _data(), ckpt_path=os.path.join(ckpt, "2"))
    assert again.global_step == STEPS
    assert_bitwise(jax.device_get(again.state.params), jax.device_get(fit.state.params))
    assert_bitwise(jax.device_get(again.state.opt_state), jax.device_get(fit.state.opt_state))
    assert_bitwise(jax.device_get(again.state.rest), jax.device_get(fit.state.rest))
    assert recorder.metrics[STEPS] == metrics[STEPS]


@pytest.mark.slow
def test_another_reference_is_refused(trained):
    _, _, ckpt, _ = trained
    with pytest.raises(jl.CheckpointError, match=r"other frozen parameters(.|\n)*"
                       r"\['rest'\]\['reference'\]\['embed'\]"):
        make_fit("fsdp", STEPS).fit(KLRegularizedLM(base_seed=8), _data(),
                                    ckpt_path=os.path.join(ckpt, "2"))


@pytest.mark.slow
def test_without_adapters_is_the_lora_base():
    rngs = nnx.Rngs(0)
    base = nnx.Linear(4, 3, rngs=rngs)
    model = nnx.LoRA(4, 2, 3, base_module=base, rngs=rngs)
    model.lora_b[...] = jnp.ones_like(model.lora_b[...])  # adapters no longer a no-op
    x = jnp.arange(8.0).reshape(2, 4)
    assert not np.allclose(model(x), base(x))
    np.testing.assert_array_equal(posttrain.without_adapters(model)(x), base(x))
    assert not np.allclose(model(x), base(x))  # the model itself keeps its adapters
