PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv check test bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

check: venv
	$(BIN)/ruff format --check rolloutlog tests benchmarks
	$(BIN)/ruff check rolloutlog tests benchmarks
	$(BIN)/mypy --strict rolloutlog

test: check
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: venv
	$(BIN)/python benchmarks/log_append.py

clean:
	rm -rf $(VENV) rolloutlog-data .pytest_cache .mypy_cache .ruff_cache
