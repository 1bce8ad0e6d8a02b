"""GPipe: the stacked layers split into stages over a `pipe` axis, the GPipe schedule.

Design choice: GPipe is the SPMD machinery (mesh `data × pipe`, the default rules table, whose
`("layers", "pipe")` rule puts each stage's slice of every stacked parameter and optimizer slot
on its own device) plus a pipeline context (`Pipelined`, `_pipelined.py`) that makes
`jaxlight.nn.Stacked` run the GPipe schedule (`jaxlight.nn._pipeline`) while the step is traced.
So its compile path differs from the other SPMD strategies only where the model runs its stack;
the state layout stays canonical (a GPipe checkpoint restores under any other strategy, only
the sharding of the `layers` axis differs), and every step-transforming callback applies as is.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from jaxlight._errors import ConfigurationError
from jaxlight.strategies._mpmd import MpmdGPipe
from jaxlight.strategies._mpmd_schedule import check_schedule
from jaxlight.strategies._pipelined import Pipelined
from jaxlight.strategies._rules import normalize_rules
from jaxlight.strategies._spmd import SpmdStrategy, with_default_rules

_SPMD_SCHEDULES = (
    " without mpmd=True: one SPMD program runs every microbatch's forward pass in a loop, then "
    "the backward pass of that loop. GPipe(stages, microbatches, schedule=..., mpmd=True) runs "
    "1f1b, zb-h1 and interleaved-1f1b with a program per device (a "
    "jaxlight.nn.Stages(..., packed=False) model)")


class GPipe(Pipelined, SpmdStrategy):
    """GPipe pipeline parallelism: `stages` groups of layers, `microbatches` per batch.

    The model's repeated block must be a `jaxlight.nn.Stacked`; its `L` stacked layers are split
    into `stages` groups of `L / stages`, one group per device along a `pipe` mesh axis, and the
    remaining devices form a `data` axis. Each batch (per data replica) is split into
    `microbatches` microbatches of `b` examples, and the schedule runs `m + p − 1` iterations
    in which every stage applies its layers and hands its activation to the next stage with a
    collective permute. Sharded shapes: `W[L_pipe, ...]`, `In[B_data, S, H]` split into
    `m × In[b_data, S, H]`.

    Per step and device: parameters and optimizer state of `L/p` layers (plus the unstacked
    embedding and head, replicated); `2(m + p − 1)` collective permutes of `b·s·h` activations
    (one per iteration forward, one gradient per iteration backward); one all-reduce of the
    stack's output to every stage; the usual data-parallel gradient all-reduce over `data`.
    Each stage idles a fraction `(p − 1)/(m + p − 1)` of the time (the bubble): use
    `microbatches ≥ 4 × stages` when the batch allows. Layers before and after the stack run on
    every stage (replicated over `pipe`).

    Args:
        stages: pipeline stages (the `pipe` axis); None uses every device (no `data` axis).
        microbatches: microbatches per batch; None means 2 × stages. The global batch must be a
            multiple of microbatches × the data-parallel degree. Fewer microbatches than stages
            is allowed, with a warning giving the bubble fraction.
        schedule: "gpipe" here; with `mpmd=True` also "1f1b" (one forward, one backward:
            at most p microbatches' activations per device whatever m is), "zb-h1" (1F1B
            with weight gradients filling the bubble) and "interleaved-1f1b". See
            `jaxlight.strategies._mpmd_schedule`.
        remat: recompute each stage's activations in the backward pass (`jax.checkpoint`),
            storing only each stage's input per iteration.
        repeats: v > 1 runs the interleaved (circular) schedule: the layers split into
            stages × v chunks, stage s holding chunks s, s + p, s + 2p, ...; each microbatch
            circles the stages v times, for a bubble of (p − 1)/(v·m + p − 1) and v times the
            collective permutes (`jaxlight.nn._circular`). Needs m ≥ p for that bubble
            (fewer microbatches run as p) and a layer count divisible by stages × v.
        rules: logical-axis rules and path rules in front of the defaults (the stacked axis
            `layers` always maps to `pipe`).
        override_annotations: path rules win over parameters' own annotations.
        devices: the devices to use (default: all).
        mpmd: run a program per device instead of one SPMD program, so that each device holds
            exactly its own stages' parameters and optimizer state (a
            `jaxlight.nn.Stages(..., packed=False)` of stages of any size; one process, no
            data axis). Returns a `MpmdGPipe` (`jaxlight.strategies._mpmd`).

    Example:
        >>> from jaxlight import strategies
        >>> strategy = strategies.GPipe(stages=4, microbatches=8)
        >>> interleaved = strategies.GPipe(stages=4, microbatches=8, repeats=2)
        >>> one_f_one_b = strategies.GPipe(stages=4, microbatches=8, schedule="1f1b", mpmd=True)
    """

    name = "gpipe"

    def __new__(cls, *args, mpmd: bool = False, **kwargs):
        if mpmd:
            return MpmdGPipe(*args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        stages: int | None = None,
        microbatches: int | None = None,
        *,
        schedule: str = "gpipe",
        remat: bool = False,
        repeats: int = 1,
        rules=None,
        override_annotations: bool = False,
        devices: Sequence[jax.Device] | None = None,
        mpmd: bool = False,
    ):
        del mpmd  # (True returned an MpmdGPipe from __new__)
        check_schedule(schedule, "GPipe", supported=("gpipe",), why=_SPMD_SCHEDULES)
        if stages is not None and (isinstance(stages, bool) or not isinstance(stages, int)
                                   or stages < 1):
            raise ConfigurationError(
                f"GPipe: stages must be a positive int (or None for every device), got "
                f"{stages!r}."
            )
        user = normalize_rules(rules, "GPipe")
        if any(name == "layers" for name, _ in user):  # (a path rule's key is a pattern)
            raise ConfigurationError(
                "GPipe: the 'layers' axis of Stacked blocks always maps to the 'pipe' axis "
                "(that is what splits the stages over devices); remove the 'layers' rule."
            )
        user, full = with_default_rules(user, "GPipe")
        shape = {"pipe": -1} if stages is None else {"data": -1, "pipe": stages}
        super().__init__(shape, (("layers", "pipe"), *full),
                         override_annotations=override_annotations, devices=devices)
        self.user_rules = user
        self._init_pipeline(microbatches, remat, repeats)
