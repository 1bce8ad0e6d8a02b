"""The code paths a CPU cannot exercise, each run once on an accelerator, one JSON line per path.

    python benchmarks/gpu_paths.py                  # on one GPU (benchmarks/gpu.sh runs it)
    python benchmarks/gpu_paths.py --out /tmp/x.json  # anywhere: CPU records what it cannot run

Each path is run in a `try`; its row says whether it ran, what it measured and, if it failed,
the error's type and first line, so one failing path does not hide the others:

- `cudnn_attention`: the `gpt` model trained with `attention="cudnn"` (bf16-mixed) and
  evaluated (`validate`); the same steps with `attention="xla"` from the same weights give the
  reference loss.
- `bf16_mixed`, `bf16_true`: short fits under each precision (parameter dtypes recorded).
- `checkpoint_bf16`: a `bf16-true` model saved from device memory by `ModelCheckpoint`
  (asynchronous: on a GPU with free memory the snapshot is taken on the device) and restored
  with `load_checkpoint`, compared bitwise with the trained parameters.
- `profiler_trace`: the `Profiler` callback's trace, opened and searched for device kernels.
- `device_stats`: `DeviceStatsMonitor`'s allocator figures and the step's static footprint.
- `peak_flops_table`: which entry of `ThroughputMonitor`'s peak table the device picks.
- `versions`: jax, jaxlib, flax, optax, orbax and the CUDA/cuDNN versions the backend reports.

Writes benchmarks/results/gpu_paths_<device>.json (or `--out`).
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import RESULTS, write_result  # noqa: E402

#: The CPU test environment's versions (pyproject's resolution on 2026-11-26), for API drift.
CPU_ENV = {"jax": "0.10.2", "jaxlib": "0.10.2", "flax": "0.12.8", "optax": "0.2.8"}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import jaxlight as jl
    from jaxlight import callbacks
    from jaxlight.recipes import gpt

    device = jax.devices()[0]
    rows: list[dict] = []
    work = tempfile.mkdtemp(prefix="gpu_paths_")

    def record(name, fn):
        t0 = time.perf_counter()
        try:
            row = {"path": name, "ok": True, **fn()}
        except Exception as e:  # noqa: BLE001 - every path is reported, failed or not
            row = {"path": name, "ok": False, "error": type(e).__name__,
                   "message": str(e).splitlines()[0][:500] if str(e) else "",
                   "traceback": traceback.format_exc()[-2000:]}
        row["seconds"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)

    # A small gpt model whose heads are 128 wide: cuDNN's flash attention applies in bf16.
    def config(**model):
        c = gpt.Config()
        c.model.num_layers, c.model.embed_dim, c.model.num_heads, c.model.mlp_dim = 2, 256, 2, 512
        for k, v in model.items():
            setattr(c.model, k, v)
        return c

    seq, batch = 256, 8
    rng = np.random.default_rng(0)
    train = [{"tokens": rng.integers(0, 256, size=(batch, seq + 1)).astype(np.int32)}
             for _ in range(4)]
    val = [{"tokens": rng.integers(0, 256, size=(batch, seq + 1)).astype(np.int32)}
           for _ in range(2)]

    def loop():
        i = 0
        while True:
            yield train[i % len(train)]
            i += 1

    def fit(c, precision="bf16-mixed", extra=(), steps=None, root=None, val_data=None):
        module = gpt.make_module(c, max_steps=steps or args.steps)
        f = jl.Fit("single", max_steps=steps or args.steps, precision=precision,
                   callbacks=list(extra), enable_progress_bar=False, enable_model_summary=False,
                   logger=False, log_every_n_steps=4, default_root_dir=root or work, seed=0,
                   num_sanity_val_steps=0)
        f.fit(module, loop(), val_data)
        return f, module

    def params_of(module):
        return jax.device_get(nnx.to_pure_dict(nnx.state(module.model, nnx.Param)))

    def cudnn_attention():
        from jaxlight.nn._layers import attention_implementation

        used = attention_implementation("cudnn", jax.default_backend(), jnp.bfloat16, 128)
        f, m = fit(config(attention="cudnn"))
        metrics = f.validate(m, val)
        fx, mx = fit(config(attention="xla"))
        metrics_x = fx.validate(mx, val)
        loss = {k: float(v) for k, v in metrics.items()}
        loss_x = {k: float(v) for k, v in metrics_x.items()}
        key = next(k for k in loss if "loss" in k)
        return {"implementation": used, "validate_cudnn": loss, "validate_xla": loss_x,
                "abs_diff": abs(loss[key] - loss_x[key]),
                "train_metrics": {k: float(v) for k, v in f.callback_metrics.items()
                                  if isinstance(v, (int, float, np.floating, np.ndarray))}}

    def precision_path(precision):
        def run():
            f, m = fit(config(), precision=precision)
            metrics = f.validate(m, val)
            dtypes = sorted({str(x.dtype) for x in jax.tree.leaves(params_of(m))})
            return {"validate": {k: float(v) for k, v in metrics.items()},
                    "param_dtypes": dtypes}
        return run

    def checkpoint_bf16():
        root = os.path.join(work, "ckpt")
        ckpt = callbacks.ModelCheckpoint(os.path.join(root, "checkpoints"), every_n_steps=4)
        f, m = fit(config(), precision="bf16-true", extra=[ckpt], root=root)
        trained = params_of(m)
        restored = gpt.GPT.load_from_checkpoint(ckpt.last_model_path) \
            if hasattr(gpt.GPT, "load_from_checkpoint") else None
        if restored is None:
            raise RuntimeError("GPT.load_from_checkpoint is missing")
        back = params_of(restored)
        # Saved in bfloat16, loaded into the module's float32: the values must be the same.
        leaves_a, leaves_b = jax.tree.leaves(trained), jax.tree.leaves(back)
        equal = len(leaves_a) == len(leaves_b) and all(
            np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
            for a, b in zip(leaves_a, leaves_b, strict=True))
        if not equal:
            raise AssertionError("restored parameters differ from the trained ones")
        return {"checkpoint": ckpt.last_model_path, "values_equal": equal,
                "saved_dtypes": sorted({str(x.dtype) for x in leaves_a}),
                "loaded_dtypes": sorted({str(x.dtype) for x in leaves_b}),
                "device_memory_stats": bool(device.memory_stats())}

    def profiler_trace():
        prof = callbacks.Profiler(start_step=4, num_steps=2, logdir=os.path.join(work, "prof"))
        fit(config(), extra=[prof], steps=8)
        traces = glob.glob(os.path.join(prof.trace_dir, "plugins", "profile", "*",
                                        "*.trace.json.gz"))
        if not traces:
            raise FileNotFoundError(f"no *.trace.json.gz under {prof.trace_dir}")
        with gzip.open(traces[0], "rt") as fh:
            trace = json.load(fh)
        events = trace.get("traceEvents", [])
        pids = {e.get("pid"): e.get("args", {}).get("name", "") for e in events
                if e.get("ph") == "M" and e.get("name") == "process_name"}
        gpu_pids = {pid for pid, name in pids.items()
                    if re.search(r"/device:GPU|GPU:|gpu", str(name), re.IGNORECASE)}
        kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids]
        names = sorted({e.get("name", "") for e in kernels})
        if not kernels:
            raise AssertionError(
                f"no device events in the trace; processes: {sorted(pids.values())}")
        return {"trace": os.path.basename(traces[0]), "device_events": len(kernels),
                "distinct_kernels": len(names), "some_kernels": names[:12],
                "processes": sorted(set(pids.values()))[:12],
                "host_timing": prof.step_timings}

    def device_stats():
        monitor = callbacks.DeviceStatsMonitor()
        fit(config(), extra=[monitor], steps=6)
        figures = monitor.device_metrics()
        if not figures:
            raise AssertionError("the backend reported no allocator statistics")
        return {"device_metrics": figures, "static": monitor.static}

    def peak_table():
        from jaxlight.analysis._flops import device_peak_entry, device_peak_flops

        return {"device_kind": device.device_kind, "peak_flops": device_peak_flops(device),
                "entry": device_peak_entry(device)}

    def versions():
        import flax
        import jaxlib
        import optax
        import orbax.checkpoint as ocp

        found = {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
                 "flax": flax.__version__, "optax": optax.__version__,
                 "orbax_checkpoint": getattr(ocp, "__version__", None),
                 "backend": jax.default_backend(),
                 "platform_version": getattr(device.client, "platform_version", None),
                 "device_kind": device.device_kind}
        try:
            found["environment"] = jax.print_environment_info(return_string=True)
        except Exception as e:  # noqa: BLE001
            found["environment"] = f"unavailable: {e}"
        found["cpu_test_env"] = CPU_ENV
        found["differs_from_cpu_env"] = {k: [CPU_ENV[k], found[k]] for k in CPU_ENV
                                         if found.get(k) != CPU_ENV[k]}
        return found

    record("versions", versions)
    record("peak_flops_table", peak_table)
    record("cudnn_attention", cudnn_attention)
    record("bf16_mixed", precision_path("bf16-mixed"))
    record("bf16_true", precision_path("bf16-true"))
    record("checkpoint_bf16", checkpoint_bf16)
    record("profiler_trace", profiler_trace)
    record("device_stats", device_stats)

    name = re.sub(r"[^A-Za-z0-9]+", "_", device.device_kind).strip("_").lower()
    report = {"benchmark": "gpu_paths", "device": device.device_kind,
              "platform": device.platform, "paths": rows,
              "all_ok": all(r["ok"] for r in rows)}
    write_result(f"gpu_paths_{name}", report,
                 args.out or os.path.join(RESULTS, f"gpu_paths_{name}.json"))


if __name__ == "__main__":
    main()
