"""DDP: classic `jax.pmap` data parallelism, PyTorch DDP's model in JAX.

Every device holds a whole replica of the train state, stored internally with a leading device
axis (`(N, *shape)`, one slice per device); the global batch `(B, ...)` is viewed as
`(N, B / N, ...)`, one slice per device. Inside the step `reduce_gradients` averages gradients
with `lax.pmean`, so every replica applies the same update. `to_canonical` drops the device axis:
checkpoints and `module.model` look exactly like every other strategy's.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxlight._errors import ConfigurationError
from jaxlight.sharding._replica_rng import replica_draws
from jaxlight.step._microbatch import accumulate_locally
from jaxlight.strategies._base import Strategy

#: The pmap axis name (`lax.pmean(x, AXIS)` inside the step).
AXIS = "ddp"

#: True while DDP's pmapped function body is traced (the pmap axis is bound there); the core
#: also traces the step abstractly, outside any pmap, where the reductions are identities.
_PER_REPLICA: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxlight_ddp_replica",
                                                                   default=False)


def _per_replica(fn: Callable) -> Callable:
    """`fn` as the body of DDP's pmap: the reductions inside it see the pmap axis."""

    @functools.wraps(fn)
    def body(*args):
        token = _PER_REPLICA.set(True)
        try:
            return fn(*args)
        finally:
            _PER_REPLICA.reset(token)

    return body


def _is_sharding(x) -> bool:
    return x is None or isinstance(x, jax.sharding.Sharding)


class _CompiledPmap:
    """The AOT-compiled pmapped step; exposes `memory_analysis` and `as_text` for plans."""

    def __init__(self, compiled, merge_outputs: bool):
        self._compiled = compiled
        self._merge = merge_outputs

    def __call__(self, *args):
        out = self._compiled(*args)
        if self._merge:
            # Unmapped outputs (predict): `(N, B / N, ...)` back to the global `(B, ...)`.
            out = jax.tree.map(lambda x: x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]), out)
        return out

    def memory_analysis(self):
        return self._compiled.memory_analysis()

    def as_text(self) -> str:
        return self._compiled.as_text()

    def cost_analysis(self):
        return self._compiled.cost_analysis()


class DDP(Strategy):
    """Data parallelism with `jax.pmap`: replicated state, per-device batch slices, `pmean`.

    Sharded shapes: `In[B_N, D] · W[D, F] -> Out[B_N, F]` with `W` replicated. Each step
    all-reduces the gradients (2(N−1)/N · Ψ · β bytes per device) and the metrics. Use it where
    PyTorch DDP would be used; `DataParallel` is the SPMD equivalent (same numbers, and it
    composes with the sharded strategies).

    Args:
        devices: the devices to use (default: all).

    Example:
        >>> from jaxlight import strategies
        >>> strategy = strategies.DDP()
    """

    name = "ddp"

    def __init__(self, devices: Sequence[jax.Device] | None = None):
        super().__init__()
        self._devices = devices
        self.devices: list[jax.Device] = []

    # -- set-up ----------------------------------------------------------------------------

    def setup(self, devices: Sequence[jax.Device] | None = None) -> None:
        if jax.process_count() > 1:
            # Multi-process pmap needs host-local views of every global array and its own
            # checkpoint gathering; the SPMD DataParallel does the same arithmetic and
            # collectives across processes, so jaxlight offers that instead.
            raise ConfigurationError(
                f"DDP (jax.pmap) supports one process; this job has {jax.process_count()} "
                "processes. Use strategies.DataParallel() (alias 'dp'): the same replicated "
                "parameters and gradient all-reduce, compiled as one SPMD program."
            )
        self.devices = list(devices if devices is not None else (self._devices or jax.devices()))
        self.mesh = Mesh(np.asarray(self.devices, dtype=object), (AXIS,),
                         axis_types=(AxisType.Auto,))

    @property
    def num_replicas(self) -> int:
        self.require_mesh("num_replicas")
        return len(self.devices)

    @property
    def data_parallel_size(self) -> int:
        return self.num_replicas

    # -- layout ----------------------------------------------------------------------------
    # State leaves get `P(AXIS)` (one spec entry: the device axis of a `(N, *shape)` array);
    # batch leaves get `P(AXIS, None, ...)` over their `(N, B / N, ...)` view (ndim + 1
    # entries). `compile` tells the two apart by that length.

    def _stacked(self) -> NamedSharding:
        return NamedSharding(self.require_mesh("state_shardings()"), PartitionSpec(AXIS))

    def state_shardings(self, abstract_state: Any, logical_axes: Any) -> Any:
        del logical_axes  # every replica holds everything
        return jax.tree.map(lambda _: self._stacked(), abstract_state)

    def batch_shardings(self, abstract_batch: Any) -> Any:
        mesh = self.require_mesh("batch_shardings()")
        return jax.tree.map(
            lambda x: NamedSharding(mesh, PartitionSpec(AXIS, *([None] * np.ndim(x)))),
            abstract_batch,
        )

    def put_batch(self, batch: Any, shardings: Any) -> Any:
        local = sum(d.process_index == jax.process_index() for d in self.devices)

        def one(x, sharding):
            x = np.asarray(x)
            view = x.reshape(local, x.shape[0] // local, *x.shape[1:])
            if jax.process_count() == 1:
                return jax.device_put(view, sharding)
            return jax.make_array_from_process_local_data(sharding, view)

        return jax.tree.map(one, batch, shardings)

    def init_state(self, init_fn: Callable, abstract_state: Any, shardings: Any) -> Any:
        del abstract_state
        n = self.num_replicas

        def stacked():
            # Each device computes the (identical) initial state and keeps its slice.
            return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))), init_fn())

        return jax.jit(stacked, out_shardings=shardings)()

    def shard_shape(self, shape: tuple[int, ...], sharding: Any) -> tuple[int, ...]:
        del sharding
        return tuple(shape)  # every device holds a whole replica

    # -- state in and out ------------------------------------------------------------------

    def to_canonical(self, tree: Any) -> Any:
        """Drops the device axis (the replicas are identical): replica 0's values."""

        def one(x):
            if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
                return x[0]  # traced (eval_shape) or host values
            return x.addressable_data(0)[0]

        return jax.tree.map(one, tree)

    def from_canonical(self, tree: Any, shardings: Any) -> Any:
        """Replicates canonical arrays onto every device, adding the device axis."""
        n = self.num_replicas

        def one(x, sharding):
            host = np.asarray(jax.device_get(x))
            return jax.make_array_from_callback((n, *host.shape), sharding,
                                                lambda index: host[None])

        return jax.tree.map(one, tree, shardings)

    # -- compiling -------------------------------------------------------------------------

    def _lift(self, abstract: Any, sharding: Any) -> tuple[Any, int | None]:
        """The per-call abstract value and pmap axis for one canonical leaf and its sharding."""
        n = self.num_replicas
        spec = tuple(sharding.spec)
        if not spec:  # replicated: broadcast to every device
            return abstract, None
        shape = tuple(abstract.shape)
        if len(spec) == 1:  # state: (N, *shape)
            return jax.ShapeDtypeStruct((n, *shape), abstract.dtype), 0
        return jax.ShapeDtypeStruct((n, shape[0] // n, *shape[1:]), abstract.dtype), 0

    def compile(
        self,
        fn: Callable,
        abstract_args: tuple,
        in_shardings: tuple,
        out_shardings: Any,
        donate_argnums: tuple[int, ...] = (),
    ) -> _CompiledPmap:
        lifted, in_axes = [], []
        for arg, shard in zip(abstract_args, in_shardings, strict=True):
            # A sharding may stand for a whole subtree (a prefix), as in jax.jit.
            lifted.append(jax.tree.map(
                lambda s, sub: jax.tree.map(lambda a: self._lift(a, s)[0], sub),
                shard, arg, is_leaf=_is_sharding))
            in_axes.append(jax.tree.map(
                lambda s, sub: jax.tree.map(lambda a: self._lift(a, s)[1], sub),
                shard, arg, is_leaf=_is_sharding))
        merge = out_shardings is None
        out_axes = 0 if merge else jax.tree.map(
            lambda s: 0 if s is None or tuple(s.spec) else None, out_shardings,
            is_leaf=_is_sharding)
        mapped = jax.pmap(_per_replica(fn), axis_name=AXIS, in_axes=tuple(in_axes),
                          out_axes=out_axes, devices=self.devices, donate_argnums=donate_argnums)
        return _CompiledPmap(mapped.lower(*lifted).compile(), merge)

    def trace_context(self):
        return contextlib.nullcontext()

    # -- inside the traced step --------------------------------------------------------------

    def gradient_fn(self, grad_fn: Callable) -> Callable:
        """`grad_fn` per replica, each drawing its own rows of the single-device random draws
        (`jaxlight.sharding._replica_rng`): without it every replica would draw the same dropout
        mask."""
        drawn = replica_draws(grad_fn, AXIS)

        def per_replica_grad_fn(params, rest, batch):
            # Outside the pmap (abstract tracing) no axis is bound and the draw is the plain one.
            return (drawn if _PER_REPLICA.get() else grad_fn)(params, rest, batch)

        return per_replica_grad_fn

    def accumulate_gradients(self, grad_fn: Callable, k: int, *,
                             sync_every_microbatch: bool = False) -> Callable:
        """A scan over this replica's k microbatches; `reduce_gradients` follows it once."""
        del sync_every_microbatch  # the reduction follows the scan either way
        return accumulate_locally(self.gradient_fn(grad_fn), k, dp=self.data_parallel_size)

    def reduce_gradients(self, grads: Any) -> Any:
        """The mean of every replica's gradients (`lax.pmean` over the devices)."""
        return jax.lax.pmean(grads, AXIS) if _PER_REPLICA.get() else grads

    def reduce_metrics(self, metrics: Any, op: str = "mean") -> Any:
        """The mean (or, for `op="sum"`, the sum) of every replica's metrics."""
        if op not in ("mean", "sum"):
            raise ConfigurationError(f"reduce_metrics op must be 'mean' or 'sum', got {op!r}.")
        if not _PER_REPLICA.get():
            return metrics
        return jax.lax.pmean(metrics, AXIS) if op == "mean" else jax.lax.psum(metrics, AXIS)

    def gather_replicas(self, tree: Any) -> Any | None:
        """Every replica's `tree` stacked on a leading axis (`lax.all_gather`), for merging."""
        return jax.lax.all_gather(tree, AXIS) if _PER_REPLICA.get() else None
