# make demo | make test | make lint | make bench [BENCH=name] | make sanity | make molecule [SCENARIO=name] | make ee
# make constraints | make release VERSION=x.y.z
VENV ?= .venv
PY := $(VENV)/bin/python
BENCH ?=
SCO_TESTHOST_ROOTFS ?= /var/cache/sco-testhost/rootfs
export SCO_TESTHOST_ROOTFS

.PHONY: setup demo test unit lint bench clean testhosts sanity molecule collection ee constraints release

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/bin/sco-demo

lint: setup
	$(VENV)/bin/ruff check src devkit tests benchmarks molecule
	$(VENV)/bin/ruff format --check src devkit tests benchmarks molecule
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	cd collections/ansible_collections/sco/orchestrator && ANSIBLE_COLLECTIONS_PATH=$(CURDIR)/collections \
		../../../../$(VENV)/bin/ansible-lint --profile production --offline -q
	$(VENV)/bin/ansible-lint --profile production --offline -q playbooks inventories molecule ee
	cd collections/ansible_collections/sco/orchestrator && ../../../../$(VENV)/bin/antsibull-changelog lint

testhosts: setup
	@$(if $(filter 0,$(shell id -u)),,sudo) bash scripts/testhost-rootfs.sh $(SCO_TESTHOST_ROOTFS)

# PYTEST_JOBS=N: N pytest-xdist workers (--dist loadgroup: the OpenStack tests in two groups, each on one worker
# with a cloud of its own; tests/conftest.py). Most tests wait on daemons and deadlines, not on the CPU, so 4 on
# two cores halves the time; PYTEST_JOBS=0 runs in one process, in file order.
PYTEST_JOBS ?= 4
unit: setup testhosts
	$(PY) -m pytest $(if $(filter-out 0,$(PYTEST_JOBS)),-n $(PYTEST_JOBS) --dist loadgroup --durations=25)

# The collection artifact as Galaxy ships it: ansible-test sanity on it (Python 3.11).
sanity: setup
	bash scripts/sanity.sh

# Molecule scenarios (molecule/), each against network-namespace SSH test hosts; SCENARIO=name for one.
SCENARIO ?=
molecule: setup testhosts
	bash scripts/molecule.sh $(SCENARIO)

# What an air-gapped controller needs (scripts/collection.py): dist/ holds the collection artifact, the collections it
# depends on (from PyPI's `ansible` package), dist/requirements.yml for `ansible-galaxy collection install --offline`,
# and dist/wheelhouse (the product and its dependencies); plus a copy of the artifact for the ee/ build.
collection: setup
	$(PY) scripts/collection.py --out dist
	cp dist/sco-orchestrator-*.tar.gz ee/sco-orchestrator.tar.gz

# constraints/control.txt: the exact versions a controller and the execution environment install (the control
# extra's closure as this venv resolved it; sco_devkit.constraints). Rerun after changing a dependency; a test checks it.
constraints: setup
	$(PY) -m sco_devkit.constraints

# A release: VERSION into pyproject.toml (its one place) and the collection's literals of it, then antsibull-changelog
# turns the fragments into CHANGELOG.rst (scripts/release.py). Commit and tag the result.
release: setup
	@test -n "$(VERSION)" || { echo "make release VERSION=x.y.z" >&2; exit 2; }
	$(PY) scripts/release.py $(VERSION)

# The execution environment (ee/README.md): built with ansible-builder and podman, then run as AWX runs it (root;
# ~2 min 45 s cold, seconds when nothing changed, so not part of `make test`).
ee: setup
	@$(if $(filter 0,$(shell id -u)),,sudo) bash scripts/ee.sh

test: lint unit sanity molecule

bench: setup
	$(PY) -m benchmarks.run $(BENCH)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
