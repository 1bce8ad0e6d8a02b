"""Real multi-process runs on 127.0.0.1 (gloo): 2 processes x 4 simulated CPU devices each.

Few launches, each doing several things, because every process pays the JAX import and its
compiles: one training run (three strategies, checkpoints both ways), one run of bad-input
scenarios, and short runs for missing and dead processes.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import time

import numpy as np
import pytest

from tests.distributed import _train_script as script
from tests.distributed._launch_util import run_launcher, run_processes

#: Real processes: the whole suite's tier (`make test-all`).
pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, "_train_script.py")
SCENARIOS = os.path.join(HERE, "_scenarios.py")
STRATEGIES = ["dp", "fsdp", "hybrid"]
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _failed(results) -> str:
    return "\n".join(r.output[-6000:] for r in results if r.returncode != 0)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The fits in this process, 1 process x 8 devices; FSDP checkpoints every 4 steps."""
    out = tmp_path_factory.mktemp("reference")
    return out, {name: script.train(name, str(out / name), ckpt_dir=str(out / "ckpt_single")
                                    if name == "fsdp" else None) for name in STRATEGIES}


@pytest.fixture(scope="module")
def multi(reference):
    """One 2-process job: the DataParallel, FSDP (checkpointing) and Hybrid fits, then a fit
    resuming the 1-process FSDP checkpoint of step 4."""
    out = reference[0]
    names = [*STRATEGIES, "ckpt_resume"]
    results = run_processes(TRAIN, [str(out), *names], nprocs=2, devices_per_proc=4, timeout=420)
    assert all(r.returncode == 0 for r in results), _failed(results)

    def load(name, rank):
        with open(out / f"{name}_rank{rank}.json") as f:
            meta = json.load(f)
        meta["losses"] = {int(k): v for k, v in meta["losses"].items()}
        arrays = np.load(out / f"{name}_rank{rank}.npz")
        meta["params"] = {k[len("param"):]: arrays[k] for k in arrays if k.startswith("param")}
        meta["predictions"], meta["batch"] = arrays["predictions"], arrays["batch"]
        return meta

    return out, {(n, r): load(n, r) for n in names for r in (0, 1)}


def _assert_same_run(got: dict, want: dict, steps) -> None:
    assert sorted(got["losses"]) == list(steps)
    np.testing.assert_allclose([got["losses"][s] for s in steps],
                               [want["losses"][s] for s in steps], **TOL)
    assert got["params"].keys() == want["params"].keys()
    for key, value in want["params"].items():
        np.testing.assert_allclose(got["params"][key], value, **TOL, err_msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("name", STRATEGIES)
def test_two_processes_match_one_process(multi, reference, name):
    _, runs = multi
    want = reference[1][name]
    for rank in (0, 1):
        got = runs[name, rank]
        assert (got["process_count"], got["device_count"]) == (2, 8)
        _assert_same_run(got, want, range(1, script.STEPS + 1))
        assert got["val"].keys() == want["val"].keys()
        np.testing.assert_allclose([got["val"][k] for k in sorted(want["val"])],
                                   [want["val"][k] for k in sorted(want["val"])], **TOL)
        np.testing.assert_allclose(got["predictions"], want["predictions"], **TOL)
        assert got["predictions"].shape[0] == 33
        # Evaluation and prediction: one compile for the full batches, one for the last of 1.
        assert got["compiles"] == want["compiles"] == {
            "init": 1, "train": 1, "eval:validation_step": 2, "predict": 2}


def _exact_logits_and_losses(params: dict, x: np.ndarray, y: np.ndarray):
    """`_train_script.AnnotatedMLP`'s logits and cross-entropies in float64 NumPy (any leading
    dimensions: rows, or rows and positions)."""
    def p(layer, name):
        return params[f"['{layer}']['{name}']"].astype(np.float64)

    x = x.astype(np.float64)
    hidden = np.maximum(x @ p("up", "kernel") + p("up", "bias"), 0.0)
    logits = (x + hidden @ p("down", "kernel") + p("down", "bias")) @ p("head", "kernel") \
        + p("head", "bias")
    top = logits.max(-1, keepdims=True)
    logz = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    return logits, logz - np.take_along_axis(logits, y[..., None], -1)[..., 0]


def _exact_validation(params: dict, held_out: dict) -> dict:
    """The validation metrics of `_train_script.Module`, in float64 NumPy over all 33 rows."""
    y = held_out["y"]
    logits, losses = _exact_logits_and_losses(params, held_out["x"], y)
    weights = y + 1.0
    return {"val_loss": losses.mean(), "val_accuracy": (logits.argmax(-1) == y).mean(),
            "val_weighted_loss": (losses * weights).sum() / weights.sum()}


@pytest.mark.parametrize("name", STRATEGIES)
def test_two_process_evaluation_is_exact(multi, name):
    """Whole-batch evaluation over 2 processes, last batch of 1 row on one process only."""
    _, runs = multi
    for rank in (0, 1):
        got = runs[name, rank]
        exact = _exact_validation(got["params"], script.data(33, 1))
        for key, value in exact.items():
            assert got["val"][key] == pytest.approx(value, rel=1e-6), key


@pytest.mark.parametrize("name", script.TOKEN_STRATEGIES)
def test_masked_token_metrics_are_exact(multi, reference, name):
    """A masked token-weighted loss (self.log weighted by the batch's token count, a clu Average
    and a clu accuracy Collection over the real tokens) equals float64 NumPy's over all 37
    sequences to 1e-6: in 1 process and in 2, where the last batch of 5 splits 2 / 3."""
    _, runs = multi
    sequences = script.token_data(script.TOKEN_ROWS, 2)
    mask = sequences["mask"].astype(bool)
    for got in [reference[1][name], runs[name, 0], runs[name, 1]]:
        logits, losses = _exact_logits_and_losses(got["params"], sequences["x"], sequences["y"])
        token_loss = losses[mask].mean()
        # The mean of per-sequence means (a per-example evaluation) is another number.
        assert abs(losses.mean(1, where=mask).mean() - token_loss) > 1e-3
        for key in ("val_token_loss", "val_clu_token_loss", "val_tokens_loss"):
            assert got["token_val"][key] == pytest.approx(token_loss, rel=1e-6), key
        accuracy = (logits.argmax(-1) == sequences["y"])[mask].mean()
        assert got["token_val"]["val_tokens_accuracy"] == pytest.approx(accuracy, rel=1e-6)
        assert got["token_compiles"] == 2  # batches of 16 and the last of 5


@pytest.mark.parametrize("name", STRATEGIES)
def test_gather_reads_the_trained_model_on_every_process(multi, name):
    """`jaxlight.distributed.gather(module.model)`, called by both processes after the fit
    (`_train_script.host_params`): the same NumPy parameters on both (the one-process run's:
    `test_two_processes_match_one_process`)."""
    _, runs = multi
    first, second = runs[name, 0], runs[name, 1]
    for got in (first, second):
        assert got["host_types"] == ["ndarray"]
        if name == "fsdp":  # no process held the whole kernel: a real all-gather ran
            assert got["kernel_layout"] == [False, False]
    assert first["params"].keys() == second["params"].keys()
    for key, value in first["params"].items():
        np.testing.assert_array_equal(second["params"][key], value, err_msg=key)


@pytest.mark.parametrize("name", STRATEGIES)
def test_global_batch_is_the_one_process_batch_row_for_row(multi, reference, name):
    _, runs = multi
    for rank in (0, 1):
        np.testing.assert_array_equal(runs[name, rank]["batch"], reference[1][name]["batch"])


def test_only_process_zero_writes_logs(multi):
    out, _ = multi
    rank0 = [os.path.join(d, f) for d, _, files in os.walk(out / "dp" / "rank0") for f in files]
    assert any(f.endswith("metrics.csv") for f in rank0), rank0
    rank1 = [os.path.join(d, f) for d, _, files in os.walk(out / "dp" / "rank1") for f in files]
    assert rank1 == []


def test_two_process_checkpoint_resumes_in_one_process(multi, reference, tmp_path):
    out, _ = multi
    # Both processes wrote their shards of the FSDP state (and process 0 committed it).
    state = out / "ckpt_multi" / "4" / "state"
    for rank in (0, 1):
        assert os.listdir(state / f"ocdbt.process_{rank}" / "d"), rank
    resumed = script.train("fsdp", str(tmp_path / "resumed"),
                           ckpt_path=str(out / "ckpt_multi" / "4"), evaluate=False)
    _assert_same_run(resumed, reference[1]["fsdp"], range(5, script.STEPS + 1))


def test_one_process_checkpoint_resumes_in_two_processes(multi, reference):
    _, runs = multi
    for rank in (0, 1):
        _assert_same_run(runs["ckpt_resume", rank], reference[1]["fsdp"],
                         range(5, script.STEPS + 1))


@pytest.mark.slow
def test_bad_input_across_processes(tmp_path):
    names = ["versions", "devices", "batch_size", "data_length", "stop_on_one_process",
             "tp_everywhere", "mesh_size"]
    results = run_processes(SCENARIOS, [str(tmp_path), *names], timeout=240)
    assert all(r.returncode == 0 for r in results), _failed(results)
    seen = {(n, r): json.loads((tmp_path / f"{n}_rank{r}.json").read_text())
            for n in names for r in (0, 1)}
    for rank in (0, 1):  # every process fails alike, so none is left waiting
        assert seen["versions", rank]["error"] == "DistributedError"
        assert re.search(r"different versions of jaxlight \(process 0: jaxlight \S+; process 1: "
                         r"jaxlight 0\.0\.0-other\)", seen["versions", rank]["message"])
        assert seen["devices", rank]["error"] == "DistributedError"
        assert re.search(r"devices are not homogeneous \(process 0: 4 cpu devices \(4 x cpu\); "
                         r"process 1: 2 gpu devices \(2 x NVIDIA H100 80GB HBM3\)\)",
                         seen["devices", rank]["message"])
        assert seen["batch_size", rank]["error"] == "DataError"
        assert re.search(r"per-process training batch differs .*process 0: \['x'\] \(16, 16\) "
                         r"float32.*process 1: \['x'\] \(8, 16\)",
                         seen["batch_size", rank]["message"])
        assert seen["batch_size", rank]["compiles"] == {}  # refused before compiling
        assert seen["data_length", rank]["error"] == "DataError"
        assert "different lengths (process 0: 4, process 1: 3 batches)" in \
            seen["data_length", rank]["message"]
        # Only process 1 asked to stop, at step 3: both stopped there.
        assert seen["stop_on_one_process", rank]["global_step"] == 3
        assert "a host-side decision on process 1" in seen["stop_on_one_process", rank]["reason"]
        assert seen["tp_everywhere", rank]["error"] == "ShardingError"
        assert re.search(r"on mesh \{'tp': 8\} the devices of process 0 hold batch rows \[0, 32\) "
                         r"of 32, but each process feeds rows \[0, 16\)",
                         seen["tp_everywhere", rank]["message"])
        assert seen["mesh_size", rank]["error"] == "ConfigurationError"
        assert re.search(r"mesh_shape \{'data': 2, 'tp': 2\} has 4 devices but 8 are available "
                         r"\(cpu; 2 processes x 4 local devices\)",
                         seen["mesh_size", rank]["message"])


def test_heterogeneous_job_is_refused_with_the_list():
    """Process 0 has 2 CPU devices, process 1 has 1: both refuse the job at initialize."""
    code = ("import jaxlight\ntry:\n    jaxlight.distributed.initialize()\n"
            "except jaxlight.DistributedError as err:\n    print('refused:', err)\n")
    flags = {1: {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}}
    results = run_processes(code, devices_per_proc=2, rank_env=flags, timeout=120)
    for r in results:
        assert r.returncode == 0, r.output
        assert re.search(r"refused: the processes of this job hold different devices, so the "
                         r"devices are not homogeneous \(process 0: 2 cpu devices \(2 x cpu\); "
                         r"process 1: 1 cpu device \(1 x cpu\)\)", r.stdout), r.output


@pytest.mark.slow
def test_missing_process_ends_with_a_clear_error_within_the_timeout():
    code = "import jaxlight; jaxlight.distributed.initialize()"

    def alone(rank):
        [result] = run_processes(code, ranks=[rank], world_size=2, dist_timeout=1,
                                 devices_per_proc=1, timeout=60)
        return result

    # WORLD_SIZE=2 but one process starts: rank 0 (two separate jobs, run side by side).
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        r0, r1 = pool.map(alone, [0, 1])
    # Rank 0 waits 1 s (the timeout) for rank 1, then says so.
    assert r0.returncode == 1, r0.output
    assert re.search(r"DistributedError: process 0 waited 1 s for the other processes of the job "
                     r"to connect to its coordinator at 127\.0\.0\.1:\d+, but not all 2 arrived\. "
                     r"Check that WORLD_SIZE=2 matches the number of processes started", r0.stderr)
    # Rank 1 alone: nobody listens at the coordinator address.
    assert r1.returncode == 1, r1.output
    assert re.search(r"process 1 could not reach the coordinator at 127\.0\.0\.1:\d+ within 1 s: "
                     r"nothing is listening there", r1.stderr)


@pytest.mark.slow
def test_launcher_stops_the_others_when_one_dies(tmp_path):
    done, _ = run_launcher(["--nprocs", "2", "--devices-per-proc", "1", "--timeout", "10",
                            "--grace", "1", "--", "python", SCENARIOS, str(tmp_path), "die"],
                           timeout=120)
    ended = time.time()
    assert done.returncode == 128 + 9, done.stderr  # rank 1's SIGKILL, passed on
    died = float(re.search(r"\[rank1\] rank 1 dies at ([0-9.]+)", done.stdout).group(1))
    assert ended - died < 10, (ended - died, done.stderr)  # within --timeout, not a hang
    assert "jaxlight launch: rank 1 failed (killed by SIGKILL); stopping rank 0." in done.stderr


@pytest.mark.slow
def test_dead_peer_ends_the_others_without_a_launcher(tmp_path):
    # Rank 1 dies; rank 0 (the coordinator, sleeping, in no collective) notices through JAX's
    # heartbeats within the 5 s timeout and terminates with JAX's diagnosis.
    results = run_processes(SCENARIOS, [str(tmp_path), "die"], devices_per_proc=1,
                            dist_timeout=5, timeout=120)
    r0, r1 = results
    assert r1.returncode == -9 and r0.returncode != 0, _failed(results)
    assert "another task died" in r0.stderr and "stopped sending heartbeats" in r0.stderr
    assert r0.seconds - r1.seconds < 5 + 5, (r0.seconds, r1.seconds)
