"""Package identity and day one: the distribution has a name of its own, the roles
install the version that matches the collection, the modules say what is missing and where, and a plain
`ansible-playbook` from the repository root finds the collection, the inventory and hosts in its groups."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import ansible_collections
import pytest
import yaml
from packaging.specifiers import SpecifierSet

import sco

REPO = Path(__file__).resolve().parents[1]
COLL = REPO / "collections" / "ansible_collections" / "sco" / "orchestrator"
BIN = Path(sys.executable).parent
DIST = "spot-capacity-orchestrator"


def galaxy_version() -> str:
    return str(yaml.safe_load((COLL / "galaxy.yml").read_text())["version"])


def clean_env() -> dict[str, str]:
    """The environment of a newcomer: no ANSIBLE_* settings, the venv's tools on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env["PATH"] = f"{BIN}:{env['PATH']}"
    return env


# --- defect 1: package identity ----------------------------------------------------------------------------------


def test_the_distribution_has_a_name_of_its_own() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["name"] == DIST  # `sco` on the public index is an unrelated neuroscience library
    assert project["version"] == sco.__version__ == galaxy_version()
    for doc in (REPO / "README.md", COLL / "README.md"):
        text = doc.read_text()
        assert "pip install sco" not in text and "pip install 'sco" not in text, doc


@pytest.mark.parametrize("role", ["node_agent", "slurm_admission"])
def test_roles_install_the_version_of_the_collection(role: str) -> None:
    defaults = yaml.safe_load((COLL / "roles" / role / "defaults" / "main.yml").read_text())
    assert defaults[f"{role}_package"] == f"{DIST}=={{{{ {role}_version }}}}"
    # the version is a hall-wide setting (role hall's sco_version, the collection's release; an inventory may pin it)
    hall = yaml.safe_load((COLL / "roles" / "hall" / "defaults" / "main.yml").read_text())
    assert hall[f"{role}_version"] == "{{ sco_version }}"
    assert str(hall["sco_version"]) == galaxy_version()
    spec = yaml.safe_load((COLL / "roles" / role / "meta" / "argument_specs.yml").read_text())
    assert spec["argument_specs"]["main"]["options"][f"{role}_version"]["type"] == "str"


# --- defect 4: modules need the product where they run -------------------------------------------------------------

PLAY = """
- name: Compile on a host without the product
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Compile and sign
      sco.orchestrator.contract_bundle:
        repo: /nonexistent
        dest: /nonexistent/bundle.json
        signing_keys: [/nonexistent/k.key]
"""


def run_play(tmp: Path, interpreter: str, extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run the play through ansible-runner (as AWX does) and return the module's result."""
    import ansible_runner

    (tmp / "project").mkdir(parents=True, exist_ok=True)
    (tmp / "project" / "play.yml").write_text(PLAY)
    r = ansible_runner.run(
        private_data_dir=str(tmp),
        playbook="play.yml",
        inventory="localhost ansible_connection=local",
        extravars={"ansible_python_interpreter": interpreter},
        envvars={
            "ANSIBLE_COLLECTIONS_PATH": str(REPO / "collections"),
            "PATH": f"{BIN}:{os.environ['PATH']}",
            **(extra_env or {}),
        },
        quiet=True,
    )
    results = [e for e in r.events if e.get("event") in ("runner_on_ok", "runner_on_failed")]
    assert len(results) == 1, r.stdout.read()
    res: dict[str, Any] = results[0]["event_data"]["res"]
    res["_failed"] = results[0]["event"] == "runner_on_failed"
    return res


def test_module_without_the_product_says_what_to_install(tmp_path: Path) -> None:
    # Debian's own python3 has no sco: exactly a managed host the module was not delegated away from
    res = run_play(tmp_path, "/usr/bin/python3")
    assert res["_failed"], res
    assert f"Failed to import the required Python library ({DIST}" in res["msg"]
    assert f"pip install {DIST}=={galaxy_version()}" in res["msg"]
    assert "delegate_to: localhost" in res["msg"]


def test_module_refuses_a_product_of_another_version(tmp_path: Path) -> None:
    # a distribution record of another release ahead of the real one on sys.path: what importlib.metadata reports
    fake = tmp_path / "site"
    info = fake / "spot_capacity_orchestrator-0.0.9.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST}\nVersion: 0.0.9\n")
    res = run_play(tmp_path, sys.executable, {"PYTHONPATH": str(fake)})
    assert res["_failed"], res
    assert f"{DIST} 0.0.9 is installed" in res["msg"] and f"{DIST}=={galaxy_version()}" in res["msg"]


def test_module_documents_where_it_runs_and_knows_its_release() -> None:
    text = (COLL / "plugins" / "modules" / "contract_bundle.py").read_text()
    assert f"{DIST}" in text and "delegate_to: localhost" in text
    product = (COLL / "plugins" / "module_utils" / "product.py").read_text()
    assert f'COLLECTION_VERSION = "{galaxy_version()}"' in product


# --- defect 3: nothing ran on day one ------------------------------------------------------------------------------


def ansible(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / argv[0]), *argv[1:]], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=120
    )


def test_plain_ansible_finds_the_collection_and_the_inventory() -> None:
    graph = ansible("ansible-inventory", "--graph")  # ansible.cfg: the local hall by default
    assert graph.returncode == 0, graph.stderr
    for group in ("@sco_nodes", "@sco_relay", "@sco_control", "@sco_distributor", "@sco_kube_nodes"):
        assert group in graph.stdout, graph.stdout
    for playbook in ("site.yml", "bake_image.yml", "drill.yml"):
        syntax = ansible("ansible-playbook", "--syntax-check", f"playbooks/{playbook}")
        assert syntax.returncode == 0, syntax.stderr
    hosts = ansible("ansible-playbook", "--list-hosts", "playbooks/site.yml")
    assert hosts.returncode == 0, hosts.stderr
    # every play matches the local host, except Slurm admission and Spark submission: the local hall has neither
    assert empty_plays(hosts.stdout) == {"slurm_controllers", "spark_submitters"}, hosts.stdout


def empty_plays(list_hosts: str) -> set[str]:
    """The host patterns of the plays `ansible-playbook --list-hosts` shows matching no host."""
    return set(re.findall(r"pattern: \['([^']+)'\]\n\s+hosts \(0\)", list_hosts))


@pytest.mark.parametrize(
    ("hall", "groups", "empty"),
    [
        (
            "hall-a",
            {"sco_kube_nodes": 4, "spark_nodes": 2, "spark_submitters": 1, "sco_relay": 1, "kube_control_plane": 1},
            {"slurm_controllers"},
        ),
        (
            "hall-b",
            {"sco_slurm_nodes": 8, "slurm_controllers": 1, "slurm_login": 2, "sco_relay": 1},
            {"spark_submitters", "sco_kube_nodes"},
        ),
    ],
)
def test_example_halls_have_their_groups(hall: str, groups: dict[str, int], empty: set[str]) -> None:
    out = ansible("ansible-inventory", "-i", f"inventories/{hall}", "--list")
    assert out.returncode == 0, out.stderr
    inv = json.loads(out.stdout)
    for group, n in groups.items():
        assert len(inv[group]["hosts"]) == n, (group, inv[group])
    hosts = ansible("ansible-playbook", "-i", f"inventories/{hall}", "--list-hosts", "playbooks/site.yml")
    assert hosts.returncode == 0, hosts.stderr
    # every play of the site playbook matches hosts of this hall except the other kind's scheduler plays
    assert empty_plays(hosts.stdout) == empty, hosts.stdout
    # the role variables resolve from the hall's settings (role hall's defaults, which every role depends on)
    node = inv[next(iter(groups))]["hosts"][0]
    show = ansible(
        "ansible-playbook", "-i", f"inventories/{hall}", "-l", node, "-e", "ansible_connection=local",
        str(REPO / "tests" / "show_hall_var.yml"), "-e", "show=node_agent_bundle_url",
    )  # fmt: skip
    assert f"/v1/halls/{hall}/bundle.json" in show.stdout, show.stdout + show.stderr


# --- what an AWX execution environment gets ----------------------------------------------------------------------


def test_execution_environment_definition_builds_a_context(tmp_path: Path) -> None:
    shutil.copytree(REPO / "ee", tmp_path / "ee", ignore=shutil.ignore_patterns("*.whl", "*.tar.gz"))
    shutil.copytree(REPO / "constraints", tmp_path / "constraints")  # the definition's ../constraints/control.txt
    built = ansible("ansible-galaxy", "collection", "build", str(COLL), "--output-path", str(tmp_path / "dist"))
    assert built.returncode == 0, built.stderr
    (tmp_path / "dist" / f"sco-orchestrator-{galaxy_version()}.tar.gz").rename(
        tmp_path / "ee" / "sco-orchestrator.tar.gz"
    )
    # the file named as scripts/ee.sh's podman reads it: left to itself ansible-builder writes a Dockerfile unless
    # podman is on PATH (podman is there only where `make ee` once ran)
    ctx = ansible(
        "ansible-builder", "create", "-f", str(tmp_path / "ee" / "execution-environment.yml"), "--context",
        str(tmp_path / "ctx"), "--output-filename", "Containerfile",
    )  # fmt: skip
    assert ctx.returncode == 0, ctx.stdout + ctx.stderr
    assert (tmp_path / "ctx" / "_build" / "collections" / "sco-orchestrator.tar.gz").is_file()
    assert (
        "/build/collections/sco-orchestrator.tar.gz" in (tmp_path / "ctx" / "_build" / "requirements.yml").read_text()
    )
    containerfile = (tmp_path / "ctx" / "Containerfile").read_text()
    # by default a usual upstream base; scripts/ee.sh (make ee) swaps base, package manager and Python packages
    # through these build arguments alone
    assert 'ARG EE_BASE_IMAGE="quay.io/centos/centos:stream9"' in containerfile
    assert 'ARG PKGMGR="/usr/bin/dnf"' in containerfile
    assert 'ARG PYPKG="python3.11 python3.11-pip"' in containerfile
    assert "FROM $EE_BASE_IMAGE AS base" in containerfile
    assert "RUN $PKGMGR install $PYPKG -y" in containerfile
    # pip from the package manager: ensurepip is disabled for Debian's system Python
    assert "/output/scripts/pip_install" not in containerfile
    # the product's wheel (ee/wheels) reaches pip in both stages that install it, as a build argument only
    for stage in ("AS builder", "AS final"):
        body = containerfile.split(stage, 1)[1].split("\nFROM ", 1)[0]
        assert "COPY _build/wheels /build/wheels" in body and "ARG PIP_FIND_LINKS=/build/wheels" in body, stage
    assert "ENV PIP_FIND_LINKS" not in containerfile
    # every pip of the build at constraints/control.txt's pins, ansible-core's in the base stage included
    assert (tmp_path / "ctx" / "_build" / "constraints" / "control.txt").read_bytes() == (
        REPO / "constraints" / "control.txt"
    ).read_bytes()
    base = containerfile.split("AS base", 1)[1].split("\nFROM ", 1)[0]
    pinned = base.index("ARG PIP_CONSTRAINT=/build/constraints/control.txt")
    assert pinned < base.index("pip install --no-cache-dir $ANSIBLE_INSTALL_REFS"), base
    for stage in ("AS builder", "AS final"):
        body = containerfile.split(stage, 1)[1].split("\nFROM ", 1)[0]
        assert "ARG PIP_CONSTRAINT=/build/constraints/control.txt" in body, stage
    assert "ENV PIP_CONSTRAINT" not in containerfile
    assert (tmp_path / "ctx" / "_build" / "wheels" / "README.md").is_file()
    # what the collection itself asks of any EE that installs it (meta/execution-environment.yml)
    deps = ansible("ansible-builder", "introspect", "collections")
    assert deps.returncode == 0, deps.stderr
    assert f"spot-capacity-orchestrator[control]=={galaxy_version()}  # from collection sco.orchestrator" in deps.stdout
    assert "openssh-client [platform:dpkg]" in deps.stdout


def test_execution_environment_has_the_collections_the_playbooks_use() -> None:
    ee = yaml.safe_load((REPO / "ee" / "requirements.yml").read_text())["collections"]
    wanted = yaml.safe_load((REPO / "collections" / "requirements.yml").read_text())["collections"]
    by_name = {c["name"]: c for c in ee}
    for c in wanted:
        assert c["name"] in by_name, f"ee/requirements.yml lacks {c['name']} (collections/requirements.yml)"
        assert by_name[c["name"]].get("version") == c.get("version"), c["name"]
    # and the collection's own dependencies are among them, in a range that admits the copies the tests run with
    # (the `ansible` package's; scripts/ee.sh installs those in the image when Galaxy is out of reach)
    deps = yaml.safe_load((COLL / "galaxy.yml").read_text())["dependencies"]
    assert set(deps) <= set(by_name)
    for name in deps:
        ns, coll = name.split(".")
        manifests = [Path(p) / ns / coll / "MANIFEST.json" for p in ansible_collections.__path__]
        have = json.loads(next(m for m in manifests if m.is_file()).read_text())["collection_info"]["version"]
        assert have in SpecifierSet(by_name[name]["version"]), (name, have, by_name[name]["version"])


def test_changelog_fragments_lint() -> None:
    lint = subprocess.run(
        [str(BIN / "antsibull-changelog"), "lint"], cwd=COLL, capture_output=True, text=True, timeout=60
    )
    assert lint.returncode == 0 and lint.stdout.strip() == "", lint.stdout + lint.stderr
    assert list((COLL / "changelogs" / "fragments").glob("*.yml"))


def test_every_module_has_the_one_sanity_ignore_and_nothing_else() -> None:
    """The only ignore is the licence header (Apache-2.0, validate-modules wants GPLv3), for every module and every
    ansible-core the collection supports: a new module without it fails `make sanity` at the end of CI."""
    want = {
        f"plugins/{kind}/{m.name} validate-modules:missing-gplv3-license"
        for kind in ("modules", "lookup")
        for m in (COLL / "plugins" / kind).glob("*.py")
    }
    files = sorted((COLL / "tests" / "sanity").glob("ignore-*.txt"))
    assert files
    for f in files:
        assert set(f.read_text().splitlines()) == want, f.name
