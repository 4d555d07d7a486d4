"""Day one with the collection as a platform team installs it: the playbooks and the
hall-wide defaults are in the artifact; an inventory overrides those defaults as Ansible users expect; generated
files go to one state directory, not the inventory; galaxy.yml declares every collection the roles use and
`make collection`'s output installs offline; argument specs require what is required; check mode fails where the
real run would. The whole hall converging from the offline install is molecule scenario `local`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from sco.contract import signing

REPO = Path(__file__).resolve().parents[1]
COLL = REPO / "collections" / "ansible_collections" / "sco" / "orchestrator"
BIN = Path(sys.executable).parent
HALL_DEFAULTS = COLL / "roles" / "hall" / "defaults" / "main.yml"


def env(**extra: str) -> dict[str, str]:
    """A newcomer's environment (no ANSIBLE_* settings), the venv's tools on PATH, HOME where the test says."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("ANSIBLE_", "XDG_STATE_HOME"))}
    e["PATH"] = f"{BIN}:{e['PATH']}"
    e["ANSIBLE_COLLECTIONS_PATH"] = str(REPO / "collections")
    return {**e, **extra}


def run(argv: list[str], cwd: Path = REPO, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / argv[0]), *argv[1:]], cwd=cwd, env=env(**extra), capture_output=True, text=True, timeout=300
    )


# --- defect 2: the playbooks and the hall-wide defaults are in the artifact --------------------------------------

PLAYBOOKS = [
    "site", "bake_image", "node_agent", "slurm_admission", "fleet_state", "kyverno_policies", "control_loop", "drill",
    "uninstall", "upgrade",
]  # fmt: skip


def test_the_artifact_ships_the_playbooks_and_the_hall_defaults(tmp_path: Path) -> None:
    built = run(["ansible-galaxy", "collection", "build", str(COLL), "--output-path", str(tmp_path)])
    assert built.returncode == 0, built.stderr
    (artifact,) = tmp_path.glob("sco-orchestrator-*.tar.gz")
    with tarfile.open(artifact) as t:
        names = set(t.getnames())
    for p in PLAYBOOKS:
        assert f"playbooks/{p}.yml" in names, p
    assert "roles/hall/defaults/main.yml" in names
    # the drill's own tasks travel with it (it finds them beside itself: playbook_dir is the collection's); its
    # program is the product's `sco drill`, not a script of the collection's
    assert "playbooks/tasks/drill_watch.yml" in names and not any(n.startswith("playbooks/files") for n in names)
    # the checkout's playbooks only import the collection's: one copy of each, the shipped one
    for p in PLAYBOOKS:
        text = (REPO / "playbooks" / f"{p}.yml").read_text()
        assert f"ansible.builtin.import_playbook: sco.orchestrator.{p}" in text, p
    assert not (REPO / "playbooks" / "group_vars").exists()  # it would beat the inventory's group_vars/all
    # what the docs tell a user to run resolves to the shipped playbook
    syntax = run(["ansible-playbook", "--syntax-check", "-i", "inventories/hall-a", "sco.orchestrator.site"])
    assert syntax.returncode == 0, syntax.stdout + syntax.stderr
    assert str(COLL / "playbooks" / "site.yml") in syntax.stdout


# --- defect 5: inventory variables win, generated files go to the state directory --------------------------------

SHOW = """
- name: Show what the roles would get
  hosts: all
  gather_facts: false
  roles: [sco.orchestrator.hall]
  tasks:
    - name: Show
      ansible.builtin.debug:
        msg: "{{ dict(names | zip(names | map('extract', vars))) | to_json }}"
      vars:
        names: [node_agent_bundle_url, node_agent_nats_url, contract_distributor_build_dir, sco_key_dir,
                notice_relay_credentials_dir, control_loop_pools, node_agent_hall]
"""


def resolved(tmp: Path, group_vars_all: dict[str, object], home: Path) -> dict[str, object]:
    inv = tmp / "inventory"
    (inv / "group_vars").mkdir(parents=True)
    (inv / "hosts.yml").write_text(
        yaml.safe_dump(
            {
                "all": {
                    "hosts": {"n1": {"ansible_connection": "local"}},
                    "children": {"sco_nodes": {"hosts": {"n1": None}}},
                }
            }
        )
    )
    (inv / "group_vars" / "all.yml").write_text(yaml.safe_dump(group_vars_all))
    (tmp / "show.yml").write_text(SHOW)
    out = run(["ansible-playbook", "-i", str(inv), str(tmp / "show.yml")], HOME=str(home))
    assert out.returncode == 0, out.stdout + out.stderr
    msg = json.loads(out.stdout.split('"msg": ', 1)[1].split("\n}", 1)[0])
    return dict(json.loads(msg))


def test_an_inventorys_group_vars_all_beats_the_hall_defaults(tmp_path: Path) -> None:
    hall = {"sco_hall": "hall-x", "sco_relay_url": "nats://relay:4222", "sco_distributor_url": "http://dist:8470",
            "sco_pools": [{"name": "p"}]}  # fmt: skip
    got = resolved(tmp_path / "a", hall, tmp_path / "home")
    assert got["node_agent_bundle_url"] == "http://dist:8470/v1/halls/hall-x/bundle.json"
    assert got["node_agent_nats_url"] == "nats://relay:4222"
    assert got["control_loop_pools"] == [{"name": "p"}]  # mapped from sco_pools
    # generated files: one state directory per hall on the controller, never beside the inventory
    state = tmp_path / "home" / ".local" / "state" / "sco" / "hall-x"
    assert got["sco_key_dir"] == f"{state}/keys"
    assert got["notice_relay_credentials_dir"] == f"{state}/credentials/nats"
    assert got["contract_distributor_build_dir"] == f"{state}/build"
    # a role variable in the inventory's group_vars/all wins over the mapping (a playbook's group_vars/all did not)
    override = {**hall, "node_agent_bundle_url": "http://mirror:8470/b.json", "sco_state_dir": str(tmp_path / "st")}
    got = resolved(tmp_path / "b", override, tmp_path / "home")
    assert got["node_agent_bundle_url"] == "http://mirror:8470/b.json"
    assert got["contract_distributor_build_dir"] == f"{tmp_path}/st/build"


# --- defect 3: every collection the roles use is declared, and the artifacts install offline ----------------------

FQCN = re.compile(r"^\s*(?:- )?([a-z0-9_]+)\.([a-z0-9_]+)\.[a-z0-9_]+:", re.M)


def test_galaxy_yml_declares_every_collection_the_roles_and_playbooks_use() -> None:
    used: dict[str, set[str]] = {}
    tasks = [*(COLL / "roles").glob("*/tasks/*.yml"), *(COLL / "roles").glob("*/handlers/*.yml")]
    for f in [*tasks, *(COLL / "playbooks").glob("*.yml")]:
        for ns, name in FQCN.findall(f.read_text()):
            used.setdefault(f"{ns}.{name}", set()).add(str(f.relative_to(COLL)))
    needed = set(used) - {"ansible.builtin", "sco.orchestrator"}
    deps = set(yaml.safe_load((COLL / "galaxy.yml").read_text())["dependencies"])
    assert "community.postgresql" in needed  # the fleet_state role's modules: the scan finds what matters
    assert needed <= deps, {n: sorted(used[n]) for n in needed - deps}
    listed = {c["name"] for c in yaml.safe_load((REPO / "collections" / "requirements.yml").read_text())["collections"]}
    assert deps <= listed


def test_make_collection_output_installs_offline_and_resolves_the_site_playbook(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    made = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "collection.py"), "--out", str(dist), "--no-wheelhouse"],
        env=env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert made.returncode == 0, made.stdout + made.stderr
    req = yaml.safe_load((dist / "requirements.yml").read_text())["collections"]
    deps = yaml.safe_load((COLL / "galaxy.yml").read_text())["dependencies"]
    assert len(req) == 1 + len(deps) and all((dist / r["name"]).is_file() for r in req)
    # from dist/ alone, nothing from Galaxy (--offline), nothing from this checkout
    tree = tmp_path / "collections"
    inst = run(
        ["ansible-galaxy", "collection", "install", "--offline", "-r", "requirements.yml", "-p", str(tree)],
        cwd=dist, ANSIBLE_COLLECTIONS_PATH=str(tree),
    )  # fmt: skip
    assert inst.returncode == 0, inst.stdout + inst.stderr
    only = {"ANSIBLE_COLLECTIONS_PATH": str(tree), "ANSIBLE_COLLECTIONS_SCAN_SYS_PATH": "False"}
    for module in ("community.postgresql.postgresql_db", "kubernetes.core.k8s", "sco.orchestrator.contract_bundle"):
        doc = run(["ansible-doc", "-t", "module", "--json", module], cwd=tmp_path, **only)
        assert doc.returncode == 0, (module, doc.stderr)
    for playbook in ("sco.orchestrator.site", "sco.orchestrator.drill"):
        syntax = run(["ansible-playbook", "--syntax-check", "-i", "localhost,", playbook], cwd=tmp_path, **only)
        assert syntax.returncode == 0, syntax.stdout + syntax.stderr
        assert str(tree) in syntax.stdout


# --- defect 4: required means required, lists say their elements, halls document their settings -----------------


def specs() -> list[tuple[str, str, dict[str, object]]]:
    out = []
    for f in sorted((COLL / "roles").glob("*/meta/argument_specs.yml")):
        role = f.parts[-3]
        for entry in yaml.safe_load(f.read_text())["argument_specs"].values():
            for name, opt in entry.get("options", {}).items():
                out.append((role, name, opt))
    return out


def test_required_options_have_no_default_and_lists_say_their_elements() -> None:
    hall = yaml.safe_load(HALL_DEFAULTS.read_text())
    problems = []
    for role, name, opt in specs():
        defaults = yaml.safe_load((COLL / "roles" / role / "defaults" / "main.yml").read_text()) or {}
        if opt.get("required"):
            if "default" in opt:
                problems.append(f"{role}: {name}: required with a default")
            if name in defaults:
                problems.append(f"{role}: {name}: required, but defaults/main.yml sets it (so required never fires)")
        if opt.get("type") == "list" and "elements" not in opt:
            problems.append(f"{role}: {name}: a list without elements")
        # a variable the hall maps must not be in the role's own defaults: those would beat the mapping
        if name in hall and name in defaults:
            problems.append(f"{role}: {name}: in defaults/main.yml and mapped by role hall")
    assert problems == []


def test_a_list_given_as_a_string_is_refused_by_the_spec(tmp_path: Path) -> None:
    play = tmp_path / "p.yml"
    play.write_text(
        "- hosts: localhost\n  gather_facts: false\n  roles: [sco.orchestrator.control_loop]\n"
    )  # fmt: skip
    out = run(
        ["ansible-playbook", "-i", "localhost,", "-c", "local", str(play), "--check", "-e",
         json.dumps({"sco_hall": "hall-x", "sco_pools": "spot-large", "sco_kubernetes": {"url": "http://k:6443"},
                     "control_loop_state_dsn": "host=db", "sco_signing_keys": ["/k/hall.key"]})],
        HOME=str(tmp_path),
    )  # fmt: skip
    assert out.returncode != 0
    assert "control_loop_pools" in out.stdout and "list" in out.stdout, out.stdout


def test_a_missing_hall_setting_is_named(tmp_path: Path) -> None:
    """The control loop's pools are a hall setting now (sco_pools); leaving it out stops the run naming it."""
    play = tmp_path / "p.yml"
    play.write_text("- hosts: localhost\n  gather_facts: false\n  roles: [sco.orchestrator.control_loop]\n")
    out = run(
        ["ansible-playbook", "-i", "localhost,", "-c", "local", str(play), "--check", "-e",
         json.dumps({"sco_hall": "hall-x", "sco_kubernetes": {"url": "http://k:6443"},
                     "control_loop_state_dsn": "host=db", "sco_signing_keys": ["/k/hall.key"]})],
        HOME=str(tmp_path),
    )  # fmt: skip
    assert out.returncode != 0
    assert "sco_pools" in out.stdout, out.stdout


@pytest.mark.parametrize("hall", ["hall-a", "hall-b"])
def test_example_halls_set_and_document_every_required_setting(hall: str) -> None:
    readme = (REPO / "inventories" / "README.md").read_text()
    settings = yaml.safe_load((REPO / "inventories" / hall / "group_vars" / "all.yml").read_text())
    required = ["sco_hall", "sco_contract_repo", "sco_relay_url", "sco_distributor_url", "sco_pools"]
    for name in required:
        assert name in settings, (hall, name)
    assert "sco_kubernetes" in settings or "sco_slurm" in settings or "sco_kube_url" in settings
    # every hall-wide setting is documented, and the example's state is not beside the inventory
    hall_settings = [k for k in yaml.safe_load(HALL_DEFAULTS.read_text()) if k.startswith("sco_")]
    for name in sorted({*settings, *hall_settings, *required} - {"ansible_user"}):
        if name.startswith("sco_"):
            assert f"`{name}`" in readme, name
    assert not str(settings.get("sco_state_dir", "")).startswith(str(REPO / "inventories"))
    # mapped once: no inventory maps a hall setting onto a role variable itself
    for f in (REPO / "inventories").rglob("*.yml"):
        text = f.read_text()
        assert not re.search(r"^(control_loop|node_agent|contract_distributor)_[a-z_]+: .*\{\{ *sco_", text, re.M), f


# --- defect 6: check mode fails where the real run would ----------------------------------------------------------


def agent_check(tmp: Path, **settings: object) -> subprocess.CompletedProcess[str]:
    """The node_agent role in check mode on this machine (nothing installed: the venv path does not exist)."""
    # a real public key: check-config reads the trusted keys agent.toml names (a corrupt one fails it, exit 4)
    (tmp / "hall.pub").write_text(signing.public_key_text(signing.generate().public))
    play = tmp / "p.yml"
    play.write_text("- hosts: localhost\n  gather_facts: false\n  roles: [sco.orchestrator.node_agent]\n")
    ev = {
        "sco_hall": "hall-x", "sco_distributor_url": "http://127.0.0.1:8470",
        "sco_trusted_keys": [str(tmp / "hall.pub")],
        "node_agent_venv": str(tmp / "venv"), "node_agent_config_dir": str(tmp / "etc"),
        "node_agent_state_dir": str(tmp / "state"), "ansible_python_interpreter": sys.executable, **settings,
    }  # fmt: skip
    return run(
        ["ansible-playbook", "-i", "localhost,", "-c", "local", str(play), "--check", "-e", json.dumps(ev)],
        HOME=str(tmp),
    )


def test_check_mode_fails_on_a_slurm_node_without_slurm_conf(tmp_path: Path) -> None:
    out = agent_check(tmp_path, node_agent_scheduler="slurm", node_agent_slurm_conf=str(tmp_path / "slurm.conf"))
    assert out.returncode != 0
    assert f"node_agent_slurm_conf: {tmp_path}/slurm.conf is not on localhost" in out.stdout, out.stdout
    assert not (tmp_path / "venv").exists() and not (tmp_path / "etc").exists()  # check mode changed nothing
    (tmp_path / "slurm.conf").write_text("ClusterName=x\n")
    out = agent_check(tmp_path, node_agent_scheduler="slurm", node_agent_slurm_conf=str(tmp_path / "slurm.conf"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ok (node localhost, hall hall-x, slurm)" in out.stdout  # check-config ran on what would be written


def test_check_mode_says_what_check_config_would_refuse(tmp_path: Path) -> None:
    out = agent_check(tmp_path, node_agent_scheduler="slurm", node_agent_metadata_url="ftp://meta")
    assert out.returncode != 0
    assert "the real run would stop here" in out.stdout and "agent.metadata_url" in out.stdout, out.stdout
    assert list(tmp_path.glob("*.agent.toml")) == [] and not (tmp_path / "etc").exists()
