PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv check test demo bench bench-quick bench-components clean nemo-gym-venv demo-nemo-gym soak

# An editable install of `.[test]`: the test tools and, through them, the server extra.
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

# pytest on PYTEST_WORKERS processes (pytest-xdist; 0 runs in this process): most tests wait on
# real processes, timeouts and leases, so two workers overlap those waits on two cores (the whole
# suite 41:50 -> 25:20 on a loaded 2-core machine). A module whose fixture outlives one test stays
# on one worker (tests/conftest.py).
PYTEST_WORKERS ?= 2

test: check nemo-gym-venv
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# The NeMo Gym venv (Python >= 3.12, nemo-gym 0.4.0 and rolloutlog's dependencies; the checkout's
# code runs in it from PYTHONPATH): built once per machine under ~/.cache/rolloutlog/nemo-gym/,
# keyed by the Python version and the pinned requirements, reused after. Without a Python >= 3.12
# it says so and the NeMo Gym tests skip (in CI, .ci/run requires it).
nemo-gym-venv: venv
	@$(BIN)/python -m rolloutlog.integrations.nemo_gym venv || \
		{ [ "$$ROLLOUTLOG_REQUIRE_SERVICES" != 1 ] && echo "NeMo Gym tests will be skipped"; }

# The README's first command: 300 simulated rollouts, a checkpoint, SIGKILL, restore.
demo: venv
	$(BIN)/python -m rolloutlog.participants.sim.demo $(DEMO_ARGS)

# The same with real NeMo Gym 0.4.0 servers (the NeMo Gym venv is built on first use, as
# nemo-gym-venv builds it): a checkpoint mid-flight, SIGKILL of every NeMo Gym process group,
# restore, relaunch, the same report.
demo-nemo-gym: venv
	$(BIN)/python -m rolloutlog.integrations.nemo_gym.demo $(DEMO_ARGS)

# `bench`: the benchmark suite (S1-S4 through the real service on both deployments, beside the
# stop-the-world, pyeventsourcing and floor baselines; the projector's fold rate; the HTTP append
# figures of api_append.py; the curves on both deployments), then its plots and
# benchmarks/RESULTS.md (within ~15 minutes here: curve points that would end past the suite's
# `--budget-s` are skipped and listed; e.g. `make bench BENCH_ARGS="--budget-s 1200"`).
# `bench-components`: the component scripts (append, catalog, in-process checkpoint/restore,
# HTTP append) with their full repetitions.
# Every script prints its figures and saves JSON under benchmarks/results/ (*_quick.json with
# --quick, not committed).
BENCH_STAMP := $(VENV)/.bench-installed
COMPONENTS := log_append catalog_commit checkpoint_restore api_append sdk_overhead agent_deltas

$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[test,bench]'
	@touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BIN)/python benchmarks/suite.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/report.py

bench-components: $(BENCH_STAMP)
	@for b in $(COMPONENTS); do echo "== $$b"; $(BIN)/python benchmarks/$$b.py || exit 1; done

bench-quick: $(BENCH_STAMP)
	$(BIN)/python benchmarks/suite.py --quick
	$(BIN)/python benchmarks/report.py --quick

# The nemesis soak: three replicas on Tansu and a throwaway PostgreSQL under a seeded random
# schedule of faults for SOAK_MINUTES (benchmarks/soak.py, tests/e2e/_nemesis.py); prints its
# figures and saves them to benchmarks/results/soak.json. SOAK_SEED replays a schedule.
SOAK_MINUTES ?= 10
soak: venv
	$(BIN)/python benchmarks/soak.py --minutes $(SOAK_MINUTES) $(if $(SOAK_SEED),--seed $(SOAK_SEED))

clean:
	rm -rf $(VENV) rolloutlog-data .pytest_cache .mypy_cache .ruff_cache
