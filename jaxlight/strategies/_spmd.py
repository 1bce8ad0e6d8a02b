"""One SPMD implementation (`jax.jit` + `NamedSharding`) under different logical-axis rules.

SingleDevice, DataParallel, FSDP, TensorParallel and Hybrid differ only in their mesh and their
rules table, as in MaxText and Levanter. A rule maps a logical axis name (from
`nnx.with_partitioning`) to a mesh axis, a tuple of mesh axes, or None (replicated).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxlight._errors import ConfigurationError, ShardingError
from jaxlight.strategies._base import Strategy, check_mesh_size

Rules = Sequence[tuple[str, Any]]

#: Mesh axes, outermost first: data-parallel axes outside so that their collectives cross the
#: slowest links, tensor parallelism innermost (fastest links).
MESH_AXES = ("data", "pipe", "fsdp", "tp")

#: Mesh axes that split the batch.
BATCH_AXES = ("data", "fsdp")


def is_axes(x) -> bool:
    """True for a tuple of logical axis names (str or None), the leaves of a logical tree."""
    return type(x) is tuple and all(n is None or isinstance(n, str) for n in x)


def _axes_tuple(target) -> tuple[str, ...]:
    if target is None:
        return ()
    if isinstance(target, str):
        return (target,)
    return tuple(target)


class SpmdStrategy(Strategy):
    """The shared SPMD machinery. Use the concrete strategies (DataParallel, FSDP, ...).

    Args:
        mesh_shape: mesh axis name to size; one size may be -1.
        rules: logical axis name to mesh axes; the first matching rule wins.
        shard_unannotated: a mesh axis (or tuple) over which a parameter with no annotation
            shards its largest divisible dimension (FSDP), or None to replicate it.
        min_shard_size: parameters with fewer elements stay replicated (biases, norms).
    """

    name = "spmd"

    def __init__(
        self,
        mesh_shape: dict[str, int],
        rules: Rules = (),
        *,
        shard_unannotated: Any = None,
        min_shard_size: int = 2**12,
        devices: Sequence[jax.Device] | None = None,
    ):
        super().__init__()
        unknown = [a for a in mesh_shape if a not in MESH_AXES]
        if unknown:
            from jaxlight._errors import suggest

            raise ConfigurationError(
                f"{type(self).__name__}: unknown mesh axis {unknown[0]!r} in {dict(mesh_shape)}; "
                f"valid axes are {list(MESH_AXES)}.{suggest(unknown[0], MESH_AXES)}"
            )
        self.mesh_shape = dict(mesh_shape)
        self.rules = tuple((str(k), v) for k, v in rules)
        #: Rules the user passed (checked for logical axes no parameter uses).
        self.user_rules: tuple[tuple[str, Any], ...] = ()
        self.shard_unannotated = shard_unannotated
        self.min_shard_size = min_shard_size
        self._devices = devices

    # -- set-up ----------------------------------------------------------------------------

    def setup(self, devices: Sequence[jax.Device] | None = None) -> None:
        devices = list(devices if devices is not None else (self._devices or jax.devices()))
        shape = check_mesh_size(self.mesh_shape, len(devices), type(self).__name__)
        names = [a for a in MESH_AXES if a in shape]
        sizes = [shape[a] for a in names]
        device_grid = np.asarray(devices, dtype=object).reshape(sizes)
        self.mesh = Mesh(device_grid, tuple(names), axis_types=(AxisType.Auto,) * len(names))

    def axis_size(self, axes) -> int:
        assert self.mesh is not None
        return math.prod(self.mesh.shape.get(a, 1) for a in _axes_tuple(axes))

    @property
    def batch_axes(self) -> tuple[str, ...]:
        assert self.mesh is not None, "call setup() first"
        return tuple(a for a in BATCH_AXES if self.mesh.shape.get(a, 1) > 1)

    @property
    def data_parallel_size(self) -> int:
        return self.axis_size(self.batch_axes)

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        out["rules"] = [list(r) if not isinstance(r[1], tuple) else [r[0], list(r[1])]
                        for r in self.rules]
        return out

    # -- layout ----------------------------------------------------------------------------

    def spec_for(self, path: str, shape: tuple[int, ...], logical: tuple | None) -> PartitionSpec:
        """The PartitionSpec of one array from its logical axes; checks divisibility."""
        assert self.mesh is not None
        used: set[str] = set()
        spec: list[Any] = []
        logical = tuple(logical) if logical else (None,) * len(shape)
        if len(logical) != len(shape):
            raise ShardingError(
                f"parameter {path} has shape {shape} but {len(logical)} logical axes {logical}; "
                "give one name (or None) per dimension in nnx.with_partitioning."
            )
        for dim, name in zip(shape, logical, strict=True):
            axes: tuple[str, ...] = ()
            if name is not None:
                for rule_name, target in self.rules:
                    if rule_name == name:
                        axes = _axes_tuple(target)
                        break
            axes = tuple(a for a in axes if self.mesh.shape.get(a, 1) > 1 and a not in used)
            if axes:
                size = self.axis_size(axes)
                if dim % size:
                    raise ShardingError(
                        f"parameter {path}: dimension of size {dim} (logical axis {name!r}) is not "
                        f"divisible by mesh axes {axes} of total size {size}. Change the model "
                        f"dimension to a multiple of {size}, or map {name!r} to another axis with "
                        f"rules=[({name!r}, None), ...]."
                    )
                used.update(axes)
            spec.append(axes[0] if len(axes) == 1 else (axes or None))
        if not used and self.shard_unannotated is not None and not any(logical):
            spec = self._fallback_spec(shape)
        return PartitionSpec(*spec)

    def _fallback_spec(self, shape: tuple[int, ...]) -> list[Any]:
        axes = tuple(a for a in _axes_tuple(self.shard_unannotated)
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

    def state_shardings(self, abstract_state: Any, logical_axes: Any) -> Any:
        assert self.mesh is not None

        def one(path, leaf, logical):
            spec = self.spec_for(jax.tree_util.keystr(path), tuple(leaf.shape), logical)
            return NamedSharding(self.mesh, spec)

        return jax.tree_util.tree_map_with_path(
            one, abstract_state, logical_axes, is_leaf=lambda x: x is None
        )

    def batch_shardings(self, abstract_batch: Any) -> Any:
        assert self.mesh is not None
        axes = self.batch_axes
        lead = axes[0] if len(axes) == 1 else (axes or None)
        return jax.tree.map(
            lambda x: NamedSharding(self.mesh, PartitionSpec(lead, *([None] * (np.ndim(x) - 1)))),
            abstract_batch,
        )

    def warn_unused_rules(self, logical_axes: Any) -> None:
        """Warns about rules naming logical axes that no parameter uses (often a typo)."""
        names = {n for t in jax.tree.leaves(logical_axes, is_leaf=is_axes)
                 if is_axes(t) for n in t if n is not None}
        for rule_name, target in self.user_rules:
            if rule_name not in names:
                warnings.warn(
                    f"{type(self).__name__}: rule ({rule_name!r} -> {target!r}) names a logical "
                    f"axis no parameter uses; the model's logical axes are {sorted(names)}.",
                    stacklevel=3,
                )

    # -- compiling -------------------------------------------------------------------------

    def trace_context(self):
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

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
        with self.trace_context():
            return jitted.lower(*abstract_args).compile()


class SingleDevice(SpmdStrategy):
    """One device, plain `jax.jit`: no collectives.

    Args:
        device: the device to use (default: the first local device).
    """

    name = "single"

    def __init__(self, device: jax.Device | None = None):
        super().__init__({}, ())
        self.device = device

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
