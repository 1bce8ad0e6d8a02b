"""Stages: a pipeline of modules of any shape (784→512, 512→256, 256→10), one or more per device.

`Stacked` pipelines identical blocks; `Stages` pipelines a list of different modules whose
inputs and outputs differ in shape and dtype (the seeds' MLP split into three stages; an
embedding stage, a few blocks and a head). Under every strategy without a `pipe` axis it runs
the modules one after another; under `GPipe` / `Hybrid` with a `pipe` axis of size p it runs the
GPipe schedule, device d running stages [d·k, (d+1)·k) (k = len(stages)/p).

**Parameter layout.** SPMD arrays shard evenly, so the stages' parameters (different shapes)
cannot be one stacked array as in `Stacked`. `Stages` packs them: per dtype, one parameter
`packed_<dtype>` of shape `(S, n)`, row s holding stage s's parameters flattened and
concatenated, zero-padded to n = the largest stage's size rounded up to a multiple of 128. Its
logical axes `("layers", "embed")` put row s on pipeline device s·p/S under GPipe (and the flat
axis over `fsdp` where there is one), so a device holds its stages' parameters and optimizer
slots and nothing of the others', padded to the largest stage: per device
`(S/p)·n·β` bytes instead of its stages' own. The padding is never read; its gradient is zero,
so it stays zero under optimizers whose update of a zero gradient is zero (SGD, Adam(W), ...).
The packed state is the same pytree under every strategy, so checkpoints move between GPipe,
SingleDevice, FSDP... unchanged. `stage(i)` rebuilds stage i as an ordinary `nnx.Module`.
`balance=True` packs the stages back to back instead (no padding between them; the vector
padded to a multiple of 128·S and viewed as S equal rows): each device holds total/p, and the
step slices each stage's parameters out of it and moves them to the stage's device (and the
gradients back) once per step, before and after the schedule. SPMD arrays split evenly, so
neither layout gives a device exactly its own stages' bytes. `packed=False` keeps each stage's
parameters as its own arrays (`stage_modules/<s>/...`): under `GPipe(mpmd=True)`, which runs a
program per device (`jaxlight.strategies._mpmd_runtime`), each device then holds exactly its
stages' parameters and optimizer state; SPMD GPipe stacks them into rows inside the step.

**Activations between stages.** The schedule passes one buffer of `(b, W)` elements between
neighbours (`ppermute` needs one shape on every device): each device's output is flattened per
example, cast to the widest dtype of the boundaries and zero-padded to W = the widest
boundary (including the final output). A boundary of width w thus costs b·(W − w)·β bytes of
padding per transfer; per step and device the permutes send 2(m + p − 1)·b·W·β bytes. (One
buffer per boundary would send exact bytes but needs p − 1 collectives per iteration.)

**Which code runs where.** All devices run one program; each selects its stages with a
`lax.switch` on its pipeline index, so a device executes only its own stages' code. The backward
pass of a switch keeps the residuals of every branch (zeros for branches not taken), so stored
activations per iteration are the sum over the branches' residuals; `remat=True` stores only
each stage's input, and the strategy's `GPipe(..., remat=True)` only each device's input.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec

from jaxlight._errors import ConfigurationError
from jaxlight.nn._mpmd import STAGE_MODULES, active_mpmd, run_mpmd
from jaxlight.nn._pipeline import (
    PipelineConfig,
    _vary,
    active_pipeline,
    psum_wide,
    split_batch,
)
from jaxlight.nn._scan import LAYERS, remat_policy
from jaxlight.sharding._layout import activation_sharding

#: Rows of the packed parameters are padded to a multiple of this (FSDP splits the flat axis).
PAD = 128


def _round_up(n: int, to: int) -> int:
    return max(to, -(-n // to) * to)


class Stages(nnx.Module):
    """A sequence of modules of any shape, run in order; the pipeline stages under GPipe.

    Args:
        stages: the modules, applied in order (`stage(x) -> y`, any shapes and dtypes). Each
            holds only `nnx.Param` variables (batch statistics and RNG streams are refused);
            wrap a plain function in `nnx.Sequential(fn)`. Under a `pipe` axis of size p,
            `len(stages)` must be a multiple of p: device d runs stages [d·k, (d+1)·k).
        remat: what each stage recomputes in the backward pass (as `Stacked`'s `remat`):
            `False`, `True`/"full", "dots" or a `jax.checkpoint_policies` policy.
        balance: store the stages' parameters back to back in one vector (viewed as `(S, n)`
            rows of equal length) instead of one zero-padded row per stage, so that each
            pipeline device holds total/p of the parameters and optimizer slots instead of
            the largest stage's; each step then moves every stage's parameters to its device
            and the gradients back (collectives XLA chooses; see docs/strategies.md for
            the measured cost).
        packed: False keeps every stage's parameters as the stage module's own arrays (under
            `stage_modules`), for `GPipe(mpmd=True)`: each pipeline device then holds its
            stages' parameters and optimizer state exactly, with no padding.

    Example:
        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> rngs = nnx.Rngs(0)
        >>> mlp = Stages([nnx.Sequential(nnx.Linear(784, 512, rngs=rngs), nnx.relu),
        ...               nnx.Sequential(nnx.Linear(512, 256, rngs=rngs), nnx.relu),
        ...               nnx.Linear(256, 10, rngs=rngs)])
        >>> mlp(jnp.ones((2, 784))).shape, mlp.packed_float32.shape
        ((2, 10), (3, 401920))
        >>> mlp.stage(2).kernel.shape
        (256, 10)
    """

    def __init__(self, stages: Sequence[nnx.Module], *, remat: bool | str | Callable = False,
                 balance: bool = False, packed: bool = True):
        stages = list(stages)
        if not stages:
            raise ConfigurationError("Stages needs at least one stage module, got none.")
        if balance and not packed:
            raise ConfigurationError(
                "Stages(balance=True, packed=False): balance packs the stages back to back, "
                "packed=False keeps each stage's own arrays; pick one.")
        remat_policy(remat)
        self.remat = remat
        self.num_stages = len(stages)
        specs, stage_leaves, groups = [], [], {}  # groups: dtype name -> size per stage
        for i, stage in enumerate(stages):
            if not isinstance(stage, nnx.Module):
                raise ConfigurationError(
                    f"Stages: stage {i} ({stage!r}) is not an nnx.Module; wrap a plain "
                    "function in nnx.Sequential(fn).")
            graphdef, state = nnx.split(stage)
            variables = jax.tree_util.tree_leaves_with_path(
                state, is_leaf=lambda v: isinstance(v, nnx.Variable))
            others = [f"{jax.tree_util.keystr(p)} ({type(v).__name__})" for p, v in variables
                      if not isinstance(v, nnx.Param)]
            if others:
                raise ConfigurationError(
                    f"Stages: stage {i} holds variables that are not parameters: "
                    f"{', '.join(others)}. Stages packs only nnx.Param (a pipeline stage's "
                    "other state would not be kept); make the stage deterministic, without "
                    "batch statistics or RNG streams.")
            leaves, treedef = jax.tree.flatten(state)
            layout, offsets = [], {}
            for leaf in leaves:
                dtype = jnp.dtype(leaf.dtype).name
                size = math.prod(leaf.shape)
                start = offsets.get(dtype, 0)
                layout.append((dtype, start, tuple(leaf.shape)))
                offsets[dtype] = start + size
            specs.append((graphdef, treedef, tuple(layout)))
            stage_leaves.append(leaves)
            for dtype, size in offsets.items():
                groups.setdefault(dtype, [0] * len(stages))[i] = size
        #: Per stage: (graphdef, treedef, ((dtype, offset, shape) per leaf)); static.
        self._specs = tuple(specs)
        self.dtypes = tuple(sorted(groups))
        #: Per dtype (in `dtypes` order): each stage's own element count.
        self.stage_sizes = tuple(tuple(groups[d]) for d in self.dtypes)
        #: True: every stage's parameters back to back in one flat vector, viewed as
        #: (S, n) rows of equal length (each device holds total/p, whatever its stages own).
        self.balance = bool(balance)
        #: False: the stage modules keep their own arrays (`stage_modules`), no packing.
        self.packed = bool(packed)
        if not packed:
            setattr(self, STAGE_MODULES, nnx.List(stages))
        for dtype in (self.dtypes if packed else ()):
            width = _round_up(max(groups[dtype]), PAD)
            rows = []
            for (_, _, layout), leaves in zip(specs, stage_leaves, strict=True):
                flat = [jnp.ravel(leaf) for leaf, (d, _, _) in zip(leaves, layout, strict=True)
                        if d == dtype]
                row = jnp.concatenate(flat) if flat else jnp.zeros((0,), dtype)
                rows.append(row if balance else jnp.pad(row, (0, width - row.shape[0])))
            if balance:
                flat = jnp.concatenate(rows)
                total = _round_up(flat.shape[0], PAD * self.num_stages)
                packed = jnp.pad(flat, (0, total - flat.shape[0])).reshape(self.num_stages, -1)
            else:
                packed = jnp.stack(rows)
            setattr(self, f"packed_{dtype}", nnx.Param(
                packed, out_sharding=(LAYERS, "embed"), eager_sharding=False))

    # -- unpacking --------------------------------------------------------------------------

    def _packed(self) -> dict[str, jax.Array]:
        """Per dtype, the (S, n) rows: row s holds stage s's parameters (zero-padded)."""
        if not self.packed:
            return self._rows_of_modules()
        out = {d: getattr(self, f"packed_{d}")[...] for d in self.dtypes}
        if not self.balance:
            return out
        rows = {}
        for d, sizes in zip(self.dtypes, self.stage_sizes, strict=True):
            flat, width = out[d].reshape(-1), _round_up(max(sizes), PAD)
            starts = np.cumsum([0, *sizes])
            rows[d] = jnp.stack([jnp.pad(flat[starts[s]:starts[s] + n], (0, width - n))
                                 for s, n in enumerate(sizes)])
        return rows

    def _rows_of_modules(self) -> dict[str, jax.Array]:
        """`packed=False`: the (S, n) rows built from the stage modules' own arrays."""
        rows: dict[str, list] = {d: [] for d in self.dtypes}
        for s, module in enumerate(getattr(self, STAGE_MODULES)):
            leaves = jax.tree.leaves(nnx.state(module))
            for d, sizes in zip(self.dtypes, self.stage_sizes, strict=True):
                flat = [jnp.ravel(v) for v, (dt, _, _) in zip(leaves, self._specs[s][2],
                                                              strict=True) if dt == d]
                row = jnp.concatenate(flat) if flat else jnp.zeros((0,), d)
                rows[d].append(jnp.pad(row, (0, _round_up(max(sizes), PAD) - row.shape[0])))
        return {d: jnp.stack(r) for d, r in rows.items()}

    def _apply(self, index: int, rows: dict[str, jax.Array], x: Any) -> Any:
        """Stage `index` applied to `x`, with its parameters read from the packed `rows`."""
        return self._merge(index, rows)(x)

    def _merge(self, index: int, rows: dict[str, jax.Array]) -> nnx.Module:
        graphdef, treedef, layout = self._specs[index]
        leaves = [lax.slice_in_dim(rows[d], start, start + math.prod(shape)).reshape(shape)
                  for d, start, shape in layout]
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))

    def _stage_fn(self, index: int) -> Callable:
        def fn(rows, x):
            return self._apply(index, rows, x)

        rematerialize, policy = remat_policy(self.remat)
        return jax.checkpoint(fn, policy=policy) if rematerialize else fn

    def stage(self, index: int) -> nnx.Module:
        """Stage `index` as an ordinary module holding its (current) parameters.

        Example:
            >>> from flax import nnx
            >>> Stages([nnx.Linear(3, 2, rngs=nnx.Rngs(0))]).stage(0).kernel.shape
            (3, 2)
        """
        if not -self.num_stages <= index < self.num_stages:
            raise IndexError(f"Stages has {self.num_stages} stages; index {index} is out of "
                             "range.")
        index %= self.num_stages
        if not self.packed:
            return getattr(self, STAGE_MODULES)[index]
        return self._merge(index, {d: v[index] for d, v in self._packed().items()})

    def own_parameter_bytes(self) -> list[int]:
        """Each stage's own parameter bytes (without the packing's padding)."""
        return [sum(sizes[s] * jnp.dtype(d).itemsize
                    for d, sizes in zip(self.dtypes, self.stage_sizes, strict=True))
                for s in range(self.num_stages)]

    # -- running ----------------------------------------------------------------------------

    def __call__(self, x: Any) -> Any:
        """Applies the stages in order (the GPipe schedule under a pipelined strategy)."""
        mpmd = active_mpmd()
        if mpmd is not None:
            if self.packed:
                raise ConfigurationError(
                    "GPipe(mpmd=True) places each stage's own parameters on its device, but "
                    "this Stages packs them into rows (the SPMD layout). Build it with "
                    "jaxlight.nn.Stages(..., packed=False).")
            return run_mpmd(list(getattr(self, STAGE_MODULES)), self.remat, mpmd, x)
        pipeline = active_pipeline()
        if not self.packed and pipeline is None:
            return self._run_modules(x)
        packed = self._packed()
        if pipeline is not None:
            return run_stages(self, pipeline, packed, x)
        for s in range(self.num_stages):
            x = self._stage_fn(s)({d: v[s] for d, v in packed.items()}, x)
        return x

    def _run_modules(self, x: Any) -> Any:
        rematerialize, policy = remat_policy(self.remat)
        for module in getattr(self, STAGE_MODULES):
            graphdef, params = nnx.split(module)
            # Eagerly, after GPipe(mpmd=True) trained it, each stage's arrays live on its own
            # device: bring the activation to them.
            device = _device_of(params)
            if device is not None and not any(isinstance(v, jax.core.Tracer)
                                              for v in jax.tree.leaves(x)):
                x = jax.device_put(x, device)

            def fn(params, x, graphdef=graphdef):
                return nnx.merge(graphdef, params)(x)

            x = (jax.checkpoint(fn, policy=policy) if rematerialize else fn)(params, x)
        return x


def _device_of(params: Any) -> jax.Device | None:
    """The one device a stage's (concrete) parameters are committed to, else None."""
    leaves = jax.tree.leaves(params)
    leaf = leaves[0] if leaves else None
    if (isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer)
            and leaf.committed and len(leaf.sharding.device_set) == 1):
        return next(iter(leaf.sharding.device_set))
    return None


# -- the schedule ----------------------------------------------------------------------------


def _common_dtype(avals: list) -> Any:
    dtypes = {jnp.dtype(a.dtype) for a in avals}
    if len(dtypes) > 1 and not all(jnp.issubdtype(d, jnp.inexact) for d in dtypes):
        raise ConfigurationError(
            f"Stages: the pipeline passes every stage's output in one buffer, but the outputs "
            f"have dtypes {sorted(d.name for d in dtypes)}, which include integers and do not "
            "share one type without loss. Make the stages' outputs floating point.")
    return jnp.result_type(*dtypes)


def _pack(tree: Any, dtype, width: int) -> jax.Array:
    leaves = [leaf.reshape(leaf.shape[0], -1).astype(dtype) for leaf in jax.tree.leaves(tree)]
    flat = jnp.concatenate(leaves, axis=1)
    return jnp.pad(flat, ((0, 0), (0, width - flat.shape[1])))


def _unpack(buffer: jax.Array, like: Any) -> Any:
    leaves, treedef = jax.tree.flatten(like)
    out, start = [], 0
    for leaf in leaves:
        size = math.prod(leaf.shape[1:])
        out.append(buffer[:, start:start + size].reshape(leaf.shape).astype(leaf.dtype))
        start += size
    return jax.tree.unflatten(treedef, out)


def run_stages(stages: Stages, config: PipelineConfig, packed: dict[str, jax.Array],
               x: Any) -> Any:
    """Runs `stages` as the GPipe schedule of `config` (called by `Stages.__call__`)."""
    config.calls += 1
    p, mesh, axis = config.stages, config.mesh, config.axis
    n_stages = stages.num_stages
    if config.repeats > 1:
        raise ConfigurationError(
            f"Stages runs the GPipe schedule only (repeats=1), got repeats={config.repeats}: "
            "the interleaved schedule needs identical chunks of layers (a jaxlight.nn.Stacked "
            "block). Use repeats=1, or k = stages/pipe consecutive Stages per device.")
    if n_stages % p:
        divisors = [d for d in range(1, n_stages + 1) if n_stages % d == 0]
        raise ConfigurationError(
            f"Stages has {n_stages} stages, which do not split into {p} pipeline devices. Use "
            f"a pipe size dividing {n_stages} ({divisors}) or a multiple of {p} stages.")
    k = n_stages // p

    batch, m, b, data, manual, bspec, smap_mesh = split_batch(config, x, "Stages",
                                                               sequence=False)
    b_local = b // mesh.shape["data"] if data else b

    # The shapes each device receives and sends, per example-row of one local microbatch.
    row = {d: jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for d, v in packed.items()}
    fns = [stages._stage_fn(s) for s in range(n_stages)]
    shape = jax.tree.map(lambda v: jax.ShapeDtypeStruct((b_local, *v.shape[1:]), v.dtype), x)
    inputs, outputs = [], []
    for dev in range(p):
        inputs.append(shape)
        for s in range(dev * k, (dev + 1) * k):
            shape = jax.eval_shape(fns[s], row, shape)
        outputs.append(shape)
    boundary = [leaf for out in outputs for leaf in jax.tree.leaves(out)]
    dtype = _common_dtype(boundary)
    widths = [sum(math.prod(leaf.shape[1:]) for leaf in jax.tree.leaves(out))
              for out in outputs]
    width, out_width = max(widths), widths[-1]
    config.buffer_width = width  # read back by benchmarks/tests (the permuted bytes)

    def to_microbatches(v):
        return jnp.swapaxes(v.reshape(b, m, *v.shape[1:]), 0, 1)

    xs = jax.tree.map(to_microbatches, x)

    def branch(dev):
        def run(local_rows, x_t, buffer):
            h = x_t if dev == 0 else _unpack(buffer, inputs[dev])
            for j in range(k):
                h = fns[dev * k + j]({d: v[j] for d, v in local_rows.items()}, h)
            return _pack(h, dtype, width)
        return run

    branches = [branch(dev) for dev in range(p)]
    if config.remat:
        # GPipe(remat=True) / Hybrid(..., remat=True): each device's stages store only their
        # input per iteration (as the Stacked schedule does), whatever the stages' own remat.
        branches = [jax.checkpoint(fn, prevent_cse=False) for fn in branches]
    perm = [(i, (i + 1) % p) for i in range(p)]

    def schedule(local_rows, xs):
        index = lax.axis_index(axis)
        local_rows, xs = _vary((local_rows, xs), manual)

        def iteration(carry, t):
            buffer, outs = carry
            x_t = jax.tree.map(lambda v: v[jnp.minimum(t, m - 1)], xs)
            y = lax.switch(index, branches, local_rows, x_t, buffer)
            done = t - (p - 1)
            slot = jnp.maximum(done, 0)
            keep = (index == p - 1) & (done >= 0)
            outs = lax.dynamic_update_index_in_dim(
                outs, jnp.where(keep, y[:, :out_width], outs[slot]), slot, 0)
            return (lax.ppermute(y, axis, perm), outs), None

        buffer = _vary(jnp.zeros((b_local, width), dtype), manual)
        outs = _vary(jnp.zeros((m, b_local, out_width), dtype), manual)
        (_, outs), _ = lax.scan(iteration, (buffer, outs), jnp.arange(m + p - 1))
        # Only the last device holds the outputs: one all-reduce hands them to every device.
        return psum_wide(jnp.where(index == p - 1, outs, 0), axis)

    row_specs = {d: PartitionSpec(axis) for d in packed}
    with activation_sharding(None):
        out = jax.shard_map(
            schedule, mesh=smap_mesh, in_specs=(row_specs, bspec), out_specs=bspec,
            axis_names=set(manual),
        )(packed, xs)
    out = jnp.swapaxes(out, 0, 1).reshape(batch, out_width)
    final = jax.tree.map(lambda v: jax.ShapeDtypeStruct((batch, *v.shape[1:]), v.dtype),
                         outputs[-1])
    return _unpack(out, final)


def stage_bytes(stages: Stages, stages_per_device: int) -> dict[str, Any]:
    """Parameter bytes per pipeline device: its stages' own, and what the packing holds."""
    own = stages.own_parameter_bytes()
    held = sum(int(np.prod(getattr(stages, f"packed_{d}").shape[1:])) * jnp.dtype(d).itemsize
               for d in stages.dtypes) * stages_per_device
    k = stages_per_device
    return {"own": [sum(own[i:i + k]) for i in range(0, len(own), k)], "held": held}


__all__ = ["Stages", "run_stages", "stage_bytes"]
