"""Ready-made path rules for stock Flax NNX layers: models without annotations shard by name.

Pass them as a strategy's rules, alone or after your own (the first matching rule wins), as
objects or by name (`SETS`; the command line's `--strategy "tp(size=2, rules='NNX')"`):

    strategies.TensorParallel(2, rules=strategies.rules.NNX)
    strategies.TensorParallel(2, rules="NNX")
    strategies.FSDP(rules=[(r"\\['proj'\\]\\['kernel'\\]$", ("mlp", "embed")),
                           *strategies.rules.NNX])

Each rule maps a parameter path (a regular expression searched in its `jax.tree_util.keystr`,
such as `['blocks'][0]['attn']['query']['kernel']`) to logical axes, one per dimension, which the
strategy's logical rules (`strategies.DEFAULT_RULES`) map to mesh axes: the layout `jaxlight.nn`'s
annotated layers get (Megatron column/row pairs under tensor parallelism, `embed` over `fsdp`
under FSDP). A module is matched by its attribute name, a parameter by its own name:

- `NNX_ATTENTION`: `nnx.MultiHeadAttention` (`query`, `key`, `value`: kernel
  `(embed, heads, kv)`, bias `(heads, kv)`; `out`: kernel `(heads, kv, embed)`, bias
  replicated), and attention built from `nnx.Linear` (`q_proj`, `k_proj`, `v_proj`, `query`,
  `key`, `value`: `(embed, heads)`, bias `(heads,)`; `o_proj`, `out_proj`: `(heads, embed)`).
- `NNX_MLP`: column-parallel `nnx.Linear` (`linear1`, `fc1`, `dense1`, `lin1`, `l1`, `up`,
  `up_proj`, `gate`, `gate_proj`, `w1`, `w3`, `wi`, `c_fc`, `fc_in`: `(embed, mlp)`, bias
  `(mlp,)`) and row-parallel ones (`linear2`, `fc2`, `dense2`, `lin2`, `l2`, `down`,
  `down_proj`, `w2`, `wo`, `c_proj`, `fc_out`: `(mlp, embed)`, bias replicated).
- `NNX_EMBED`: `nnx.Embed` tables (`embedding`: `(vocab, embed)`) and output heads (`head`,
  `lm_head`, `unembed`, `output`, `logits`: `(embed, vocab)`, bias `(vocab,)`).
- `NNX_NORM`: norm scales (`scale`) and the `bias`, `mean`, `var` of modules whose name holds
  `norm`, `ln` or `bn` (`nnx.LayerNorm`, `nnx.RMSNorm`, `nnx.BatchNorm`): `(norm,)`.
- `NNX`: all of the above, as one set.

Parameters that match no rule (a third `nnx.Linear` of an MLP, a convolution) keep the
strategy's fallback: FSDP shards their largest divisible dimension, tensor parallelism
replicates them. `Fit.plan` shows which rule placed each parameter, and which matched none.
A set that matches no parameter of the model warns once (not once per rule).
"""

from __future__ import annotations

from jaxlight.sharding._layout import PathRule

__all__ = ["NNX", "NNX_ATTENTION", "NNX_EMBED", "NNX_MLP", "NNX_NORM", "SETS"]


def _param(modules: str, param: str) -> str:
    """A pattern for parameter `param` of a module whose attribute name is one of `modules`."""
    name = f"({param})" if "|" in param else param
    return rf"\['({modules})'\]\['{name}'\]$"


def _set(group: str, *pairs: tuple[str, tuple]) -> tuple[PathRule, ...]:
    return tuple(PathRule(pattern, axes, group) for pattern, axes in pairs)


_QKV = "query|key|value"
_QKV_PROJ = "q_proj|k_proj|v_proj|query|key|value"
_OUT_PROJ = "o_proj|out_proj"
_COLUMN = ("linear_?1|fc_?1|dense_?1|lin_?1|l1|up|up_proj|gate|gate_proj|w1|w3|wi|wi_0|wi_1|"
           "c_fc|fc_in")
_ROW = "linear_?2|fc_?2|dense_?2|lin_?2|l2|down|down_proj|w2|wo|c_proj|fc_out"
_HEAD = "head|lm_head|unembed|output|logits"
_NORM_MODULE = r"[^']*(?:norm|ln|bn)[^']*"

_ATTENTION = (
    # nnx.MultiHeadAttention: LinearGeneral kernels (embed, heads, head_dim) and back.
    (_param(_QKV, "kernel"), ("embed", "heads", "kv")),
    (_param(_QKV, "bias"), ("heads", "kv")),
    (_param("out", "kernel"), ("heads", "kv", "embed")),
    (_param("out", "bias"), (None,)),
    # Attention written with nnx.Linear: heads × head_dim flattened into one dimension.
    (_param(_QKV_PROJ, "kernel"), ("embed", "heads")),
    (_param(_QKV_PROJ, "bias"), ("heads",)),
    (_param(_OUT_PROJ, "kernel"), ("heads", "embed")),
    (_param(_OUT_PROJ, "bias"), (None,)),
)
_MLP = (
    (_param(_COLUMN, "kernel"), ("embed", "mlp")),
    (_param(_COLUMN, "bias"), ("mlp",)),
    (_param(_ROW, "kernel"), ("mlp", "embed")),
    (_param(_ROW, "bias"), (None,)),
)
_EMBED = (
    (r"\['embedding'\]$", ("vocab", "embed")),
    (_param(_HEAD, "kernel"), ("embed", "vocab")),
    (_param(_HEAD, "bias"), ("vocab",)),
)
_NORM = (
    (r"\['scale'\]$", ("norm",)),
    (_param(_NORM_MODULE, "bias|mean|var"), ("norm",)),
)

#: `nnx.MultiHeadAttention` and attention built from `nnx.Linear` projections.
NNX_ATTENTION = _set("NNX_ATTENTION", *_ATTENTION)
#: Two-layer MLPs of `nnx.Linear` (column-parallel up, row-parallel down).
NNX_MLP = _set("NNX_MLP", *_MLP)
#: `nnx.Embed` tables and `nnx.Linear` output heads (vocabulary-parallel).
NNX_EMBED = _set("NNX_EMBED", *_EMBED)
#: Norm scales and biases (replicated; `norm` in the rules table).
NNX_NORM = _set("NNX_NORM", *_NORM)
#: Every ready-made rule for stock Flax NNX layers, as one set.
NNX = _set("NNX", *_ATTENTION, *_MLP, *_EMBED, *_NORM)

#: The ready-made sets by name: a strategy's `rules` may name them (`rules="NNX"`, or
#: `rules=[my_rule, "NNX"]`), which is how the command line and config files pass them
#: (`--strategy "tp(size=2, rules='NNX')"`).
SETS = {"NNX": NNX, "NNX_ATTENTION": NNX_ATTENTION, "NNX_MLP": NNX_MLP,
        "NNX_EMBED": NNX_EMBED, "NNX_NORM": NNX_NORM}
