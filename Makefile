# Two entry points for a fresh clone: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.shoal-installed

.PHONY: demo test unit integration lint clean

$(STAMP): pyproject.toml scripts/setup-venv.sh
	bash scripts/setup-venv.sh $(VENV)
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/local_swarm.py

test: $(STAMP)
	$(VENV)/bin/ruff check node protocols averaging tests examples benchmarks scripts
	bash scripts/run-suite.sh $(PY)

unit: $(STAMP)
	$(PY) -m pytest tests/unit

integration: $(STAMP)
	$(PY) -m pytest tests/integration

lint: $(STAMP)
	$(VENV)/bin/ruff check node protocols averaging tests examples benchmarks scripts

clean:
	rm -rf $(VENV) build *.egg-info
