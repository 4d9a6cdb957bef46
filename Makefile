# Quick start:  make demo   (set up, then run the 4-rank demo with a hung rank)
#               make test   (set up, then run every test tier this machine can run)
#               make check  (the import contracts, ruff and mypy: seconds; settings in pyproject.toml)
SHELL := /bin/bash
VENV := .venv
# Root can load eBPF and run real jobs under ccld, so there the bpf and e2e tiers must run: a skip
# in a required tier fails the run (see tests/conftest.py).
REQUIRE := $(shell [ "$$(id -u)" = 0 ] && echo unit,bpf,e2e || echo unit)

.PHONY: setup demo check test test-unit bench bench-long clean

setup: $(VENV)/.ccld-ready

$(VENV)/.ccld-ready: pyproject.toml setup.py scripts/setup.sh ccld/export/_hotpath.c ccld/ncclprof/ccld_profiler.c ccld/ncclprof/ccld_profiler.h
	bash scripts/setup.sh
	touch $@

demo: setup
	$(VENV)/bin/ccld demo --fault hang

# Layering kept honest: which packages may import which (import-linter), a linter over ccld/ (ruff),
# the type checker over the packages whose annotations are checked (mypy) and the length of every
# module (scripts/module_lines.py: at most 450 lines, but for the few it lists). Any finding fails.
check: setup
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check ccld
	$(VENV)/bin/mypy
	$(VENV)/bin/python scripts/module_lines.py

test: setup
	CCLD_REQUIRE_TIERS=$(REQUIRE) $(VENV)/bin/python -m pytest -m "unit or bpf or e2e" -rs -p no:cacheprovider --durations=40 tests

test-unit: setup
	$(VENV)/bin/python -m pytest -m unit -q tests

# A few minutes: each benchmark in a short form, results written to bench/RESULTS.md (as root).
bench: setup
	$(VENV)/bin/python bench/probe_cost.py --rounds 3 --write-results
	$(VENV)/bin/python bench/overhead.py --windows 2 --window-s 10 --configs "gloo;net,sched;all" --write-results
	$(VENV)/bin/python bench/collector_scale.py --ranks 1024,4096 --seconds 10 --compare-rate 100 --write-results
	$(VENV)/bin/python bench/accuracy.py --tick-only --write-results

# The big runs (about an hour): every benchmark at full size.
bench-long: setup
	$(VENV)/bin/python bench/probe_cost.py --write-results
	$(VENV)/bin/python bench/overhead.py --configs "gloo;net,sched;all" --write-results
	$(VENV)/bin/python bench/collector_scale.py --compare-rate 100 --write-results
	$(VENV)/bin/python bench/accuracy.py --write-results
	$(VENV)/bin/python bench/store_bench.py --write-results
	$(VENV)/bin/python bench/export_bench.py --write-results
	$(VENV)/bin/python bench/fuzz_collector.py
	$(VENV)/bin/python bench/flood_collector.py
	$(VENV)/bin/python bench/clock_align.py --write-results

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .mypy_cache .ruff_cache .import_linter_cache build ccld/export/_hotpath*.so
