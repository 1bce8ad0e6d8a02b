"""8 simulated CPU devices for every test, set before JAX starts."""

import os
import shutil
import tempfile

# The suite is dominated by XLA compiling small programs (docs/architecture.md, "Tests"). Three
# code-generation flags halve its CPU time: LLVM's optimizations of the CPU code cost more than
# they save here (2.5x faster on tests/strategies/test_equivalence.py), and so do XLA:CPU's MLIR
# fusion emitters against its older LLVM IR ones (that file's CPU-seconds 47.5 -> 23.9, its
# backend compiles 22.5 s -> 10.1 s); and LLVM's module is compiled whole, not split for
# parallel threads, which two busy cores cannot run in parallel anyway (that file 25.4 -> 21.4
# CPU-s, the mean of 3 and 2 runs side by side). HLO passes (sharding, collectives, fusion
# decisions) are unaffected; benchmarks do not use this file. JAXLIGHT_TEST_USER_CODEGEN=1
# leaves XLA's code generation as users get it (only the device count is set):
# tests/test_user_codegen.py runs every strategy's equivalence that way. Each flag is added
# once: pytest-xdist's workers inherit the environment this file already set.
_FLAGS = os.environ.get("XLA_FLAGS", "").split()
CODEGEN_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
                 "--xla_cpu_parallel_codegen_split_count=1")
_USER_CODEGEN = os.environ.get("JAXLIGHT_TEST_USER_CODEGEN") == "1"
for _flag in ("--xla_force_host_platform_device_count=8", *(() if _USER_CODEGEN
                                                            else CODEGEN_FLAGS)):
    if not any(f.split("=")[0] == _flag.split("=")[0] for f in _FLAGS):
        _FLAGS.append(_flag)
os.environ["XLA_FLAGS"] = " ".join(_FLAGS)
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite never writes the user's persistent compilation cache: it shares one of its own, a
# fresh directory per run, which the test processes it starts inherit. Many tests compile the
# same programs (the same small models under the same strategies); each compiles once per run.
# tests/test_cache.py uses directories of its own; a test that counts XLA's compiles turns the
# cache off for its fits (Fit(compilation_cache=False)).
if "JAXLIGHT_TEST_XLA_CACHE" not in os.environ:
    os.environ["JAXLIGHT_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="jaxlight-test-xla-")
    _OWN_CACHE = True
else:  # a worker or child of a run that made it
    _OWN_CACHE = False
os.environ["JAXLIGHT_COMPILATION_CACHE"] = os.environ["JAXLIGHT_TEST_XLA_CACHE"]

import json  # noqa: E402
import pathlib  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

#: Seconds each test took in a whole-suite run (setup, call and teardown), written by
#: `make durations`; pytest-xdist's workers take the longest files first (see below).
DURATIONS = pathlib.Path(__file__).with_name("durations.json")
#: Files whose tests share no module-scoped state, so a worker may take them one test at a time:
#: each docs page runs in a folder of its own and trains minutes, and one worker taking the
#: whole file finished the run minutes after the other.
SPLIT_FILES = {"tests/test_docs.py"}


@pytest.fixture(scope="session", autouse=True)
def _session_folder(tmp_path_factory):
    """Module-scoped fixtures run before a test's folder is entered: their fits write (logs, the
    default checkpoint) into a folder of this worker's, never the checkout, where two workers'
    fits took each other's checkpoint-directory lock."""
    before = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("session"))
    yield
    os.chdir(before)


@pytest.fixture(autouse=True)
def _chdir_tmp(tmp_path, monkeypatch):
    """Default log and checkpoint directories land in the test's temporary folder."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def _xla_flags_unchanged():
    """A test must leave XLA_FLAGS as it found it. XLA reads the variable once per process, so a
    change does nothing here, but every process a later test starts inherits it: a leftover
    `--xla_force_host_platform_device_count=4` gave later SIGKILL-resume children 4 devices
    instead of 8, and 1-ulp different gradients, in whichever order put the change first
    (pytest-xdist's file order did)."""
    before = os.environ.get("XLA_FLAGS")
    yield
    after = os.environ.get("XLA_FLAGS")
    if after != before:
        os.environ.pop("XLA_FLAGS", None)
        if before is not None:
            os.environ["XLA_FLAGS"] = before
        pytest.fail(f"the test changed XLA_FLAGS from {before!r} to {after!r}; processes started "
                    "by later tests would inherit it. Set it in a subprocess's env instead, or "
                    "restore it (monkeypatch.setenv).", pytrace=False)


def pytest_addoption(parser):
    parser.addoption("--record-durations", metavar="PATH", default=None,
                     help="write each test's seconds (setup, call, teardown) to PATH as JSON "
                          "(`make durations` refreshes tests/durations.json this way)")


_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    _SECONDS[report.nodeid] = _SECONDS.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("--record-durations")
    if path and not hasattr(session.config, "workerinput"):  # the controller has every report
        pathlib.Path(path).write_text(json.dumps(
            {k: round(v, 1) for k, v in sorted(_SECONDS.items())}, indent=0) + "\n")
    if _OWN_CACHE:
        shutil.rmtree(os.environ["JAXLIGHT_TEST_XLA_CACHE"], ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` (the Makefile's), longest first: a file's tests stay on one worker
    (their module-scoped fixtures are built once), except SPLIT_FILES' tests, which go out one
    at a time; and each worker that needs work takes the unit with the most recorded seconds
    (tests/durations.json; 1 s for a test it does not know). In collection order a 10-minute
    file could start last and leave the other worker idle."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    recorded = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}

    class LongestFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return nodeid if path in SPLIT_FILES else path

        def _assign_work_unit(self, node) -> None:
            longest = max(self.workqueue, key=lambda scope: sum(
                recorded.get(nodeid, 1.0) for nodeid in self.workqueue[scope]))
            self.workqueue.move_to_end(longest, last=False)
            super()._assign_work_unit(node)

    return LongestFirst(config, log)


def pytest_report_header(config):
    return f"jax {jax.__version__}, devices: {jax.device_count()} x {jax.devices()[0].platform}"
