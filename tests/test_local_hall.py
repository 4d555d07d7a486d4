"""The local hall's inventory (the embedded hall of `make demo`) against what the demo actually runs: the fleet
state the site playbook points at is the embedded PostgreSQL that `sco db migrate --embedded` starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sco.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def newcomer_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env["PATH"] = f"{BIN}:{env['PATH']}"
    return env


def local_var(name: str) -> str:
    """A variable as the site playbook's roles resolve it for the local hall's host (the inventory over role hall's
    defaults)."""
    out = subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", "inventories/local", "-l", "localhost", "tests/show_hall_var.yml",
         "-e", f"show={name}"],
        cwd=REPO, env=newcomer_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    shown = out.stdout.split(f'"msg": "{name}=', 1)[1].split('"\n', 1)[0]
    return str(json.loads(shown.encode().decode("unicode_escape")))


def test_fleet_state_is_the_demos_embedded_postgresql() -> None:
    embedded = build_parser().parse_args(["db", "migrate", "--embedded", "/nonexistent"])
    assert local_var("fleet_state_port") == str(embedded.port)
    # the embedded server listens on 127.0.0.1 only (not ::1, which `localhost` may resolve to first)
    assert local_var("fleet_state_host") == "127.0.0.1"


def test_check_mode_on_a_new_local_hall_gets_through_and_says_what_it_would_do(tmp_path: Path) -> None:
    """A newcomer's first `ansible-playbook playbooks/site.yml --check` (ansible.cfg: the local hall, this machine):
    no keys, no bundle, no venv yet. The keys are made (signing and trust need them); the distributor says what the
    real run would stage and publish instead of failing on a file check mode never wrote; the Kyverno play has
    nothing to do (the demo's Kubernetes API is a stand-in without Kyverno) instead of stopping every later play on
    the one host; the fleet state says what it would create where, and still hands the control loop its DSN. The
    hall's generated files go to tmp_path; check mode changes nothing on this machine."""
    out = subprocess.run(
        [str(BIN / "ansible-playbook"), "playbooks/site.yml", "--check",
         "-e", f"sco_key_dir={tmp_path}/keys", "-e", f"sco_credentials_dir={tmp_path}/credentials",
         "-e", f"contract_distributor_build_dir={tmp_path}/build", "-e", f"fleet_state_venv={tmp_path}/venv"],
        cwd=REPO, env=newcomer_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr
    assert "failed=0" in out.stdout.split("PLAY RECAP")[1]
    assert (tmp_path / "keys" / "hall.key").exists() and (tmp_path / "keys" / "hall.pub").exists()
    assert "check mode: the bundle of" in out.stdout and "stages it here and publishes it" in out.stdout, out.stdout
    assert not (tmp_path / "build" / "bundle.json").exists()  # compiled, not written
    assert "creates role sco and database sco_fleet on 127.0.0.1:5433" in out.stdout, out.stdout
    assert not (tmp_path / "venv").exists()
