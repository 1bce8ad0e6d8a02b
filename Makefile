# Every target creates the virtual environment on first use; nothing else needs installing.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8
export WANDB_MODE ?= offline

.PHONY: demo test lint bench clean posttrain-oracle

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[all]'
	touch $(STAMP)

demo: $(STAMP)  ## train the digits recipe under DataParallel on 8 simulated CPU devices
	$(BIN)/jaxlight fit digits --strategy dp

test: $(STAMP)  ## the whole test suite (8 simulated CPU devices)
	$(BIN)/python -m pytest tests --durations=15

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)  ## every benchmark; JSON and PNG charts in benchmarks/results/
	$(BIN)/python benchmarks/run_all.py

# Tunix, the oracle of the post-training losses, lives in a venv of its own: it brings
# tensorflow-datasets, which jaxlight's environment never gets.
TUNIX_VENV ?= .venv-tunix
$(TUNIX_VENV)/.installed:
	$(PY) -m venv $(TUNIX_VENV)
	$(TUNIX_VENV)/bin/pip install -q google-tunix==0.1.7
	touch $@

posttrain-oracle: $(TUNIX_VENV)/.installed  ## rerun Tunix's DPO/GRPO losses: tests/posttrain/fixtures
	XLA_FLAGS= $(TUNIX_VENV)/bin/python tests/posttrain/make_tunix_fixtures.py

clean:
	rm -rf $(VENV) $(TUNIX_VENV) jaxlight_logs .pytest_cache
