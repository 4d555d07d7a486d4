"""uninstall.yml checks what it is asked before it removes anything: Ansible does not check extra variables, so a
misspelt purge switch (`-e sco_purge=true`, `-e sco_purge_data=ture`) uninstalled the hall and kept its data without a
word (review of issue 30). And a run that keeps the data says so at its end. Real ansible-playbook on the collection's
playbook against an inventory of the controller alone (no hall host is touched: --check, always-tagged tasks only)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.testhosts import REPO

BIN = Path(sys.executable).parent
INVENTORY = """all:
  hosts:
    localhost:
      ansible_connection: local
"""


def uninstall(tmp: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    inv = tmp / "inventory.yml"
    inv.write_text(INVENTORY)
    return subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", str(inv), "sco.orchestrator.uninstall", "--check", "--tags", "sco_none",
         "-e", f"ansible_python_interpreter={sys.executable}", *extra],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(REPO / "collections"), "ANSIBLE_NOCOLOR": "1"},
    )  # fmt: skip


def test_a_purge_switch_the_playbook_does_not_know_stops_it_before_anything(tmp_path: Path) -> None:
    r = uninstall(tmp_path, "-e", "sco_purge=true")
    assert r.returncode == 2, (r.stdout[-3000:], r.stderr[-2000:])
    assert "sco_purge: not a setting of this playbook (the prefix sco_purge is its own); the data is removed with -e" \
        " sco_purge_data=true" in r.stdout  # fmt: skip
    assert "Nothing was removed" in r.stdout
    assert "PLAY [Node agents" not in r.stdout, r.stdout[-3000:]  # the first play's failure ended the run


def test_a_purge_value_that_is_no_boolean_stops_it(tmp_path: Path) -> None:
    r = uninstall(tmp_path, "-e", "sco_purge_data=ture")
    assert r.returncode == 2, (r.stdout[-3000:], r.stderr[-2000:])
    assert 'sco_purge_data=\\"ture\\" on localhost: write true or false' in r.stdout, r.stdout[-3000:]
    assert "PLAY [Node agents" not in r.stdout


def test_a_run_that_keeps_the_data_says_so_and_a_purge_does_not(tmp_path: Path) -> None:
    for extra, kept in [((), True), (("-e", "sco_purge_data=no"), True), (("-e", "sco_purge_data=true"), False)]:
        r = uninstall(tmp_path, *extra)
        assert r.returncode == 0, (extra, r.stdout[-3000:], r.stderr[-2000:])
        assert ("data kept (sco_purge_data is false)" in r.stdout) == kept, (extra, r.stdout[-3000:])


def test_a_purge_value_set_for_a_group_is_checked_too(tmp_path: Path) -> None:
    """The switch may come from the inventory (group_vars of one group): checked on every host, the host named."""
    inv = tmp_path / "inventory.yml"
    group = "  children:\n    sco_nodes:\n      hosts:\n        n1:\n          sco_purge_data: ture\n"
    inv.write_text(INVENTORY + group)
    r = subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", str(inv), "sco.orchestrator.uninstall", "--check", "--tags", "sco_none",
         "-e", f"ansible_python_interpreter={sys.executable}"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(REPO / "collections"), "ANSIBLE_NOCOLOR": "1"},
    )  # fmt: skip
    assert r.returncode == 2, (r.stdout[-3000:], r.stderr[-2000:])
    assert 'sco_purge_data=\\"ture\\" on n1: write true or false' in r.stdout, r.stdout[-3000:]
    assert "[n1]" not in r.stdout  # refused before any play reached it
