"""`GPipe(mpmd=True)`: a pipeline whose devices each run their own program and hold their own
stages' parameters and optimizer state, exactly (no padding to the largest stage).

Design choice: SPMD (`jax.jit` over a mesh) splits every array evenly, so a `pipe` device holds
the same shape of every parameter whatever its stage owns (`jaxlight.nn.Stages` pads each
stage's row to the largest). This strategy instead places each stage's arrays on its own device
(`SingleDeviceSharding`) and runs the step through `MpmdProgram`
(`jaxlight.strategies._mpmd_runtime`): traced once, cut into per-device executables, dispatched
from the host in the schedule's order (GPipe's, 1F1B, ZB-H1 or interleaved 1F1B:
`_mpmd_schedule.py`). It pipelines `jaxlight.nn.Stages(..., packed=False)` on one
process; the state is the canonical pytree, so checkpoints move to and from every other
strategy unchanged.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, SingleDeviceSharding

from jaxlight._errors import ConfigurationError
from jaxlight.nn._mpmd import STAGE_MODULES, MpmdConfig, mpmd_context, stage_index
from jaxlight.sharding._layout import require_divisible
from jaxlight.strategies._base import Strategy
from jaxlight.strategies._mpmd_runtime import MpmdProgram
from jaxlight.strategies._mpmd_schedule import bubble as schedule_bubble
from jaxlight.strategies._mpmd_schedule import check_schedule, microbatch_gradients
from jaxlight.strategies._pipelined import (
    PIPE,
    check_microbatches_arg,
    warn_few_microbatches,
)


class MpmdGPipe(Strategy):
    """GPipe with a program per device (`GPipe(stages, microbatches, mpmd=True)`).

    Device d of p holds the parameters and optimizer slots of stages [d·k, (d+1)·k) of the
    model's `jaxlight.nn.Stages(..., packed=False)` (k = S/p), exactly; anything else in the
    state (the step counter, layers outside `Stages`, optimizer counters) lives on device 0. A
    step runs m microbatches through the stages: each stage call is its own executable on its
    device, dispatched asynchronously in the GPipe order, so the devices overlap as in the
    SPMD schedule (bubble (p − 1)/(m + p − 1) for stages of equal cost); activations and their
    gradients cross devices as copies of exactly each boundary's bytes (2·m·(p − 1) per step:
    no padding to the widest boundary). One process only; no data axis.

    Args:
        stages: pipeline devices p (None: every device).
        microbatches: microbatches per batch (None: 2p); the training batch must divide.
        schedule: the order each device runs its passes in (`_mpmd_schedule.SCHEDULES`):
            "gpipe" (every forward pass, then every backward pass), "1f1b" (device d at most
            p − d microbatches' activations, whatever m), "zb-h1" (1F1B with weight gradients
            filling the bubble) or "interleaved-1f1b" (a Stages of v·p stages, stage s on
            device s mod p: bubble (p − 1)/(v·m + p − 1); m a multiple of p).
        remat: each stage stores only its input per microbatch and recomputes the rest in the
            backward pass.
        devices: the devices to use (default: all local ones).
    """

    name = "gpipe"

    def __init__(self, stages: int | None = None, microbatches: int | None = None, *,
                 schedule: str = "gpipe", remat: bool = False,
                 devices: Sequence[jax.Device] | None = None, **unsupported):
        super().__init__()
        if unsupported.get("repeats", 1) == 1:
            unsupported.pop("repeats", None)
        if unsupported:
            raise ConfigurationError(
                f"GPipe(mpmd=True) does not take {sorted(unsupported)}: it pipelines a "
                "jaxlight.nn.Stages with the GPipe schedule over a 'pipe' axis only (no "
                "interleaving, no rules tables: each stage's arrays sit whole on its device). "
                "Remove them, or use GPipe without mpmd.")
        if stages is not None and (isinstance(stages, bool) or not isinstance(stages, int)
                                   or stages < 1):
            raise ConfigurationError(
                f"GPipe: stages must be a positive int (or None for every device), got "
                f"{stages!r}.")
        check_microbatches_arg(microbatches, "GPipe(mpmd=True)")
        self.schedule = check_schedule(schedule, "GPipe(mpmd=True)")
        self._stages_arg = stages
        self._chunks = 1
        self.microbatches = microbatches
        self.pipeline_remat = bool(remat)
        self._devices = None if devices is None else list(devices)

    # -- set-up ----------------------------------------------------------------------------

    def setup(self, devices: Sequence[jax.Device] | None = None) -> None:
        if jax.process_count() > 1:
            raise ConfigurationError(
                f"GPipe(mpmd=True) runs on one process (its host dispatches every device's "
                f"program), but this is one of {jax.process_count()} processes. Use GPipe "
                "without mpmd (SPMD) across processes.")
        pool = list(self._devices or devices or jax.local_devices())
        p = self._stages_arg or len(pool)
        if p > len(pool):
            raise ConfigurationError(
                f"GPipe(stages={p}, mpmd=True) needs {p} devices, but only {len(pool)} are "
                "available. Use fewer stages.")
        self.mesh = Mesh(np.asarray(pool[:p], dtype=object), (PIPE,))
        if self.microbatches is None:
            self.microbatches = 2 * p
        if self.schedule == "interleaved-1f1b" and self.microbatches % p:
            near = (self.microbatches // p * p, (self.microbatches // p + 1) * p)
            raise ConfigurationError(
                f"{self._who()}: interleaved 1F1B runs the microbatches in groups of the "
                f"{p} pipeline devices, but {self.microbatches} is not a multiple of {p}. Use "
                f"microbatches={' or '.join(str(n) for n in near if n)}, or "
                "schedule='1f1b'.")
        warn_few_microbatches(p, self.microbatches, self._who())

    def _who(self) -> str:
        extra = "" if self.schedule == "gpipe" else f", schedule={self.schedule!r}"
        return (f"GPipe(stages={self.stages}, microbatches={self.microbatches}{extra}, "
                "mpmd=True)")

    @property
    def pipeline_devices(self) -> list[jax.Device]:
        return list(self.require_mesh("pipeline_devices").devices.flat)

    @property
    def stages(self) -> int:
        return len(self.pipeline_devices) if self.mesh is not None else (self._stages_arg or 0)

    @property
    def data_parallel_size(self) -> int:
        return 1

    @property
    def mesh_shape(self) -> dict[str, int]:
        return {PIPE: self.stages or -1}

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        if self.mesh is not None:
            v = self._chunks
            out["pipeline"] = {
                "stages": self.stages, "microbatches": self.microbatches, "repeats": v,
                "schedule": self.schedule, "mpmd": True, "remat": self.pipeline_remat,
                "iterations": v * self.microbatches + self.stages - 1,
                "bubble_fraction": schedule_bubble(self.schedule, self.stages,
                                                   self.microbatches, v),
                # Microbatches whose activations a device holds at once (device 0, the most;
                # interleaved: chunk passes of 1/v of its layers, counted in microbatches).
                "microbatches_in_flight": self._in_flight(),
            }
        return out

    def _in_flight(self) -> float:
        p, m, v = self.stages, self.microbatches, self._chunks
        if self.schedule == "gpipe":
            return m
        if self.schedule == "interleaved-1f1b":
            return min(2 * (p - 1) + (v - 1) * p + 1, v * m) / v
        return min(p, m)

    # -- layout ----------------------------------------------------------------------------

    def state_shardings(self, abstract_state: Any, logical_axes: Any) -> Any:
        del logical_axes
        devices = self.pipeline_devices
        flat = jax.tree_util.tree_leaves_with_path(abstract_state)
        found = sorted({s for path, _ in flat if (s := stage_index(path)) is not None})
        if not found:
            raise ConfigurationError(
                f"{self._who()} places each stage's parameters on its device, but the model "
                f"has no jaxlight.nn.Stages(..., packed=False) (no state under "
                f"'{STAGE_MODULES}'). Put the pipelined layers in one, e.g. "
                "jaxlight.nn.Stages([stage0, stage1, ...], packed=False).")
        # Stages without parameters (a log-softmax head) have no state: the stage count seen
        # here may be short of the model's, so each device takes ceil(n/p) of those seen. A
        # last device holding only parameter-free stages would shift the placement; `compile`
        # then warns with the bytes copied per step.
        k = -(-(found[-1] + 1) // len(devices))
        interleaved = self.schedule == "interleaved-1f1b"  # stage s on device s mod p
        # (The model's chunks per device, for `describe`: fixed by the model, read here.)
        self._chunks = k if interleaved else 1

        def place(path, _):
            s = stage_index(path)
            d = 0 if s is None else (s % len(devices) if interleaved else s // k)
            return SingleDeviceSharding(devices[d])

        return jax.tree_util.tree_map_with_path(place, abstract_state)

    def batch_shardings(self, abstract_batch: Any) -> Any:
        """The batch on the first pipeline device, where the first stage reads it; the step
        copies to other devices only what they read (the labels, to the loss beside the last
        stage), instead of every device receiving the whole batch."""
        first = SingleDeviceSharding(self.pipeline_devices[0])
        return jax.tree.map(lambda _: first, abstract_batch)

    def check_batch(self, abstract_batch: Any, what: str = "batch") -> None:
        super().check_batch(abstract_batch, what)
        if what == "batch":
            require_divisible(abstract_batch, what, self.microbatches,
                              lambda: f"microbatches {self.microbatches} of {self._who()}",
                              advice=", or change microbatches")

    def bytes_per_device(self, abstract: Any, shardings: Any) -> int:
        """The most bytes any pipeline device holds of `abstract` (each leaf is whole on one)."""
        per = {}
        for leaf, sharding in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings),
                                  strict=True):
            for device in sharding.device_set:
                per[device] = per.get(device, 0) + int(np.prod(leaf.shape)) * leaf.dtype.itemsize
        return max(per.values(), default=0)

    # -- compiling -------------------------------------------------------------------------

    def trace_context(self):
        return mpmd_context(MpmdConfig(self.stages, self.microbatches, self.pipeline_remat))

    def gradient_fn(self, grad_fn):
        """GPipe: the whole batch's gradient (`Stages` splits it into the microbatches). 1F1B
        and ZB-H1: one microbatch at a time, each with its own loss, so that its backward pass
        can start before the other microbatches' forward passes (`_mpmd_schedule`)."""
        if self.schedule == "gpipe":
            return grad_fn
        return microbatch_gradients(grad_fn, self.microbatches, self.stages,
                                    self.pipeline_remat)

    def create(self, fn, shardings):
        """`fn()` run as a program per device: each array made on the device it lives on."""
        return self.compile(fn, (), (), shardings)()

    def compile(self, fn, abstract_args, in_shardings, out_shardings, donate_argnums=()):
        config = MpmdConfig(self.stages, self.microbatches, self.pipeline_remat)
        with mpmd_context(config):
            program = MpmdProgram(fn, tuple(abstract_args), in_shardings, out_shardings,
                                  self.pipeline_devices, tuple(donate_argnums),
                                  schedule=self.schedule, microbatches=self.microbatches,
                                  who=self._who())
        if program.misplaced_bytes:
            warnings.warn(
                f"{self._who()}: {program.misplaced_bytes} bytes of state are copied to another "
                "device every step: they live on one device and a stage on another reads them "
                "(a last pipeline device whose stages hold no parameters shifts the placement, "
                "or a layer outside Stages is used inside the pipeline). Give every device a "
                "stage with parameters, or fewer stages.", stacklevel=2)
        return program


__all__ = ["MpmdGPipe"]
