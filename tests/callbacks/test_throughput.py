"""FLOPs with loop trip counts, throughput and MFU against analytic figures, learning rate,
device memory."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks, strategies
from jaxlight.analysis._flops import compiled_flops, device_peak_flops
from jaxlight.callbacks._lr_monitor import find_schedules
from tests.models import Classifier, classification_data

# Batch, width, layers. Matmuls dominate: the rest (loss, and the SGD update, which every
# device repeats on its replica under data parallelism) is under 1% of 6*B*D*D*L.
B, D, L = 256, 128, 6
PEAK = 1e12  # a made-up peak for the CPU, so that MFU is defined


def _compile(fn, *args):
    return jax.jit(fn).lower(*args).compile()


def test_compiled_flops_counts_every_loop_iteration():
    x = jnp.ones((B, D))
    # A scan over L dense layers, forward and backward: 3 matmuls of 2*B*D*D per layer.
    def loss(ws, x):
        return (jax.lax.scan(lambda h, w: (h @ w, None), x, ws)[0] ** 2).mean()

    count = compiled_flops(_compile(jax.grad(loss), jnp.ones((L, D, D)), x))
    analytic = 3 * 2 * B * D * D * L
    assert count.flops == pytest.approx(analytic, rel=0.02)
    assert count.xla_flops == pytest.approx(analytic / L, rel=0.02)  # XLA: each body once
    assert count.parsed_flops_once == pytest.approx(count.xla_flops, rel=0.01)
    assert [loop.trip_count for loop in count.loops] == [L, L]

    # Nested loops multiply: 3 groups of 5 layers.
    def nested(ws, x):
        def group(h, w5):
            return jax.lax.scan(lambda h, w: (h @ w, None), h, w5)[0], None
        return jax.lax.scan(group, x, ws)[0]

    count = compiled_flops(_compile(nested, jnp.ones((3, 5, D, D)), x))
    assert count.flops == pytest.approx(15 * 2 * B * D * D, rel=0.01)
    assert [(lp.trip_count, lp.multiplicity) for lp in count.loops] == [(3, 1), (5, 3)]

    # fori_loop with static bounds, and a loop-free matmul (nothing to correct).
    count = compiled_flops(_compile(lambda a, b: jax.lax.fori_loop(0, 7, lambda i, a: a @ b, a),
                                    jnp.ones((D, D)), jnp.ones((D, D))))
    assert count.flops == pytest.approx(7 * 2 * D**3, rel=0.01)
    count = compiled_flops(_compile(jnp.matmul, jnp.ones((B, D)), jnp.ones((D, 3 * D))))
    assert count.flops == count.xla_flops == 2 * B * D * 3 * D and count.loops == ()


def test_peak_flops_table():
    assert device_peak_flops("NVIDIA H100 80GB HBM3") == 989.4e12
    assert device_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert device_peak_flops("NVIDIA H200") == 989.4e12
    assert device_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert device_peak_flops("TPU v4") == 275e12
    assert device_peak_flops("TPU v5 lite") == 197e12
    assert device_peak_flops("TPU v5p") == 459e12
    assert device_peak_flops(jax.devices()[0]) is None  # cpu


class DenseStack(jl.TrainModule):
    """L bias-free dense layers under `jl.nn.Stacked` (a scan); training FLOPs are 6*B*D*D*L."""

    def __init__(self, width: int = D, layers: int = L, seq: int = 16):
        super().__init__()
        self.width, self.layers, self.seq = width, layers, seq

    def configure_model(self, rngs):
        return jl.nn.Stacked(lambda r: nnx.Linear(self.width, self.width, use_bias=False,
                                                  rngs=r), self.layers, rngs=rngs)

    def configure_optimizers(self):
        return optax.sgd(optax.linear_schedule(0.1, 0.0, 40))

    def training_step(self, model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()

    def tokens_per_batch(self, batch):
        return batch["x"].shape[0] * self.seq  # as if each example were `seq` tokens

    def analytic_flops(self, batch_size: int) -> float:
        return 6.0 * batch_size * self.width**2 * self.layers


def _regression_data(n=B * 4):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, D)).astype(np.float32)
    return {"x": x, "y": np.tanh(x)}


class Rows(callbacks.Callback):
    def __init__(self):
        self.rows = {}

    def on_log(self, fit, module, metrics, step):
        self.rows.setdefault(step, {}).update(metrics)


# DataParallel in the whole suite only: the fast tier keeps one device and data parallelism (DDP).
@pytest.mark.parametrize("strategy", ["single", pytest.param("dp", marks=pytest.mark.slow), "ddp"])
def test_mfu_matches_analytic_flops(strategy):
    module = DenseStack()
    monitor, rows = callbacks.ThroughputMonitor(peak_flops_per_device=PEAK), Rows()
    fit = jl.Fit(strategies.resolve(strategy), max_steps=12, log_every_n_steps=4,
                 callbacks=[monitor, callbacks.LearningRateMonitor(), rows],
                 enable_progress_bar=False, enable_model_summary=False, logger=False,
                 enable_checkpointing=False)
    fit.fit(module, jl.data.ArrayLoader(_regression_data(), B, seed=0))
    devices = fit.strategy.mesh.devices.size
    analytic = module.analytic_flops(B)
    assert monitor.flops_per_step == pytest.approx(analytic, rel=0.02)
    # Per device, the compiled step does 1/devices of the work; XLA alone counts one layer.
    assert monitor.flop_count.flops * devices == pytest.approx(analytic, rel=0.02)
    assert monitor.flop_count.xla_flops * devices < analytic / (L - 1)
    logged = [r for r in rows.rows.values() if "throughput/mfu" in r]
    assert len(logged) == 3
    for r in logged:
        steps_per_sec = r["throughput/steps_per_sec"]
        assert r["throughput/samples_per_sec"] == pytest.approx(B * steps_per_sec, rel=1e-9)
        assert r["throughput/tokens_per_sec"] == pytest.approx(16 * B * steps_per_sec, rel=1e-9)
        assert r["throughput/flops_per_sec"] == pytest.approx(analytic * steps_per_sec, rel=0.02)
        mfu = analytic * steps_per_sec / (PEAK * devices)
        assert r["throughput/mfu"] == pytest.approx(mfu, rel=0.02)
    assert monitor.summary["throughput/mfu"] > 0
    # The learning rate of each logged step: the schedule at the optimizer count before it.
    schedule = optax.linear_schedule(0.1, 0.0, 40)
    for step, r in rows.rows.items():
        if "loss" in r:
            assert r["lr"] == pytest.approx(float(schedule(step - 1)), rel=1e-6), step


class DeclaredFlops(DenseStack):
    def flops_per_batch(self, batch):
        return 123.0e6


def test_module_declared_flops_win():
    monitor = callbacks.ThroughputMonitor(peak_flops_per_device=PEAK)
    fit = jl.Fit("single", max_steps=4, log_every_n_steps=2, callbacks=[monitor],
                 enable_progress_bar=False, enable_model_summary=False, logger=False,
                 enable_checkpointing=False)
    fit.fit(DeclaredFlops(layers=2), jl.data.ArrayLoader(_regression_data(), B))
    assert monitor.flops_per_step == 123.0e6
    assert monitor.summary["throughput/flops_per_sec"] == pytest.approx(
        123.0e6 * monitor.summary["throughput/steps_per_sec"])


def test_find_schedules():
    sched = optax.cosine_decay_schedule(1.0, 100)
    assert find_schedules(optax.adamw(sched))[0] is sched
    assert find_schedules(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(sched))) == [sched]
    assert find_schedules(optax.adam(1e-3)) == []  # a constant is not a schedule
    other = optax.scale_by_schedule(lambda count: -0.5 * jnp.ones(()))
    [magnitude] = find_schedules(other)
    assert float(magnitude(3)) == 0.5


class InjectedLR(Classifier):
    def configure_optimizers(self):
        schedule = optax.exponential_decay(0.1, transition_steps=1, decay_rate=0.5)
        return optax.inject_hyperparams(optax.sgd)(learning_rate=schedule, momentum=0.9)


def test_lr_monitor_reads_inject_hyperparams():
    rows = Rows()
    fit = jl.Fit("single", max_steps=4, log_every_n_steps=1,
                 callbacks=[callbacks.LearningRateMonitor(log_momentum=True), rows],
                 enable_progress_bar=False, enable_model_summary=False, logger=False,
                 enable_checkpointing=False)
    fit.fit(InjectedLR(), jl.data.ArrayLoader(classification_data(128), 32))
    for step in range(1, 5):
        assert rows.rows[step]["lr"] == pytest.approx(0.1 * 0.5 ** (step - 1), rel=1e-6)
        assert rows.rows[step]["momentum"] == pytest.approx(0.9)
    assert fit.compile_counts["train"] == 1


def test_device_stats_on_cpu_and_lr_monitor_reads_a_constant_lr(capsys):
    monitor, rows = callbacks.DeviceStatsMonitor(), Rows()
    fit = jl.Fit("single", max_steps=2, log_every_n_steps=1,
                 callbacks=[monitor, callbacks.LearningRateMonitor(), rows],
                 enable_progress_bar=False, enable_model_summary=False, logger=False,
                 enable_checkpointing=False)
    fit.fit(Classifier(), jl.data.ArrayLoader(classification_data(64), 32))
    # optax.adam(1e-2)'s constant rate, read from its closure (Lightning logs it too).
    assert [r["lr"] for r in rows.rows.values() if "lr" in r] == pytest.approx([1e-2, 1e-2])
    stats = fit.compiled_train_step.memory_analysis()
    assert rows.rows[0]["memory/step_arguments_gib"] == stats.argument_size_in_bytes / 2**30
    assert math.isfinite(rows.rows[0]["memory/step_temp_gib"])
    # The CPU backend has no allocator statistics: no per-device rows, one note.
    assert jax.devices()[0].memory_stats() is None and monitor.device_metrics() == {}
    assert not any(k.startswith("memory/dev") for r in rows.rows.values() for k in r)
    assert capsys.readouterr().err.count("reports no allocator statistics") == 1
