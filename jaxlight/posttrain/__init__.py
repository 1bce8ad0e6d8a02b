"""Post-training: DPO and GRPO losses, and a frozen reference model beside the trained policy.

The losses are pure functions of log-probabilities (Tunix's semantics and defaults, checked
against `tunix.rl.algo_core` and `tunix.sft.dpo` by `tests/posttrain/`), for use inside a
`TrainModule.training_step`; `PolicyAndReference` with `trainable = POLICY` puts a frozen
reference in the same compiled step, outside the optimizer state and the checkpoints.
`rollout` samples GRPO's generation batches; reward functions have TRL's contract (`score`,
`combine`) and prompts come from local files (`read_rows`); `sample_table` / `log_samples` send
sampled completions to the loggers that take text tables.

May import `nn.pretrained`, `callbacks` (the loggers) and the root modules (layer 19 of
docs/architecture.md).
"""

from jaxlight.posttrain._data import read_rows
from jaxlight.posttrain._dpo import DPO_LOSSES, dpo_loss
from jaxlight.posttrain._grpo import (
    ADVANTAGES,
    KL_MODES,
    check_grpo_options,
    group_advantages,
    grpo_loss,
    kl_penalty,
)
from jaxlight.posttrain._logprobs import (
    AGGREGATIONS,
    aggregate,
    batch_weights,
    masked_mean,
    sequence_log_probs,
    token_log_probs,
)
from jaxlight.posttrain._reference import POLICY, PolicyAndReference, without_adapters
from jaxlight.posttrain._rewards import (
    RewardFunction,
    combine,
    reward_metrics,
    reward_name,
    score,
)
from jaxlight.posttrain._rollout import completion_log_probs, rollout
from jaxlight.posttrain._samples import log_samples, sample_table

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "DPO_LOSSES",
    "KL_MODES",
    "POLICY",
    "PolicyAndReference",
    "RewardFunction",
    "aggregate",
    "batch_weights",
    "check_grpo_options",
    "combine",
    "completion_log_probs",
    "dpo_loss",
    "group_advantages",
    "grpo_loss",
    "kl_penalty",
    "log_samples",
    "masked_mean",
    "read_rows",
    "reward_metrics",
    "reward_name",
    "rollout",
    "sample_table",
    "score",
    "sequence_log_probs",
    "token_log_probs",
    "without_adapters",
]
