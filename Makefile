# Every target creates the virtual environment on first use; nothing else needs installing.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8
export WANDB_MODE ?= offline

.PHONY: demo test lint bench clean fixtures

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

# A Python with torch, transformers and tokenizers (test-only; never a jaxlight dependency).
HF_PYTHON ?= python3

fixtures:  ## regenerate the tiny pretrained-model fixtures and transformers' reference outputs
	HF_HUB_OFFLINE=1 $(HF_PYTHON) tests/nn/pretrained/make_fixtures.py

clean:
	rm -rf $(VENV) jaxlight_logs .pytest_cache
