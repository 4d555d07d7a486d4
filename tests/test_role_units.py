"""The control loop's and the Slurm contract refresh's systemd units, rendered from the roles'
templates with the roles' defaults: their own system users, sandboxed to an exposure of at most 3.0 by
``systemd-analyze security --offline=true`` (8.9 as root before), and a failure reported by an installed unit."""

from __future__ import annotations

import configparser
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
ROLES = REPO / "collections/ansible_collections/sco/orchestrator/roles"
HALL_DEFAULTS = ROLES / "hall" / "defaults" / "main.yml"
BIN = Path(sys.executable).parent
FAILED_UNIT = ROLES / "control_loop" / "files" / "sco-unit-failed@.service"

RENDER = """
- name: Render the role's units with its defaults
  hosts: localhost
  gather_facts: false
  vars_files: ["{{ role }}/defaults/main.yml", "{{ role }}/vars/main.yml"]
  tasks:
    - name: Render
      ansible.builtin.template:
        src: "{{ role }}/templates/{{ item }}.j2"
        dest: "{{ out }}/{{ item }}"
        mode: "0644"
      loop: "{{ units }}"
"""

# role -> (its units, the required settings role hall would map, the venv setting, the executable ExecStart runs)
CASES = {
    "control_loop": (
        ["sco-control-loop.service", "sco-control-loop.timer"],
        {"control_loop_hall": "hall-a"},
        "control_loop_venv",
        "sco-control-loop",
    ),
    "slurm_admission": (
        ["sco-slurm-contracts.service"],
        {"slurm_admission_bundle_url": "https://dist.example:8443/v1/halls/hall-a/bundle.json"},
        "slurm_admission_venv",
        "sco",
    ),
}


def render(tmp: Path, role: str) -> Path:
    """The role's units as the role installs them (defaults, except a stand-in venv so verify finds ExecStart)."""
    units, required, venv_var, exe = CASES[role]
    out = tmp / role
    (out / "venv" / "bin").mkdir(parents=True)
    stand_in = out / "venv" / "bin" / exe
    stand_in.write_text("#!/bin/sh\n")
    stand_in.chmod(0o755)
    play = tmp / "render.yml"
    play.write_text(RENDER)
    ev = {"ansible_python_interpreter": sys.executable, "role": str(ROLES / role), "out": str(out), "units": units}
    ev |= required | {venv_var: str(out / "venv")}
    p = subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", "localhost,", "-c", "local", str(play), "-e", json.dumps(ev)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"},
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    (out / FAILED_UNIT.name).write_text(FAILED_UNIT.read_text())
    return out


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("units")
    return {role: render(tmp / role, role) for role in CASES}


def service(path: Path) -> configparser.ConfigParser:
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.optionxform = str  # type: ignore[assignment,method-assign]
    cp.read(path)
    return cp


def exposure(unit: Path) -> float:
    p = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", str(unit)],
        capture_output=True, text=True, timeout=120, cwd=unit.parent,
    )  # fmt: skip
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", p.stdout + p.stderr)
    assert m, p.stdout + p.stderr
    return float(m.group(1))


UNITS = [("control_loop", "sco-control-loop.service"), ("slurm_admission", "sco-slurm-contracts.service")]


@pytest.mark.parametrize(("role", "unit"), UNITS)
def test_exposure_at_most_3(rendered: dict[str, Path], role: str, unit: str) -> None:
    assert exposure(rendered[role] / unit) <= 3.0


def test_the_failure_report_unit_is_sandboxed_too(rendered: dict[str, Path]) -> None:
    assert exposure(rendered["control_loop"] / FAILED_UNIT.name) <= 3.0


@pytest.mark.parametrize(("role", "unit"), UNITS)
def test_runs_as_the_roles_own_system_user(rendered: dict[str, Path], role: str, unit: str) -> None:
    defaults = yaml.safe_load((ROLES / role / "defaults" / "main.yml").read_text())
    s = service(rendered[role] / unit)["Service"]
    assert s["User"] == defaults[f"{role}_user"] and s["Group"] == defaults[f"{role}_group"]
    assert s["User"] not in ("root", "0") and s["User"].startswith("sco-")
    assert s["CapabilityBoundingSet"] == "" and s["NoNewPrivileges"] == "yes"
    # the roles make the user and group: system accounts without a login shell
    tasks = [t for f in sorted((ROLES / role / "tasks").glob("*.yml")) for t in yaml.safe_load(f.read_text()) or []]
    # the tasks that make them (uninstall's, which remove them with a purge, come first by file name)
    made = [
        t
        for t in tasks
        if (t.get("ansible.builtin.user") or t.get("ansible.builtin.group") or {}).get("state") != "absent"
    ]
    user = next(t["ansible.builtin.user"] for t in made if "ansible.builtin.user" in t)
    group = next(t["ansible.builtin.group"] for t in made if "ansible.builtin.group" in t)
    assert user["system"] is True and user["shell"] == "/usr/sbin/nologin" and group["system"] is True
    assert user["name"] == f"{{{{ {role}_user }}}}" and group["name"] == f"{{{{ {role}_group }}}}"


def test_write_access_only_where_each_writes(rendered: dict[str, Path]) -> None:
    loop = service(rendered["control_loop"] / "sco-control-loop.service")["Service"]
    # its data directory, and node_exporter's textfile directory its runs write their metrics to
    assert loop["ProtectSystem"] == "strict"
    assert loop["ReadWritePaths"].split() == ["/var/lib/sco-control-loop", "/var/lib/prometheus/node-exporter"]
    assert loop["Environment"] == "SCO_METRICS_TEXTFILE_DIR=/var/lib/prometheus/node-exporter"
    slurm = service(rendered["slurm_admission"] / "sco-slurm-contracts.service")["Service"]
    # the table's own directory beside slurm.conf and the bundle cache: never /etc/slurm itself
    assert slurm["ProtectSystem"] == "strict"
    assert slurm["ReadWritePaths"].split() == ["/etc/slurm/sco-contracts", "/var/lib/sco-slurm"]
    assert "--out-dir /etc/slurm/sco-contracts " in slurm["ExecStart"]


@pytest.mark.parametrize(("role", "unit"), UNITS)
def test_on_failure_names_a_unit_the_role_installs(rendered: dict[str, Path], role: str, unit: str) -> None:
    assert service(rendered[role] / unit)["Unit"]["OnFailure"] == "sco-unit-failed@%n.service"
    copies = [
        t["ansible.builtin.copy"]
        for f in sorted((ROLES / role / "tasks").glob("*.yml"))
        for t in yaml.safe_load(f.read_text()) or []
        if "ansible.builtin.copy" in t
    ]
    installed = [c for c in copies if str(c["dest"]).endswith("/sco-unit-failed@.service")]
    assert len(installed) == 1, copies
    assert Path(str(installed[0]["src"]).replace("{{ role_path }}", str(ROLES / role))).name == FAILED_UNIT.name
    failed = service(FAILED_UNIT)["Service"]
    assert failed["SyslogIdentifier"] == "sco-unit-failed" and "%i failed" in failed["ExecStart"]


@pytest.mark.parametrize("role", list(CASES))
def test_systemd_analyze_verify_is_clean(rendered: dict[str, Path], role: str) -> None:
    units, *_ = CASES[role]
    p = subprocess.run(
        ["systemd-analyze", "verify", *[f"./{u}" for u in units], f"./{FAILED_UNIT.name}"],
        cwd=rendered[role], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    # verify exits 0 even for a bad unit: what it says is the verdict
    assert p.stderr.strip() == "", p.stderr


@pytest.mark.parametrize("role", list(CASES))
def test_every_default_is_documented_in_the_argument_spec(role: str) -> None:
    defaults = yaml.safe_load((ROLES / role / "defaults" / "main.yml").read_text())
    hall = yaml.safe_load(HALL_DEFAULTS.read_text())
    options = yaml.safe_load((ROLES / role / "meta" / "argument_specs.yml").read_text())["argument_specs"]["main"]
    options = options["options"]
    mapped = {k for k in hall if k.startswith(f"{role}_")}
    required = {k for k, o in options.items() if o.get("required")}
    assert set(options) == set(defaults) | mapped | required
    for name in (f"{role}_user", f"{role}_group", f"{role}_create_user"):
        assert options[name]["default"] == defaults[name], name
