"""One SPMD implementation (`jax.jit` + `NamedSharding`) under different logical-axis rules.

SingleDevice, DataParallel, FSDP, TensorParallel and Hybrid differ only in their mesh and their
rules table, as in MaxText and Levanter. A rule maps a logical axis name (from
`nnx.with_partitioning`) to a mesh axis, a tuple of mesh axes, or None (replicated); a path rule
gives the parameters whose paths it matches their logical axes (`_paths.place`).

This module owns the shared machinery (`SpmdStrategy`: the mesh, the batch's layout, the
state's shardings, compiling), the strategies with no rules of their own (`SingleDevice`,
`DataParallel`) and the user rules put in front of `DEFAULT_RULES` (`with_default_rules`);
the sharded strategies (`FSDP`, `TensorParallel`, `Hybrid`) are in `_sharded.py`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxlight.sharding._layout import axes_of, partition_spec, spmd_context
from jaxlight.step._microbatch import (
    accumulate_locally,
    accumulate_per_replica,
    param_layout,
    traced_param_specs,
)
from jaxlight.strategies._base import Strategy
from jaxlight.strategies._paths import Placement, place, warn_unused
from jaxlight.strategies._rules import (
    COMPUTE_BATCH_AXES,
    DEFAULT_RULES,
    MESH_AXES,
    PathRule,
    check_path_rules,
    fill_mesh_shape,
    normalize_rules,
    parse_mesh_shape,
)

Rules = Sequence[tuple[str, Any]]

#: Mesh axes that split the batch, in the order batches are placed: `data` major, so that each
#: process feeds a contiguous share of the global batch (data spans processes).
BATCH_AXES = ("data", "fsdp", "expert")


class SpmdStrategy(Strategy):
    """The shared SPMD machinery. Use the concrete strategies (DataParallel, FSDP, ...).

    Args:
        mesh_shape: mesh axis name to size; one size may be -1.
        rules: logical axis name to mesh axes, and path rules; the first matching rule wins.
        shard_unannotated: a mesh axis (or tuple) over which a parameter with no annotation
            and no matching path rule shards its largest divisible dimension (FSDP), or None to
            replicate it.
        min_shard_size: parameters with fewer elements stay replicated (biases, norms).
        override_annotations: path rules win over parameters' own annotations.
    """

    name = "spmd"

    def __init__(
        self,
        mesh_shape: dict[str, int],
        rules: Rules = (),
        *,
        shard_unannotated: Any = None,
        min_shard_size: int = 2**12,
        override_annotations: bool = False,
        devices: Sequence[jax.Device] | None = None,
    ):
        super().__init__()
        self.mesh_shape = parse_mesh_shape(mesh_shape, type(self).__name__) if mesh_shape else {}
        self.rules = tuple(r if isinstance(r, PathRule) else (str(r[0]), r[1]) for r in rules)
        #: Rules the user passed (checked for rules that place nothing).
        self.user_rules: tuple[tuple[Any, Any], ...] = ()
        self.override_annotations = bool(override_annotations)
        self.shard_unannotated = shard_unannotated
        self.min_shard_size = min_shard_size
        self._devices = devices

    # -- set-up ----------------------------------------------------------------------------

    def setup(self, devices: Sequence[jax.Device] | None = None) -> None:
        devices = list(devices if devices is not None else (self._devices or jax.devices()))
        shape = fill_mesh_shape(self.mesh_shape, len(devices), type(self).__name__)
        names = [a for a in MESH_AXES if a in shape]
        sizes = [shape[a] for a in names]
        device_grid = np.asarray(devices, dtype=object).reshape(sizes)
        self.mesh = Mesh(device_grid, tuple(names), axis_types=(AxisType.Auto,) * len(names))

    def axis_size(self, axes) -> int:
        mesh = self.require_mesh("axis_size()")
        return math.prod(mesh.shape.get(a, 1) for a in axes_of(axes))

    def _split(self, axes: tuple[str, ...], what: str) -> tuple[str, ...]:
        mesh = self.require_mesh(what)
        return tuple(a for a in axes if mesh.shape.get(a, 1) > 1)

    def _rows_over(self, axes: tuple[str, ...], tree: Any) -> Any:
        """Per leaf of `tree`, the sharding that splits its rows over `axes`."""
        lead = axes[0] if len(axes) == 1 else (axes or None)
        return jax.tree.map(lambda x: NamedSharding(
            self.mesh, PartitionSpec(lead, *([None] * (np.ndim(x) - 1)))), tree)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        return self._split(BATCH_AXES, "batch_axes")

    @property
    def compute_batch_axes(self) -> tuple[str, ...]:
        """`batch_axes` in the order the steps lay the batch out (`relayout_batch`)."""
        return self._split(COMPUTE_BATCH_AXES, "compute_batch_axes")

    @property
    def data_parallel_size(self) -> int:
        return self.axis_size(self.batch_axes)

    def relayout_batch(self, batch: Any) -> Any:
        """The batch split over (fsdp, data) instead of its placement's (data, fsdp), where both
        split it: one collective-permute of the batch per step (rows move between the devices
        whose two orders differ), against XLA's wrong gradients in the other order."""
        axes = self.compute_batch_axes
        if len(axes) < 2:
            return batch
        return jax.lax.with_sharding_constraint(batch, self._rows_over(axes, batch))

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        out["rules"] = [[r.pattern.pattern, list(r.axes)] if isinstance(r, PathRule)
                        else [r[0], list(r[1]) if isinstance(r[1], tuple) else r[1]]
                        for r in self.rules]
        if self.override_annotations:
            out["override_annotations"] = True
        return out

    # -- layout ----------------------------------------------------------------------------

    def spec_for(self, path: str, shape: tuple[int, ...], logical: tuple | None,
                 source: str = "") -> PartitionSpec:
        """The PartitionSpec of one array from its logical axes (`partition_spec`), or, for an
        array without any (no annotation, no path rule), the `shard_unannotated` fallback.

        `source` says what gave the logical axes (a path rule), for error messages.
        """
        mesh = self.require_mesh("spec_for()")
        spec = partition_spec(dict(mesh.shape), self.rules, shape, logical, path=path,
                              source=source if source.startswith("path rule") else "")
        if self.shard_unannotated is not None and logical is None:
            return PartitionSpec(*self._fallback_spec(shape))
        return spec

    def _fallback_spec(self, shape: tuple[int, ...]) -> list[Any]:
        axes = tuple(a for a in axes_of(self.shard_unannotated)
                     if self.mesh.shape.get(a, 1) > 1)
        spec: list[Any] = [None] * len(shape)
        if not axes or math.prod(shape) < self.min_shard_size:
            return spec
        size = self.axis_size(axes)
        candidates = [i for i, d in enumerate(shape) if d % size == 0]
        if candidates:
            best = max(candidates, key=lambda i: shape[i])
            spec[best] = axes[0] if len(axes) == 1 else axes
        return spec

    def place(self, abstract_state: Any, logical_axes: Any) -> Placement:
        """Per leaf of the train state, its logical axes and the rule or annotation behind them.

        Annotations first (unless `override_annotations`), then the first matching path rule;
        optimizer slots follow their parameters (`jaxlight.strategies._paths`).
        """
        return place(self.rules, abstract_state, logical_axes,
                     override_annotations=self.override_annotations,
                     user_rules=self.user_rules)

    def state_shardings(self, abstract_state: Any, logical_axes: Any) -> Any:
        mesh = self.require_mesh("state_shardings()")
        placement = self.place(abstract_state, logical_axes)
        warn_unused(type(self).__name__, self.user_rules, placement)
        return placement.treedef.unflatten([
            NamedSharding(mesh, self.spec_for(jax.tree_util.keystr(path),
                                              tuple(leaf.shape), logical, source))
            for path, leaf, logical, source in placement.leaves
        ])

    def batch_shardings(self, abstract_batch: Any) -> Any:
        self.require_mesh("batch_shardings()")
        return self._rows_over(self.batch_axes, abstract_batch)

    # -- compiling -------------------------------------------------------------------------

    def trace_context(self):
        if self.mesh is None:
            return contextlib.nullcontext()
        # The rules also reach jaxlight.nn.constrain (activation sharding constraints).
        return spmd_context(self.mesh, self.rules)

    def accumulate_gradients(self, grad_fn: Callable, k: int, *,
                             sync_every_microbatch: bool = False) -> Callable:
        """Microbatched `grad_fn` whose gradient collective runs once per step, not per microbatch.

        The scan runs per data-parallel replica inside `jax.shard_map` (manual over the batch
        axes, automatic over `tp`) and one fp32 psum follows it (`jaxlight.step._microbatch`).
        Without batch axes (one device, pure tensor parallelism) it is a plain scan. With
        `sync_every_microbatch` it is a plain scan over the global batch: XLA gathers and
        reduces per microbatch and parameters and accumulator stay sharded (FSDP's memory).
        """
        if not self.batch_axes or sync_every_microbatch:
            return accumulate_locally(grad_fn, k, dp=self.data_parallel_size,
                                      rows_per_replica=False)
        mesh, axes, rules = self.mesh, self.compute_batch_axes, self.rules

        def microbatched(params, rest, batch):
            # The parameters' layout is that of the step being compiled (`compile` makes it
            # known while tracing); without one (abstract tracing) parameters enter whole.
            return accumulate_per_replica(grad_fn, k, mesh, axes, rules=rules,
                                          param_specs=traced_param_specs())(params, rest, batch)

        return microbatched

    def step_input(self, batch: Any, shardings: Any) -> Any:
        """The host batch itself when it is all NumPy arrays in one process: the compiled
        step's call places them by its input shardings in C++ (the same bytes, ~0.3 ms less
        host time per step than `jax.device_put` first, benchmarks/overhead.py)."""
        if jax.process_count() == 1 and all(
                isinstance(x, np.ndarray) for x in jax.tree.leaves(batch)):
            return batch
        return self.put_batch(batch, shardings)

    #: Bytes per device the last `init_state` held at its peak (from its compiled calls'
    #: `memory_analysis()`: the outputs so far plus a call's temporaries); None before it ran,
    #: or where the backend reports nothing.
    init_peak_bytes: int | None = None

    def init_state(self, init_fn: Callable, abstract_state: Any, shardings: Any) -> Any:
        """Creates the state in two compiled calls when `init_fn` has two parts (a
        `StateInit` of `jaxlight.state`): the model's variables, then the optimizer state
        from the parameters. One call would hold the parameters' initialization temporaries
        beside the whole optimizer state (a 4 B-parameter MoE with AdamW: 47.5 GB of state plus
        25.8 GB of temporaries); two hold at most the state, as a hand-written loop that builds
        the model and then runs `jax.jit(tx.init)` does, and leave no hole among the state's
        buffers for the first step's temporaries to miss."""
        if not hasattr(init_fn, "init_optimizer"):
            return super().init_state(init_fn, abstract_state, shardings)
        with self.trace_context():
            make_model = jax.jit(init_fn.init_model,
                                 out_shardings=shardings.replace(opt_state=None)).lower().compile()
            make_opt = jax.jit(init_fn.init_optimizer, in_shardings=(shardings.params,),
                               out_shardings=shardings.opt_state
                               ).lower(abstract_state.params).compile()
        self.init_peak_bytes = _peak_bytes(make_model, make_opt)
        state = make_model()
        return state.replace(opt_state=make_opt(state.params))

    def compile(
        self,
        fn: Callable,
        abstract_args: tuple,
        in_shardings: tuple,
        out_shardings: Any,
        donate_argnums: tuple[int, ...] = (),
    ):
        jitted = jax.jit(
            fn,
            in_shardings=in_shardings,
            out_shardings=out_shardings,
            donate_argnums=donate_argnums,
        )
        with self.trace_context(), param_layout(in_shardings):
            return jitted.lower(*abstract_args).compile()


def _peak_bytes(*compiled: Any) -> int | None:
    """The most bytes per device held while `compiled` run one after the other, each call's
    outputs kept (arguments are earlier outputs), or None where the backend reports nothing."""
    peak = held = 0
    for c in compiled:
        try:
            m = c.memory_analysis()
        except Exception:  # noqa: BLE001 - some backends do not implement it
            return None
        if m is None:
            return None
        outputs = m.output_size_in_bytes - m.alias_size_in_bytes
        peak = max(peak, held + outputs + m.temp_size_in_bytes)
        held += outputs
    return peak


class SingleDevice(SpmdStrategy):
    """One device, plain `jax.jit`: no collectives.

    Args:
        device: the device to use (default: the first local device).
    """

    name = "single"

    def __init__(self, device: jax.Device | None = None):
        super().__init__({}, ())
        self.device = device

    @property
    def requested_devices(self) -> list[jax.Device] | None:
        return None if self.device is None else [self.device]

    def setup(self, devices=None) -> None:
        device = self.device or (list(devices)[0] if devices else jax.local_devices()[0])
        # A one-device mesh keeps SingleDevice on the same code path as every SPMD strategy.
        self.mesh = Mesh(np.asarray([device], dtype=object), ("data",),
                         axis_types=(AxisType.Auto,))


class DataParallel(SpmdStrategy):
    """SPMD data parallelism: the batch split over a `data` axis, parameters replicated.

    Sharded shapes: `In[B_data, D] · W[D, F] -> Out[B_data, F]`. Each step all-reduces the
    gradients, 2(N−1)/N · Ψ · β bytes per device for Ψ parameters of β bytes; optimizer state
    is replicated (12 bytes/param with fp32 Adam). Use it while the model and optimizer state
    fit on one device.

    Args:
        devices: the devices to use (default: all).
    """

    name = "dp"

    def __init__(self, devices: Sequence[jax.Device] | None = None):
        super().__init__({"data": -1}, (), devices=devices)


def with_default_rules(rules, who: str) -> tuple[tuple, tuple]:
    """(user rules, user rules in front of DEFAULT_RULES): the first matching rule wins."""
    user = normalize_rules(rules, who)
    check_path_rules(user + DEFAULT_RULES, who)
    return user, user + DEFAULT_RULES
