# The two set-up commands of the README. Both create/reuse .venv and install what they need.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: run test setup bench

setup:
	@scripts/setup.sh

# Main job: plan a GCN on the built-in synthetic graph over 4 local ranks (data strategy, METIS),
# print the plan, train across the ranks, report accuracy and per-rank communication.
run: setup
	$(PY) -m gnncompile run --dataset sbm --model gcn --gpus 4 --strategy data --epochs 100

# The layers contract (import-linter, [tool.importlinter] in pyproject.toml), then the whole test
# suite (pytest + hypothesis), two workers.
test: setup
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -n 2 -q

bench: setup
	$(PY) benchmarks/spmm.py
	$(PY) benchmarks/epoch_time.py
	$(PY) benchmarks/replication.py
	$(PY) benchmarks/data_parallel.py
	$(PY) benchmarks/cost_model.py
	$(PY) benchmarks/feature_parallel.py
	$(PY) benchmarks/tensor_pipeline.py
