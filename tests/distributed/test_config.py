"""Launcher-variable detection, validation and bad input, in the pytest process (no peers).

The real multi-process runs are in test_multiprocess.py.
"""

from __future__ import annotations

import os
import socket

import jax
import pytest

import jaxlight as jl
from jaxlight import ConfigurationError, distributed
from jaxlight._cli import main as cli_main
from jaxlight.distributed._launch import child_env
from jaxlight.distributed._launch import main as launch_main

TORCHRUN = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "RANK": "3", "WORLD_SIZE": "4",
            "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}


def test_torchrun_variables_map_to_jax_processes():
    config = distributed.detect(TORCHRUN).validate()
    assert (config.num_processes, config.process_id, config.coordinator_address) == (
        4, 3, "10.0.0.1:29500")
    assert (config.local_rank, config.local_world_size, config.num_nodes) == (1, 2, 2)
    assert config.local_device_ids == (1,)  # one accelerator per process, as JAX does for SLURM
    assert config.cluster_detection_method == "deactivate"
    assert distributed.detect({**TORCHRUN, "JAX_COORDINATOR_PORT": "1234"}) \
        .coordinator_address == "10.0.0.1:1234"


def test_cluster_variables_are_detected_like_jax_does():
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_NTASKS": "8",
             "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
             "SLURM_STEP_NUM_NODES": "2"}
    config = distributed.detect(slurm).validate()
    assert (config.source, config.num_processes, config.process_id, config.local_world_size,
            config.num_nodes, config.cluster_detection_method) == ("slurm", 8, 5, 4, 2, "slurm")
    ompi = {"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.2:4000", "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    assert distributed.detect(ompi).source == "ompi"
    k8s = {"KUBERNETES_SERVICE_HOST": "10.1.0.1", "JOB_COMPLETION_INDEX": "2"}
    assert (distributed.detect(k8s).source, distributed.detect(k8s).process_id) == ("k8s", 2)
    tpu = {"TPU_WORKER_HOSTNAMES": "w0,w1,w2,w3", "TPU_WORKER_ID": "1"}
    assert distributed.detect(tpu).source == "tpu"
    # A pod that is not an indexed Job, one TPU host, a one-process torchrun: single process.
    for env in ({"KUBERNETES_SERVICE_HOST": "10.1.0.1"}, {"TPU_WORKER_HOSTNAMES": "w0"},
                {"WORLD_SIZE": "1"}, {}):
        config = distributed.detect(env)
        assert config is None or not config.is_multi_process
    assert distributed.detect({**TORCHRUN, "JAXLIGHT_DISTRIBUTED": "0"}) is None


@pytest.mark.parametrize("env, match", [
    ({**TORCHRUN, "RANK": "4"}, r"RANK=4 is not below WORLD_SIZE=4 .* ranks are 0 \.\.\. 3"),
    ({**TORCHRUN, "NNODES": "3"},
     r"WORLD_SIZE=4 but NNODES=3 nodes x LOCAL_WORLD_SIZE=2 processes per node = 6"),
    ({**TORCHRUN, "LOCAL_RANK": "2"}, r"LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"),
    ({**TORCHRUN, "RANK": "-1"}, r"RANK=-1 .* never negative"),
    ({**TORCHRUN, "WORLD_SIZE": "0"}, r"WORLD_SIZE=0 .* at least 1"),
    ({**TORCHRUN, "MASTER_PORT": "70000"}, r"port 70000 is not in 1 \.\.\. 65535"),
    ({**TORCHRUN, "WORLD_SIZE": "four"}, r"WORLD_SIZE='four' is not an integer"),
    ({"WORLD_SIZE": "2", "RANK": "0"}, r"MASTER_ADDR, MASTER_PORT are not set"),
    ({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "8", "SLURM_PROCID": "9",
      "SLURM_LOCALID": "0"}, r"SLURM_PROCID=9 is not below SLURM_NTASKS=8"),
])
def test_inconsistent_layouts_are_named(env, match):
    with pytest.raises(ConfigurationError, match=match):
        distributed.detect(env).validate()


def test_open_mpi_5_without_a_coordinator_is_named(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    with pytest.raises(ConfigurationError, match=r"not OMPI_MCA_orte_hnp_uri.*"
                                                 r"JAX_COORDINATOR_ADDRESS=host:port"):
        jl.distributed.initialize()
    assert distributed.detect({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1",
                               "JAX_COORDINATOR_ADDRESS": "10.0.0.1:99"}).coordinator_address \
        == "10.0.0.1:99"


def test_explicit_arguments_are_validated_with_their_names():
    with pytest.raises(ConfigurationError, match=r"process_id=2 is not below num_processes=2"):
        distributed.DistributedConfig(num_processes=2, process_id=2).validate()
    with pytest.raises(ConfigurationError, match=r"coordinator_address='nohost' is not host:port"):
        distributed.DistributedConfig(2, 0, coordinator_address="nohost").validate()


def test_single_process_initialize_is_a_no_op(monkeypatch):
    for var in ("WORLD_SIZE", "JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    config = jl.distributed.initialize()
    assert (config.num_processes, config.process_id, config.source) == (1, 0, "none")
    assert jl.distributed.initialize() == config  # idempotent
    assert not jax.distributed.is_initialized()
    assert jl.distributed.all_gather_json("x", {"a": 1}) == [{"a": 1}]
    assert jl.distributed.agree_stop(None) is None and jl.distributed.agree_stop("r") == "r"


def test_busy_coordinator_port_is_reported_with_a_free_one(monkeypatch):
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "2")
        with pytest.raises(ConfigurationError, match=rf"coordinator port {port} .*already in use"
                                                     r".*for example (\d+) \(free now\)") as err:
            jl.distributed.initialize()
        suggested = int(err.value.args[0].split("for example ")[1].split(" ")[0])
        assert suggested != port
        distributed.check_port_free(suggested)  # the suggestion binds
        # The launcher refuses a busy --port before starting anything.
        with pytest.raises(ConfigurationError, match=rf"port {port} \(--port\) is already in use"):
            launch_main(["--nprocs", "2", "--port", str(port), "--", "python", "-c", "pass"])


def test_joining_after_jax_started_is_refused(monkeypatch):
    jax.devices()  # the backend runs in this process
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with socket.socket() as s:
        s.bind(("", 0))
        free = s.getsockname()[1]
    monkeypatch.setenv("MASTER_PORT", str(free))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigurationError, match=r"process 1 of 2\b.*JAX has already started its "
                                                 r"backend.*at the top of the script"):
        jl.Fit("dp", max_steps=1)
    assert not jax.distributed.is_initialized()


@pytest.mark.parametrize("argv, match", [
    (["--nprocs", "2"], r"no command given"),
    (["--nprocs", "0", "--", "python", "x.py"], r"--nprocs must be at least 1, got 0"),
    (["--devices-per-proc", "0", "--", "x"], r"--devices-per-proc must be at least 1"),
    (["--nnodes", "2", "--node-rank", "2", "--port", "1234", "--", "x"],
     r"--node-rank 2 is not in 0 \.\.\. 1"),
    (["--nnodes", "2", "--", "x"], r"--port is required with --nnodes > 1"),
    (["--timeout", "-1", "--", "x"], r"--timeout must be positive"),
    (["--nprocs", "two", "--", "x"], r"invalid int value: 'two'"),
])
def test_launcher_refuses_bad_arguments(argv, match):
    with pytest.raises(ConfigurationError, match=match):
        launch_main(argv)


def test_cli_reports_launcher_errors_with_status_2(capsys):
    assert cli_main(["launch", "--nprocs", "0", "--", "python", "x.py"]) == 2
    assert "--nprocs must be at least 1" in capsys.readouterr().err


def test_child_environment():
    base = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/x",
            "RANK": "9", "JAXLIGHT_DISTRIBUTED": "0"}
    env = child_env(1, 2, 4321, devices_per_proc=4, timeout=7, nnodes=2, node_rank=1, base=base)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"],
            env["MASTER_PORT"], env["GROUP_RANK"]) == ("3", "4", "1", "2", "4321", "1")
    assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=4"
    assert env["JAX_PLATFORMS"] == "cpu" and env["JAXLIGHT_TIMEOUT"] == "7"
    assert "JAXLIGHT_DISTRIBUTED" not in env
    assert distributed.detect(env).validate().describe().startswith("process 3 of 4 (2 nodes")


@pytest.mark.slow
def test_launcher_runs_processes_with_prefixed_output():
    from tests.distributed._launch_util import run_launcher

    code = ("import os, sys; print(os.environ['RANK'], os.environ['WORLD_SIZE'], "
            "os.environ['LOCAL_RANK'], os.environ['XLA_FLAGS']); sys.stdout.write('\\rbar')")
    done, _ = run_launcher(["--nprocs", "3", "--devices-per-proc", "2", "--", "python", "-c",
                            code], timeout=60)
    assert done.returncode == 0, done.stderr
    lines = sorted(done.stdout.splitlines())
    # The launcher keeps the flags it inherits (conftest's) and sets its own device count.
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    flags = " ".join([*kept, "--xla_force_host_platform_device_count=2"])
    assert [line for line in lines if "xla" in line] == [
        f"[rank{r}] {r} 3 {r} {flags}" for r in range(3)]
    # A carriage return (progress bars) ends a prefixed segment; a last partial line is kept.
    assert done.stdout.count("bar") == 3 and "[rank0] \rbar" not in done.stdout
    # A failing process makes the launcher exit with its status.
    failed, _ = run_launcher(["--nprocs", "2", "--", "python", "-c", "import sys; sys.exit(3)"],
                             timeout=60)
    assert failed.returncode == 3 and "failed (exit status 3)" in failed.stderr
