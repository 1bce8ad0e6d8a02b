"""The GPipe schedule: a `Stacked` block run as a pipeline over the `pipe` mesh axis.

A pipelined strategy (`strategies.GPipe`, or `Hybrid` with a `pipe` axis) activates a
`PipelineConfig` while it traces a step; `Stacked.__call__` then runs `run_pipeline` instead of
its plain scan. The model's code does not change between strategies.

The schedule (Huang et al., 2019, as in the JAX shard_map guide) inside `jax.shard_map`, manual
over `pipe` (and `data`, see below), with p stages and m microbatches of b examples:

    stage s holds layers [s·L/p, (s+1)·L/p)          (the stacked axis sharded over pipe)
    for t in range(m + p − 1):                        (one lax.scan: a while loop in the HLO)
        x = microbatch t if s == 0 else buffer        (stage 0 feeds, the others receive)
        y = stage(x)                                  (a scan over the stage's L/p layers)
        if s == p − 1 and t ≥ p − 1: out[t − p + 1] = y
        buffer = ppermute(y, s -> s + 1 mod p)        (one b·s·h collective-permute)

Autodiff transposes the loop into the backward schedule: the reverse loop of m + p − 1
iterations with one collective-permute of the activation gradient each. Per step and device the
permutes move 2(m + p − 1)·b·s·h·β bytes; the bubble (idle fraction of each stage) is
(p − 1)/(m + p − 1).

Design notes:
- `data` is manual inside the shard_map too, and every input is cast to "varying" over the
  manual axes once, before the loop. Otherwise JAX casts the (data-invariant) stage parameters
  inside the loop body, and the transpose of that cast is a gradient all-reduce over `data` in
  every backward iteration instead of one after the loop.
- The last stage's outputs reach the other stages with one all-reduce (psum of a masked
  buffer), so the layers after the stack (norm, head, loss) run as ordinary SPMD code.
- Per-example arguments of the block (masks, segment ids: at least 2-d with a leading
  dimension equal to the batch) are split into microbatches like `x`; each stage slices the
  microbatch it is working on (t − s) from its own copy, so they never travel between stages.
  Other arguments (positions of shape (length,), say) are passed whole to every block.
- A batch of one example (the per-example `vmap` of jaxlight's evaluation) runs as a single
  microbatch: correct, with the full bubble, and still one stage's parameters per device.
- With a `context` mesh axis the shard_map is manual over it too: every input's sequence
  dimension (dimension 1 of the block's input, and of per-example arguments; positions
  `(length,)`) is split over it, each device runs its stage on its shard, and attention passes
  keys and values over `context` itself (`jaxlight.nn._context_attention`). A shard_map over
  `context` nested inside this one would not lower (JAX gives the residuals it saves inside the
  schedule's loop a sharding over the outer manual axes).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from jaxlight._errors import ConfigurationError, DataError
from jaxlight.nn._context_attention import check_context_length
from jaxlight.nn._scan import LAYERS, scan_layers
from jaxlight.sharding._layout import activation_sharding


@dataclasses.dataclass
class PipelineConfig:
    """What `Stacked` needs to run as a pipeline; active while a pipelined step is traced.

    Attributes:
        mesh: the strategy's mesh (it has the `axis` axis).
        stages: the size of the `axis` mesh axis.
        microbatches: how many microbatches each batch reaching a `Stacked` block is split into.
        remat: recompute each stage's activations in the backward pass (`jax.checkpoint`).
        axis: the mesh axis of the stages.
        batch_axes: the mesh axes that split the batch (`data`, `fsdp`); `data` is made manual
            with `axis` (it never shards parameters), the others stay automatic.
        calls: `Stacked` blocks that ran the schedule in this trace (0 after tracing means the
            model has no `Stacked` block, which a pipelined strategy refuses).
        repeats: chunks of layers per stage; above 1 the interleaved (circular) schedule of
            `jaxlight.nn._circular` runs instead of GPipe's.
    """

    mesh: Mesh
    stages: int
    microbatches: int
    remat: bool = False
    axis: str = "pipe"
    repeats: int = 1
    batch_axes: tuple[str, ...] = ("data",)
    calls: int = 0

    @property
    def iterations(self) -> int:
        """Forward schedule iterations, v·m + p − 1 (m + p − 1 for GPipe's v = 1)."""
        return schedule_iterations(self.stages, self.microbatches, self.repeats)


_ACTIVE: contextvars.ContextVar[PipelineConfig | None] = contextvars.ContextVar(
    "jaxlight_pipeline", default=None
)


@contextlib.contextmanager
def pipeline_context(config: PipelineConfig) -> Iterator[PipelineConfig]:
    """Makes every `Stacked` block traced inside run the GPipe schedule of `config`."""
    token = _ACTIVE.set(config)
    try:
        yield config
    finally:
        _ACTIVE.reset(token)


#: True while an evaluation step is traced: evaluation batches come in any size (a short last
#: batch is never padded), and one that does not split into the microbatches runs as a single
#: microbatch (correct, with the full bubble) instead of being refused.
_ANY_BATCH: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxlight_pipeline_any_batch",
                                                                  default=False)


@contextlib.contextmanager
def any_batch_size() -> Iterator[None]:
    """Lets batches that do not split into microbatches run as one (evaluation steps)."""
    token = _ANY_BATCH.set(True)
    try:
        yield
    finally:
        _ANY_BATCH.reset(token)


def active_pipeline() -> PipelineConfig | None:
    """The pipeline of the step being traced, or None (then `Stacked` runs a plain scan)."""
    return _ACTIVE.get()


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The idle fraction of each stage: (p − 1)/(v·m + p − 1) (GPipe: v = 1).

    With v repeats (the interleaved schedule) each of the v·m + p − 1 iterations is 1/v of a
    GPipe stage's work; fewer microbatches than stages run as p (the extra slots idle).

    Example:
        >>> bubble_fraction(4, 8), bubble_fraction(4, 8, repeats=2)
        (0.2727272727272727, 0.15789473684210525)
    """
    if repeats > 1 and microbatches < stages:
        return 1 - repeats * microbatches / (repeats * stages + stages - 1)
    return (stages - 1) / (repeats * microbatches + stages - 1)


def _narrow_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 32


def _vary(tree: Any, axes: tuple[str, ...]) -> Any:
    """Casts every leaf to "varying" over `axes` (those it is not varying over already).

    A bf16/fp16 leaf is cast through float32 (exactly), so that the all-reduce its gradient
    gets in the backward pass adds float32: XLA:CPU promotes a bf16 all-reduce to float32 by
    rebuilding its reduction, which jax lowers with a sharding constraint inside, and XLA
    aborts the process on it ("Invalid binary instruction opcode copy", jax 0.10.2) under
    `precision="bf16-mixed"`; a float32 sum is the more exact one anyway.
    """

    def one(x):
        missing = tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)
        if not missing:
            return x
        if _narrow_float(x):
            return lax.pcast(x.astype(jnp.float32), missing, to="varying").astype(x.dtype)
        return lax.pcast(x, missing, to="varying")

    return jax.tree.map(one, tree)


def psum_wide(x: jax.Array, axis: str) -> jax.Array:
    """`lax.psum`, adding bf16/fp16 in float32 (see `_vary` for why)."""
    if _narrow_float(x):
        return lax.psum(x.astype(jnp.float32), axis).astype(x.dtype)
    return lax.psum(x, axis)


def _batch_size(x: Any) -> int:
    sizes = {int(jnp.shape(leaf)[0]) if jnp.ndim(leaf) else None for leaf in jax.tree.leaves(x)}
    if len(sizes) != 1 or None in sizes:
        raise DataError(
            f"a pipelined Stacked block needs an input whose leaves share a leading batch "
            f"dimension; got leading sizes {sorted(map(str, sizes))}."
        )
    return sizes.pop()


def _check_state(stacked, state: nnx.State, stages: int) -> None:
    if stacked.num_layers % stages:
        divisors = [d for d in range(1, stacked.num_layers + 1) if stacked.num_layers % d == 0]
        raise ConfigurationError(
            f"{type(stacked).__name__} has {stacked.num_layers} layers, which do not split into "
            f"{stages} pipeline stages. Use a stage count dividing {stacked.num_layers} "
            f"({divisors}) or a layer count that is a multiple of {stages}."
        )
    variables = jax.tree_util.tree_leaves_with_path(
        state, is_leaf=lambda v: isinstance(v, nnx.Variable))
    unsplit = [jax.tree_util.keystr(path) for path, v in variables
               if tuple(v.get_metadata().get("out_sharding") or ())[:1] != (LAYERS,)]
    if unsplit:
        warnings.warn(
            f"a pipelined Stacked block has variables without logical axes ({', '.join(unsplit)}"
            f"); Stacked names the stacked axis {LAYERS!r} only on annotated variables, so these "
            "are stored whole on every stage instead of split over the stages. Annotate them "
            "(nnx.with_partitioning(init, names), or the layers of jaxlight.nn).",
            stacklevel=4,
        )
    others = sorted({type(v).__name__ for _, v in variables if not isinstance(v, nnx.Param)})
    if others:
        warnings.warn(
            f"a pipelined Stacked block holds non-parameter variables ({', '.join(others)}); "
            "under the GPipe schedule they are read-only (their updates, for example RNG "
            "counters or batch statistics, are not kept). Make the block deterministic or keep "
            "such state outside the Stacked block.",
            stacklevel=4,
        )


def run_pipeline(stacked, config: PipelineConfig, x: Any, *args: Any) -> Any:
    """Runs `stacked` (a `jaxlight.nn.Stacked`) as the GPipe schedule of `config`.

    Called by `Stacked.__call__` while a pipelined strategy traces a step; returns what the
    plain scan returns, up to floating-point reassociation.
    """
    config.calls += 1
    p, axis = config.stages, config.axis
    graphdef, state = nnx.split(stacked.layers)
    _check_state(stacked, state, p)
    pure_state = nnx.to_pure_dict(state)

    batch, m, b, data, manual, bspec, smap_mesh = split_batch(config, x, "Stacked block")

    def to_microbatches(v):
        # Row r of microbatch k is example r·m + k: the data shard of each row stays on its
        # device (the batch is split over data in contiguous blocks), so no data moves.
        return jnp.swapaxes(v.reshape(b, m, *v.shape[1:]), 0, 1)

    def is_per_example(v) -> bool:
        # (batch, ...) masks and segment ids; 1-d arguments such as positions (length,) are
        # passed whole even when the length happens to equal the batch size.
        return jnp.ndim(v) >= 2 and jnp.shape(v)[0] == batch

    arg_leaves, arg_tree = jax.tree.flatten(args)
    per_example = [is_per_example(v) for v in arg_leaves]
    xs = jax.tree.map(to_microbatches, x)
    mb_args = [to_microbatches(v) for v, e in zip(arg_leaves, per_example, strict=True) if e]
    whole_args = [v for v, e in zip(arg_leaves, per_example, strict=True) if not e]

    def stage_fn(stage_state, inp, stage_args):
        layers = nnx.merge(graphdef, stage_state)
        # The stage's share of the stack, run as Stacked's plain scan runs it (same metadata).
        return scan_layers(layers, inp, stage_args, stacked.remat)

    if config.remat:
        stage_fn = jax.checkpoint(stage_fn, prevent_cse=False)

    perm = [(i, (i + 1) % p) for i in range(p)]

    def schedule(stage_state, xs, mb_args, whole_args):
        stage = lax.axis_index(axis)
        stage_state, xs, mb_args, whole_args = _vary((stage_state, xs, mb_args, whole_args),
                                                     manual)

        def iteration(carry, t):
            buffer, outs = carry
            # Stage 0 reads microbatch t; every other stage works on what it just received.
            first = jax.tree.map(lambda v: v[jnp.minimum(t, m - 1)], xs)
            inp = jax.tree.map(lambda a, c: jnp.where(stage == 0, a, c), first, buffer)
            mb = jnp.clip(t - stage, 0, m - 1)  # the microbatch this stage works on
            it_mb = iter([v[mb] for v in mb_args])
            it_whole = iter(whole_args)
            leaves = [next(it_mb) if e else next(it_whole) for e in per_example]
            y = stage_fn(stage_state, inp, jax.tree.unflatten(arg_tree, leaves))
            done = t - (p - 1)
            slot = jnp.maximum(done, 0)
            keep = (stage == p - 1) & (done >= 0)
            outs = jax.tree.map(
                lambda o, v: lax.dynamic_update_index_in_dim(
                    o, jnp.where(keep, v, o[slot]), slot, 0),
                outs, y)
            buffer = lax.ppermute(y, axis, perm)
            return (buffer, outs), None

        buffer = jax.tree.map(lambda v: jnp.zeros_like(v[0]), xs)
        outs = jax.tree.map(jnp.zeros_like, xs)
        (_, outs), _ = lax.scan(iteration, (buffer, outs), jnp.arange(m + p - 1))
        # Only the last stage holds the outputs: one all-reduce hands them to every stage.
        return jax.tree.map(lambda o: psum_wide(jnp.where(stage == p - 1, o, 0), axis), outs)

    state_specs = jax.tree.map(lambda _: PartitionSpec(axis), pure_state)
    x_specs, mb_specs, whole_specs = schedule_specs(config, bspec, x, xs, mb_args, whole_args)
    # Activation constraints (jaxlight.nn.constrain) name the whole mesh, whose pipe and data
    # axes are manual inside: switched off there, GSPMD still shards by the parameters.
    with activation_sharding(None):
        out = jax.shard_map(
            schedule,
            mesh=smap_mesh,
            in_specs=(state_specs, x_specs, mb_specs, whole_specs),
            out_specs=x_specs,
            axis_names=set(manual),
        )(pure_state, xs, mb_args, whole_args)
    return jax.tree.map(lambda o: jnp.swapaxes(o, 0, 1).reshape(batch, *o.shape[2:]), out)


def schedule_iterations(stages: int, microbatches: int, repeats: int = 1) -> int:
    """v·m + p − 1: the forward (and backward) iterations of the schedule (GPipe: v = 1)."""
    if repeats > 1:
        microbatches = max(microbatches, stages)
    return repeats * microbatches + stages - 1


__all__ = [
    "PipelineConfig",
    "active_pipeline",
    "bubble_fraction",
    "pipeline_context",
    "run_pipeline",
    "schedule_iterations",
]


def split_batch(config: Any, x: Any, what: str, sequence: bool = True) -> tuple:
    """How a pipelined call (GPipe's, the interleaved one, `Stages`') splits its batch:
    `(batch, microbatches, rows per microbatch, the data axis split inside the schedule or None,
    shard_map's manual axes, the microbatches' PartitionSpec, shard_map's mesh)`. `what` names
    the block in the error for a batch that does not split.

    With a `context` mesh axis the schedule is manual over it too (each device runs its stage
    on its own shard of the sequence, and attention inside passes keys and values over
    `context` itself: a shard_map nested in the schedule's does not lower), so the manual axes
    include it; `sequence_spec` then splits the sequence dimension of the inputs. A block that
    cannot take its sequence split (`sequence=False`, `Stages`) is refused there."""
    mesh, axis = config.mesh, config.axis
    batch = _batch_size(x)
    m = config.microbatches
    context = jax.sharding.get_abstract_mesh()
    outer_manual = set() if context.empty else set(context.manual_axes)
    # Batch axes still automatic here; inside GradientAccumulation's per-replica shard_map the
    # batch axes are manual already and `x` is one replica's share.
    auto_batch = tuple(a for a in config.batch_axes
                       if a not in outer_manual and mesh.shape.get(a, 1) > 1)
    dsize = math.prod(mesh.shape[a] for a in auto_batch)
    if batch == 1 or (batch % (m * dsize) and _ANY_BATCH.get()):
        # One example, or an evaluation batch (a short last one) that does not split: a
        # single microbatch.
        m = 1
    elif batch % (m * dsize):
        raise DataError(
            f"the batch reaching the pipelined {what} has {batch} examples, which do not "
            f"split into {m} microbatches × data-parallel degree {dsize} = {m * dsize}. Use a "
            f"batch per step (per accumulation step under GradientAccumulation) that is a "
            f"multiple of {m * dsize}, or change the microbatch count."
        )
    b = batch // m
    data = "data" if "data" in auto_batch and b % mesh.shape["data"] == 0 else None
    manual = (axis, data) if data else (axis,)
    cp = context_axis(config)
    if cp:
        if not sequence:
            raise ConfigurationError(
                f"a pipelined {what} cannot run under a context axis (context="
                f"{mesh.shape[cp]}): it passes each example flattened between stages, so its "
                "sequence cannot be split. Pipeline a Stacked block (TransformerLM) with the "
                "context axis, or drop the context axis.")
        _check_sequence(x, mesh.shape[cp], what)
        manual = (*manual, cp)
    bspec = PartitionSpec(None, data) if data else PartitionSpec()
    smap_mesh = context if outer_manual else mesh
    return batch, m, b, data, manual, bspec, smap_mesh


def context_axis(config: Any) -> str | None:
    """The `context` axis the schedule splits the sequence over, or None (none, or size 1)."""
    return "context" if config.mesh.shape.get("context", 1) > 1 else None


def _sequence_length(x: Any) -> int:
    return int(jnp.shape(jax.tree.leaves(x)[0])[1])


def _check_sequence(x: Any, n: int, what: str) -> None:
    shapes = [tuple(jnp.shape(leaf)) for leaf in jax.tree.leaves(x)]
    if any(len(shape) < 2 for shape in shapes) or len({shape[1] for shape in shapes}) != 1:
        raise ConfigurationError(
            f"under a context axis the pipelined {what} splits dimension 1 of its input (the "
            f"sequence) over context={n}; got input leaves of shapes {shapes}. Give it "
            "(batch, length, ...) activations, or drop the context axis.")
    check_context_length(shapes[0][1], n, f"the input of the pipelined {what}")


def sequence_spec(config: Any, bspec: PartitionSpec, x: Any, leaf: Any,
                  dim: int) -> PartitionSpec:
    """`leaf`'s spec in the schedule's shard_map: `bspec` (the microbatched batch split),
    plus the `context` axis on dimension `dim` when it is the sequence (the length of `x`'s
    dimension 1); `dim` is 2 for microbatched `(m, b, length, ...)` leaves, 0 for whole
    arguments such as positions `(length,)`."""
    cp = context_axis(config)
    if cp is None or jnp.ndim(leaf) <= dim or jnp.shape(leaf)[dim] != _sequence_length(x):
        return bspec
    entries = list(bspec) + [None] * (dim + 1 - len(bspec))
    entries[dim] = cp
    return PartitionSpec(*entries)


def schedule_specs(config: Any, bspec: PartitionSpec, x: Any, xs: Any, mb_args: list,
                   whole_args: list) -> tuple:
    """The schedule's shard_map specs of its microbatched input `xs` (also its output's),
    per-example arguments and whole arguments: the batch split `bspec`, and under a context
    axis the sequence split too (`sequence_spec`)."""
    return (jax.tree.map(lambda u: sequence_spec(config, bspec, x, u, 2), xs),
            [sequence_spec(config, bspec, x, u, 2) for u in mb_args],
            [sequence_spec(config, PartitionSpec(), x, u, 0) for u in whole_args])
