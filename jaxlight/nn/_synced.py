"""A copy of a network that follows it inside the compiled step: a DQN or TD3 target network, a
BYOL or MoCo momentum encoder, a teacher for self-training.

Lightning keeps such a copy as a second module on `self` and re-syncs it from the step or a
hook (`target_net.load_state_dict(net.state_dict())`). In a step compiled once, a network on
`self` is a constant of the compiled program, and assignments to it from a hook never reach the
step (jaxlight refuses both: `jaxlight.step._guards`). The copy belongs in the model, where the
step carries it like batch statistics: its arrays are `Synced` variables (not `nnx.Param`, so
the optimizer never trains them and no gradient flows into them), the step writes their new
values, and checkpoints save and restore them with the rest of the model.

Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> class QNets(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.net = nnx.Linear(4, 2, rngs=rngs)
    ...         self.target = SyncedCopy(nnx.Linear(4, 2, rngs=rngs))  # its own init
    >>> model = QNets(nnx.Rngs(0))
    >>> _ = model.target.sync(model.net, every=10)  # call 0: copies (0 % 10 == 0)
    >>> bool(jnp.all(model.target.net.kernel[...] == model.net.kernel[...]))
    True
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxlight._errors import ConfigurationError


class Synced(nnx.Variable):
    """A variable that follows another network's parameter: carried and checkpointed by the
    step like batch statistics, never trained (it is not an `nnx.Param`)."""


def _child(node: Any, key: Any) -> Any:
    return node[key] if isinstance(key, int) else getattr(node, key)


def _params(net: nnx.Module) -> dict:
    return nnx.to_pure_dict(nnx.state(net, nnx.Param))


class SyncedCopy(nnx.Module):
    """A network whose parameters follow another one's, updated inside the step.

    `SyncedCopy(net)` takes `net` (not copied: build it for this purpose, with its own
    initialization, or pass `nnx.clone(online)` to start equal) and turns its `nnx.Param`s
    into `Synced` variables. Call it like the network; update it in `training_step` with
    `sync`. Its arrays are part of the model: the step carries what `sync` writes, every
    strategy lays them out like the network's parameters, and checkpoints keep them.

    Args:
        net: the network to hold as the copy.
    """

    def __init__(self, net: nnx.Module):
        for path, node in list(nnx.iter_graph(net)):
            if isinstance(node, nnx.Param):
                parent = net
                for key in path[:-1]:
                    parent = _child(parent, key)
                synced = Synced(node.get_value(), **node.get_metadata())
                if isinstance(path[-1], int):
                    parent[path[-1]] = synced
                else:
                    setattr(parent, path[-1], synced)
        self.net = net
        #: How many times `sync` ran (the step's count, when it is called once per step).
        self.count = Synced(jnp.zeros((), jnp.int32))

    def __call__(self, *args, **kwargs):
        """Runs the copy (no gradient flows into it: its variables are not trained)."""
        return jax.lax.stop_gradient(self.net(*args, **kwargs))

    def sync(self, online: nnx.Module, *, every: int | None = None,
             tau: float | None = None) -> jax.Array:
        """Updates the copy from `online`'s parameters (the same structure); returns whether
        this call copied (a traced bool; always True for `tau`).

        Exactly one of:
            every: copy outright on every `every`-th call, the first (call 0) included:
                `optax.periodic_update`. Called once per step after the loss, this is
                Lightning's DQN `if global_step % sync_rate == 0: load_state_dict(...)`.
                The count is of calls: with `accumulate_grad_batches=k` (or
                `Microbatches(k)`) the step runs `training_step` k times, so every N
                optimizer steps is `every=N * k`.
            tau: move each parameter a fraction `tau` toward `online`'s (Polyak averaging,
                `optax.incremental_update`): `copy = tau * online + (1 - tau) * copy`.
        """
        if (every is None) == (tau is None):
            raise ConfigurationError(
                f"SyncedCopy.sync got every={every}, tau={tau}: give exactly one, every=N (copy "
                "every N-th call) or tau=x (move a fraction x toward the online network).")
        new = jax.tree.map(jax.lax.stop_gradient, _params(online))
        state = nnx.state(self.net, Synced)
        old = nnx.to_pure_dict(state)
        if jax.tree.structure(new) != jax.tree.structure(old):
            raise ConfigurationError(
                "SyncedCopy.sync: the online network's parameters do not match the copy's: "
                f"{jax.tree.structure(new)} vs {jax.tree.structure(old)}. Build the copy from "
                "a network of the same class and configuration.")
        count = self.count.get_value()
        if every is not None:
            updated = optax.periodic_update(new, old, count, every)
            copied = count % every == 0
        else:
            updated = optax.incremental_update(new, old, tau)
            copied = jnp.asarray(True)
        nnx.replace_by_pure_dict(state, updated)
        nnx.update(self.net, state)
        self.count.set_value(count + 1)
        return copied
