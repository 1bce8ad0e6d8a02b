"""Pipeline schedules of GPipe(mpmd=True): GPipe, 1F1B and ZB-H1 side by side.

`GPipe(stages, microbatches, schedule=..., mpmd=True)` on simulated CPU devices
(`jaxlight.strategies._mpmd_schedule`). Five measurements:

1. equivalence: 10 AdamW steps of the seeds' 784→512→256→10 MLP in 3 stages and of a
   StagedTransformerLM in 4 stages (embedding, 2 blocks, head; `Stages(packed=False)`)
   against SingleDevice running the same model, for every schedule; interleaved 1F1B (2
   stages per device) on the MLP with a log-softmax fourth stage and the LM, on 2 devices.
   equivalence_cause: why the MLP sits at ~1e-5 of one device (`equivalence_cause`): the
   largest parameter difference per step, the element it is at, and that element's
   first-step gradient exactly and in float32, beside one device summing the batch in 4
   microbatches (`callbacks.Microbatches(4)`).
2. memory: per pipeline device, the runtime's own accounting of live buffers
   (`MpmdProgram.device_bytes`) at m = p, 2p, 4p, 8p microbatches of a fixed size:
   `activations` (the peak of the forward stage calls' outputs, copies included: what is kept
   for the backward pass) must be flat in m for 1F1B and ZB-H1, and at m = 4p 1F1B's at most
   (p/m) × GPipe's + a constant (`constant_bytes`); beside it `intermediate` (every value that
   is neither the step's input nor its output, plus the running segment's temporaries:
   activations and the gradient buffers).
3. schedule: for m = 1..16 and p = 2..4 the step's timeline built from the compiled program
   (`MpmdProgram.simulate`: each device runs its segments in dispatch order, each as soon as
   its inputs exist) with unit-cost stage calls, against the textbook makespan and bubble
   (`_mpmd_schedule.makespan`, `bubble`): 2(m + p − 1) and (p − 1)/(m + p − 1) for GPipe and
   1F1B, 3m + p − 1 and (p − 1)/(3m + p − 1) for ZB-H1 (m ≥ p; F = B = W = 1 unit), and
   2(v·m + p − 1), (p − 1)/(v·m + p − 1) for interleaved 1F1B with v = 2 stages per device
   (m a multiple of p; a unit is one stage, 1/v of a device's). The model has a learned scale
   in front of its stages so that every stage has an input gradient.
4. overhead: Fit against a hand-written loop of the same schedule (per-device `jax.jit`
   functions for each stage's forward, input gradient and weight gradient of the seeds' MLP,
   dispatched in the textbook order, AdamW per device), alternated in rounds; the median step
   time of each, the process's CPU time per step, and Fit / hand-written of both (on a loaded
   host the CPU-time ratio is the steadier one); and per step, counted rather than timed
   (`per_step_work`): executables dispatched, copies, Python calls on the host, FLOPs and
   bytes accessed per device, for each.

    python benchmarks/pipeline_schedules.py            # results/pipeline_schedules.json
    python benchmarks/pipeline_schedules.py --sections schedule --keep   # one section again
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _common import setup_devices, write_result  # noqa: E402

setup_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from pipeline_stages import DIMS, SeedMLP, batches, fit_seed_mlp  # noqa: E402

import jaxlight as jl  # noqa: E402
from jaxlight import callbacks, nn, strategies  # noqa: E402
from jaxlight.analysis._flops import compiled_flops  # noqa: E402
from jaxlight.strategies._mpmd_schedule import bubble, makespan, timeline  # noqa: E402
from jaxlight.strategies._roofline import bytes_accessed  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "zb-h1")
LM = dict(vocab_size=64, embed_dim=32, num_layers=2, num_heads=4, mlp_dim=64,
          tie_embeddings=False)


def _strategy(schedule, p, m):
    return strategies.GPipe(p, m, schedule=schedule, mpmd=True, devices=jax.devices()[:p])


def _max_diffs(losses, params, ref_losses, ref_params) -> dict:
    pairs = list(zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True))
    return {"max_loss_rel_diff_vs_single": float(np.max(np.abs(losses - ref_losses)
                                                        / np.abs(ref_losses))),
            "max_param_abs_diff_vs_single": max(float(np.max(np.abs(a - b))) for a, b in pairs),
            # The tests' criterion: |a − b| ≤ 1e-5 + 1e-5·|b| for every parameter.
            "params_close_1e-5": all(np.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in pairs)}


class MpmdLM(jl.TrainModule):
    """A StagedTransformerLM's 4 stages, each with its own arrays (`Stages(packed=False)`)."""

    def configure_model(self, rngs):
        lm = nn.StagedTransformerLM(nn.TransformerConfig(**LM), rngs=rngs)
        return nn.Stages([lm.stage(s) for s in range(lm.num_stages)], packed=False)

    def configure_optimizers(self):
        return optax.adamw(1e-2)

    def training_step(self, model, batch):
        tokens = batch["tokens"]
        return nn.lm_loss(model(tokens[:, :-1]), tokens[:, 1:])


def _fit_lm(strategy, steps):
    rng = np.random.default_rng(0)
    data = {"tokens": rng.integers(0, LM["vocab_size"], size=(16 * steps, 17)).astype(np.int32)}
    losses = []
    log = callbacks.LambdaCallback(on_log=lambda f, m, metrics, step: losses.append(
        metrics["loss"]))
    module = MpmdLM()
    fit = jl.Fit(strategy=strategy, max_steps=steps, log_every_n_steps=1, callbacks=[log],
                 enable_progress_bar=False, enable_model_summary=False, logger=False,
                 enable_checkpointing=False)
    fit.fit(module, jl.data.ArrayLoader(data, 16))
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(module.model, nnx.Param)))
    return fit, np.asarray(losses), params


def equivalence(args) -> dict:
    out = {}
    _, _, ref, ref_params, _ = fit_seed_mlp(strategies.SingleDevice(), 3, args.steps,
                                            args.batch, packed=False)
    _, lm_ref, lm_ref_params = _fit_lm(strategies.SingleDevice(), args.steps)
    for schedule in SCHEDULES:
        fit, _, losses, params, _ = fit_seed_mlp(_strategy(schedule, 3, 4), 3, args.steps,
                                                 args.batch, packed=False)
        mlp = {**_max_diffs(losses, params, ref, ref_params),
               "compiles": fit.compile_counts.get("train")}
        lm_fit, lm_losses, lm_params = _fit_lm(_strategy(schedule, 4, 4), args.steps)
        lm = {**_max_diffs(lm_losses, lm_params, lm_ref, lm_ref_params),
              "compiles": lm_fit.compile_counts.get("train")}
        out[schedule] = {"mlp_784_512_256_10_3_stages": mlp, "staged_lm_4_stages": lm,
                         "ok": all(r["max_loss_rel_diff_vs_single"] <= 1e-5
                                   and r["params_close_1e-5"] for r in (mlp, lm))}
    # Interleaved 1F1B needs v ≥ 2 stages per device: the MLP with its log-softmax fourth
    # stage and the LM's 4 stages, on 2 devices (stages 0 and 2 on the first, 1 and 3 on the
    # second).
    _, _, ref4, ref4_params, _ = fit_seed_mlp(strategies.SingleDevice(), 4, args.steps,
                                              args.batch, packed=False)
    fit, _, losses, params, _ = fit_seed_mlp(_strategy("interleaved-1f1b", 2, 4), 4,
                                             args.steps, args.batch, packed=False)
    mlp = {**_max_diffs(losses, params, ref4, ref4_params),
           "compiles": fit.compile_counts.get("train")}
    lm_fit, lm_losses, lm_params = _fit_lm(_strategy("interleaved-1f1b", 2, 4), args.steps)
    lm = {**_max_diffs(lm_losses, lm_params, lm_ref, lm_ref_params),
          "compiles": lm_fit.compile_counts.get("train")}
    out["interleaved-1f1b"] = {"mlp_784_512_256_10_log_softmax_4_stages_on_2": mlp,
                               "staged_lm_4_stages_on_2": lm,
                               "ok": all(r["max_loss_rel_diff_vs_single"] <= 1e-5
                                         and r["params_close_1e-5"] for r in (mlp, lm))}
    return out


class SeedMLP64(SeedMLP):
    """`SeedMLP` with float64 parameters (its float32 initial values, widened), computing in
    float64 on float64 inputs (under `jax.enable_x64`)."""

    def configure_model(self, rngs):
        model = super().configure_model(rngs)
        nnx.update(model, jax.tree.map(lambda v: v.astype(jnp.float64),
                                       nnx.state(model, nnx.Param)))
        return model


def equivalence_float64(args) -> dict:
    """The equivalence section's MLP runs in float64: each schedule (m = 4; interleaved 1F1B on
    the 4-stage MLP over 2 devices) and one device summing 4 microbatches
    (`callbacks.Microbatches(4)`), against one device. Equal here to float64's rounding, the
    float32 differences are the float32 summation order's, not the schedules' arithmetic."""

    def run(strategy, stages=3, cbs=()):
        fit = jl.Fit(strategy=strategy, max_steps=args.steps, callbacks=list(cbs),
                     enable_progress_bar=False, enable_model_summary=False, logger=False,
                     enable_checkpointing=False)
        module = SeedMLP64(stages, False, False)
        fit.fit(module, [{**b, "x": b["x"].astype(np.float64)}
                         for b in batches(args.steps, args.batch)])
        params = _pure(module)
        assert {str(v.dtype) for v in jax.tree.leaves(params)} == {"float64"}
        return params

    def diff(params, ref) -> float:
        return max(float(np.max(np.abs(a - b))) for a, b in zip(
            jax.tree.leaves(params), jax.tree.leaves(ref), strict=True))

    out = {}
    with jax.enable_x64(True):
        ref, ref4 = run(strategies.SingleDevice()), run(strategies.SingleDevice(), 4)
        out["single_device_microbatches_4"] = diff(
            run(strategies.SingleDevice(), cbs=[callbacks.Microbatches(4)]), ref)
        for schedule in SCHEDULES:
            out[schedule] = diff(run(_strategy(schedule, 3, 4)), ref)
        out["interleaved-1f1b"] = diff(run(_strategy("interleaved-1f1b", 2, 4), 4), ref4)
    return {"max_param_abs_diff_vs_single": out, "steps": args.steps, "batch": args.batch}


def _pure(module) -> dict:
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(module.model, nnx.Param)))


def _mlp_loss(params, x, y):
    """The seeds' MLP (`SeedMLP(3)`) on the pure dict of its `Stages`' parameters."""
    stages = params["stage_modules"]
    for s in range(2):
        layer = stages[s]["layers"][0]
        x = jax.nn.relu(x @ layer["kernel"] + layer["bias"])
    logits = x @ stages[2]["kernel"] + stages[2]["bias"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def equivalence_cause(args) -> dict:
    """Where the MLP's schedules differ from one device, and why: per step the largest
    parameter difference of each schedule (m = 4) and of one device summing the batch in 4
    microbatches (`callbacks.Microbatches(4)`: the same model, optimizer and data, nothing
    pipelined), the parameter element it is at, and that element's first-step gradient
    exactly (float64) and in float32 (the whole batch; its 4 contiguous microbatches
    summed), with AdamW's first update lr·g/(|g| + ε) for each."""
    start: dict = {}

    def run(strategy, cbs=()):
        steps = []
        grab = callbacks.LambdaCallback(
            on_train_start=lambda fit, module: start.setdefault("params", _pure(module)),
            on_train_batch_end=lambda fit, module, *a: steps.append(_pure(module)))
        fit = jl.Fit(strategy=strategy, max_steps=args.steps, callbacks=[grab, *cbs],
                     enable_progress_bar=False, enable_model_summary=False, logger=False,
                     enable_checkpointing=False)
        fit.fit(SeedMLP(3, False, False), batches(args.steps, args.batch))
        return steps

    ref = run(strategies.SingleDevice())
    runs = {"single_device_microbatches_4": run(strategies.SingleDevice(),
                                                [callbacks.Microbatches(4)]),
            **{s: run(_strategy(s, 3, 4)) for s in SCHEDULES}}
    out, where = {}, None
    for name, steps in runs.items():
        per_step = [max(float(np.max(np.abs(a - b))) for a, b in zip(
            jax.tree.leaves(got), jax.tree.leaves(want), strict=True))
            for got, want in zip(steps, ref, strict=True)]
        diffs = [(np.abs(a - b), jax.tree_util.keystr(path)) for (path, a), b in zip(
            jax.tree_util.tree_leaves_with_path(steps[-1]), jax.tree.leaves(ref[-1]),
            strict=True)]
        worst, leaf = max(diffs, key=lambda d: float(np.max(d[0])))
        index = tuple(int(i) for i in np.unravel_index(np.argmax(worst), worst.shape))
        where = where or (leaf, index)
        out[name] = {"max_param_abs_diff_per_step": per_step, "largest_at": [leaf, index],
                     "elements_over_1e-6": int(sum(np.sum(d > 1e-6) for d, _ in diffs)),
                     "elements_over_1e-7": int(sum(np.sum(d > 1e-7) for d, _ in diffs))}
    batch, m = batches(args.steps, args.batch)[0], 4

    def element(params, x, y, dtype):
        grads = jax.grad(_mlp_loss)(jax.tree.map(lambda v: v.astype(dtype), params),
                                    x.astype(dtype), y)
        found = {jax.tree_util.keystr(p): g for p, g in jax.tree_util.tree_leaves_with_path(
            grads)}
        return float(found[where[0]][where[1]])

    rows = len(batch["y"]) // m
    with jax.enable_x64(True):
        exact = element(start["params"], batch["x"], batch["y"], np.float64)
    whole = element(start["params"], batch["x"], batch["y"], np.float32)
    parts = np.float32(0)
    for i in range(m):
        parts += np.float32(element(start["params"], batch["x"][i * rows:(i + 1) * rows],
                                    batch["y"][i * rows:(i + 1) * rows], np.float32))
    lr, eps = 1e-3, 1e-8  # SeedMLP's adamw(1e-3), optax's default eps
    grads = {"float64_exact": exact, "float32_whole_batch": whole,
             "float32_microbatches_summed": float(parts / m)}
    out["element"] = {"leaf": where[0], "index": where[1], "first_step_gradient": grads,
                      "adam_first_update": {k: lr * g / (abs(g) + eps) for k, g in grads.items()}}
    return out


def memory(args) -> dict:
    p, b = 3, args.memory_microbatch
    ms = (p, 2 * p, 4 * p, 8 * p)
    rows, own = {}, None
    for schedule in SCHEDULES:
        for m in ms:
            fit, module, *_ = fit_seed_mlp(_strategy(schedule, p, m), p, 1, m * b, packed=False)
            rows[schedule, m] = fit.compiled_train_step.device_bytes()
            own = module.model.own_parameter_bytes()

    def table(field):
        return {s: {f"m={m}": [r[field] for r in rows[s, m]] for m in ms} for s in SCHEDULES}

    act, mid = table("activations"), table("intermediate")
    m = 4 * p
    g, f = act["gpipe"][f"m={m}"], act["1f1b"][f"m={m}"]
    return {
        "stages": p, "microbatch_size": b, "param_bytes_per_device": own,
        "activation_bytes_per_device": act, "intermediate_bytes_per_device": mid,
        "activations_flat_in_m": {s: len({tuple(v) for v in act[s].values()}) == 1
                                  for s in SCHEDULES},
        "intermediate_flat_in_m": {s: len({tuple(v) for v in mid[s].values()}) == 1
                                   for s in SCHEDULES},
        "at_m_4p": {"gpipe": g, "1f1b": f, "p_over_m_times_gpipe": [p / m * x for x in g],
                    "constant_bytes": [a - p / m * c for a, c in zip(f, g, strict=True)],
                    "ok": all(a <= p / m * c for a, c in zip(f, g, strict=True))},
    }


class _Tanh(nnx.Module):
    def __init__(self, width, rngs):
        self.w = nnx.Param(1.0 + 0.1 * jax.random.normal(rngs.params(), (width,)))

    def __call__(self, x):
        return jnp.tanh(x * self.w[...])


class _Scaled(nnx.Module):
    def __init__(self, stages, width, rngs):
        self.scale = nnx.Param(jnp.ones((width,)))
        self.body = nn.Stages([_Tanh(width, rngs) for _ in range(stages)], packed=False)

    def __call__(self, x):
        return self.body(x * self.scale[...])


class ScaledStages(jl.TrainModule):
    """p equal elementwise stages behind a learned scale (every stage has an input gradient)."""

    def __init__(self, stages, width=8):
        super().__init__()
        self.stages, self.width = stages, width

    def configure_model(self, rngs):
        return _Scaled(self.stages, self.width, rngs)

    def configure_optimizers(self):
        return optax.sgd(1e-2)

    def training_step(self, model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def schedule_rows(args) -> dict:
    out = {}
    rng = np.random.default_rng(0)
    for schedule in (*SCHEDULES, "interleaved-1f1b"):
        v = 2 if schedule == "interleaved-1f1b" else 1  # chunks (stages) per device
        for p in (2, 3, 4):
            rows = []
            for m in args.microbatches:
                if m % p and v > 1:
                    continue  # interleaved 1F1B runs microbatches in groups of p
                data = [{"x": rng.normal(size=(2 * m, 8)).astype(np.float32),
                         "y": rng.normal(size=(2 * m, 8)).astype(np.float32)}]
                fit = jl.Fit(strategy=_strategy(schedule, p, m), max_steps=1,
                             enable_progress_bar=False, enable_model_summary=False,
                             logger=False)
                fit.fit(ScaledStages(p * v), data)
                unit = fit.compiled_train_step.simulate(lambda s: float(s.stage is not None))
                row = {"microbatches": m, "unit_makespan": unit["makespan"],
                       "expected_makespan": makespan(schedule, p, m, v),
                       "bubble_fraction_schedule": 1 - max(unit["busy"]) / unit["makespan"],
                       "bubble_fraction_theory": bubble(schedule, p, m, v)}
                row["ok"] = (row["unit_makespan"] == row["expected_makespan"] and abs(
                    row["bubble_fraction_schedule"] - row["bubble_fraction_theory"]) < 1e-12)
                rows.append(row)
            out[f"{schedule} p={p}"] = {"all_ok": all(r["ok"] for r in rows), "rows": rows}
    # Beside each other in the same units (F = B = W = 1: 1F1B's backward is B + W = 2).
    out["zb_h1_vs_1f1b_same_units"] = {
        f"p={p} m={m}": {"1f1b": 3 * (m + p - 1), "zb-h1": makespan("zb-h1", p, m)}
        for p in (2, 3, 4) for m in (p, 2 * p, 4 * p)}
    out["all_ok"] = all(v["all_ok"] for k, v in out.items() if "all_ok" in v)
    return out


# -- the hand-written loop ---------------------------------------------------------------------


def hand_written(schedule, p, m, lr, record=None):
    """`(init(params), step(state, batch) -> (state, loss))`: the seeds' MLP by hand, each
    stage's arrays on its device, passes dispatched in the schedule's textbook order.
    `record`: a list receiving `(function, args)` for every executable call and
    `(jax.device_put, args)` for every copy (counting only: the timed loop runs without)."""
    devices = jax.devices()[:p]
    last = p - 1
    tx = optax.adamw(lr)

    def jit(fn=None, **kwargs):
        if fn is None:
            return functools.partial(jit, **kwargs)
        compiled = jax.jit(fn, **kwargs)
        if record is None:
            return compiled
        return lambda *a: record.append((compiled, a)) or compiled(*a)

    put = jax.device_put if record is None else (
        lambda *a: record.append((jax.device_put, a)) or jax.device_put(*a))

    @jit
    def forward(w, b, x):
        z = x @ w + b
        return z, jax.nn.relu(z)

    @jit
    def loss_grad(z, y):
        loss, g = jax.value_and_grad(
            lambda z: optax.softmax_cross_entropy_with_integer_labels(z, y).mean())(z)
        return loss, g / m

    def input_grad(s):
        @jit
        def run(w, z, ct):
            pre = ct if s == last else ct * (z > 0)
            return pre, (None if s == 0 else pre @ w.T)  # (the batch needs no gradient)
        return run

    @jit
    def first_weight_grad(x, pre):
        return x.T @ pre, pre.sum(0)

    @jit(donate_argnums=(2, 3))
    def weight_grad(x, pre, gw, gb):
        return gw + x.T @ pre, gb + pre.sum(0)

    @jit(donate_argnums=(0, 1))
    def update(params, opt, grads):
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt

    in_grad = [input_grad(s) for s in range(p)]
    timing = timeline(schedule, p, m)
    order = sorted(timing, key=lambda k: (timing[k][0], k[0]))
    split = schedule == "zb-h1"

    def init(params):
        params = [jax.device_put(pp, devices[s]) for s, pp in enumerate(params)]
        return params, [jax.device_put(tx.init(pp), devices[s]) for s, pp in enumerate(params)]

    def step(state, batch):
        params, opt = state
        n = batch["x"].shape[0] // m
        xs = [put(batch["x"][i * n:(i + 1) * n], devices[0]) for i in range(m)]
        ys = [put(batch["y"][i * n:(i + 1) * n], devices[last]) for i in range(m)]
        acts, ins, zs, cts, pres, losses = {}, {}, {}, {}, {}, []
        grads = [None] * p
        for s, kind, i in order:
            if kind == "F":
                x = xs[i] if s == 0 else put(acts.pop((s - 1, i)), devices[s])
                z, a = forward(params[s]["w"], params[s]["b"], x)
                zs[s, i], ins[s, i] = z, x
                if s < last:
                    acts[s, i] = a
                if s == last:
                    loss, cts[s, i] = loss_grad(z, ys[i])
                    losses.append(loss)
                continue
            if kind == "B":
                ct = cts[s, i] if s == last else put(cts.pop((s, i)), devices[s])
                pre, dx = in_grad[s](params[s]["w"], zs.pop((s, i)), ct)
                if s > 0:
                    cts[s - 1, i] = dx
                pres[s, i] = pre
                if split:
                    continue
            x, pre = ins.pop((s, i)), pres.pop((s, i))
            grads[s] = (first_weight_grad(x, pre) if grads[s] is None
                        else weight_grad(x, pre, *grads[s]))
        new = [update(params[s], opt[s], {"w": grads[s][0], "b": grads[s][1]})
               for s in range(p)]
        return ([pp for pp, _ in new], [o for _, o in new]), sum(losses) / m

    return init, step


def _python_calls(fn) -> int:
    """Python function calls (the profiler's 'call' events) while `fn()` runs: host work
    counted, not timed, so that other programs on the cores do not change it."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        count += event == "call"

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def per_step_work(schedule, p, m, batch) -> dict:
    """Per step, counted rather than timed: executables dispatched, copies (`device_put`
    calls), Python function calls on the host (one step after two warm ones) and each
    device's FLOPs and bytes accessed (XLA's cost analysis, each executable as often as it
    runs), for Fit's compiled step (`MpmdProgram`, called as the loop calls it) and the
    hand-written loop."""
    fit = jl.Fit(strategy=_strategy(schedule, p, m), max_steps=1, enable_progress_bar=False,
                 enable_model_summary=False, logger=False)
    fit.fit(SeedMLP(3, False, False), [batch])
    program, state = fit.compiled_train_step, [fit.state]

    def fit_step():
        on_device = jax.device_put(batch, jax.devices()[0])  # as the loop hands it over
        return lambda: state.append(program(state.pop(), on_device)[0])

    for _ in range(2):
        fit_step()()
    fit_calls = _python_calls(fit_step())
    jax.block_until_ready(state)
    costs = program.device_costs()
    fit_row = {"executable_calls": len(program.segments), "copies": len(program.transfers()),
               "executables_compiled": len({id(seg.executable) for seg in program.segments}),
               "python_calls": fit_calls,
               "flops_per_device": [c["flops"] for c in costs],
               "bytes_accessed_per_device": [c["bytes_accessed"] for c in costs]}
    params = [{"w": np.asarray(w), "b": np.asarray(b)} for w, b in _mlp_params(p)]
    init, step = hand_written(schedule, p, m, 1e-3)
    hand_state = [init(params)]
    for _ in range(2):
        hand_state.append(step(hand_state.pop(), batch)[0])
    hand_calls = _python_calls(lambda: hand_state.append(step(hand_state.pop(), batch)[0]))
    jax.block_until_ready(hand_state)
    record: list = []
    init, step = hand_written(schedule, p, m, 1e-3, record)
    step(init(params), batch)
    flops, accessed, compiled = [0.0] * p, [0.0] * p, {}
    for fn, call_args in record:
        if fn is jax.device_put:
            continue
        leaves = [x for x in jax.tree.leaves(call_args) if isinstance(x, jax.Array)]
        key = (id(fn), tuple((x.shape, str(x.dtype)) for x in leaves))
        if key not in compiled:
            done = fn.lower(*call_args).compile()
            compiled[key] = (compiled_flops(done).flops, bytes_accessed(done) or 0.0)
        d = jax.devices().index(next(iter(leaves[0].sharding.device_set)))
        flops[d] += compiled[key][0]
        accessed[d] += compiled[key][1]
    puts = [a for fn, a in record if fn is jax.device_put]
    hand_row = {"executable_calls": len(record) - len(puts),
                "copies": sum(isinstance(a[0], jax.Array) for a in puts),
                "host_to_device_puts": sum(not isinstance(a[0], jax.Array) for a in puts),
                "executables_compiled": len(compiled), "python_calls": hand_calls,
                "flops_per_device": flops, "bytes_accessed_per_device": accessed}
    return {"fit": fit_row, "hand_written": hand_row}


def overhead(args) -> dict:
    p, m, b = 3, args.overhead_microbatches, args.overhead_microbatch_size
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(m * b, DIMS[0])).astype(np.float32),
             "y": rng.integers(0, DIMS[-1], size=(m * b,)).astype(np.int32)}
    out = {}
    for schedule in ("1f1b", "zb-h1"):
        rounds = []
        for _ in range(args.rounds):
            stamps = []
            fit = jl.Fit(strategy=_strategy(schedule, p, m), max_steps=args.overhead_steps,
                         callbacks=[callbacks.LambdaCallback(on_train_batch_end=lambda *a:
                                                             stamps.append(_now()))],
                         enable_progress_bar=False, enable_model_summary=False, logger=False)
            fit.fit(SeedMLP(3, False, False), [batch] * args.overhead_steps)
            init, step = hand_written(schedule, p, m, 1e-3)
            state = init([{"w": np.asarray(w), "b": np.asarray(bb)} for w, bb in _mlp_params(p)])
            hand, prev = [], None
            for _ in range(args.overhead_steps):
                state, loss = step(state, batch)
                if prev is not None:
                    prev.block_until_ready()
                prev = loss
                hand.append(_now())
            jax.block_until_ready(state)
            fit_ms, fit_cpu = _per_step(stamps[args.warmup:])
            hand_ms, hand_cpu = _per_step(hand[args.warmup:])
            rounds.append({"fit_ms": fit_ms, "hand_ms": hand_ms, "ratio": fit_ms / hand_ms,
                           "fit_cpu_ms": fit_cpu, "hand_cpu_ms": hand_cpu,
                           "cpu_ratio": fit_cpu / hand_cpu})
        out[schedule] = {"rounds": rounds,
                         "median_ratio": float(np.median([r["ratio"] for r in rounds])),
                         "median_cpu_ratio": float(np.median([r["cpu_ratio"] for r in rounds])),
                         "per_step": per_step_work(schedule, p, m, batch)}
    return {"stages": p, "microbatches": m, "microbatch_size": b, **out}


def _now():
    return time.perf_counter(), time.process_time()


def _per_step(stamps) -> tuple[float, float]:
    """Median wall ms per step, and the process's CPU ms per step (every thread: the loop's
    dispatching and XLA's work; unlike wall time, not inflated by other programs holding the
    cores)."""
    wall = float(np.median(np.diff([w for w, _ in stamps]))) * 1e3
    cpu = (stamps[-1][1] - stamps[0][1]) / (len(stamps) - 1) * 1e3
    return wall, cpu


def _mlp_params(p):
    rng = np.random.default_rng(1)
    return [(rng.normal(size=(DIMS[s], DIMS[s + 1])).astype(np.float32) * 0.05,
             np.zeros(DIMS[s + 1], np.float32)) for s in range(p)]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=48)
    parser.add_argument("--memory-microbatch", type=int, default=128)
    parser.add_argument("--microbatches", type=int, nargs="*", default=list(range(1, 17)))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--overhead-steps", type=int, default=30)
    parser.add_argument("--overhead-microbatches", type=int, default=6)
    parser.add_argument("--overhead-microbatch-size", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--sections", nargs="*",
                        default=["equivalence", "equivalence_cause", "equivalence_float64",
                                 "memory", "schedule", "overhead"])
    parser.add_argument("--out", default=None)
    parser.add_argument("--keep", action="store_true",
                        help="keep the other sections of an existing results file")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore", UserWarning)  # m < p warns by design
    report = {"jax": jax.__version__, "cpus": os.cpu_count()}
    path = args.out or os.path.join(HERE, "results", "pipeline_schedules.json")
    sections = {"equivalence": equivalence, "equivalence_cause": equivalence_cause,
                "equivalence_float64": equivalence_float64, "memory": memory,
                "schedule": schedule_rows, "overhead": overhead}
    for name in args.sections:
        start = time.perf_counter()
        report[name] = sections[name](args)
        report[name]["seconds"] = time.perf_counter() - start
        print(name, "done", flush=True)
    if args.keep and os.path.exists(path):  # sections run apart: the others kept (read now,
        with open(path) as f:                 # so that runs of other sections may overlap)
            report = {**json.load(f), **report}
    write_result("pipeline_schedules", report, path)
    return report


if __name__ == "__main__":
    main()
