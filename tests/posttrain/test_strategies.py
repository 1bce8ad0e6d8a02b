"""The GRPO and DPO losses inside a jaxlight compiled step equal Tunix's under single, fsdp and
fsdp x tp: the policy and its frozen reference are the oracle's stand-in heads
(`PolicyAndReference`, `trainable = POLICY`), the reference's log-probabilities come from its
forward pass in the same step, and one SGD step of learning rate 1 moves the policy kernel by
exactly minus the sum of Tunix's two gradients (≤ 1e-5).

`FSDP()` evaluates the step per data-parallel replica on the replica's rows and averages the
replicas' losses, so the batch carries what needs the whole batch: the group-relative
advantages and `batch_weights` (computed on the host, as the GRPO recipe does)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxlight as jl
from jaxlight import posttrain, strategies
from jaxlight.callbacks import Callback
from tests.posttrain._oracle import (
    ARRAYS,
    RESULTS,
    SHAPES,
    TOL,
    TP,
    dpo_batch,
    dpo_objective,
    grpo_batch,
    grpo_objective,
)

GRPO, DPO = 1, 1  # the fixtures' non-default configurations (low_var_kl, label smoothing, ...)
GRPO_CFG, DPO_CFG = RESULTS["grpo"][GRPO]["config"], RESULTS["dpo"][DPO]["config"]


class Recorder(Callback):
    def __init__(self):
        self.metrics = {}

    def on_log(self, fit, module, metrics, step):
        self.metrics[step] = dict(metrics)


class OracleHeads(jl.TrainModule):
    trainable = posttrain.POLICY

    def configure_model(self, rngs):
        def head(kernel):
            return jl.nn.Dense(SHAPES["D"], SHAPES["V"], axes=("embed", "vocab"),
                               kernel_init=lambda *_: jnp.asarray(kernel), rngs=rngs)
        return posttrain.PolicyAndReference(head(ARRAYS["kernel"]), head(ARRAYS["ref_kernel"]))

    def configure_optimizers(self):
        return optax.sgd(1.0)

    def training_step(self, model, batch):
        g = {k[5:]: v for k, v in batch.items() if k.startswith("grpo_")}
        d = {k[4:]: v for k, v in batch.items() if k.startswith("dpo_")}

        def logits(net, hidden):
            return net(hidden)[:, TP - 1:-1]

        ref_logps = posttrain.token_log_probs(logits(model.reference, g["hidden"]),
                                              g["completion_ids"], GRPO_CFG["temperature"])
        grpo, gm = grpo_objective(None, logits(model.policy, g["hidden"]), ref_logps, g,
                                  GRPO_CFG)
        ref = tuple(posttrain.sequence_log_probs(logits(model.reference, d[f"{s}_hidden"]),
                                                 d[f"{s}_ids"], d[f"{s}_mask"])
                    for s in ("chosen", "rejected"))
        dpo, dm = dpo_objective(logits(model.policy, d["chosen_hidden"]),
                                logits(model.policy, d["rejected_hidden"]), d, DPO_CFG, ref)
        return grpo + dpo, {"grpo_loss": grpo, "grpo_kl": gm["kl"], "grpo_ppo_kl": gm["ppo_kl"],
                            "dpo_loss": dpo, "dpo_margin": dm["rewards/margin"]}


def _data():
    g = grpo_batch(GRPO)
    # Advantages and the batch-wide normalizers come from the host, for the whole batch: FSDP()
    # runs the step per replica on its own rows (one of a group of four, here).
    g["advantages"] = np.asarray(posttrain.group_advantages(g.pop("rewards"), SHAPES["G"]))
    g.update(jax.tree.map(np.asarray, posttrain.batch_weights(g["mask"])))
    g = {f"grpo_{k}": v for k, v in g.items() if k != "ref_logps"}
    d = {f"dpo_{k}": v for k, v in dpo_batch().items() if not k.startswith("ref_")}
    return jl.data.ArrayLoader({**g, **d}, batch_size=8, shuffle=False)


STRATEGIES = {
    "single": strategies.SingleDevice,
    "fsdp": lambda: strategies.FSDP(min_shard_size=1),
    "fsdp_tp": lambda: strategies.Hybrid({"fsdp": 4, "tp": 2}, min_shard_size=1),
}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_losses_in_the_compiled_step_equal_tunix(name):
    recorder = Recorder()
    fit = jl.Fit(STRATEGIES[name](), max_steps=1, log_every_n_steps=1, callbacks=[recorder],
                 enable_progress_bar=False, enable_model_summary=False, logger=False,
                 enable_checkpointing=False)
    fit.fit(OracleHeads(), _data())
    got = recorder.metrics[1]
    grpo, dpo = RESULTS["grpo"][GRPO], RESULTS["dpo"][DPO]
    expected = {"loss": grpo["loss"] + dpo["loss"], "grpo_loss": grpo["loss"],
                "grpo_kl": grpo["aux"]["kl"], "grpo_ppo_kl": grpo["aux"]["ppo_kl"],
                "dpo_loss": dpo["loss"], "dpo_margin": dpo["aux"]["rewards/margin"]}
    for key, want in expected.items():
        assert abs(got[key] - want) <= TOL, (name, key, got[key], want)
    policy = fit.state.params["policy"]["kernel"]
    stepped = ARRAYS["kernel"] - (ARRAYS[f"grpo{GRPO}_grad"] + ARRAYS[f"dpo{DPO}_grad"])
    np.testing.assert_allclose(np.asarray(policy), stepped, atol=TOL, rtol=0)
    # The reference stayed where it was, outside the trained parameters, laid out like them.
    reference = fit.state.rest["reference"]["kernel"]
    assert set(fit.state.params) == {"policy"}
    np.testing.assert_array_equal(np.asarray(reference), ARRAYS["ref_kernel"])
    assert reference.sharding.spec == policy.sharding.spec
    if name == "fsdp_tp":
        assert tuple(policy.sharding.spec) == ("fsdp", "tp")
    assert fit.compile_counts["train"] == 1
