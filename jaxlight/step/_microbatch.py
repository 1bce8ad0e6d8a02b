"""Gradient accumulation: k microbatches scanned inside one compiled step, one optimizer update.

`callbacks.Microbatches` (each loader batch split into k microbatches) and
`callbacks.GradientAccumulation` (k loader batches per optimizer step, Lightning's
`accumulate_grad_batches`) ask the strategy for a microbatched gradient function
(`Strategy.accumulate_gradients`); the two layouts it can get live here.

For `GradientAccumulation` the loop stacks k loader batches into one `Accumulated` batch
(`stack_batches`): the rows interleaved so that microbatch i below is loader batch i, plus a
per-row weight that is 0 for the copies padding an epoch's last, short group (Lightning steps
the optimizer on the r < k batches left at an epoch's end, still dividing by k: the weights
keep that one compiled step exact).

- `accumulate_locally`: a plain `lax.scan` over the k microbatches of the batch that the step
  function sees. Right for one device and for per-replica steps (DDP's `pmap`), whose gradients
  the core reduces once, after the scan, with `Strategy.reduce_gradients`. Under SPMD `jit` it
  is the opt-in `sync_every_microbatch` layout: collectives per microbatch, state kept sharded.
- `accumulate_per_replica`: under SPMD `jit` the batch is one global array, and differentiating a
  scan body makes XLA all-reduce each microbatch's gradient inside the loop (k times the
  traffic). So the scan runs per data-parallel replica inside `jax.shard_map`, manual over the
  batch axes only (tensor-parallel axes stay automatic), and a single fp32 `psum` follows the loop.
  Parameters sharded over a batch axis (FSDP) are gathered once per step at the `shard_map`
  boundary, not once per microbatch, so every collective runs once per optimizer step; the price
  is one whole copy of the parameters and of the fp32 accumulator per device during the step
  (as PyTorch FSDP's `no_sync`).

Microbatch i holds the global rows whose index is i mod k. Each device's contiguous shard splits
that way without any data movement (rows are reshaped to (n/k, k) and the k axis is scanned), and
the microbatches are the same whatever the data-parallel degree, so a run on 8 devices sees the
same microbatches as a run on one.

Loss and metrics are averaged over microbatches (and replicas); with equal microbatch sizes this
is the full-batch mean, and so is the gradient. Non-gradient variables (`rest`: batch statistics,
RNG counters) are threaded through the microbatches in order; per replica, floating ones are then
averaged over replicas, so batch statistics are per-replica statistics as in DDP. Random draws
inside the per-replica scan are each replica's rows of the single-device draw
(`jaxlight.sharding._replica_rng`): dropout masks differ across replicas and microbatches exactly
as on one
device.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxlight.sharding._layout import activation_sharding, axes_of, require_divisible
from jaxlight.sharding._replica_rng import replica_draws

GradFn = Callable[[Any, Any, Any], tuple[tuple[jax.Array, tuple[dict, Any]], Any]]


def check_microbatches(batch: Any, k: int, dp: int, rows_per_replica: bool) -> None:
    """Refuses a batch whose global size is not a multiple of k × the data-parallel degree.

    Args:
        batch: the batch as the step sees it (traced or abstract).
        k: microbatches per step.
        dp: the data-parallel degree.
        rows_per_replica: True when `batch` is one replica's share (pmap), False when global.
    """
    need = k * dp
    require_divisible(
        batch, "batch", need,
        lambda: f"accumulate_grad_batches k={k} × data-parallel degree {dp} = {need}: each of "
                f"the {dp} data-parallel shards must split into {k} equal microbatches",
        advice=", or change k", scale=dp if rows_per_replica else 1,
        scalar_reason="gradient accumulation splits every batch leaf along its leading "
                      "(example) dimension")


# -- the parameters' layout of the step being compiled ------------------------------------------

_PARAM_SPECS: contextvars.ContextVar[Any] = contextvars.ContextVar("jaxlight_param_specs",
                                                                  default=None)


@contextlib.contextmanager
def param_layout(in_shardings: Any) -> Iterator[None]:
    """Makes the PartitionSpecs of a step's parameters known while it is traced and compiled.

    `in_shardings` are the step's input shardings; its first argument is the train state (a
    pytree with `params`), whose parameter specs `traced_param_specs` then returns.
    """
    state = in_shardings[0] if isinstance(in_shardings, tuple | list) and in_shardings else None
    specs = None
    if hasattr(state, "params"):
        specs = jax.tree.map(lambda s: s.spec, state.params,
                             is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    token = _PARAM_SPECS.set(specs)
    try:
        yield
    finally:
        _PARAM_SPECS.reset(token)


def traced_param_specs() -> Any:
    """The PartitionSpecs of the parameters of the step being compiled, or None."""
    return _PARAM_SPECS.get()


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Accumulated:
    """k loader batches as one step input: `batch` holds row j of loader batch i at row
    j·k + i (so microbatch i of `split_microbatches` is loader batch i, and each device's
    contiguous rows are its share of every loader batch); `weight[j·k + i]` is loader batch
    i's weight (1, or 0 for a padding copy)."""

    batch: Any
    weight: Any


def _rows(batch: Any) -> int:
    """The leading (example) dimension of a host batch."""
    return int(np.shape(jax.tree.leaves(batch)[0])[0])


def stack_rows(batches: Sequence[Any], k: int) -> Any:
    """Up to k host batches (NumPy pytrees of equal shapes) as one batch of k times the rows,
    padded to k with copies of the last one: row j of batch i at row j·k + i."""
    padded = list(batches) + [batches[-1]] * (k - len(batches))

    def interleave(*xs):
        stacked = np.stack([np.asarray(x) for x in xs], axis=1)  # (n, k, ...)
        return stacked.reshape(stacked.shape[0] * k, *stacked.shape[2:])

    return jax.tree.map(interleave, *padded)


def group_weight(real: int, k: int, rows: int) -> np.ndarray:
    """The per-row weights of `stack_rows` for `real` batches of `rows` rows: 1 for a real
    batch's rows, 0 for a padding copy's."""
    return np.tile((np.arange(k) < real).astype(np.float32), rows)


def stack_batches(batches: Sequence[Any], k: int) -> Accumulated:
    """`Accumulated` of up to k host batches (NumPy pytrees of equal shapes), padded to k with
    zero-weight copies of the last one."""
    rows = _rows(batches[0])
    return Accumulated(stack_rows(batches, k), group_weight(len(batches), k, rows))


class GroupTransfer:
    """Puts groups of k loader batches on the devices as `Accumulated` step inputs.

    The weights of a full group are all ones, the same every step: they are made (and put)
    once and reused (step inputs other than the state are not donated), so a step transfers
    only its stacked batch, as a hand-written loop does.

    Args:
        put: `(host tree, shardings) -> step input` (the strategy's `put_batch`, or its
            `step_input` in the loop's own thread).
    """

    def __init__(self, put: Callable[[Any, Any], Any]):
        self._put = put
        self._ones: dict = {}

    def __call__(self, batches: Sequence[Any], k: int, shardings: Accumulated) -> Accumulated:
        rows = _rows(batches[0])
        if len(batches) < k:  # an epoch's last, short group
            weight = self._put(group_weight(len(batches), k, rows), shardings.weight)
        else:
            key = (k, rows, shardings.weight)
            weight = self._ones.get(key)
            if weight is None:
                weight = self._ones[key] = self._put(group_weight(k, k, rows), shardings.weight)
        return Accumulated(self._put(stack_rows(batches, k), shardings.batch), weight)


def split_microbatches(batch: Any, k: int) -> Any:
    """(n, ...) -> (k, n/k, ...) where microbatch i holds rows i, i+k, i+2k, ... (no copy across
    devices: each device's rows stay on it)."""

    def one(x):
        n = x.shape[0]
        return jnp.swapaxes(x.reshape(n // k, k, *x.shape[1:]), 0, 1)

    return jax.tree.map(one, batch)


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def widened(x):
    """A float at least float32 wide, for sums over microbatches: bf16 and fp16 are added in
    float32, float32 and float64 in their own precision (a float64 model's gradients summed in
    float32 had moved 3.5e-6 from one device's after 10 AdamW steps)."""
    if not _is_float(x):
        return x
    return x.astype(jnp.promote_types(jnp.result_type(x), jnp.float32))


def scan_microbatches(grad_fn: GradFn, params, rest, batch, k: int):
    """Runs `grad_fn` on k microbatches in a `lax.scan`, summing gradients at least in fp32.

    Returns `(loss_mean, metrics_mean, rest, grad_sum)`; `grad_sum` is at least fp32 wide
    (`widened`) and not yet divided.
    """
    micro = split_microbatches(batch, k)
    acc0 = jax.tree.map(lambda p: widened(jnp.zeros(jnp.shape(p), jnp.result_type(p))), params)
    weighted = isinstance(batch, Accumulated)

    def body(carry, microbatch):
        acc, rest = carry
        if not weighted:
            (loss, (metrics, rest)), grads = grad_fn(params, rest, microbatch)
            acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, grads)
            return (acc, rest), (loss.astype(jnp.float32), metrics, jnp.float32(1))
        # A padding copy (weight 0) adds nothing and leaves `rest` (batch statistics, RNG
        # counters) as the real batches left it.
        w = microbatch.weight[0]
        (loss, (metrics, new_rest)), grads = grad_fn(params, rest, microbatch.batch)
        acc = jax.tree.map(lambda a, g: a + (w * g).astype(a.dtype), acc, grads)
        rest = jax.tree.map(lambda new, old: jnp.where(w > 0, new, old), new_rest, rest)
        return (acc, rest), (loss.astype(jnp.float32), metrics, w)

    (grad_sum, rest), (losses, metrics, w) = jax.lax.scan(body, (acc0, rest), micro)
    # Loss and metrics: the mean over the real microbatches.
    total = jnp.sum(w)
    metrics = jax.tree.map(lambda m: jnp.sum(w * m.astype(jnp.float32)) / total, metrics)
    return jnp.sum(w * losses) / total, metrics, rest, grad_sum


def _finish(grad_sum, params, denominator: int):
    """Mean gradient, in each parameter's own dtype (so the optimizer state keeps its dtypes)."""
    return jax.tree.map(lambda g, p: (g / denominator).astype(jnp.result_type(p)), grad_sum, params)


def accumulate_locally(grad_fn: GradFn, k: int, dp: int = 1,
                       rows_per_replica: bool = True) -> GradFn:
    """A microbatched `grad_fn` as a plain scan over the batch that the step function sees.

    For one replica's batch (DDP, one device). Under SPMD `jit` on a global batch
    (`rows_per_replica=False`) XLA reduces every microbatch's gradients inside the loop: k
    times the traffic, but parameters and the accumulator stay sharded (FSDP's memory).

    Args:
        grad_fn: `(params, rest, batch) -> ((loss, (metrics, rest)), grads)`.
        k: microbatches per step.
        dp: the data-parallel degree, used only to check and describe the global batch size.
        rows_per_replica: whether the batch seen is one replica's share (pmap) or global.
    """

    def microbatched(params, rest, batch):
        check_microbatches(batch, k, dp, rows_per_replica=rows_per_replica)
        loss, metrics, rest, grad_sum = scan_microbatches(grad_fn, params, rest, batch, k)
        return (loss, (metrics, rest)), _finish(grad_sum, params, k)

    return microbatched


def _without_axes(rules: Sequence, axes: Sequence[str]) -> tuple:
    """The rules with `axes` removed from every target (they are manual inside shard_map)."""
    return tuple((name, tuple(a for a in axes_of(target) if a not in axes) or None)
                 for name, target in rules)


def _manual_dim(spec: Any, axes: Sequence[str]) -> tuple[int, tuple[str, ...]] | None:
    """The one dimension of a parameter spec sharded over manual (batch) axes only, if any."""
    if spec is None:
        return None
    found = None
    for dim, entry in enumerate(tuple(spec)):
        names = axes_of(entry)
        manual = tuple(n for n in names if n in axes)
        if not manual:
            continue
        if len(manual) != len(names) or found is not None:
            return None  # mixed manual/automatic sharding: left to GSPMD at the boundary
        found = (dim, manual)
    return found


def accumulate_per_replica(
    grad_fn: GradFn, k: int, mesh: jax.sharding.Mesh, batch_axes: Sequence[str],
    rules: Sequence = (), param_specs: Any = None,
) -> GradFn:
    """A microbatched `grad_fn` for SPMD `jit` whose gradient collective runs once per step.

    Args:
        grad_fn: `(params, rest, batch) -> ((loss, (metrics, rest)), grads)` on global arrays.
        k: microbatches per step.
        mesh: the strategy's mesh.
        batch_axes: the mesh axes the batch's leading dimension is split over (in that order).
        rules: the strategy's logical-axis rules; activation constraints inside the body
            (`jaxlight.nn.constrain`) keep the automatic axes (`tp`) and drop the manual ones.
        param_specs: PartitionSpecs of the parameters (a pytree like them), or None. A
            parameter sharded over batch axes (FSDP) then enters as its shard, is all-gathered
            once inside, and its gradient leaves through one reduce-scatter (`psum_scatter`)
            into the same shard layout: (N−1)/N·Ψβ each way, the least FSDP can move.
    """
    axes = tuple(batch_axes)
    dp = int(np.prod([mesh.shape[a] for a in axes]))
    lead = axes[0] if len(axes) == 1 else axes
    inner_rules = _without_axes(rules, axes)

    treedef = None
    manual_dims = None
    if param_specs is not None:
        treedef = jax.tree.structure(param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        manual_dims = [_manual_dim(sp, axes) for sp in
                       jax.tree.leaves(param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))]

    def param_in_specs():
        if manual_dims is None:
            return PartitionSpec()
        specs = []
        for md in manual_dims:
            if md is None:
                specs.append(PartitionSpec())
            else:
                dim, names = md
                entries = [None] * (dim + 1)
                entries[dim] = names[0] if len(names) == 1 else names
                specs.append(PartitionSpec(*entries))
        return jax.tree.unflatten(treedef, specs)

    def gather(params):
        if manual_dims is None:
            return params
        leaves = jax.tree.leaves(params)
        out = [x if md is None else jax.lax.all_gather(x, md[1], axis=md[0], tiled=True)
               for x, md in zip(leaves, manual_dims, strict=True)]
        return jax.tree.unflatten(jax.tree.structure(params), out)

    def reduce(grad_sum):
        if manual_dims is None:
            return jax.lax.psum(grad_sum, axes)
        leaves = jax.tree.leaves(grad_sum)
        out = []
        for g, md in zip(leaves, manual_dims, strict=True):
            if md is None:
                out.append(jax.lax.psum(g, axes))
                continue
            dim, names = md
            g = jax.lax.psum_scatter(g, names, scatter_dimension=dim, tiled=True)
            others = tuple(a for a in axes if a not in names)
            out.append(jax.lax.psum(g, others) if others else g)
        return jax.tree.unflatten(jax.tree.structure(grad_sum), out)

    # Each replica draws its own rows of the single-device run's random draws (dropout).
    drawn = replica_draws(grad_fn, axes)

    def per_replica(params, rest, batch):
        shards = params
        params = gather(params)  # FSDP: the one all-gather of the step, before the loop
        with activation_sharding(mesh, inner_rules):
            loss, metrics, rest, grad_sum = scan_microbatches(drawn, params, rest, batch, k)
        # The one gradient collective of the step, in fp32, after the loop.
        grad_sum = reduce(grad_sum)
        params = shards
        loss, metrics = jax.lax.pmean((loss, metrics), axes)
        rest = jax.tree.map(lambda r: jax.lax.pmean(r, axes) if _is_float(r) else r, rest)
        return (loss, (metrics, rest)), _finish(grad_sum, params, k * dp)

    def microbatched(params, rest, batch):
        check_microbatches(batch, k, dp, rows_per_replica=False)
        batch_specs = jax.tree.map(
            lambda x: PartitionSpec(lead, *([None] * (np.ndim(x) - 1))), batch
        )
        # check_vma=False: with replication checking on, differentiating replicated parameters
        # inside the body would insert a psum into the loop, which is exactly what this avoids.
        # Outputs are made replicated explicitly above (psum/pmean; non-float `rest` leaves such
        # as RNG counters advance identically on every replica).
        p_specs = param_in_specs()
        return jax.shard_map(
            per_replica,
            mesh=mesh,
            in_specs=(p_specs, PartitionSpec(), batch_specs),
            out_specs=(PartitionSpec(), p_specs),
            axis_names=frozenset(axes),
            check_vma=False,
        )(params, rest, batch)

    return microbatched
