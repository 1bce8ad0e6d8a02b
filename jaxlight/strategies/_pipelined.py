"""Pipeline support shared by `GPipe` and `Hybrid` meshes with a `pipe` axis.

`Pipelined` is a mixin in front of `SpmdStrategy`: the state layout, batch layout and compile
are the SPMD ones (the stacked `layers` axis maps to `pipe` in the default rules table, so each
device holds its stage's parameters and optimizer state); what it adds is

- a `PipelineConfig` (`jaxlight.nn._pipeline`) active while a step is traced, which makes every
  `jaxlight.nn.Stacked` block run the GPipe schedule instead of its plain scan;
- the checks a pipeline needs, before compiling: a model with stacked layers, a layer count the
  stages divide, a global batch that splits into microbatches × the data-parallel degree, and a
  warning when fewer microbatches than stages leave most of each stage idle;
- after tracing, a refusal if no `Stacked` block ran the schedule (the stack was built but its
  layers were called some other way).

It lives apart from `_gpipe.py` so that `Hybrid` (in `_sharded.py`) can use it without an import
cycle. It keeps no state between calls: `compile` makes a fresh `PipelineConfig` for the step
it traces and reads its call counter back.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax

from jaxlight._errors import ConfigurationError
from jaxlight.analysis._hlo import collectives, summarize
from jaxlight.nn._mpmd import stage_index
from jaxlight.nn._pipeline import (
    PipelineConfig,
    bubble_fraction,
    pipeline_context,
    schedule_iterations,
)
from jaxlight.nn._scan import LAYERS
from jaxlight.sharding._layout import is_axes, require_divisible

PIPE = "pipe"


def check_repeats_arg(repeats: Any, who: str) -> None:
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigurationError(
            f"{who}: repeats (chunks of layers per pipeline stage, the interleaved schedule) "
            f"must be a positive int, got {repeats!r}.")


def check_microbatches_arg(microbatches: Any, who: str) -> None:
    if microbatches is not None and (isinstance(microbatches, bool)
                                     or not isinstance(microbatches, int) or microbatches < 1):
        raise ConfigurationError(
            f"{who}: microbatches must be a positive int (or None for 2 × stages), got "
            f"{microbatches!r}."
        )


def warn_few_microbatches(stages: int, microbatches: int, who: str) -> None:
    if microbatches < stages:
        bubble = bubble_fraction(stages, microbatches)
        warnings.warn(
            f"{who}: {microbatches} microbatches for {stages} pipeline stages leaves each stage "
            f"idle {bubble:.0%} of the step (bubble (p−1)/(m+p−1) = {stages - 1}/"
            f"{microbatches + stages - 1}). Use microbatches ≥ {stages} (GPipe suggests "
            f"≥ {4 * stages}) if the batch allows.",
            stacklevel=3,
        )


class Pipelined:
    """Mixin for `SpmdStrategy` subclasses whose mesh may have a `pipe` axis.

    Call `_init_pipeline(microbatches, remat, repeats)` in `__init__`. Without a `pipe` axis in
    `mesh_shape` every method is the plain SPMD one.
    """

    microbatches: int | None = None
    pipeline_remat: bool = False
    repeats: int = 1

    def _init_pipeline(self, microbatches: int | None, remat: bool, repeats: int = 1) -> None:
        check_microbatches_arg(microbatches, type(self).__name__)
        check_repeats_arg(repeats, type(self).__name__)
        self.microbatches = microbatches
        self.pipeline_remat = bool(remat)
        self.repeats = repeats

    # -- what the pipeline is -----------------------------------------------------------------

    @property
    def pipelined(self) -> bool:
        """True when the mesh has a `pipe` axis (even of size 1: a one-stage pipeline)."""
        return PIPE in self.mesh_shape

    @property
    def stages(self) -> int:
        """Pipeline stages: the size of the `pipe` mesh axis (after `setup`)."""
        if self.mesh is not None:
            return int(self.mesh.shape.get(PIPE, 1))
        return int(self.mesh_shape.get(PIPE, 1))

    def setup(self, devices=None) -> None:
        super().setup(devices)
        if self.pipelined:
            if self.microbatches is None:
                # 2p: a bubble of (p−1)/(3p−1) (27% at p = 4) while the batch only needs to be
                # a multiple of 2p × the data degree; pass microbatches for more overlap.
                self.microbatches = 2 * self.stages
            warn_few_microbatches(self.stages, self.microbatches, self._who())

    def _who(self) -> str:
        extra = f", repeats={self.repeats}" if self.repeats > 1 else ""
        return (f"{type(self).__name__}(stages={self.stages}, "
                f"microbatches={self.microbatches}{extra})")

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        if self.pipelined and self.microbatches is not None:
            out["pipeline"] = {
                "stages": self.stages,
                "microbatches": self.microbatches,
                "repeats": self.repeats,
                "schedule": "interleaved" if self.repeats > 1 else "gpipe",
                "remat": self.pipeline_remat,
                "iterations": schedule_iterations(self.stages, self.microbatches, self.repeats),
                "bubble_fraction": bubble_fraction(self.stages, self.microbatches,
                                                   self.repeats),
            }
        return out

    # -- checks before compiling --------------------------------------------------------------

    def state_shardings(self, abstract_state: Any, logical_axes: Any) -> Any:
        if self.pipelined:
            self._check_stacked(abstract_state, logical_axes)
        return super().state_shardings(abstract_state, logical_axes)

    def _check_stacked(self, abstract_state: Any, logical_axes: Any) -> None:
        """Refuses a model without stacked layers, or whose layer count the stages cannot split."""
        flat_axes = jax.tree_util.tree_leaves_with_path(
            logical_axes.params, is_leaf=lambda x: x is None or is_axes(x))
        flat_params = jax.tree.leaves(abstract_state.params)
        stacked = [(jax.tree_util.keystr(path), leaf.shape[0])
                   for (path, axes), leaf in zip(flat_axes, flat_params, strict=True)
                   if axes and axes[0] == LAYERS]
        if not stacked and any(stage_index(path) is not None for path, _ in flat_axes):
            return  # a Stages(packed=False): the step stacks its stages' rows itself
        if not stacked:
            raise ConfigurationError(
                f"{self._who()} pipelines the model's stacked layers, but no parameter has the "
                f"logical axis {LAYERS!r}: the model has no jaxlight.nn.Stacked block or "
                "jaxlight.nn.Stages (or its block's parameters carry no logical axes, and "
                "Stacked names the stacked axis only on annotated ones). Put the repeated "
                "block in one, e.g. self.blocks = "
                "jaxlight.nn.Stacked(lambda rngs: Block(..., rngs=rngs), num_layers, rngs=rngs) "
                "and call self.blocks(x, ...) (a plain scan under every other strategy), with "
                "annotated parameters (the layers of jaxlight.nn, or nnx.with_partitioning), "
                "or use a strategy without a 'pipe' axis."
            )
        p = self.stages
        chunks = p * self.repeats  # the interleaved schedule splits layers into p·v chunks
        bad = [(path, n) for path, n in stacked
               if n % (p if "packed_" in path else chunks)]
        if bad:
            path, n = bad[0]
            divisors = [d for d in range(1, n + 1) if n % d == 0]
            if "packed_" in path:  # a jaxlight.nn.Stages: one row per stage
                raise ConfigurationError(
                    f"{self._who()}: the Stages module's {n} stages (parameter {path}) do not "
                    f"split into {p} pipeline devices. Use a stage count dividing {n} "
                    f"({divisors}) or a multiple of {p} stage modules.")
            if self.repeats > 1:
                raise ConfigurationError(
                    f"{self._who()}: the Stacked block's {n} layers (parameter {path}) do not "
                    f"split into {p} stages × {self.repeats} repeats = {chunks} chunks. Use "
                    f"stages × repeats dividing {n} ({divisors}) or a layer count that is a "
                    f"multiple of {chunks}.")
            raise ConfigurationError(
                f"{self._who()}: the Stacked block's {n} layers (parameter {path}) do not "
                f"split into {p} pipeline stages. Use a stage count dividing {n} ({divisors}) "
                f"or a layer count that is a multiple of {p}."
            )

    def check_batch(self, abstract_batch: Any, what: str = "batch") -> None:
        super().check_batch(abstract_batch, what)
        # An evaluation batch that does not split into microbatches runs as a single one
        # (`nn._pipeline.any_batch_size`), so only training batches must split.
        if not self.pipelined or what != "batch":
            return
        need = self.microbatches * self.data_parallel_size
        require_divisible(
            abstract_batch, what, need,
            lambda: f"microbatches {self.microbatches} × data-parallel degree "
                    f"{self.data_parallel_size} = {need} of {self._who()} on mesh "
                    f"{dict(self.mesh.shape)}",
            advice=", or change microbatches")

    # -- tracing and compiling ----------------------------------------------------------------

    def compile(self, fn, abstract_args, in_shardings, out_shardings, donate_argnums=()):
        if not self.pipelined or self.mesh is None:
            return super().compile(fn, abstract_args, in_shardings, out_shardings,
                                   donate_argnums)
        # A fresh config for this trace: its `calls` counter says whether a Stacked block ran.
        pipeline = PipelineConfig(
            mesh=self.mesh, stages=self.stages, microbatches=self.microbatches,
            remat=self.pipeline_remat, axis=PIPE, batch_axes=tuple(self.batch_axes),
            repeats=self.repeats,
        )
        with pipeline_context(pipeline):
            compiled = super().compile(fn, abstract_args, in_shardings, out_shardings,
                                       donate_argnums)
        if pipeline.calls == 0:
            raise ConfigurationError(
                f"{self._who()}: the step ran no jaxlight.nn.Stacked block nor "
                "jaxlight.nn.Stages, so there is nothing to pipeline (the model has stacked "
                "parameters but does not call the Stacked "
                "module, for example it loops over the layers itself). Call the stack as one "
                "module, x = self.blocks(x, ...), so that it runs as the pipeline schedule."
            )
        return compiled


# -- reading the compiled schedule back ------------------------------------------------------


def schedule_stats(hlo_text: str) -> dict[str, Any]:
    """Reads the pipeline schedule back from a compiled step's HLO (`compiled.as_text()`).

    Uses `jaxlight.analysis._hlo.collectives`, which counts an instruction inside a `while` body
    once
    per iteration (XLA's `known_trip_count`). The schedule's loops are where its permutes are:
    one collective-permute in the forward loop body and one in the backward loop body, each
    executed once per iteration.

    Returns:
        `iterations`: per collective-permute instruction, how many times it runs per step
        (m + p − 1 for each of the two schedule loops, v·m + p − 1 interleaved; × k under
        GradientAccumulation);
        `collective_permute_bytes`: bytes per step and device the permutes send;
        `schedule_permute_bytes`: those of the permutes inside loops (run more than once per
        step: the schedule's), without the one-off permutes XLA uses elsewhere (the
        interleaved schedule's relayout of the stack);
        `other_collectives`: `jaxlight.analysis._hlo.summarize` totals of the other kinds.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> schedule_stats(jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compile().as_text())
        {'iterations': [], 'collective_permute_bytes': 0, 'schedule_permute_bytes': 0, \
'other_collectives': {}}
    """
    items = collectives(hlo_text)
    permutes = [c for c in items if c.kind == "collective-permute"]
    others = {kind: totals for kind, totals in summarize(
        c for c in items if c.kind != "collective-permute").items() if totals["count"]}
    return {
        "iterations": [c.executions for c in permutes],
        "collective_permute_bytes": sum(c.total_buffer_bytes for c in permutes),
        "schedule_permute_bytes": sum(c.total_buffer_bytes for c in permutes
                                      if c.executions > 1),
        "other_collectives": others,
    }
