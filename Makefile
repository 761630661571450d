# The two set-up commands (see README):  make demo   and   make test
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.trimkit-installed
# llama-cpp-python compiles llama.cpp on install. A build tuned to the compiling CPU (-march=native)
# turns on AMX kernels on CPUs that have them, and those crash (SIGSEGV in ggml_backend_amx_mul_mat)
# where the OS does not grant AMX state to the process, as in this project's sandboxes. Build the
# portable CPU variant (AVX2/FMA/F16C) unless the caller chose CMAKE_ARGS (e.g. -DGGML_CUDA=on).
export CMAKE_ARGS ?= -DGGML_NATIVE=OFF

.PHONY: demo test venv clean bench

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/trimkit demo

test: $(STAMP)
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) benchmarks/prediction_accuracy.py
	$(PY) benchmarks/budget_attainment.py
	$(PY) benchmarks/rag_answer_kept.py

clean:
	rm -rf $(VENV)
