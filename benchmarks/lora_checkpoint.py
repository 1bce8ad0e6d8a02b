"""LoRA checkpoints: bytes on disk and save/restore time with only the adapters vs with the base.

Fine-tunes an sft `FineTuner` (a `gpt` transformer of `--layers` x `--embed`, LoRA rank
`--rank`) for `--steps` steps, then saves its train state twice with jaxlight's
`CheckpointWriter` (synchronously): as jaxlight does (the adapters, their AdamW state and the
step; the frozen base is rebuilt by configure_model on restore) and with the base weights
included (what a checkpoint held before frozen parameters were skipped). Reports the bytes of
each `state` directory, the save times, and the restore times (plain orbax restore of `state`;
`jaxlight.load_checkpoint`, which also rebuilds and fingerprints the base).

    python benchmarks/lora_checkpoint.py --devices 8 --strategy fsdp --layers 8 --embed 512
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import setup_devices, write_result  # noqa: E402


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f))
               for root, _, files in os.walk(path) for f in files)


class _WithSpec:
    """`fit` as `CheckpointWriter.save` sees it, with the session's spec replaced: the
    "with_base" variant saves with no frozen mask, so it writes `rest` whole, as before."""

    def __init__(self, fit, spec):
        self._fit = fit
        self.session = types.SimpleNamespace(spec=spec)

    def __getattr__(self, name):
        return getattr(self._fit, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--strategy", default="fsdp", choices=["single", "dp", "fsdp"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embed", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="saves/restores timed (best)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    setup_devices(args.devices)

    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from flax import nnx

    import jaxlight as jl
    from jaxlight.checkpoint._restore import CheckpointWriter
    from jaxlight.recipes import sft

    model = {"num_layers": args.layers, "embed_dim": args.embed, "num_heads": args.heads,
             "mlp_dim": 3 * args.embed}
    task = sft.TaskConfig(min_len=3, max_len=3, train_examples=256, val_examples=16)
    data = sft.task_data(task)["train"]
    loader = jl.data.ArrayLoader({k: data[k] for k in ("tokens", "mask")}, 16, seed=0)
    module = sft.FineTuner(model=model, lora_rank=args.rank)
    fit = jl.Fit(args.strategy, max_steps=args.steps, enable_progress_bar=False,
                 enable_model_summary=False, logger=False)
    fit.fit(module, loader)
    jax.block_until_ready(fit.state)

    def nbytes(tree) -> int:
        return sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape))
                   for x in jax.tree.leaves(tree))

    adapters = nbytes(nnx.state(module.model, nnx.LoRAParam))
    base = nbytes(nnx.state(module.model, nnx.Not(nnx.LoRAParam)))
    root = tempfile.mkdtemp(prefix="lora_ckpt_")
    spec = fit.session.spec
    report = {"strategy": args.strategy, "devices": args.devices, "model": model,
              "lora_rank": args.rank, "adapter_params_bytes": adapters, "base_params_bytes": base}
    try:
        for variant, frozen in (("adapters_only", spec.frozen), ("with_base", None)):
            # with_base: the save sees no frozen mask, so it writes `rest` whole, as before.
            saver = _WithSpec(fit, dataclasses.replace(spec, frozen=frozen))
            saves, restores, loads = [], [], []
            for i in range(args.repeats):
                path = os.path.join(root, f"{variant}_{i}")
                writer = CheckpointWriter(path, async_save=False)
                start = time.perf_counter()
                writer.save(saver, module)
                writer.wait()
                saves.append(time.perf_counter() - start)
                writer.close()
                step_dir = os.path.join(path, str(fit.global_step))
                state_dir = os.path.join(step_dir, "state")
                start = time.perf_counter()
                jax.block_until_ready(ocp.StandardCheckpointer().restore(state_dir))
                restores.append(time.perf_counter() - start)
                if frozen is not None:
                    start = time.perf_counter()
                    loaded = jl.load_checkpoint(step_dir, sft.FineTuner(model=model,
                                                                        lora_rank=args.rank))
                    jax.block_until_ready(nnx.state(loaded))
                    loads.append(time.perf_counter() - start)
            report[variant] = {
                "state_dir_bytes": _du(state_dir),
                "save_seconds": min(saves),
                "orbax_restore_seconds": min(restores),
                **({"load_checkpoint_seconds": min(loads)} if loads else {}),
            }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report["bytes_ratio_with_base_over_adapters_only"] = (
        report["with_base"]["state_dir_bytes"] / report["adapters_only"]["state_dir_bytes"])
    name = f"lora_checkpoint_{args.layers}x{args.embed}_r{args.rank}"
    write_result(name, report, args.out)


if __name__ == "__main__":
    main()
