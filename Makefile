# Two commands set everything up on a fresh machine: `make demo` and `make test`.
# Two stacks (README, "Install"): the newest TensorFlow without TFRA in .venv (the default: `make install`,
# `make test`), and TF 2.16.2 with TFRA 0.8.1 in .venv-tfra (`make install-tfra`, `make test-tfra`).
# stacks/*.txt pin what each stack runs; setup.py's ranges say what tf_psx accepts.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# Written after a successful install; a newer setup.py or stack file triggers a reinstall.
STAMP := $(VENV)/.tf_psx-installed
TFRA_VENV := .venv-tfra
TFRA_BIN := $(TFRA_VENV)/bin
TFRA_STAMP := $(TFRA_VENV)/.tf_psx-installed
# Both stacks are tested on Python 3.11 here (TFRA 0.8.1 has wheels only up to cp311; TF 2.21 takes 3.10-3.13).
CHECK_PYTHON = @command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found; the stacks here are tested on Python 3.11. Install it or run make PYTHON=/path/to/python3.11." >&2; exit 1; }

.PHONY: install install-tfra demo test test-fast test-slow test-tfra bench docs clean

install: $(STAMP)

$(STAMP): setup.py stacks/newest.txt
	$(CHECK_PYTHON)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c stacks/newest.txt -e '.[dev]'
	touch $(STAMP)

install-tfra: $(TFRA_STAMP)

$(TFRA_STAMP): setup.py stacks/tfra.txt
	$(CHECK_PYTHON)
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] > (3, 11))' || { echo "error: $(PYTHON) is newer than 3.11; TFRA 0.8.1 has wheels only for Python 3.9-3.11. Run make PYTHON=/path/to/python3.11." >&2; exit 1; }
	test -x $(TFRA_BIN)/python || $(PYTHON) -m venv $(TFRA_VENV)
	$(TFRA_BIN)/python -m pip install --quiet --upgrade pip
	$(TFRA_BIN)/python -m pip install --quiet -c stacks/tfra.txt -e '.[dev,tfra]'
	touch $(TFRA_STAMP)

demo: install
	$(BIN)/python examples/quickstart.py

# Two test processes (one per core), each file kept in one process: most
# tests wait on task processes and TF start-up, so this roughly halves the
# wall time. Each process has its own session cluster.
PYTEST_PARALLEL := -n 2 --dist loadfile --durations=15

# The slow tier (worker kills in the middle of steps: a few minutes per trial,
# and the few other tests of over a minute) is left out to keep `make test`
# under 30 minutes; `make test-slow` runs it, and CI (.ci/run) runs both.
test: install
	$(BIN)/python -m pytest $(PYTEST_PARALLEL) -m "not slow"

test-slow: install
	$(BIN)/python -m pytest -q -m slow

# The TFRA stack: every test that needs TFRA (marked `tfra`), and a smoke of the rest (marked `smoke`: the
# quickstart, a sync and an exact-update test), on TF 2.16.2 with TFRA 0.8.1.
test-tfra: install-tfra
	$(TFRA_BIN)/python -m pytest $(PYTEST_PARALLEL) -m "(tfra or smoke) and not slow"
	$(TFRA_BIN)/python -m pytest -q -m "tfra and slow"

# The unit tier: no session cluster, no process of its own (each test file's pytestmark; STYLE.md).
test-fast: install
	$(BIN)/python -m pytest $(PYTEST_PARALLEL) -m unit

# Every benchmark, then docs/benchmarks.md from bench/results/*.json (~3 h on 2 cores, estimated: the interleaved
# benchmarks run 5 rounds of fresh processes, fused_embeddings ~50 min of them; exact_fit ~30 min).
BENCHES := overhead shard_balance dedup_bytes vocab_scaling dynamic_vs_static native_table_split convergence exact_updates \
	hash_table_memory hash_table_quality fused_embeddings reader_throughput wire_dtype_quality snapshot_stall sync_regime sync_stragglers tls_tunnel elastic delta_snapshots ps_latency exact_fit exact_resume hash_table_wire memory_growth
bench: install
	for b in $(BENCHES); do $(BIN)/python bench/$$b.py || exit 1; done
	$(BIN)/python bench/report.py

# The docs site, into site/; strict: a warning (broken link, bad docstring) fails.
docs: install
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) $(TFRA_VENV) *.egg-info site .pytest_cache
