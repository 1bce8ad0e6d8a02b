"""The Strategy base: which mesh, how state and batches are laid out, how the step compiles.

A strategy holds no hooks, no checkpoint I/O and no precision logic (DESIGN.md). The core asks it
four things, in this order, once per fit:

1. `setup(devices)`: build the mesh (refusing a mesh that does not fit the devices).
2. `state_shardings(abstract_state, logical_axes)`: a sharding for every train-state leaf.
3. `batch_shardings(abstract_batch)`: a sharding for every batch leaf (checked for divisibility).
4. `compile(fn, ...)`: an ahead-of-time compiled step (`jax.stages.Compiled`-like callable).

Inside the traced step the core calls `reduce_gradients`/`reduce_metrics`, which are identities for
SPMD strategies (XLA inserts the collectives) and `lax.pmean` under `DDP`.
"""

from __future__ import annotations

import abc
import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxlight._errors import NotSetUpError
from jaxlight.sharding._layout import require_divisible
from jaxlight.step._microbatch import accumulate_locally


class Strategy(abc.ABC):
    """How a fit is laid out over devices. Subclasses are final; customise by wrapping."""

    #: Short name used in logs, aliases and the hyperparameter record.
    name: str = "strategy"

    def __init__(self) -> None:
        self.mesh: jax.sharding.Mesh | None = None

    # -- set-up ----------------------------------------------------------------------------

    @abc.abstractmethod
    def setup(self, devices: Sequence[jax.Device]) -> None:
        """Builds `self.mesh` over `devices` (all global devices by default)."""

    @property
    def requested_devices(self) -> list[jax.Device] | None:
        """The devices given to the constructor, or None (those `setup` gets, else all)."""
        devices = getattr(self, "_devices", None)
        return None if devices is None else list(devices)

    @property
    @abc.abstractmethod
    def data_parallel_size(self) -> int:
        """How many ways the global batch is split."""

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary (name, mesh) for logs and hyperparameter records."""
        mesh = {} if self.mesh is None else dict(self.mesh.shape)
        return {"name": self.name, "mesh": mesh}

    # -- layout ----------------------------------------------------------------------------

    @abc.abstractmethod
    def state_shardings(self, abstract_state: Any, logical_axes: Any) -> Any:
        """Shardings for every leaf of `abstract_state` (a pytree of ShapeDtypeStruct).

        `logical_axes` mirrors `abstract_state` with a tuple of logical axis names (or None) per
        leaf, taken from `nnx.with_partitioning` annotations.
        """

    @abc.abstractmethod
    def batch_shardings(self, abstract_batch: Any) -> Any:
        """Shardings for every leaf of a global batch."""

    def check_batch(self, abstract_batch: Any, what: str = "batch") -> None:
        """Refuses a global batch whose leading dimension the data-parallel degree cannot split."""
        dp = self.data_parallel_size
        require_divisible(
            abstract_batch, what, dp,
            lambda: f"the data-parallel degree {dp} of {self.name} on mesh "
                    f"{self.describe()['mesh']}")

    def put_batch(self, batch: Any, shardings: Any) -> Any:
        """Turns this process's share of a batch into global device arrays."""
        if jax.process_count() == 1:
            # One process holds the whole batch: a single device_put of the tree is cheapest.
            return jax.device_put(batch, shardings)
        return jax.tree.map(
            lambda x, s: jax.make_array_from_process_local_data(s, np.asarray(x)), batch, shardings
        )

    def step_input(self, batch: Any, shardings: Any) -> Any:
        """A batch as the loop's own thread hands it to a compiled step: `put_batch`'s device
        arrays here; a strategy whose compiled steps place host arrays themselves may return
        the host batch instead (`SpmdStrategy`)."""
        return self.put_batch(batch, shardings)

    # -- compiling -------------------------------------------------------------------------

    @abc.abstractmethod
    def compile(
        self,
        fn: Callable,
        abstract_args: tuple,
        in_shardings: tuple,
        out_shardings: Any,
        donate_argnums: tuple[int, ...] = (),
    ) -> Any:
        """Compiles `fn` ahead of time for `abstract_args`; returns the compiled callable."""

    def shard_shape(self, shape: tuple[int, ...], sharding: jax.sharding.Sharding
                    ) -> tuple[int, ...]:
        """The part of a canonical array of `shape` one device holds under `sharding`."""
        return tuple(sharding.shard_shape(tuple(shape)))

    def require_mesh(self, what: str) -> Any:
        """The device mesh, or a `NotSetUpError` naming `what` needed it before `setup`."""
        if self.mesh is None:
            name = type(self).__name__
            raise NotSetUpError(
                f"{name}.{what} needs the device mesh, which {name}.setup(devices) builds; "
                f"call strategy.setup() first (Fit does it before it trains, evaluates or "
                "plans), or pass the strategy to jaxlight.Fit and let it set up."
            )
        return self.mesh

    def bytes_per_device(self, abstract: Any, shardings: Any) -> int:
        """Bytes one device holds of `abstract` (ShapeDtypeStructs) laid out by `shardings`."""
        total = 0
        for leaf, sharding in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings),
                                  strict=True):
            local = self.shard_shape(tuple(leaf.shape), sharding)
            # `leaf.dtype.itemsize`, not `np.dtype(...)`: RNG key arrays (`nnx.Rngs` streams,
            # Dropout) have JAX's extended `key<fry>` dtype, which NumPy cannot interpret.
            total += math.prod(local) * leaf.dtype.itemsize
        return total

    def replicated(self) -> jax.sharding.Sharding:
        """The sharding of a value every device holds whole (metrics, scalars)."""
        return jax.sharding.NamedSharding(self.require_mesh("replicated()"),
                                          jax.sharding.PartitionSpec())

    def replicated_like(self, tree: Any) -> Any:
        return jax.tree.map(lambda _: self.replicated(), tree)

    def init_state(self, init_fn: Callable, abstract_state: Any, shardings: Any) -> Any:
        """Runs `init_fn` so that every array is created directly in its target shard."""
        del abstract_state
        return self.create(init_fn, shardings)

    def create(self, fn: Callable, shardings: Any) -> Any:
        """`fn()`'s arrays, each created directly in its sharding (one compiled call)."""
        with self.trace_context():
            return jax.jit(fn, out_shardings=shardings)()

    def trace_context(self) -> contextlib.AbstractContextManager:
        """A context active while the step is traced and compiled (for example the mesh)."""
        return contextlib.nullcontext()

    # -- inside the traced step --------------------------------------------------------------

    def gradient_fn(self, grad_fn: Callable) -> Callable:
        """The strategy's layout of `grad_fn(params, rest, batch)` when no callback sets one.

        Identity by default (XLA places the collectives); FSDP gathers once and
        reduce-scatters once.
        """
        return grad_fn

    def relayout_batch(self, batch: Any) -> Any:
        """The batch in the layout the step computes in (the training step's first op).
        Identity here; SPMD strategies split it over (fsdp, data) (`SpmdStrategy`)."""
        return batch

    def reduce_gradients(self, grads: Any) -> Any:
        """Makes per-replica gradients global. SPMD: already global (identity)."""
        return grads

    def reduce_metrics(self, metrics: Any, op: str = "mean") -> Any:
        """Makes per-replica metrics global (`op` is "mean" or "sum"). SPMD: identity."""
        return metrics

    def gather_replicas(self, tree: Any) -> Any | None:
        """Every replica's `tree` stacked on a new leading axis (for merging clu metrics), or
        None where the step already sees the global batch (SPMD)."""
        del tree
        return None

    def accumulate_gradients(self, grad_fn: Callable, k: int, *,
                             sync_every_microbatch: bool = False) -> Callable:
        """`grad_fn` over k microbatches of the step's batch, one fp32 gradient sum.

        Used by `callbacks.Microbatches` and `callbacks.GradientAccumulation`. The default
        scans the batch the step function sees, which here is one replica's share (DDP) or the
        whole batch (one device); the core's `reduce_gradients` then reduces the result once
        per step. SPMD strategies override it so that their gradient collective also runs
        once per step.

        Args:
            grad_fn: `(params, rest, batch) -> ((loss, (metrics, rest)), grads)`.
            k: microbatches per optimizer step.
            sync_every_microbatch: reduce (and, for sharded parameters, gather) once per
                microbatch instead of once per step, keeping parameters and the accumulator
                sharded. Here, where the reduction follows the scan, it changes nothing.
        """
        del sync_every_microbatch
        return accumulate_locally(grad_fn, k, dp=self.data_parallel_size)

    # -- state in and out ------------------------------------------------------------------

    def to_canonical(self, tree: Any) -> Any:
        """The state as every strategy sees it (no per-replica axis). Identity for SPMD."""
        return tree

    def from_canonical(self, tree: Any, shardings: Any) -> Any:
        """Places canonical arrays into this strategy's layout."""
        return jax.device_put(tree, shardings)
