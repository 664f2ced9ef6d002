# megarl: `make quickstart` (install + run the CPU quickstart), `make test` (install + run the tests).
PY ?= python3
VENV ?= .venv
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: install quickstart test bench clean

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

quickstart: $(STAMP)
	$(VENV)/bin/megarl quickstart $(ARGS)

test: $(STAMP)
	$(VENV)/bin/pytest tests

bench: $(STAMP)
	$(VENV)/bin/python -m tools.bench.algorithms
	$(VENV)/bin/python -m tools.bench.rollout
	$(VENV)/bin/python -m tools.bench.rewards

clean:
	rm -rf $(VENV) runs
