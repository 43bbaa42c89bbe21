# The two set-up commands of the README. Both create/reuse .venv and install what they need.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: run test setup bench

setup:
	@scripts/setup.sh

# Main job: train a GCN on the built-in synthetic graph and report accuracy and epoch time.
run: setup
	$(PY) -m gnncompile train --dataset sbm --model gcn --epochs 100

# The whole test suite (pytest + hypothesis), two workers.
test: setup
	$(PY) -m pytest -n 2 -q

bench: setup
	$(PY) benchmarks/spmm.py
	$(PY) benchmarks/epoch_time.py
