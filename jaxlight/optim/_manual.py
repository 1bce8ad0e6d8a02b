"""Manual optimization: `automatic_optimization = False`, updates sequenced inside the one step.

    class GAN(jl.TrainModule):
        automatic_optimization = False

        def training_step(self, model, batch, opt):
            g_loss = opt.step("generator", lambda model: generator_loss(model, batch))
            d_loss = opt.step("discriminator", lambda model: discriminator_loss(model, batch))
            self.log_dict({"g_loss": g_loss, "d_loss": d_loss})

`opt.step(name, loss_fn)` is Lightning's `toggle_optimizer` + `manual_backward` +
`optimizer.step()` + `untoggle_optimizer` in one call: it takes the gradient of `loss_fn(model)`
with respect to the parameters of optimizer `name` only (the others are constants, as a toggled
torch optimizer leaves them), applies that optimizer's update, and writes the new parameters
into `model`, so every later call (and the rest of training_step) sees them: Lightning's order.
It returns what `loss_fn` returned, computed before the update.

The whole training_step, with all its updates, is still one compiled step; the optimizer
state is the partition of every named optimizer (`jaxlight.optim._named`), donated with the
train state. Per-optimizer gradient handling is optax's: `optax.chain(optax.clip_by_global_norm
(1.0), optax.adam(...))` clips one optimizer's gradients, `optax.apply_if_finite(tx, n)` skips
its non-finite updates, `optax.MultiSteps(tx, k)` accumulates its gradients over k steps.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxlight._errors import ConfigurationError, JaxlightWarning, StepOutputError, suggest
from jaxlight.metrics import _metrics
from jaxlight.optim._named import NamedOptimizers, named_optimizers
from jaxlight.state import _frozen
from jaxlight.step._step import check_scalar_metrics, split_loss_output
from jaxlight.step._user_step import call_user_step

GUIDE = "docs/models.md (section 'Several optimizers')"

#: Step pieces a callback may contribute that act on "the" loss, gradient or optimizer: with
#: several optimizers and updates the step has none of these, so such callbacks are refused.
_ONE_LOSS_PIECES = ("transform_loss", "transform_loss_for_step", "transform_grad",
                    "gradient_computation", "process_gradients", "transform_optimizer",
                    "transform_params")

#: The optax way to do what a refused callback does, per optimizer.
_PER_OPTIMIZER = {
    "GradientClipping": "chain a clip into that optimizer: optax.chain("
                        "optax.clip_by_global_norm(max_norm), optax.adam(...))",
    "NonFiniteGuard": "wrap that optimizer: optax.apply_if_finite(optax.adam(...), "
                      "max_consecutive_errors=5)",
    "GradientAccumulation": "wrap that optimizer: optax.MultiSteps(optax.adam(...), "
                            "every_k_schedule=k)",
    "MixedPrecision": "cast inside the loss function you pass to opt.step (for example "
                      "model(x.astype(jnp.bfloat16)))",
}


def check_callbacks(module: Any, callbacks) -> None:
    """Refuses step-transforming callbacks that assume one loss and one update per step."""
    for cb in callbacks:
        if getattr(cb, "observes_optimizer_only", False):
            continue
        pieces = [p for p in _ONE_LOSS_PIECES
                  if getattr(type(cb), p, None) is not None
                  and any(p in vars(c) for c in type(cb).__mro__
                          if c.__module__ != "jaxlight.callbacks._base")]
        if pieces:
            name = type(cb).__name__
            how = _PER_OPTIMIZER.get(name, "apply it inside the loss functions given to "
                                           "opt.step, or per optimizer with optax")
            raise ConfigurationError(
                f"{name} changes the step's one loss, gradient or optimizer ({', '.join(pieces)})"
                f", but {type(module).__name__} uses manual optimization "
                "(automatic_optimization = False), whose training_step makes its own updates "
                f"(as Lightning refuses it with manual optimization). Per optimizer, {how}. "
                f"See {GUIDE}."
            )


def _is_masked(x: Any) -> bool:
    return isinstance(x, optax.MaskedNode)


class Optimizers:
    """What `training_step(self, model, batch, opt)` receives under manual optimization.

    Attributes:
        names: the optimizer names, in configure_optimizers' order.
        global_step: the training steps completed before this one (traced int32 scalar).
    """

    def __init__(self, model: nnx.Module, opt_state: optax.PartitionState,
                 named: NamedOptimizers, trainable: Any, strategy: Any, global_step: jax.Array):
        self._model = model
        self._states = dict(opt_state.inner_states)
        self._named = named
        self._trainable = trainable
        self._strategy = strategy
        self.names = named.names
        self.global_step = global_step

    def step(self, name: str, loss_fn: Callable[[nnx.Module], Any], *,
             when: jax.Array | bool | None = None) -> Any:
        """Applies optimizer `name`'s update for the gradient of `loss_fn(model)`.

        Args:
            name: which optimizer (its configure_optimizers name).
            loss_fn: `loss_fn(model) -> loss` or `-> (loss, aux)`, a scalar loss; the gradient
                is taken with respect to this optimizer's parameters only.
            when: a traced boolean: where it is False the parameters, this optimizer's state
                and the model's other variables stay as they were (the step is skipped; the
                loss is still computed). No Python `if` on traced values is needed.

        Returns:
            What `loss_fn` returned, before the update (under DDP the loss is averaged over
            the replicas, so conditions on it agree on every device).
        """
        if name not in self._states:
            raise ConfigurationError(
                f"opt.step({name!r}, ...): there is no optimizer {name!r}; configure_optimizers "
                f"named {list(self.names)}.{suggest(name, self.names)}"
            )
        mask = self._named.mask(name)
        tx = self._named.txs[name]
        graphdef, params_state, rest_state = nnx.split(self._model, self._trainable, ...)
        params = nnx.to_pure_dict(params_state)
        rest = nnx.to_pure_dict(rest_state)
        mine = jax.tree.map(lambda x, m: x if m else optax.MaskedNode(), params, mask)

        def join(own):
            return jax.tree.map(lambda a, b: b if _is_masked(a) else a, own, params,
                                is_leaf=_is_masked)

        def loss_of(own):
            model = nnx.merge(graphdef, join(own), rest)
            out = loss_fn(model)
            loss = out[0] if isinstance(out, tuple | list) else out
            if not hasattr(loss, "shape") or jnp.shape(loss) != ():
                raise StepOutputError(
                    f"opt.step({name!r}, loss_fn): loss_fn must return a scalar loss or "
                    f"(loss, aux), got {type(loss).__name__} of shape {jnp.shape(loss)}."
                )
            _, _, new_rest = nnx.split(model, self._trainable, ...)
            return loss.astype(jnp.float32), (out, nnx.to_pure_dict(new_rest))

        (loss, (out, new_rest)), grads = jax.value_and_grad(loss_of, has_aux=True)(mine)
        grads = self._strategy.reduce_gradients(grads)
        masked_state = self._states[name]
        updates, inner = tx.update(grads, masked_state.inner_state, mine)
        new_mine = optax.apply_updates(mine, updates)
        new_state = masked_state._replace(inner_state=inner)
        if when is not None:
            keep = jnp.asarray(when, jnp.bool_)

            def pick(new, old):
                return jax.tree.map(lambda a, b: jnp.where(keep, a, b), new, old)

            new_mine, new_state, new_rest = (pick(new_mine, mine),
                                             pick(new_state, masked_state),
                                             pick(new_rest, rest))
        self._states[name] = new_state
        nnx.replace_by_pure_dict(params_state, join(new_mine))
        nnx.replace_by_pure_dict(rest_state, new_rest)
        nnx.update(self._model, params_state, rest_state)
        if isinstance(out, tuple | list):
            return (self._replica_mean(out[0]), *out[1:])
        return self._replica_mean(out)

    def _replica_mean(self, loss: jax.Array) -> jax.Array:
        return self._strategy.reduce_metrics({"loss": loss})["loss"]

    def opt_state(self, old: optax.PartitionState) -> optax.PartitionState:
        return old._replace(inner_states=dict(self._states))


def _metrics_of(out: Any, where: str) -> dict:
    """training_step's return under manual optimization: None, a dict of scalar metrics, a
    loss, or (loss, metrics)."""
    if out is None:
        return {}
    if isinstance(out, dict):
        check_scalar_metrics(out, where)
        return dict(out)
    loss, metrics = split_loss_output(out, where)
    return {"loss": loss, **metrics}


def runs_per_replica(strategy: Any) -> bool:
    """Whether the strategy's automatic step runs `training_step` on each data-parallel
    replica's share of the batch while a manual step, compiled as one SPMD program, sees the
    global batch (FSDP, Hybrid with fsdp; docs/strategies.md, 'The batch a step sees')."""
    def probe(*args):
        return args

    return bool(getattr(strategy, "batch_axes", ())) and strategy.gradient_fn(probe) is not probe


def warn_batch_statistics(module: Any, model: nnx.Module, strategy: Any) -> None:
    """Warns (at training_step's source) when a manual step's model normalizes with batch
    statistics where the automatic step would use each replica's own (see
    `runs_per_replica`)."""
    layers = sorted({type(node).__name__ for _, node in nnx.iter_graph(model)
                     if isinstance(node, nnx.BatchNorm)})
    if not layers:
        return
    message = (
        f"{type(module).__name__} uses manual optimization under {strategy.name}, whose "
        f"automatic step runs training_step on each device's share of the batch (its "
        f"{', '.join(layers)} then normalizes with per-device statistics, as Lightning's FSDP "
        "and DDP do); a manual step runs on the global batch, so here the statistics are the "
        "whole batch's (as torch's SyncBatchNorm). For per-device statistics use "
        "strategies.DDP(); DataParallel uses whole-batch statistics in both modes "
        "(docs/strategies.md, 'The batch a step sees').")
    step = type(module).training_step
    try:
        warnings.warn_explicit(message, JaxlightWarning, inspect.getsourcefile(step),
                               inspect.getsourcelines(step)[1])
    except (TypeError, OSError):  # no source to point at
        warnings.warn(message, JaxlightWarning, stacklevel=2)


def build_manual_step(module, graphdef, tx: optax.GradientTransformation, callbacks, strategy,
                      frozen: Any = None, log_spec: _metrics.LogSpec | None = None) -> Callable:
    """The training step of a manual-optimization module: `train_step(state, batch)` calls
    `training_step(model, batch, opt)`, whose `opt.step` calls update the state in order."""
    named = named_optimizers(tx)
    if named is None:
        raise ConfigurationError(
            f"{type(module).__name__} uses manual optimization, but a callback replaced the "
            f"optimizer configure_optimizers returned. See {GUIDE}."
        )
    check_callbacks(module, callbacks)
    for cb in callbacks:
        cb.setup_step(strategy)
    where = f"{type(module).__name__}.training_step"
    per_replica = runs_per_replica(strategy)

    def train_step(state, batch):
        model = nnx.merge(graphdef, state.params, state.rest)
        if per_replica:
            warn_batch_statistics(module, model, strategy)
        opt = Optimizers(model, state.opt_state, named, module.trainable, strategy, state.step)
        with _metrics.collecting("train", where) as logs:
            out = call_user_step(module.training_step, where, model, batch, opt)
        metrics = _metrics.merge_training_logs(_metrics_of(out, where), logs, log_spec, where)
        metrics = strategy.reduce_metrics(
            {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()})
        _, params, rest = nnx.split(model, module.trainable, ...)
        params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
        if _frozen.has_frozen(frozen):
            rest = _frozen.join(frozen, _frozen.select(rest, frozen, False),
                                _frozen.select(state.rest, frozen, True))
        return state.replace(step=state.step + 1, params=params,
                             opt_state=opt.opt_state(state.opt_state), rest=rest), metrics

    step = train_step
    for cb in callbacks:
        step = cb.transform_step(step)
    return step
