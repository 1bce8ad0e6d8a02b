# Every target creates the virtual environment on first use; nothing else needs installing.
# `make demo` installs jaxlight alone (what the demo needs); the test, lint and benchmark targets
# add the extras their code imports (loggers, pretrained, recipes' data, pytest), once.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CORE_STAMP := $(VENV)/.installed-core
STAMP := $(VENV)/.installed
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8
export WANDB_MODE ?= offline

.PHONY: demo test test-all durations lint bench conformance conformance-fixtures fixtures posttrain-oracle trl-oracle clean

# Installs go through uv (from the package registry, into the venv): the whole `.[all]` set in
# 13 s where pip took 183 s, the same versions; pip does it where uv cannot run. uv compiles the
# packages' bytecode as pip does (--compile-bytecode, +25 s): without it a process where
# PYTHONDONTWRITEBYTECODE is set compiled jax, flax and optax from source at every start
# (6.3 s to import jax, flax, optax, orbax and jaxlight instead of 2.2), in each of the
# many processes the suite starts.
INSTALL = $(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python
$(CORE_STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip uv
	$(INSTALL) -e . || $(BIN)/pip install -q -e .
	touch $(CORE_STAMP)

$(STAMP): $(CORE_STAMP)
	$(INSTALL) -e '.[all]' || $(BIN)/pip install -q -e '.[all]'
	touch $(STAMP)

demo: $(CORE_STAMP)  ## train the digits recipe under DataParallel on 8 simulated CPU devices
	$(BIN)/jaxlight fit digits --strategy dp

# Two tiers (pyproject.toml's `slow` marker): `make test` runs every test not marked slow, in
# pytest-xdist workers (a test file each); `make test-all` runs everything, which CI does.
# WORKERS=0 runs in this process.
WORKERS ?= 2
PYTEST = $(BIN)/python -m pytest tests -n $(WORKERS) --dist loadfile

test: $(STAMP)  ## the fast tier: every package, tiny sizes (under 5 min on 2 cores)
	$(PYTEST) -m "not slow" --durations=15

test-all: $(STAMP)  ## the whole suite: docs that train, SIGKILL, multi-process, recipes, conformance
	$(PYTEST) --durations=25

# Each worker takes the longest file left first, by the seconds tests/durations.json records
# (tests/conftest.py); refresh it after adding slow tests.
durations: $(STAMP)  ## run the whole suite and record each test's seconds in tests/durations.json
	$(PYTEST) --record-durations tests/durations.json

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)  ## every benchmark; JSON and PNG charts in benchmarks/results/
	$(BIN)/python benchmarks/run_all.py

# The oracle's environment: torch (CPU) and Lightning, the `conformance` extra of pyproject.toml.
CONF_VENV ?= .venv-conformance
CONF_STAMP := $(CONF_VENV)/.installed
CONF_REQS = $$($(PY) -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['conformance']))")

$(CONF_STAMP): pyproject.toml
	$(PY) -m venv $(CONF_VENV)
	$(CONF_VENV)/bin/pip install -q --upgrade pip
	$(CONF_VENV)/bin/pip install -q $(CONF_REQS)
	touch $(CONF_STAMP)

# The oracle alone: PyTorch Lightning reruns every group and rewrites tests/conformance/fixtures
# (CI runs it before `make test-all`, whose tests/conformance then compares jaxlight with what
# Lightning just computed). One process imports torch and Lightning and forks a child per group
# script (_run_all.py): the same fixtures as a process per script, 26 CPU-seconds instead of 102.
conformance-fixtures: $(CONF_STAMP)  ## run PyTorch Lightning: regenerate tests/conformance/fixtures
	cd tests/conformance/lightning_side && ../../../$(CONF_VENV)/bin/python _run_all.py

conformance: $(STAMP) conformance-fixtures  ## Lightning beside jaxlight: new fixtures, tests/conformance, porting.md's table
	JAXLIGHT_CONFORMANCE_RESULTS=tests/conformance/results.json $(BIN)/python -m pytest \
		tests/conformance -q -p no:warnings; status=$$?; \
		$(BIN)/python tests/conformance/table.py; exit $$status

# A Python with torch, transformers and tokenizers (test-only; never a jaxlight dependency).
HF_PYTHON ?= python3

fixtures:  ## regenerate the tiny pretrained-model fixtures and transformers' reference outputs
	HF_HUB_OFFLINE=1 $(HF_PYTHON) tests/nn/pretrained/make_fixtures.py
	HF_HUB_OFFLINE=1 $(HF_PYTHON) tests/nn/pretrained/make_moe_fixtures.py

# Tunix, the oracle of the post-training losses, lives in a venv of its own: it brings
# tensorflow-datasets, which jaxlight's environment never gets.
TUNIX_VENV ?= .venv-tunix
$(TUNIX_VENV)/.installed:
	$(PY) -m venv $(TUNIX_VENV)
	$(TUNIX_VENV)/bin/pip install -q google-tunix==0.1.7
	touch $@

posttrain-oracle: $(TUNIX_VENV)/.installed  ## rerun Tunix's DPO/GRPO losses: tests/posttrain/fixtures
	XLA_FLAGS= $(TUNIX_VENV)/bin/python tests/posttrain/make_tunix_fixtures.py

# TRL, the oracle of GRPO's advantages and loss as TRL users run them (and of DPO's sigmoid loss):
# torch (CPU) and trl in a venv of their own; tests/posttrain/test_trl_parity.py reads the fixture.
TRL_VENV ?= .venv-trl
$(TRL_VENV)/.installed:
	$(PY) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/pip install -q torch==2.13.0 trl==1.16.0
	touch $@

trl-oracle: $(TRL_VENV)/.installed  ## rerun TRL's GRPO advantages/loss and DPO loss: tests/posttrain/fixtures
	$(TRL_VENV)/bin/python tests/posttrain/trl_side.py

clean:
	rm -rf $(VENV) $(CONF_VENV) $(TUNIX_VENV) $(TRL_VENV) jaxlight_logs .pytest_cache
