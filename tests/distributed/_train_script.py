"""A tiny annotated MLP trained under DataParallel, FSDP or Hybrid, in one process or several.

After the fit, DataParallel and FSDP also evaluate a masked token-weighted loss on sequences
(`token_data`: the same MLP applied to every position) with `self.log(batch_size=tokens)` and
clu metrics. The multi-process tests run this file in 2 processes x 4 devices (`python
_train_script.py OUT dp fsdp hybrid`); the 1-process reference imports `train` and runs it in
the pytest process (8 devices). Nothing here calls jax.distributed: `ArrayLoader` and `Fit`
join the job from the launcher's variables, as a user's script would.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import optax
from clu import metrics as clu_metrics
from flax import nnx

import jaxlight as jl
from jaxlight import strategies

GLOBAL_BATCH = 32
STEPS = 6
#: Strategies that also run the masked token evaluation: 37 sequences in batches of 16, so the
#: last batch holds 5, split 2 / 3 between two processes.
TOKEN_STRATEGIES = ("dp", "fsdp")
TOKEN_ROWS, TOKEN_BATCH, TOKEN_LENGTH = 37, 16, 6


class AnnotatedMLP(nnx.Module):
    """Column- then row-parallel layers (`embed` -> fsdp, `mlp` -> tp) and a classifier head."""

    def __init__(self, din: int, hidden: int, classes: int, *, rngs: nnx.Rngs):
        def init(axes):
            return nnx.with_partitioning(nnx.initializers.lecun_normal(), axes)

        self.up = nnx.Linear(din, hidden, kernel_init=init(("embed", "mlp")), rngs=rngs)
        self.down = nnx.Linear(hidden, din, kernel_init=init(("mlp", "embed")), rngs=rngs)
        self.head = nnx.Linear(din, classes, kernel_init=init(("embed", None)), rngs=rngs)

    def __call__(self, x):
        return self.head(x + self.down(nnx.relu(self.up(x))))


class Module(jl.TrainModule):
    def __init__(self, din: int = 16, hidden: int = 32, classes: int = 4, lr: float = 1e-2):
        super().__init__()
        self.din, self.hidden, self.classes, self.lr = din, hidden, classes, lr

    def configure_model(self, rngs):
        return AnnotatedMLP(self.din, self.hidden, self.classes, rngs=rngs)

    def configure_optimizers(self):
        return optax.adam(self.lr)

    def training_step(self, model, batch):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    def validation_step(self, model, batch):
        logits = model(batch["x"])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        # A weighted mean (like a token-weighted loss): each batch weighs its weights' sum.
        weights = (batch["y"] + 1).astype(losses.dtype)
        self.log("val_weighted_loss", (losses * weights).sum() / weights.sum(),
                 batch_size=weights.sum())
        return {"loss": losses.mean(), "accuracy": (logits.argmax(-1) == batch["y"]).mean()}


#: Token accuracy and loss over the unmasked tokens (clu: merged over batches).
TokenMetrics = clu_metrics.Collection.create(accuracy=clu_metrics.Accuracy,
                                             loss=clu_metrics.Average.from_output("loss"))


class TokenModule(Module):
    """Evaluates sequences (rows, positions, features) of different lengths (`mask`): every mean
    is over real tokens, not over sequences."""

    def validation_step(self, model, batch):
        if "mask" not in batch:  # the classification evaluation (the batch's structure is static)
            return super().validation_step(model, batch)
        logits = model(batch["x"])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        mask = batch["mask"]
        tokens = mask.sum()
        self.log("val_token_loss", (losses * mask).sum() / tokens, batch_size=tokens)
        return {"clu_token_loss": clu_metrics.Average.from_model_output(losses, mask=mask > 0),
                "tokens": TokenMetrics.single_from_model_output(
                    logits=logits, labels=batch["y"], loss=losses, mask=mask > 0)}


def data(n: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 16)).astype(np.float32)
    return {"x": x, "y": x[:, :4].argmax(-1).astype(np.int32)}


def token_data(n: int, seed: int) -> dict:
    """`n` sequences of `TOKEN_LENGTH` positions; sequence i has 1 to TOKEN_LENGTH real ones."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, TOKEN_LENGTH, 16)).astype(np.float32)
    lengths = rng.integers(1, TOKEN_LENGTH + 1, size=n)
    mask = (np.arange(TOKEN_LENGTH)[None] < lengths[:, None]).astype(np.float32)
    return {"x": x, "y": x[..., :4].argmax(-1).astype(np.int32), "mask": mask}


STRATEGIES = {
    "dp": lambda: strategies.DataParallel(),
    "fsdp": lambda: strategies.FSDP(),
    "hybrid": lambda: strategies.Hybrid({"data": 2, "fsdp": 2, "tp": 2}),
}


def host_params(model) -> dict[str, np.ndarray]:
    """Every parameter, whole, as NumPy, on every process: `jaxlight.distributed.gather`, as a
    user reads the trained model (every process calls it: a collective)."""
    import jax

    host = jl.distributed.gather(model)
    state = nnx.to_pure_dict(nnx.state(host, nnx.Param))
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(state)}


def first_global_batch(fit, loader) -> np.ndarray:
    """The first training batch as the strategy lays it out, gathered back to the host."""
    import jax
    from jax.experimental import multihost_utils

    from jaxlight._fit import abstract_global_batch

    local = next(iter(loader))["x"]
    sharding = fit.strategy.batch_shardings(abstract_global_batch(local))
    arr = fit.strategy.put_batch(local, sharding)
    return np.asarray(multihost_utils.process_allgather(arr, tiled=True)
                      if jax.process_count() > 1 else arr)


def train(name: str, root: str, steps: int = STEPS, *, ckpt_dir: str | None = None,
          ckpt_path: str | None = None, evaluate: bool = True) -> dict:
    """Fits under strategy `name`; returns per-step losses, parameters and, with `evaluate`,
    validation metrics, predictions and the first global batch. `ckpt_dir` saves every 4
    steps there (step 4, the one the tests resume from); `ckpt_path` resumes from a checkpoint."""
    losses: dict[int, float] = {}
    record = jl.callbacks.LambdaCallback(
        on_log=lambda fit, module, metrics, step: losses.__setitem__(step, metrics["loss"])
        if "loss" in metrics and "val_loss" not in metrics else None)
    callbacks = [record]
    if ckpt_dir is not None:
        callbacks.append(jl.callbacks.ModelCheckpoint(ckpt_dir, every_n_steps=4, save_top_k=-1))
    train_data = jl.data.ArrayLoader(data(256, 0), GLOBAL_BATCH, seed=1)
    # 33 examples: the last batch holds 1, so one of two processes gets none of it (gathered and
    # evaluated whole, unpadded).
    held_out = data(33, 1)
    val_data = jl.data.ArrayLoader(held_out, GLOBAL_BATCH, shuffle=False, drop_remainder=False)
    # Only `ckpt_dir` saves (the default checkpoint at train end is read by no test), and the CSV
    # log (process 0's metrics.csv) skips its curves.png: each cost seconds per fit.
    fit = jl.Fit(STRATEGIES[name](), max_steps=steps, log_every_n_steps=1, callbacks=callbacks,
                 enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                 enable_checkpointing=ckpt_dir is not None,
                 logger=jl.callbacks.CSVLogger(plot=False))
    tokens = evaluate and name in TOKEN_STRATEGIES
    module = TokenModule() if tokens else Module()
    fit.fit(module, train_data, ckpt_path=ckpt_path)
    kernel = module.model.up.kernel[...]
    result = {"losses": {int(k): v for k, v in losses.items()}, "val": {},
              "params": host_params(module.model), "predictions": np.zeros(0),
              "batch": np.zeros(0), "token_val": {},
              # (False, False) under FSDP on 2 processes: no process holds the whole kernel, so
              # jax.device_get refuses it and gather all-gathers it.
              "kernel_layout": [kernel.is_fully_addressable, kernel.is_fully_replicated]}
    if evaluate:
        result["val"] = fit.validate(module, val_data)
        predictions = fit.predict(module, val_data)
        result["predictions"] = np.concatenate([np.asarray(p) for p in predictions])
        result["batch"] = first_global_batch(
            fit, jl.data.ArrayLoader(data(256, 0), GLOBAL_BATCH, seed=1))
    result["compiles"] = dict(fit.compile_counts)
    if tokens:
        sequences = jl.data.ArrayLoader(token_data(TOKEN_ROWS, 2), TOKEN_BATCH, shuffle=False,
                                        drop_remainder=False)
        result["token_val"] = fit.validate(module, sequences)
        result["token_compiles"] = fit.compile_counts["eval:validation_step"] \
            - result["compiles"]["eval:validation_step"]
    return result


def main(argv: list[str]) -> None:
    """`OUT NAME...`: NAME is a strategy (dp, fsdp, hybrid; fsdp also checkpoints every 4 steps
    to OUT/ckpt_multi) or `ckpt_resume` (FSDP from OUT/ckpt_single/4 to 6 steps)."""
    import jax

    out, names = argv[0], argv[1:]
    rank = int(os.environ.get("RANK", "0"))  # jax.process_index() here would start JAX too early
    for name in names:
        root = os.path.join(out, name, f"rank{rank}")
        if name == "ckpt_resume":
            result = train("fsdp", root, ckpt_path=os.path.join(out, "ckpt_single", "4"),
                           evaluate=False)
        elif name == "fsdp":
            result = train(name, root, ckpt_dir=os.path.join(out, "ckpt_multi"))
        else:
            result = train(name, root)
        assert rank == jax.process_index()
        arrays = {f"param{k}": v for k, v in result["params"].items()}
        arrays.update(predictions=result["predictions"], batch=result["batch"])
        np.savez(os.path.join(out, f"{name}_rank{rank}.npz"), **arrays)
        with open(os.path.join(out, f"{name}_rank{rank}.json"), "w") as f:
            json.dump({"losses": result["losses"], "val": result["val"],
                       "token_val": result["token_val"],
                       "token_compiles": result.get("token_compiles"),
                       "compiles": result["compiles"], "process_count": jax.process_count(),
                       "device_count": jax.device_count(), "kernel_layout": result["kernel_layout"],
                       "host_types": sorted({type(v).__name__ for v in result["params"].values()})},
                      f)
        print(f"{name}: losses {result['losses']}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
