"""A last partial training batch: one more compiled step kind vs padding with zero-weight rows.

Two ways to train on an epoch's short last batch (torch's `DataLoader(drop_last=False)`):

- `partial`: what jaxlight does, `jaxlight.data.DataLoader`; the short batch runs through one
  more compiled step of its shape (`compile_counts["train_partial"]`);
- `padded`: the short batch padded to full size with rows of weight 0 and a `training_step`
  that takes a weighted mean, so the loss equals the unpadded batch's (the user must write
  it so: a plain `.mean()` would count the padding).

Both train the same MLP on the same examples for the same epochs (fresh fits, the persistent
compilation cache off); the report gives each fit's wall time, the extra compile's time, the
steady-state time of a full step and of a partial one, and the largest parameter difference
between the two (they compute the same updates).

    python benchmarks/partial_batch.py
    python benchmarks/partial_batch.py --batch 256 --remainder 64 --epochs 3 --hidden 512

Prints JSON; writes benchmarks/results/partial_batch.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import setup_devices, write_result  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--remainder", type=int, default=64)
    p.add_argument("--full-batches", type=int, default=7)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--din", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--rounds", type=int, default=2,
                   help="alternating rounds of both fits; the last round is reported (the "
                        "first pays JAX's own start-up)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    setup_devices(1)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import jaxlight as jl

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(args.din, args.hidden, rngs=rngs)
            self.l2 = nnx.Linear(args.hidden, args.hidden, rngs=rngs)
            self.l3 = nnx.Linear(args.hidden, 10, rngs=rngs)

        def __call__(self, x):
            return self.l3(nnx.relu(self.l2(nnx.relu(self.l1(x)))))

    class Module(jl.TrainModule):
        def configure_model(self, rngs):
            return MLP(rngs)

        def configure_optimizers(self):
            return optax.sgd(0.05)

        def training_step(self, model, batch):
            ce = optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])
            if "w" in batch:  # padded: the weighted mean over the real rows
                return (ce * batch["w"]).sum() / batch["w"].sum()
            return ce.mean()

    class Timing(jl.callbacks.Callback):
        """Wall time of each step, measured to the end of the step (blocks: timing only)."""

        def __init__(self):
            self.times, self.rows = [], []

        def on_train_batch_start(self, fit, module, batch, batch_idx):
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, fit, module, outputs, batch, batch_idx):
            jax.block_until_ready(outputs.metrics)
            self.times.append(time.perf_counter() - self.t0)
            self.rows.append(int(batch["w"].sum()) if "w" in batch else len(batch["x"]))

    rng = np.random.default_rng(0)
    n = args.batch * args.full_batches + args.remainder
    data = {"x": rng.normal(size=(n, args.din)).astype(np.float32),
            "y": rng.integers(0, 10, n).astype(np.int32)}

    class Padded:
        """DataLoader's batches, the short one padded with zero-weight rows."""

        def __len__(self):
            return -(-n // args.batch)

        def __iter__(self):
            for start in range(0, n, args.batch):
                b = {k: v[start:start + args.batch] for k, v in data.items()}
                real = len(b["x"])
                pad = args.batch - real
                b = {k: np.concatenate([v, np.zeros((pad, *v.shape[1:]), v.dtype)])
                     for k, v in b.items()}
                b["w"] = np.concatenate([np.ones(real, np.float32), np.zeros(pad, np.float32)])
                yield b

    def run(loader):
        timing = Timing()
        fit = jl.Fit("single", max_epochs=args.epochs, callbacks=[timing],
                     enable_progress_bar=False, logger=False, enable_model_summary=False,
                     compilation_cache=False)
        module = Module()
        start = time.perf_counter()
        fit.fit(module, loader)
        wall = time.perf_counter() - start
        # Steady state: every epoch but the first (its steps include the compiles).
        per_epoch = len(timing.times) // args.epochs
        later = [(t, r) for i, (t, r) in enumerate(zip(timing.times, timing.rows, strict=True))
                 if i >= per_epoch]
        full = [t for t, r in later if r == args.batch]
        short = [t for t, r in later if r != args.batch]
        params = jax.tree.leaves(nnx.state(module.model, nnx.Param))
        return fit, wall, float(np.median(full)), float(np.median(short)), params

    init = None
    for _ in range(args.rounds):
        fit_p, wall_p, full_p, short_p, params_p = run(jl.data.DataLoader(data, args.batch))
        fit_d, wall_d, full_d, short_d, params_d = run(Padded())
        init = init or jax.tree.leaves(nnx.state(
            fit_p.session.model(fit_p.session.init_state()), nnx.Param))
    moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(params_p, init, strict=True))
    diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(params_p, params_d, strict=True))
    report = {
        "config": vars(args) | {"examples": n, "steps": fit_p.global_step},
        "partial": {"fit_s": wall_p, "compile_train_s": fit_p.compile_times["train"],
                    "compile_train_partial_s": fit_p.compile_times["train_partial"],
                    "compile_counts": dict(fit_p.compile_counts),
                    "full_step_s": full_p, "partial_step_s": short_p},
        "padded": {"fit_s": wall_d, "compile_train_s": fit_d.compile_times["train"],
                   "compile_counts": dict(fit_d.compile_counts),
                   "full_step_s": full_d, "padded_step_s": short_d},
        "max_param_diff": diff,
        "max_param_change_from_init": moved,
    }
    write_result("partial_batch", report, args.out)


if __name__ == "__main__":
    main()
