PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv check test bench bench-quick clean

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

# Each script prints its figures and saves JSON under benchmarks/results/.
BENCHMARKS := log_append catalog_commit checkpoint_restore api_append

bench: venv
	@for b in $(BENCHMARKS); do echo "== $$b"; $(BIN)/python benchmarks/$$b.py || exit 1; done

bench-quick: venv
	$(BIN)/python benchmarks/log_append.py --quick --runs 1
	$(BIN)/python benchmarks/checkpoint_restore.py --quick --runs 1

clean:
	rm -rf $(VENV) rolloutlog-data .pytest_cache .mypy_cache .ruff_cache
