# The two set-up commands (see README):  make demo   and   make test
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.trimkit-installed

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
