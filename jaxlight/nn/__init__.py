"""Annotated building blocks that shard correctly under every jaxlight strategy.

Parameters carry logical axis names in MaxText's vocabulary ("embed", "mlp", "heads", "kv",
"vocab", "norm", "layers"); activations are constrained with "batch", "length" and
"activation_*" names. A strategy's rules table (`jaxlight.strategies.DEFAULT_RULES`) maps them
to mesh axes.

| block | weights (logical axes) |
|---|---|
| `Dense` | any, e.g. `("embed", "mlp")` column-parallel, `("mlp", "embed")` row-parallel |
| `Embed` | `("vocab", "embed")`, vocabulary-parallel |
| `RMSNorm` | `("norm",)` |
| `MultiHeadAttention` | qkv `("embed", None, "heads", "kv")`, out `("heads", "kv", "embed")` |
| `MLP` (SwiGLU) | fused gate/up `("embed", None, "mlp")`, down `("mlp", "embed")` |
| `Stacked` | a leading `"layers"` axis on every weight of the repeated block |
| `Stages` | stages of any shape, packed per dtype as `(stages, n)` with `("layers", "embed")` |
| `TransformerLM` | all of the above |
| `StagedTransformerLM` | `TransformerLM` as `Stages`: embedding, blocks, head in the pipeline |
| `MoE`, `MoETransformerLM` | experts `("expert", "embed", "mlp")` / `("expert", "mlp", "embed")` |
| `DecoderLM` | Llama 3, Qwen 2-3, Gemma 3 (`jaxlight.nn.pretrained`: Hugging Face I/O) |
| `SyncedCopy` | a copy following a network (a DQN target, a momentum encoder): `Synced` |

The building blocks (`nn/_*.py`) may import `sharding` and the root modules; this `__init__`
also re-exports `nn.pretrained`'s names, so it sits above `strategies` (layer 13 of
docs/architecture.md), and lower layers import `nn`'s modules, never the package. Those
names are resolved on first use (PEP 562: `__getattr__` imports `jaxlight.nn.pretrained` with
`importlib.import_module`), so importing a building block does not load the pretrained
families; `from jaxlight.nn import from_pretrained` works as before.
"""

import importlib as _importlib

from jaxlight._errors import MissingAttributeError as _MissingAttributeError
from jaxlight.nn._layers import (
    ATTENTION_IMPLEMENTATIONS,
    MLP,
    Dense,
    Embed,
    MultiHeadAttention,
    RMSNorm,
    apply_rope,
    causal_attention,
)
from jaxlight.nn._moe import MoE, MoEConfig, MoETransformerLM
from jaxlight.nn._moe_lora import EXPERT_TARGETS, ExpertLoRA, add_expert_lora
from jaxlight.nn._stacked import LAYERS, REMAT_POLICIES, Stacked
from jaxlight.nn._stages import Stages
from jaxlight.nn._synced import Synced, SyncedCopy
from jaxlight.nn._transformer import (
    StagedTransformerLM,
    TransformerBlock,
    TransformerConfig,
    TransformerLM,
    lm_loss,
)
from jaxlight.sharding._layout import constrain

#: `nn.pretrained`'s names, imported on first use (PEP 562, `__getattr__` below): a plain fit
#: imports `nn`'s building blocks and never pays for the Hugging Face families.
_PRETRAINED = ("DecoderConfig", "DecoderLM", "Tokenizer", "from_pretrained", "generate",
               "save_pretrained")

__all__ = [
    "ATTENTION_IMPLEMENTATIONS",
    "DecoderConfig",
    "DecoderLM",
    "EXPERT_TARGETS",
    "ExpertLoRA",
    "LAYERS",
    "MLP",
    "MoE",
    "MoEConfig",
    "MoETransformerLM",
    "Dense",
    "Embed",
    "MultiHeadAttention",
    "REMAT_POLICIES",
    "RMSNorm",
    "Stacked",
    "StagedTransformerLM",
    "Stages",
    "Synced",
    "SyncedCopy",
    "TransformerBlock",
    "TransformerConfig",
    "Tokenizer",
    "TransformerLM",
    "add_expert_lora",
    "apply_rope",
    "causal_attention",
    "constrain",
    "from_pretrained",
    "generate",
    "lm_loss",
    "save_pretrained",
]


def __getattr__(name: str):
    if name in _PRETRAINED:
        value = getattr(_importlib.import_module("jaxlight.nn.pretrained"), name)
        globals()[name] = value
        return value
    if name == "pretrained":
        return _importlib.import_module("jaxlight.nn.pretrained")
    raise _MissingAttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    hidden = {"_PRETRAINED", "_importlib", "_MissingAttributeError", "__getattr__", "__dir__"}
    return sorted({*globals(), *__all__, "pretrained"} - hidden)
