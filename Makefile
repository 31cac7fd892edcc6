# make run  : set up the venv, create a demo lab under runs/demo-lab, run the loop offline (no API key).
# make test : set up the venv and run the whole test suite.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO := runs/demo-lab

.PHONY: venv run test bench clean

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

test: venv
	$(BIN)/python -m pytest -q

bench: venv
	$(BIN)/python benchmarks/pipeline_speed.py

clean:
	rm -rf $(VENV) runs/demo-lab
