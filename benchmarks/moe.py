"""Mixture of experts and the `expert` mesh axis: bytes per device, all-to-all bytes, step time.

A tiny `MoETransformerLM` (width 64, 2 layers, 8 experts of width 64, top-2, batch 16 × 64
tokens) on 8 simulated CPU devices. Everything but the step times comes from the compiled
training step (`Fit.plan`: parameter placement, optimizer bytes and the HLO's collectives).

1. layouts: per layout (single, expert=4, data2×expert4, fsdp2×expert2×tp2, expert=8) the
   expert weights' bytes per device against total / (expert × tp × fsdp shards), and the
   optimizer state per device (AdamW: twice the parameters, plus its step count).
2. all_to_all: the experts' all-to-all bytes per layer and direction against theory. Ideal:
   each device sends its `T_d · k` routed tokens of `D · β` bytes, the `(n−1)/n` bound for other
   devices at an even load: `T_d · k · D · β · (n−1)/n`. jaxlight moves fixed buffers (XLA:CPU
   has no ragged all-to-all): `n · R · D · β · (n−1)/n` with `R` the per-peer buffer rows
   (`jaxlight.nn._moe_dispatch`): dropless `R = T_d · min(k, E/n)`, capacity factor c
   `R = (E/n) · b_d · ceil(c · L · k / E)`. Reported per capacity factor, with the dropped
   fraction of the first step's routing.
3. step_time (CPU, one device, side by side, round robin): the dropless MoE layer (and LM)
   forward+backward against a dense SwiGLU MLP of width `k · F` (the same active FLOPs).
4. overhead (benchmarks/overhead.py's method on the MoE LM): Fit against a hand-written
   `jax.jit` loop (the same module's `training_step`, the same shardings, state donated, two
   steps in flight, each batch `device_put` first), alternated rounds in one process, under
   one device and data 2 × expert 4; the median step time of each (first steps dropped), the
   ratio Fit / hand per round, the same in process CPU seconds, the final parameters'
   largest relative difference, and the instructions whose counts differ between the two
   compiled steps (`overhead.hlo_ops`) with whether their collectives are the same.

    python benchmarks/moe.py              # everything: results/moe.json
    python benchmarks/moe.py --only layouts
    python benchmarks/moe.py --only overhead --rounds 5 --out benchmarks/results/moe_overhead.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _common import setup_devices, write_result  # noqa: E402
from overhead import hlo_ops  # noqa: E402

setup_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxlight as jl  # noqa: E402
from jaxlight import callbacks, nn, strategies  # noqa: E402
from jaxlight.nn._moe_routing import capacity  # noqa: E402

WIDTH, LAYERS, HEADS, VOCAB = 64, 2, 4, 256
EXPERTS, K, EXPERT_DIM = 8, 2, 64
BATCH, LENGTH = 16, 64
LAYOUTS = {
    "single": ({}, 1),
    "expert4": ({"expert": 4}, 4),
    "data2_expert4": ({"data": 2, "expert": 4}, 8),
    "fsdp2_expert2_tp2": ({"fsdp": 2, "expert": 2, "tp": 2}, 8),
    "expert8": ({"expert": 8}, 8),
}


class MoELM(jl.TrainModule):
    def __init__(self, capacity_factor=None):
        super().__init__()
        self.config = nn.MoEConfig(
            vocab_size=VOCAB, embed_dim=WIDTH, num_layers=LAYERS, num_heads=HEADS,
            tie_embeddings=False, num_experts=EXPERTS, experts_per_token=K,
            expert_dim=EXPERT_DIM, capacity_factor=capacity_factor)

    def configure_model(self, rngs):
        return nn.MoETransformerLM(self.config, rngs=rngs)

    def configure_optimizers(self):
        return optax.adamw(1e-3)

    def training_step(self, model, batch):
        logits, aux = model(batch["tokens"][:, :-1], return_aux=True)
        return nn.lm_loss(logits, batch["tokens"][:, 1:]) + aux["loss"]


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    return {"tokens": rng.integers(0, VOCAB, size=(BATCH, LENGTH + 1)).astype(np.int32)}


def _strategy(name):
    shape, n = LAYOUTS[name]
    if not shape:
        return strategies.SingleDevice()
    return strategies.Hybrid(shape, devices=jax.devices()[:n])


def _plan(name, capacity_factor=None):
    fit = jl.Fit(strategy=_strategy(name), max_steps=1, enable_progress_bar=False,
                 enable_model_summary=False, logger=False)
    return fit.plan(MoELM(capacity_factor), _batch(), verbose=False)


def layouts() -> dict:
    out = {}
    for name, (shape, _) in LAYOUTS.items():
        plan = _plan(name)
        experts = [p for p in plan.params if "'moe'" in p.path and any(
            f"['{w}']" in p.path for w in ("gate", "up", "down"))]
        total = sum(p.bytes for p in experts)
        per_device = sum(p.bytes_per_device for p in experts)
        shards = shape.get("expert", 1) * shape.get("tp", 1) * shape.get("fsdp", 1)
        out[name] = {
            "mesh": shape or {"single": 1},
            "expert_param_bytes": total,
            "expert_param_bytes_per_device": per_device,
            "expected_total_over_expert_tp_fsdp": total // shards,
            "ratio_measured_over_expected": per_device / (total / shards),
            "param_bytes_per_device": plan.param_bytes_per_device,
            "opt_state_bytes_per_device": plan.opt_state_bytes_per_device,
            "specs": {p.path: p.spec for p in experts},
        }
    return out


def _a2a_per_layer_direction(plan) -> list[float]:
    """Float all-to-alls (the tokens; the int32 counts are separate), per layer and direction."""
    items = [c for c in plan.collectives if c.kind == "all-to-all"
             and all(dtype.startswith("f") or dtype.startswith("bf") for dtype, _ in c.shapes)]
    # forward: tokens out and results back; backward: the same two transposed; per layer
    return sorted({c.traffic_bytes for c in items}), sum(c.total_traffic_bytes for c in items)


def all_to_all(factors=(None, 1.0, 1.25, 2.0)) -> dict:
    out = {}
    for name in ("expert4", "data2_expert4", "expert8"):
        shape, _ = LAYOUTS[name]
        n = shape["expert"]
        dp = n * shape.get("data", 1)
        t_d, b_d = BATCH * LENGTH // dp, BATCH // dp
        ideal = t_d * K * WIDTH * 4 * (n - 1) / n
        rows = {}
        for cf in factors:
            plan = _plan(name, cf)
            sizes, total = _a2a_per_layer_direction(plan)
            if cf is None:
                r = t_d * min(K, EXPERTS // n)
            else:
                r = min(t_d * min(K, EXPERTS // n),
                        (EXPERTS // n) * b_d * capacity(LENGTH, EXPERTS, K, cf))
            theory_buffer = n * r * WIDTH * 4 * (n - 1) / n
            rows["dropless" if cf is None else f"capacity_{cf}"] = {
                "per_layer_direction_bytes_measured": sizes,
                "per_layer_direction_bytes_from_buffer_rows": theory_buffer,
                "ideal_bytes": ideal,
                "measured_over_ideal": sizes[-1] / ideal if sizes else None,
                "step_total_bytes": total,
                "dropped_fraction_first_step": _dropped(cf),
            }
        out[name] = rows
    return out


def _dropped(cf):
    model = nn.MoETransformerLM(MoELM(cf).config, rngs=nnx.Rngs(0))
    _, aux = nnx.jit(lambda m, t: m(t, return_aux=True))(
        model, jnp.asarray(_batch()["tokens"][:, :-1]))
    return float(aux["dropped_fraction"])


def _timed(fns: dict, args: dict, rounds: int = 7, inner: int = 5) -> dict:
    times = {k: [] for k in fns}
    for k, f in fns.items():  # compile and warm up
        jax.block_until_ready(f(*args[k]))
    for _ in range(rounds):
        for k, f in fns.items():
            start = time.perf_counter()
            for _ in range(inner):
                out = f(*args[k])
            jax.block_until_ready(out)
            times[k].append((time.perf_counter() - start) / inner)
    return {k: float(np.median(v)) for k, v in times.items()}


def step_time(tokens=4096, width=256, expert_dim=256) -> dict:
    rngs = nnx.Rngs(0)
    moe = nn.MoE(width, expert_dim, num_experts=EXPERTS, experts_per_token=K, rngs=rngs)
    dense = nn.MLP(width, K * expert_dim, rngs=rngs)
    x = jax.random.normal(jax.random.key(0), (tokens // 256, 256, width))

    def grad_of(model, call):
        graphdef, state = nnx.split(model)

        def loss(state, x):
            return jnp.sum(call(nnx.merge(graphdef, state), x) ** 2)

        return jax.jit(jax.grad(loss)), state

    moe_grad, moe_state = grad_of(moe, lambda m, x: m(x)[0])
    dense_grad, dense_state = grad_of(dense, lambda m, x: m(x))
    layer = _timed({"moe_dropless": moe_grad, "dense_same_active_flops": dense_grad},
                   {"moe_dropless": (moe_state, x), "dense_same_active_flops": (dense_state, x)})
    active = 2 * 3 * tokens * width * K * expert_dim * 3  # fwd+bwd of three matmuls
    return {
        "shape": {"tokens": tokens, "width": width, "experts": EXPERTS, "k": K,
                  "expert_dim": expert_dim, "dense_mlp_dim": K * expert_dim},
        "layer_fwd_bwd_seconds": layer,
        "moe_over_dense": layer["moe_dropless"] / layer["dense_same_active_flops"],
        "active_flops_fwd_bwd": active,
        "backend": jax.default_backend(),
    }


def _stamp(stamps):
    return lambda *_: stamps.append((time.perf_counter(), time.process_time()))


def _hand_loop(fit, batches) -> tuple[list, dict, str]:
    """The hand-written loop in `fit`'s shardings: timestamps per step, final parameters, the
    compiled step's optimized HLO."""
    from jax.sharding import NamedSharding, PartitionSpec

    module = MoELM()
    graphdef, params, rest = nnx.split(module.configure_model(nnx.Rngs(0)), nnx.Param, ...)
    tx = module.configure_optimizers()
    param_sh, opt_sh = fit.session.shardings.params, fit.session.shardings.opt_state
    mesh = fit.strategy.mesh
    batch_sh = fit.strategy.batch_shardings(jax.eval_shape(lambda: batches[0]))
    params = jax.device_put(nnx.to_pure_dict(params), param_sh)
    opt_state = jax.jit(tx.init, out_shardings=opt_sh)(params)

    def step(params, opt_state, batch):
        def loss_fn(p):
            return module.training_step(nnx.merge(graphdef, p, rest), batch)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    # The strategy's trace context: the mesh and rules the MoE layer's expert dispatch reads.
    with fit.strategy.trace_context():
        step = jax.jit(step, in_shardings=(param_sh, opt_sh, batch_sh),
                       out_shardings=(param_sh, opt_sh, NamedSharding(mesh, PartitionSpec())),
                       donate_argnums=(0, 1)).lower(params, opt_state, batches[0]).compile()
    text = step.as_text()
    stamps, prev = [], None
    for batch in batches:
        params, opt_state, loss = step(params, opt_state, jax.device_put(batch, batch_sh))
        if prev is not None:
            prev.block_until_ready()  # two steps in flight, as Fit keeps
        prev = loss
        stamps.append((time.perf_counter(), time.process_time()))
    prev.block_until_ready()
    return stamps, jax.device_get(params), text


def overhead(layouts=("single", "data2_expert4"), steps=60, warmup=10, rounds=3) -> dict:
    batches = [_batch(seed) for seed in range(steps)]

    def wall(stamps):
        return float(np.median(np.diff([w for w, _ in stamps[warmup:]])))

    def cpu(stamps):
        c = [c for _, c in stamps[warmup:]]
        return (c[-1] - c[0]) / (len(c) - 1)

    out = {}
    for name in layouts:
        rows, rel = [], 0.0
        for _ in range(rounds):
            fit_stamps = []
            fit = jl.Fit(strategy=_strategy(name), max_steps=steps, enable_progress_bar=False,
                         enable_model_summary=False, logger=False, enable_checkpointing=False,
                         callbacks=[callbacks.LambdaCallback(
                             on_train_batch_end=_stamp(fit_stamps))])
            module = MoELM()
            fit.fit(module, batches)
            fit_params = jax.device_get(nnx.to_pure_dict(nnx.state(module.model, nnx.Param)))
            hand_stamps, hand_params, hand_text = _hand_loop(fit, batches)
            fit_ops, hand_ops = hlo_ops(fit.compiled_train_step.as_text()), hlo_ops(hand_text)
            rows.append({"fit_ms": wall(fit_stamps) * 1e3, "hand_ms": wall(hand_stamps) * 1e3,
                         "fit_cpu_ms": cpu(fit_stamps) * 1e3,
                         "hand_cpu_ms": cpu(hand_stamps) * 1e3})
            rel = max(rel, max(float(np.linalg.norm(np.asarray(a) - np.asarray(b))
                                     / np.linalg.norm(np.asarray(b)))
                               for a, b in zip(jax.tree.leaves(fit_params),
                                               jax.tree.leaves(hand_params), strict=True)))
        for r in rows:
            r["ratio"], r["cpu_ratio"] = r["fit_ms"] / r["hand_ms"], r["fit_cpu_ms"] / r[
                "hand_cpu_ms"]
        out[name] = {
            "median_fit_ms": float(np.median([r["fit_ms"] for r in rows])),
            "median_hand_ms": float(np.median([r["hand_ms"] for r in rows])),
            "median_ratio": float(np.median([r["ratio"] for r in rows])),
            "median_cpu_ratio": float(np.median([r["cpu_ratio"] for r in rows])),
            "target_ratio": 1.02,
            "final_params_max_rel_err": rel,
            # The device work, read from the two compiled programs (overhead.py's comparison):
            # the instructions whose counts differ, and whether the collectives are the same.
            "hlo_op_counts_differing": {op: {"fit": fit_ops[op], "hand": hand_ops[op]}
                                        for op in sorted(set(fit_ops) | set(hand_ops))
                                        if fit_ops[op] != hand_ops[op] and op != "collectives"},
            "collectives_equal": fit_ops["collectives"] == hand_ops["collectives"],
            "rounds": rows,
        }
    out["backend"] = jax.default_backend()
    out["device_kind"] = jax.devices()[0].device_kind
    out["note"] = ("on CPU: wall-clock ratios from a shared, loaded machine unless re-measured "
                   "on a quiet one; the CPU-seconds ratio is the steadier figure")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=["layouts", "all_to_all", "step_time", "overhead"])
    parser.add_argument("--out", default=None)
    parser.add_argument("--layouts", default="single,data2_expert4",
                        help="overhead: comma-separated layouts (one GPU: single)")
    parser.add_argument("--steps", type=int, default=60, help="overhead: steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="overhead: alternated rounds")
    args = parser.parse_args()
    report = {"model": {"width": WIDTH, "layers": LAYERS, "experts": EXPERTS, "k": K,
                        "expert_dim": EXPERT_DIM, "batch": BATCH, "length": LENGTH}}
    sections = {"layouts": layouts, "all_to_all": all_to_all, "step_time": step_time,
                "overhead": lambda: overhead(tuple(args.layouts.split(",")), args.steps,
                                             rounds=args.rounds)}
    for name, fn in sections.items():
        if args.only in (None, name):
            report[name] = fn()
    write_result("moe", report, args.out)


if __name__ == "__main__":
    main()
