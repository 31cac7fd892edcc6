# make run  : set up the venv, create a demo lab under runs/demo-lab, run the loop offline (no API key).
# make test : set up the venv and run the whole test suite.
# make test-fast : the unit and fast integration tests (markers; under 2 minutes): run after every change.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO := runs/demo-lab

.PHONY: venv run test test-fast bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: the CPU wheel on local disk, never a CUDA build from a loose range
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

run: venv
	test -f $(DEMO)/research.toml || $(BIN)/autoresearch init $(DEMO) --suite small
	$(BIN)/autoresearch --repo $(DEMO) run --offline --max-hypotheses 3
	$(BIN)/autoresearch --repo $(DEMO) status

# two xdist workers: most tests wait on subprocesses (git, the driver, a Ray node, a browser) as much
# as they compute. --dist loadfile: a module's tests run on one worker in order, so a module fixture is
# built once (xdist_group marks do not group under pytest 9.2); the two Ray modules take a file lock
# (tests/support/ray_cluster.py). TEST_WORKERS=0 runs everything one test after another.
TEST_WORKERS ?= 2

test: venv
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

# the tiers are pytest markers (pyproject.toml); every test module declares one in `pytestmark`.
# langsmith's pytest plugin (it comes with langgraph; no test uses it) costs seconds per worker.
FAST := (unit or integration) and not (system or slow)

test-fast: venv
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -p no:langsmith_plugin -m "$(FAST)" --durations=10

bench: venv
	$(BIN)/python benchmarks/pipeline_speed.py

clean:
	rm -rf $(VENV) runs/demo-lab
