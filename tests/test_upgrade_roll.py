"""upgrade.yml's node play stops the roll at a node it cannot reach. Ansible counts failed hosts against
max_fail_percentage, not unreachable ones: a node that could not be reached was left out and the next batch was
upgraded. Real ansible-playbook on the collection's playbook, in check mode and with only the
always-tagged tasks (the reach check; role node_agent's checks, harmless on this machine in check mode)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from tests.testhosts import REPO

BIN = Path(sys.executable).parent
INVENTORY = """all:
  hosts:
    localhost:
      ansible_connection: local
  children:
    sco_nodes:
      hosts:
        bad1:
          ansible_host: 127.0.0.1
          ansible_port: 1
          ansible_connection: ssh
        good1:
          ansible_connection: local
"""


def upgrade(tmp: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    inv = tmp / "inventory.yml"
    inv.write_text(INVENTORY)
    return subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", str(inv), "sco.orchestrator.upgrade", "--check", "--tags", "sco_none",
         "-e", "sco_upgrade_batch=1", "-e", "sco_hall=rollhall", "-e", f"sco_state_dir={tmp / 'state'}",
         "-e", f"ansible_python_interpreter={sys.executable}", *extra],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(REPO / "collections"), "ANSIBLE_NOCOLOR": "1"},
    )  # fmt: skip


def test_an_unreachable_node_stops_the_roll_before_the_next_batch(tmp_path: Path) -> None:
    r = upgrade(tmp_path)
    assert r.returncode == 2, (r.stdout[-3000:], r.stderr[-2000:])
    assert "bad1 cannot be reached" in r.stdout and "--limit '!bad1'" in r.stdout, r.stdout[-3000:]
    assert "[good1]" not in r.stdout  # its batch (the next) never started
    assert re.search(r"bad1\s+: ok=1\s+changed=0\s+unreachable=0\s+failed=1", r.stdout)  # made a failure


def test_reachable_nodes_go_through(tmp_path: Path) -> None:
    r = upgrade(tmp_path, "--limit", "all:!bad1")
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-2000:])
    assert "ok: [good1]" in r.stdout and "failed=0" in r.stdout


def test_a_sco_version_of_another_release_than_the_collections_is_refused(tmp_path: Path) -> None:
    """An upgrade run with the old collection and -e sco_version=<new> installed a product the collection's modules
    on the control hosts refuse (another major.minor): every control-loop run failed, and nothing said so."""
    r = upgrade(tmp_path, "--limit", "localhost", "-e", "sco_version=9.1.0")
    assert r.returncode == 2, (r.stdout[-3000:], r.stderr[-2000:])
    assert 'sco_version="9.1.0" but this is collection sco.orchestrator' in r.stdout, r.stdout[-3000:]
    assert "install collection sco.orchestrator 9.1.0" in r.stdout
    ok = upgrade(tmp_path, "--limit", "localhost", "-e", f"sco_version={project_version(patch=7)}")
    assert ok.returncode == 0, (ok.stdout[-3000:], ok.stderr[-2000:])  # another patch of the same release is one


def project_version(patch: int) -> str:
    major, minor, _ = metadata.version("spot-capacity-orchestrator").split(".")
    return f"{major}.{minor}.{patch}"
