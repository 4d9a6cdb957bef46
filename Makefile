# Quick start:  make demo   (set up, then run the 4-rank demo with a hung rank)
#               make test   (set up, then run every test tier this machine can run)
SHELL := /bin/bash
VENV := .venv
# Root can load eBPF and run real jobs under ccld, so there the bpf and e2e tiers must run: a skip
# in a required tier fails the run (see tests/conftest.py).
REQUIRE := $(shell [ "$$(id -u)" = 0 ] && echo unit,bpf,e2e || echo unit)

.PHONY: setup demo test test-unit clean

setup: $(VENV)/.ccld-ready

$(VENV)/.ccld-ready: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $@

demo: setup
	$(VENV)/bin/ccld demo --fault hang

test: setup
	CCLD_REQUIRE_TIERS=$(REQUIRE) $(VENV)/bin/python -m pytest -m "unit or bpf or e2e" -rs -p no:cacheprovider tests

test-unit: setup
	$(VENV)/bin/python -m pytest -m unit -q tests

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
