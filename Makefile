# make demo | make test | make lint | make bench [BENCH=name]
VENV ?= .venv
PY := $(VENV)/bin/python
BENCH ?=
SCO_TESTHOST_ROOTFS ?= /var/cache/sco-testhost/rootfs
export SCO_TESTHOST_ROOTFS

.PHONY: setup demo test unit lint bench clean testhosts

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/bin/sco demo

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	# the collection finds itself (module_defaults groups are resolved in the syntax check)
	cd collections/ansible_collections/sco/orchestrator && ANSIBLE_COLLECTIONS_PATH=$(CURDIR)/collections ../../../../$(VENV)/bin/ansible-lint --profile production --offline -q

testhosts: setup
	@$(if $(filter 0,$(shell id -u)),,sudo) bash scripts/testhost-rootfs.sh $(SCO_TESTHOST_ROOTFS)

unit: setup testhosts
	$(PY) -m pytest

test: lint unit

bench: setup
	$(PY) -m benchmarks.run $(BENCH)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
