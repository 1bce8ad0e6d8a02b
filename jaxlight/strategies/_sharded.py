"""The sharded strategies: FSDP, TensorParallel and Hybrid, the SPMD machinery of `_spmd.py`
under other rules tables.

FSDP shards parameters, gradients and optimizer state over `fsdp`; TensorParallel splits
annotated layers over `tp` (refusing a model none of whose parameters would); Hybrid takes any
product of the mesh axes, with a `pipe` axis (the GPipe schedule, `_pipelined.py`) and a
`context` axis (context-parallel attention, `jaxlight.nn._context_attention`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from jaxlight._errors import ConfigurationError, ShardingError
from jaxlight.nn._collective_matmul import OVERLAP_RULES, overlapped
from jaxlight.nn._context_attention import (
    DEFAULT_CONTEXT_ALGORITHM,
    check_context_algorithm,
    context_parallel,
)
from jaxlight.sharding._layout import axes_of
from jaxlight.strategies._pipelined import Pipelined
from jaxlight.strategies._rules import ACTIVATION_NAMES, parse_mesh_shape
from jaxlight.strategies._spmd import SpmdStrategy, with_default_rules


def require_tp_annotations(strategy: SpmdStrategy, abstract_state: Any, shardings: Any) -> None:
    """Refuses a model none of whose parameters shards over `tp` (tp would only replicate)."""
    if strategy.mesh is None or strategy.mesh.shape.get("tp", 1) == 1:
        return

    def uses_tp(sharding) -> bool:
        return any(a == "tp" or (isinstance(a, tuple) and "tp" in a) for a in sharding.spec)

    if any(uses_tp(s) for s in jax.tree.leaves(shardings.params)):
        return
    tp_names = sorted(name for name, target in strategy.rules if isinstance(name, str)
                      and "tp" in axes_of(target) and name not in ACTIVATION_NAMES)
    flat = jax.tree_util.tree_leaves_with_path(abstract_state.params)
    largest = sorted(flat, key=lambda kv: -math.prod(kv[1].shape))[:5]
    listed = ", ".join(f"{jax.tree_util.keystr(p)} {tuple(x.shape)}" for p, x in largest)
    raise ShardingError(
        f"{type(strategy).__name__}: tensor parallelism over tp={strategy.mesh.shape['tp']} "
        f"devices needs parameters annotated with a logical axis mapped to 'tp' "
        f"({tp_names}), but none of the model's {len(flat)} parameters is (largest: {listed}). "
        "Annotate kernels with nnx.with_partitioning, e.g. kernel_init=nnx.with_partitioning("
        "nnx.initializers.lecun_normal(), ('embed', 'mlp')) for column-parallel and "
        "('mlp', 'embed') for row-parallel layers, use the blocks in jaxlight.nn, or map your "
        "own names with rules=[('my_axis', 'tp')]. For stock Flax NNX layers (nnx.Linear, "
        "nnx.MultiHeadAttention, nnx.Embed) pass the ready-made path rules, "
        "rules=strategies.rules.NNX, or your own path rules such as "
        "rules=[(r\"\\['up'\\]\\['kernel'\\]\", ('embed', 'mlp'))]; Fit.plan shows which rule "
        "placed each parameter."
    )


class FSDP(SpmdStrategy):
    r"""Fully sharded data parallelism (ZeRO-3) over an `fsdp` axis.

    Parameters, gradients and optimizer state are sharded; the batch is split over the same
    axis. Sharded shapes: `W[E_fsdp, F]` is all-gathered to `W[E, F]` before use, and the
    gradient is reduce-scattered back to `dW[E_fsdp, F]`. Every device holds 1/N of the
    parameters and optimizer state between steps. Annotated parameters follow their logical
    axes (`embed` -> `fsdp` by default); unannotated ones shard their largest dimension
    divisible by N (path rules, such as `strategies.rules.NNX`, place them by name instead);
    parameters under `min_shard_size` elements stay replicated.

    Two layouts of the step, as PyTorch FSDP's `reshard_after_forward`:

    - `False` (default): each sharded parameter is all-gathered once per step and its gradient
      leaves through one explicit reduce-scatter, in fp32: 2(N−1)/N · Ψ · β bytes per device
      and step. The step holds one whole copy of the parameters and gradients while it runs.
    - `True`: XLA gathers each layer's parameters where they are used (forward, and again in
      the backward pass) and reduces the gradients itself: the least temporary memory, up to
      3(N−1)/N · Ψ · β bytes where XLA forms reduce-scatters (GPU, TPU); XLA's CPU backend
      all-reduces instead (4(N−1)/N).

    Args:
        rules: logical-axis rules and path rules in front of `DEFAULT_RULES` (dict or pairs;
            see `jaxlight.strategies._rules`).
        min_shard_size: parameters with no annotation and no path rule and fewer elements stay
            replicated.
        reshard_after_forward: gather per layer where used (True) or once per step (False).
        override_annotations: path rules win over parameters' own annotations.
        devices: the devices to use (default: all).

    Example:
        >>> from jaxlight import strategies
        >>> strategy = strategies.FSDP(rules={"mlp": "fsdp"})
        >>> by_path = strategies.FSDP(rules=[(r"\['embed'\]", ("vocab", "fsdp"))])
    """

    name = "fsdp"

    def __init__(self, *, rules=None, min_shard_size: int = 2**12,
                 reshard_after_forward: bool = False, override_annotations: bool = False,
                 devices: Sequence[jax.Device] | None = None):
        user, full = with_default_rules(rules, "FSDP")
        super().__init__({"fsdp": -1}, full, shard_unannotated="fsdp",
                         min_shard_size=min_shard_size,
                         override_annotations=override_annotations, devices=devices)
        self.user_rules = user
        self.reshard_after_forward = reshard_after_forward

    def gradient_fn(self, grad_fn: Callable) -> Callable:
        if self.reshard_after_forward:
            return grad_fn  # XLA gathers per layer, forward and backward
        # Gather every sharded parameter once, reduce-scatter every gradient once, in fp32.
        return self.accumulate_gradients(grad_fn, 1)

    def describe(self) -> dict:
        out = super().describe()
        out["reshard_after_forward"] = self.reshard_after_forward
        return out


class TensorParallel(SpmdStrategy):
    """Megatron-style tensor parallelism over a `tp` axis of `size` devices; `data` over the rest.

    Column-parallel then row-parallel layers: `In[B_data, E] · W[E, F_tp] -> H[B_data, F_tp]`,
    `H[B_data, F_tp] · W[F_tp, E] -> Out[B_data, E]` (an all-reduce over `tp`). A transformer
    block costs four all-reduces of `b·s·h` activations per step (two forward, two backward);
    embeddings are vocabulary-parallel. Parameters must carry logical axes mapped to `tp`
    (`mlp`, `heads`, `vocab` by default; see `jaxlight.nn`), from annotations or from path
    rules (`strategies.rules.NNX` for stock Flax NNX layers); a model with none is refused.

    With `overlap=True` the all-reduces become collective matmuls (`jaxlight.nn`'s
    `_collective_matmul`): the residual stream stays sharded `In[B_data, E_tp]` between layers,
    column-parallel layers all-gather it and row-parallel layers reduce-scatter their output as
    rings of collective-permutes interleaved with partial matmuls, which an asynchronous
    scheduler (GPU, TPU) overlaps with compute. Same bytes, same results up to float rounding.

    Args:
        size: devices per tensor-parallel group (the `tp` axis); None: all devices.
        rules: logical-axis rules and path rules in front of `DEFAULT_RULES`.
        overlap: run column- and row-parallel `jaxlight.nn.Dense` layers as collective matmuls.
        override_annotations: path rules win over parameters' own annotations.
        devices: the devices to use (default: all).

    Example:
        >>> from jaxlight import strategies
        >>> strategy = strategies.TensorParallel(2)
        >>> overlapped = strategies.TensorParallel(2, overlap=True)
        >>> stock = strategies.TensorParallel(2, rules=strategies.rules.NNX)
    """

    name = "tp"

    def __init__(self, size: int | None = None, *, rules=None, overlap: bool = False,
                 override_annotations: bool = False,
                 devices: Sequence[jax.Device] | None = None):
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ConfigurationError(f"TensorParallel(size) needs a positive int, got {size!r}.")
        user, full = with_default_rules(rules, "TensorParallel")
        if overlap:
            full = user + OVERLAP_RULES + full[len(user):]
        shape = {"tp": -1} if size is None else {"data": -1, "tp": size}
        super().__init__(shape, full, override_annotations=override_annotations,
                         devices=devices)
        self.user_rules = user
        self.size = size
        self.overlap = bool(overlap)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "overlap": self.overlap}

    def trace_context(self):
        if not self.overlap or self.mesh is None:
            return super().trace_context()
        return overlapped(super().trace_context(), self.mesh, self.rules)

    def state_shardings(self, abstract_state: Any, logical_axes: Any) -> Any:
        shardings = super().state_shardings(abstract_state, logical_axes)
        require_tp_annotations(self, abstract_state, shardings)
        return shardings


class Hybrid(Pipelined, SpmdStrategy):
    """Any product of the `data`, `fsdp`, `context` and `tp` (and `pipe`) axes under one rules
    table.

    With a `pipe` axis the stacked layers of `jaxlight.nn.Stacked` are split into stages over
    it and run as the GPipe schedule (see `GPipe`); the batch is never split over `pipe`.

    With a `context` axis of n devices (context parallelism) every activation's sequence
    dimension is split over it (the rule `length -> context`): `X[B_data, L_context, E]`, so
    activation memory per device falls ~1/n. `jaxlight.nn.MultiHeadAttention` (and so
    `TransformerLM`) attends across the shards by `context_attention`: "ring" passes keys and
    values around the ring (n−1 collective-permutes of `B·Lc·H·D` each per layer forward, one
    `Lc × Lc` score block live at a time), "allgather" gathers them once per layer (scores
    `Lc × L`). The batch is not split over `context`; parameters are replicated over it. With
    a `pipe` axis too, each pipeline stage runs on its devices' shards of the sequence (the
    schedule is manual over both axes).

    With an `expert` axis the experts of every `jaxlight.nn.MoE` layer are split over it
    (`W[E_expert, D, F_tp]`) and each layer moves its tokens to their experts' devices and back
    by two all-to-alls; the batch is split over `expert` too (see docs/moe.md).

    Args:
        mesh_shape: `{"data": 2, "fsdp": 2, "tp": 2}` or the Tunix form
            `[[2, 2, 2], ["data", "fsdp", "tp"]]`; one size may be -1 (the remaining devices).
        rules: logical-axis rules and path rules in front of `DEFAULT_RULES`.
        min_shard_size: parameters with no annotation and no path rule and fewer elements stay
            replicated.
        microbatches: with a `pipe` axis, microbatches per batch (None: 2 × pipe).
        remat: with a `pipe` axis, recompute each stage's activations in the backward pass.
        repeats: with a `pipe` axis, v > 1 chunks of layers per stage: the interleaved
            schedule (see `GPipe`).
        context_attention: with a `context` axis, "ring" (default) or "allgather".
        override_annotations: path rules win over parameters' own annotations.
        devices: the devices to use (default: all).

    Example:
        >>> from jaxlight import strategies
        >>> strategy = strategies.Hybrid([[2, -1, 2], ["data", "fsdp", "tp"]])
        >>> pipelined = strategies.Hybrid({"data": 2, "pipe": 4}, microbatches=8)
        >>> long_sequences = strategies.Hybrid({"data": 2, "context": 4})
        >>> experts = strategies.Hybrid({"data": 2, "expert": 4})
    """

    name = "hybrid"

    def __init__(self, mesh_shape, *, rules=None, min_shard_size: int = 2**12,
                 microbatches: int | None = None, remat: bool = False, repeats: int = 1,
                 context_attention: str = DEFAULT_CONTEXT_ALGORITHM,
                 override_annotations: bool = False,
                 devices: Sequence[jax.Device] | None = None):
        self.context_attention = check_context_algorithm(context_attention, "Hybrid")
        shape = parse_mesh_shape(mesh_shape, "Hybrid")
        user, full = with_default_rules(rules, "Hybrid")
        if "pipe" in shape:
            full = (("layers", "pipe"), *full)  # each stage holds its own layers
        super().__init__(shape, full, shard_unannotated="fsdp", min_shard_size=min_shard_size,
                         override_annotations=override_annotations, devices=devices)
        self.user_rules = user
        self._init_pipeline(microbatches, remat, repeats)

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        if self.mesh_shape.get("context", 1) != 1:
            out["context_attention"] = self.context_attention
        return out

    def trace_context(self):
        context = super().trace_context()
        if self.mesh is None or self.mesh.shape.get("context", 1) == 1:
            return context
        return _with_context_parallel(context, self.mesh, self.context_attention)

    def state_shardings(self, abstract_state: Any, logical_axes: Any) -> Any:
        shardings = super().state_shardings(abstract_state, logical_axes)
        require_tp_annotations(self, abstract_state, shardings)
        return shardings


@contextlib.contextmanager
def _with_context_parallel(context, mesh: Mesh, algorithm: str):
    """A strategy's trace context with context-parallel attention switched on."""
    with context, context_parallel(mesh, algorithm):
        yield
