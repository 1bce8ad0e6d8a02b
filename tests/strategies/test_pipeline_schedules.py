"""Pipeline schedules of GPipe(mpmd=True): 1F1B, ZB-H1 and interleaved 1F1B beside GPipe's.

The textbook schedules (`_mpmd_schedule`) are checked on their own (fast); the programs the
strategy builds are checked against them, against one device, for memory, and for
checkpoints moving between schedules (slow: each fit compiles a program per device).
"""

from __future__ import annotations

import contextlib
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks, nn, strategies
from jaxlight.strategies._mpmd_runtime import MpmdProgram
from jaxlight.strategies._mpmd_schedule import (
    bubble,
    device_orders,
    interleaved_orders,
    makespan,
    timeline,
)
from tests.nn.staged_lm import CONFIG, StagedLM, lm_data
from tests.nn.stages_mlp import StageMLP, stage_data
from tests.pipeline_runs import assert_runs_close, kill_at, logged_fit

STEPS, BATCH, M = 10, 24, 4
SCHEDULES = ("1f1b", "zb-h1")


def _mpmd(schedule="gpipe", p=3, m=M, **kwargs):
    return strategies.GPipe(p, m, schedule=schedule, mpmd=True, devices=jax.devices()[:p],
                            **kwargs)


def _mlp_fit(strategy, steps=STEPS, cbs=(), ckpt_path=None):
    return logged_fit(strategy, StageMLP(packed=False),
                      jl.data.ArrayLoader(stage_data(192), BATCH, seed=1), steps, cbs,
                      ckpt_path)


class MpmdLM(StagedLM):
    """tests/nn/staged_lm.py's StagedTransformerLM (embedding, 2 blocks, head: 4 stages) with
    each stage's own arrays (`Stages(packed=False)`), for a program per device."""

    def configure_model(self, rngs):
        lm = nn.StagedTransformerLM(nn.TransformerConfig(**CONFIG), rngs=rngs)
        return nn.Stages([lm.stage(s) for s in range(lm.num_stages)], packed=False)


# -- the textbook schedules (fast) -------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", *SCHEDULES])
def test_textbook_makespan_bubble_and_memory(schedule):
    """Each order runs every pass once; its unit-cost timeline has the closed-form makespan;
    1F1B's device d holds at most p − d microbatches (F run, B not yet), ZB-H1's at most p
    (F run, W not yet), GPipe's all m."""
    for p in range(2, 5):
        for m in range(1, 17):
            orders = device_orders(schedule, p, m)
            kinds = ("F", "B", "W") if schedule == "zb-h1" else ("F", "B")
            for order in orders:
                assert sorted(order) == sorted((k, i) for k in kinds for i in range(m))
            times = timeline(schedule, p, m)
            assert max(end for _, end in times.values()) == makespan(schedule, p, m)
            for d, order in enumerate(orders):
                held = peak = 0
                for kind, _ in order:
                    held += {"F": 1, "B": 0 if schedule == "zb-h1" else -1, "W": -1}[kind]
                    peak = max(peak, held)
                limit = {"gpipe": m, "1f1b": min(m, p - d), "zb-h1": min(m, p)}[schedule]
                assert peak == limit, (schedule, p, m, d, peak)
    assert bubble("1f1b", 4, 12) == pytest.approx(3 / 15)
    assert bubble("gpipe", 4, 12) == bubble("1f1b", 4, 12)
    assert bubble("zb-h1", 4, 12) == pytest.approx(3 / 39)  # (p − 1)/(3m + p − 1)


def test_textbook_interleaved_1f1b():
    """Megatron's interleaved order: every device runs each of its v chunks' passes once per
    microbatch, and the timeline in passes of one chunk is 2(v·m + p − 1) long: bubble
    (p − 1)/(v·m + p − 1)."""
    for p in range(2, 5):
        for v in (2, 3):
            for m in range(p, 17, p):
                orders = interleaved_orders(p, m, v)
                for d, order in enumerate(orders):
                    assert sorted(order) == sorted((k, i, c * p + d) for k in "FB"
                                                   for i in range(m) for c in range(v))
                times = timeline("interleaved-1f1b", p, m, v=v)
                assert max(end for _, end in times.values()) == makespan(
                    "interleaved-1f1b", p, m, v) == 2 * (v * m + p - 1)
    assert bubble("interleaved-1f1b", 4, 8, 2) == pytest.approx(3 / 19)
    strategy = _mpmd("interleaved-1f1b", p=2, m=3)
    with pytest.raises(jl.ConfigurationError, match=r"3 is not a multiple of 2\. Use "
                                                    r"microbatches=2 or 4, or schedule='1f1b'"):
        strategy.setup(jax.devices()[:2])


def test_unknown_or_unsupported_schedule_is_refused():
    with pytest.raises(jl.ConfigurationError,
                       match=r"schedule='1F1' is not a pipeline schedule.*'gpipe'.*'1f1b'.*"
                             r"'zb-h1'.*Did you mean '1f1b'"):
        strategies.GPipe(3, 4, schedule="1F1", mpmd=True)
    with pytest.raises(jl.ConfigurationError,
                       match=r"GPipe: schedule='1f1b' is not supported here without mpmd=True.*"
                             r"Supported: 'gpipe'"):
        strategies.GPipe(4, 8, schedule="1f1b")
    assert strategies.GPipe(3, 4, schedule="ZB_H1", mpmd=True).schedule == "zb-h1"


def test_a_value_returned_twice_comes_back_as_two_buffers():
    """As from `jax.jit`: a value the traced step returns twice (Adam's two zero moments of a
    leaf, one value in the program) or a constant of the program comes back as buffers of its
    own, so that donating one output to the next step deletes nothing else (the two moments
    read by one optimizer update)."""
    device = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)

    def step(x):
        y = x + 1
        return y, y, jnp.arange(3.0)

    program = MpmdProgram(step, (jax.ShapeDtypeStruct((4,), jnp.float32, sharding=sharding),),
                          sharding, sharding, [device])
    first, second, constant = program(jax.device_put(jnp.zeros(4), device))
    _, _, again = program(jax.device_put(jnp.zeros(4), device))
    assert first.unsafe_buffer_pointer() != second.unsafe_buffer_pointer()
    assert constant.unsafe_buffer_pointer() != again.unsafe_buffer_pointer()
    np.testing.assert_array_equal(second, np.ones(4))


# -- the programs (slow) -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """10 steps of the MLP on one device and under each schedule; GPipe's and 1F1B's runs also
    save their step 5 (in `ckpt`: test_checkpoint_resumes_under_another_schedule resumes it)."""
    root = tmp_path_factory.mktemp("schedules")

    def saving(name):
        return [callbacks.ModelCheckpoint(str(root / name), every_n_steps=5, save_top_k=-1)]

    out = {"single": _mlp_fit("single")}
    for schedule in ("gpipe", *SCHEDULES):
        saves = schedule in ("gpipe", "1f1b")
        out[schedule] = _mlp_fit(_mpmd(schedule), cbs=saving(schedule) if saves else ())
        if saves:
            out[schedule]["ckpt"] = str(root / schedule)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_mlp_matches_single_device(runs, schedule):
    assert_runs_close(runs[schedule], runs["single"])
    assert runs[schedule]["fit"].compile_counts["train"] == 1
    # Auto's roofline prices the schedule's own order (the makespan of its dispatch order):
    # with every stage call at its roofline time, no longer than GPipe's for the same work.
    program, gpipe = (runs[k]["fit"].compiled_train_step for k in (schedule, "gpipe"))
    speeds = (1e11, 1e11, 1e15)  # FLOP/s, memory and link bytes/s: copies ~free
    assert 0 < program.roofline_seconds(*speeds) <= gpipe.roofline_seconds(*speeds) * 1.01


def _lm_loader():
    return jl.data.ArrayLoader(lm_data(160, 9), 16, seed=1)


@pytest.fixture(scope="module")
def lm_single():
    """One device's run of the 4-stage LM: the reference of every schedule's run of it."""
    return logged_fit("single", MpmdLM(), _lm_loader(), STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_staged_lm_in_four_stages_matches_single_device(schedule, lm_single):
    run = logged_fit(_mpmd(schedule, p=4), MpmdLM(), _lm_loader(), STEPS)
    assert_runs_close(run, lm_single)


@pytest.mark.slow
def test_interleaved_1f1b_matches_single_device_in_its_order(lm_single):
    """Interleaved 1F1B, 2 stages per device (stage s on device s mod 2): the MLP with its
    log-softmax fourth stage and the LM's 4 stages equal one device; the MLP's program runs
    Megatron's order, makespan 2(v·m + p − 1) unit stage calls."""
    loader = jl.data.ArrayLoader(stage_data(192), BATCH, seed=1)
    ref = logged_fit("single", StageMLP(4, packed=False), loader, STEPS)
    run = logged_fit(_mpmd("interleaved-1f1b", p=2), StageMLP(4, packed=False), loader, STEPS)
    assert_runs_close(run, ref)
    program = run["fit"].compiled_train_step
    for d, order in enumerate(interleaved_orders(2, M, 2)):
        assert [(s.call.kind, s.call.microbatch, s.stage) for s in program.segments
                if s.stage is not None and s.device == d] == order
    assert program.simulate(lambda seg: float(seg.stage is not None))["makespan"] == \
        makespan("interleaved-1f1b", 2, M, 2)
    devices = jax.devices()[:2]
    model = run["module"].model
    assert model.stage(2).kernel[...].sharding.device_set == {devices[0]}
    assert run["fit"].strategy.describe()["pipeline"]["repeats"] == 2
    assert_runs_close(logged_fit(_mpmd("interleaved-1f1b", p=2), MpmdLM(), _lm_loader(), STEPS),
                      lm_single)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_devices_run_their_passes_in_the_schedules_order(runs, schedule):
    """The dispatch order of the compiled program, per device, is the textbook order (ZB-H1:
    the first stage reads the batch, so it has no input gradient: its backward is all W)."""
    program = runs[schedule]["fit"].compiled_train_step
    for d, order in enumerate(device_orders(schedule, 3, M)):
        got = [(s.call.kind, s.call.microbatch) for s in program.segments
               if s.stage is not None and s.device == d]
        if schedule == "zb-h1" and d == 0:
            order = [x for x in order if x[0] != "B"]
        assert got == order, (d, got)


def _parameter_copies(hlo: str) -> int:
    """Copies of an entry parameter in optimized HLO modules (XLA keeps a donated buffer that
    an output took while it is still read by copying it)."""
    count = 0
    for module in hlo.split("HloModule")[1:]:
        entry = module[module.index("ENTRY"):]
        params = set(re.findall(r"(%[\w.\-]+) = [^\n]*? parameter\(\d+\)", entry))
        count += sum(1 for name in re.findall(r" copy\((%[\w.\-]+)\)", entry) if name in params)
    return count


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", *SCHEDULES])
def test_one_dispatch_per_stage_call(runs, schedule):
    """The loss, each microbatch's labels and the gradient sums run inside the stage calls'
    executables: per step one dispatch per stage call plus at most one optimizer update per
    device (a hand-written loop's count), the labels copied to the loss once, the stage calls
    compiled once for every microbatch (the slices' offsets are inputs), and no executable
    copying a buffer it is given (donating the step's intermediate values made XLA copy
    them)."""
    program = runs[schedule]["fit"].compiled_train_step
    calls = sum(1 for s in program.segments if s.stage is not None)
    # Stage 0 reads the batch: no input gradient, so under ZB-H1 its backward is all W.
    assert calls == {"zb-h1": 3 * M * 3 - M}.get(schedule, 2 * M * 3)
    # Besides the stage calls, at most each device's optimizer update (the first device's
    # joins its last backward pass: it reads nothing from the others).
    others = [(s.device, [op.eqn.primitive.name for op in s.ops][:8])
              for s in program.segments if s.stage is None]
    assert len(others) == len({d for d, _ in others}) <= 3, others
    labels = [c.nbytes for c in program.transfers() if (c.source, c.target) == (0, 2)
              and c.nbytes > 8]
    assert labels == [BATCH * 4]
    # Each stage's forward passes after the first (which takes the step's opening equations)
    # share one executable: the first stage slices its microbatch at an offset that is an
    # input, not a number compiled into each.
    forward: dict = {}
    for s in program.segments:
        if s.stage is not None and s.call.kind == "F" and s.call.microbatch in range(1, M):
            forward.setdefault(s.stage, set()).add(id(s.executable))
    assert schedule == "gpipe" or sorted(forward) == [0, 1, 2]
    assert all(len(found) == 1 for found in forward.values()), forward
    assert _parameter_copies(program.as_text()) == 0
    # Segments alike in structure (a stage's call and glue on every microbatch) are lowered
    # once, not once each (p = 3, m = 6: 1F1B lowered 20 of its 38 segments, ZB-H1 28 of 98
    # at m = 12; all of them before). Under GPipe every lowering makes an executable of its
    # own; under 1F1B and ZB-H1 a few segments of different equations lower to one program.
    assert program.lowered < len(program.segments)
    if schedule == "gpipe":
        assert program.lowered == len({id(s.executable) for s in program.segments})


class _Scaled(jl.TrainModule):
    """p equal elementwise stages behind a learned scale (so the first stage's input has a
    gradient: every stage has an input-gradient pass)."""

    def __init__(self, stages):
        super().__init__()
        self.stages = stages

    def configure_model(self, rngs):
        return _ScaledStages(self.stages, rngs)

    def configure_optimizers(self):
        return optax.sgd(1e-2)

    def training_step(self, model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


class _Tanh(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(1.0 + 0.1 * jax.random.normal(rngs.params(), (4,)))

    def __call__(self, x):
        return jnp.tanh(x * self.w[...])


class _ScaledStages(nnx.Module):
    def __init__(self, stages, rngs):
        self.scale = nnx.Param(jnp.ones((4,)))
        self.body = nn.Stages([_Tanh(rngs) for _ in range(stages)], packed=False)

    def __call__(self, x):
        return self.body(x * self.scale[...])


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", *SCHEDULES])
@pytest.mark.parametrize("p,m", [(2, 1), (3, 2), (3, 6), (4, 5)])
def test_schedule_read_from_the_program_is_the_textbook_one(schedule, p, m):
    """`MpmdProgram.simulate` with unit-cost stage calls (every device running its segments
    in dispatch order, each as soon as its inputs exist) gives the textbook makespan, and each
    device is busy exactly its passes (benchmarks/pipeline_schedules.py: m = 1..16, p = 2..4)."""
    rng = np.random.default_rng(0)
    data = [{"x": rng.normal(size=(2 * m, 4)).astype(np.float32),
             "y": rng.normal(size=(2 * m, 4)).astype(np.float32)}]
    fit = jl.Fit(strategy=_mpmd(schedule, p=p, m=m), max_steps=1, enable_progress_bar=False,
                 enable_model_summary=False, logger=False, enable_checkpointing=False)
    with pytest.warns(UserWarning, match="microbatches") if m < p else contextlib.nullcontext():
        fit.fit(_Scaled(p), data)
    unit = fit.compiled_train_step.simulate(lambda seg: float(seg.stage is not None))
    assert unit["makespan"] == makespan(schedule, p, m)
    assert unit["busy"] == [(3 if schedule == "zb-h1" else 2) * m] * p
    assert 1 - max(unit["busy"]) / unit["makespan"] == pytest.approx(bubble(schedule, p, m))


@pytest.mark.slow
def test_1f1b_activation_memory_is_flat_in_microbatches():
    """Per device, the runtime's peak of live forward-pass outputs (`device_bytes`'s
    `activations`: what is kept for the backward pass, copies included) at m = p, 2p, 4p, 8p
    microbatches of 16 examples: the same for 1F1B and ZB-H1 (device d holds p − d
    microbatches' under 1F1B, at most p under ZB-H1), m microbatches' for GPipe; at m = 4p
    1F1B's is at most p/m of GPipe's (the constant is 0 here)."""
    p, b = 3, 16
    ms = (p, 2 * p, 4 * p, 8 * p)
    peaks = {}
    for schedule in ("gpipe", *SCHEDULES):
        for m in ms:
            data = jl.data.ArrayLoader(stage_data(m * b), m * b)
            run = logged_fit(_mpmd(schedule, p=p, m=m), StageMLP(packed=False), data, 1)
            peaks[schedule, m] = [r["activations"]
                                  for r in run["fit"].compiled_train_step.device_bytes()]
    one = [x // p for x in peaks["gpipe", p]]  # one microbatch's, per device
    for m in ms:
        assert peaks["gpipe", m] == [m * x for x in one], peaks
        assert peaks["1f1b", m] == [(p - d) * one[d] for d in range(p)], peaks
        assert peaks["zb-h1", m] == peaks["zb-h1", p], peaks
        assert all(x <= p * y for x, y in zip(peaks["zb-h1", m], one, strict=True)), peaks
    m = 4 * p
    assert all(f <= p / m * g for f, g in zip(peaks["1f1b", m], peaks["gpipe", m], strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("first,then", [("gpipe", "1f1b"), ("1f1b", "gpipe"),
                                        ("gpipe", "zb-h1")])
def test_checkpoint_resumes_under_another_schedule(runs, tmp_path, first, then):
    """5 steps under one schedule, saved (the `runs` fit's step 5); 5 more under another from
    the checkpoint: the run of 10 steps under the first, to 1e-5 (the schedules sum the same
    gradients in another order)."""
    resumed = _mlp_fit(_mpmd(then),
                       cbs=[callbacks.ModelCheckpoint(str(tmp_path), every_n_steps=5)],
                       ckpt_path=os.path.join(runs[first]["ckpt"], "5"))
    assert resumed["fit"].global_step == STEPS
    for a, b in zip(jax.tree.leaves(resumed["params"]), jax.tree.leaves(runs[first]["params"]),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_1f1b_resume_after_sigkill_is_bitwise_exact(runs, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    saved = kill_at("stages_1f1b", ckpt, STEPS, 6)
    assert saved and saved[-1] < STEPS, saved
    resumed = _mlp_fit(_mpmd("1f1b"),
                       cbs=[callbacks.ModelCheckpoint(ckpt, every_n_steps=STEPS)],
                       ckpt_path="last")
    assert resumed["fit"].global_step == STEPS
    for a, b in zip(jax.tree.leaves(resumed["params"]), jax.tree.leaves(runs["1f1b"]["params"]),
                    strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_plan_shows_the_schedule():
    fit = jl.Fit(strategy=_mpmd("1f1b", m=6), max_steps=1, enable_progress_bar=False,
                 logger=False)
    plan = fit.plan(StageMLP(packed=False), stage_data(BATCH), verbose=False)
    pipe = plan.strategy["pipeline"]
    assert pipe["schedule"] == "1f1b" and pipe["microbatches_in_flight"] == 3
    assert pipe["bubble_fraction"] == pytest.approx(2 / 8)
    assert "pipeline: 1f1b schedule" in plan.table()
