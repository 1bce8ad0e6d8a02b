"""Manual optimization's overhead: Fit's GAN step (two `opt.step` updates) against the same step
hand-written with `jax.jit`, alternated in one run.

Lightning's basic GAN (docs/porting.md: generator 100-128-256-512-1024-784 with BatchNorm,
discriminator 784-512-256-1, Adam for each): Fit runs `training_step(model, batch, opt)`, the
hand-written loop a jitted step that makes the same two updates in Lightning's order, with the
same shardings, donation and bound of two steps in flight (dispatch t, then wait for t-1). The
figure is the median steady-state step time of each and their ratio per round, over alternating
rounds; final parameters are compared too.

    python benchmarks/gan_step.py                    # 1 device and 8 simulated devices (dp)
    python benchmarks/gan_step.py --devices 8 --strategy fsdp --steps 60 --rounds 3

Prints JSON; writes benchmarks/results/gan_step.json (when run for every configuration).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def run_one(args) -> dict:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    import jaxlight as jl
    from jaxlight import callbacks, strategies

    latent, shape = 100, (1, 28, 28)

    def leaky(x):
        return nnx.leaky_relu(x, 0.2)

    class Generator(nnx.Module):
        def __init__(self, rngs):
            def block(i, o, normalize=True):
                bn = [nnx.BatchNorm(o, epsilon=0.8, momentum=0.9, rngs=rngs)] if normalize else []
                return [nnx.Linear(i, o, rngs=rngs), *bn, leaky]

            self.model = nnx.Sequential(*block(latent, 128, False), *block(128, 256),
                                        *block(256, 512), *block(512, 1024),
                                        nnx.Linear(1024, 784, rngs=rngs), nnx.tanh)

        def __call__(self, z):
            return self.model(z).reshape(z.shape[0], *shape)

    class Nets(nnx.Module):
        def __init__(self, rngs):
            self.generator = Generator(rngs)
            self.discriminator = nnx.Sequential(
                nnx.Linear(784, 512, rngs=rngs), leaky, nnx.Linear(512, 256, rngs=rngs), leaky,
                nnx.Linear(256, 1, rngs=rngs))
            self.noise = nnx.Rngs(rngs.params())

    def bce(y_hat, y):
        return optax.sigmoid_binary_cross_entropy(y_hat, y).mean()

    def g_loss(m, z, ones):
        return bce(m.discriminator(m.generator(z).reshape(z.shape[0], -1)), ones)

    def d_loss(m, x, z, ones, zeros):
        fake = jax.lax.stop_gradient(m.generator(z)).reshape(z.shape[0], -1)
        return (bce(m.discriminator(x.reshape(x.shape[0], -1)), ones)
                + bce(m.discriminator(fake), zeros)) / 2

    def adam():
        return optax.adam(2e-4, b1=0.5, b2=0.999)

    class GAN(jl.TrainModule):
        automatic_optimization = False

        def configure_model(self, rngs):
            return Nets(rngs)

        def configure_optimizers(self):
            return [{"name": "generator", "params": "generator", "optimizer": adam()},
                    {"name": "discriminator", "params": "discriminator", "optimizer": adam()}]

        def training_step(self, model, batch, opt):
            x = batch["image"]
            z = jax.random.normal(model.noise(), (x.shape[0], latent))
            ones, zeros = jnp.ones((x.shape[0], 1)), jnp.zeros((x.shape[0], 1))
            gl = opt.step("generator", lambda m: g_loss(m, z, ones))
            dl = opt.step("discriminator", lambda m: d_loss(m, x, z, ones, zeros))
            return {"g_loss": gl, "d_loss": dl}

    rng = np.random.default_rng(0)
    n = args.batch * 8
    data = {"image": np.tanh(rng.normal(size=(n, *shape))).astype(np.float32)}

    def make_strategy():
        if args.devices == 1:
            return strategies.SingleDevice()
        if args.strategy == "fsdp":
            return strategies.FSDP(min_shard_size=0)
        return strategies.DataParallel()

    def fit_round():
        stamps = []
        rec = callbacks.LambdaCallback(
            on_train_batch_end=lambda f, m, o, b, i: stamps.append(time.perf_counter()))
        module = GAN()
        fit = jl.Fit(make_strategy(), max_steps=args.steps, callbacks=[rec],
                     enable_progress_bar=False, enable_model_summary=False, logger=False,
                     log_every_n_steps=args.log_every)
        fit.fit(module, jl.data.ArrayLoader(data, args.batch, seed=0))
        return stamps, jax.device_get(nnx.to_pure_dict(nnx.state(module.model, nnx.Param))), fit

    def hand_round(fit):
        model = Nets(nnx.Rngs(0))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
        tx = adam()
        mesh = fit.strategy.mesh
        sh = fit.session.shardings
        gen_sh, dis_sh = sh.params["generator"], sh.params["discriminator"]
        inner = sh.opt_state.inner_states
        og_sh = inner["generator"].inner_state
        od_sh = inner["discriminator"].inner_state
        axis = {"dp": "data", "fsdp": "fsdp"}[args.strategy] if args.devices > 1 else None
        batch_sh = NamedSharding(mesh, PartitionSpec(axis))
        rep = NamedSharding(mesh, PartitionSpec())
        params = jax.device_put(params, sh.params)
        rest = jax.device_put(rest, sh.rest)
        # Each optimizer's state over its own sub-tree (the hand-written way).
        opt_g = jax.jit(tx.init, out_shardings=_strip(og_sh, "generator"))(params["generator"])
        opt_d = jax.jit(tx.init, out_shardings=_strip(od_sh, "discriminator"))(
            params["discriminator"])

        def run(params, rest, loss_of):
            m = nnx.merge(graphdef, params, rest)
            return loss_of(m), nnx.to_pure_dict(nnx.split(m, nnx.Param, ...)[2])

        def step(params, rest, opt_g, opt_d, x):
            m = nnx.merge(graphdef, params, rest)
            z = jax.random.normal(m.noise(), (x.shape[0], latent))
            rest = nnx.to_pure_dict(nnx.split(m, nnx.Param, ...)[2])
            ones, zeros = jnp.ones((x.shape[0], 1)), jnp.zeros((x.shape[0], 1))
            (gl, rest), grads = jax.value_and_grad(
                lambda g, r: run({**params, "generator": g}, r, lambda m: g_loss(m, z, ones)),
                has_aux=True)(params["generator"], rest)
            upd, opt_g = tx.update(grads, opt_g, params["generator"])
            params = {**params, "generator": optax.apply_updates(params["generator"], upd)}
            (dl, rest), grads = jax.value_and_grad(
                lambda d, r: run({**params, "discriminator": d}, r,
                                 lambda m: d_loss(m, x, z, ones, zeros)),
                has_aux=True)(params["discriminator"], rest)
            upd, opt_d = tx.update(grads, opt_d, params["discriminator"])
            params = {**params,
                      "discriminator": optax.apply_updates(params["discriminator"], upd)}
            return params, rest, opt_g, opt_d, gl + dl

        opt_shardings = (_strip(og_sh, "generator"), _strip(od_sh, "discriminator"))
        step = jax.jit(step, in_shardings=(sh.params, sh.rest, *opt_shardings, batch_sh),
                       out_shardings=(sh.params, sh.rest, *opt_shardings, rep),
                       donate_argnums=(0, 1, 2, 3))
        loader = jl.data.ArrayLoader(data, args.batch, seed=0)
        it = iter(loader)
        stamps, prev = [], None
        for _ in range(args.steps):
            try:
                batch = next(it)
            except StopIteration:
                it = iter(loader)
                batch = next(it)
            params, rest, opt_g, opt_d, loss = step(params, rest, opt_g, opt_d,
                                                    jax.device_put(batch["image"], batch_sh))
            if prev is not None:
                prev.block_until_ready()
            prev = loss
            stamps.append(time.perf_counter())
        prev.block_until_ready()
        del gen_sh, dis_sh
        return stamps, jax.device_get(params)

    def median_step(stamps):
        return float(np.median(np.diff(stamps[args.warmup:])))

    rounds = []
    for _ in range(args.rounds):
        f_stamps, fit_params, fit = fit_round()
        h_stamps, hand_params = hand_round(fit)
        rounds.append({"fit_ms": median_step(f_stamps) * 1e3,
                       "hand_ms": median_step(h_stamps) * 1e3})
    for r in rounds:
        r["ratio"] = r["fit_ms"] / r["hand_ms"]
    err = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
              for a, b in zip(jax.tree.leaves(fit_params), jax.tree.leaves(hand_params),
                              strict=True))
    ratio = float(np.median([r["ratio"] for r in rounds]))
    return {
        "devices": args.devices, "strategy": fit.strategy.name, "steps": args.steps,
        "batch": args.batch, "compiles": dict(fit.compile_counts),
        "median_fit_ms": float(np.median([r["fit_ms"] for r in rounds])),
        "median_hand_ms": float(np.median([r["hand_ms"] for r in rounds])),
        "median_ratio": ratio, "target_ratio": 1.02, "ratio_met": bool(ratio <= 1.02),
        "final_params_max_abs_err": err, "rounds": rounds,
        "platform": jax.devices()[0].platform, "device_kind": jax.devices()[0].device_kind,
    }


def _strip(tree, name):
    """A partition's masked sub-state (the other optimizer's parameters as MaskedNodes) cut
    to the sub-tree `name`: the hand-written loop's own optimizer state layout."""
    import jax

    def whole(x):
        return isinstance(x, dict) and {"generator", "discriminator"} <= set(x)

    return jax.tree.map(lambda node: node[name] if whole(node) else node, tree, is_leaf=whole)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=None, help="simulated CPU devices (one run)")
    p.add_argument("--strategy", choices=["dp", "fsdp"], default="dp")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--out", default=os.path.join(HERE, "results", "gan_step.json"))
    args = p.parse_args(argv)
    if args.devices is not None:
        print(json.dumps(run_one(args)))
        return
    results = []
    for devices, strategy in ((1, "dp"), (8, "dp")):
        cmd = [sys.executable, os.path.abspath(__file__), "--devices", str(devices),
               "--strategy", strategy, "--steps", str(args.steps), "--rounds", str(args.rounds),
               "--batch", str(args.batch), "--warmup", str(args.warmup),
               "--log-every", str(args.log_every)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            results.append({"devices": devices, "strategy": strategy,
                            "error": out.stderr.strip().splitlines()[-1:]})
            continue
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    report = {"benchmark": "gan_step", "results": results}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
