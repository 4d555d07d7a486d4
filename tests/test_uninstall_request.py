"""uninstall.yml checks what it is asked before it removes anything: Ansible does not check extra variables, so a
misspelt purge switch (`-e sco_purge=true`, `-e sco_purge_data=ture`) uninstalled the hall and kept its data without a
word. And a run that keeps the data says so at its end. Real ansible-playbook on the collection's
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
    return with_inventory(tmp, "", *extra)


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
    group = "  children:\n    sco_nodes:\n      hosts:\n        n1:\n          sco_purge_data: ture\n"
    r = with_inventory(tmp_path, group)
    assert r.returncode == 2, (r.stdout[-3000:], r.stderr[-2000:])
    assert 'sco_purge_data=\\"ture\\" on n1: write true or false' in r.stdout, r.stdout[-3000:]
    assert "[n1]" not in r.stdout  # refused before any play reached it


def with_inventory(tmp: Path, hosts: str, *extra: str) -> subprocess.CompletedProcess[str]:
    inv = tmp / "inventory.yml"
    inv.write_text(INVENTORY + hosts)
    return subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", str(inv), "sco.orchestrator.uninstall", "--check", "--tags", "sco_none",
         "-e", f"ansible_python_interpreter={sys.executable}", *extra],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(REPO / "collections"), "ANSIBLE_NOCOLOR": "1"},
    )  # fmt: skip


def test_only_the_words_every_supported_core_reads_alike_are_taken(tmp_path: Path) -> None:
    """ansible-core before 2.19 reads `y` and `t` as false (its to_bool knew yes/on/1/true only): taken, they would
    keep the data on one core and purge it on another. Refused; the words all cores agree on pass, in any case."""
    for word in ("y", "t", "Y"):
        r = uninstall(tmp_path, "-e", f"sco_purge_data={word}")
        assert r.returncode == 2 and f'sco_purge_data=\\"{word}\\" on localhost: write true or false' in r.stdout, (
            word, r.stdout[-3000:])  # fmt: skip
    for word, kept in (("TRUE", False), ("On", False), ("1", False), ("No", True), ("off", True)):
        r = uninstall(tmp_path, "-e", f"sco_purge_data={word}")
        assert r.returncode == 0, (word, r.stdout[-3000:])
        assert ("data kept (sco_purge_data is false)" in r.stdout) == kept, (word, r.stdout[-3000:])


def test_a_misspelt_switch_in_a_hosts_inventory_is_refused_too(tmp_path: Path) -> None:
    """The prefix sco_purge is the playbook's in the inventory too, not only in extra variables (the check read the
    controller's variables alone: a group's sco_purge_all was let through)."""
    group = "  children:\n    sco_nodes:\n      hosts:\n        n1: {}\n      vars:\n        sco_purge_all: true\n"
    r = with_inventory(tmp_path, group)
    assert r.returncode == 2, (r.stdout[-3000:], r.stderr[-2000:])
    assert "sco_purge_all on n1: not a setting of this playbook" in r.stdout, r.stdout[-3000:]
    assert "PLAY [Node agents" not in r.stdout


def test_a_roles_own_switch_that_says_otherwise_is_refused(tmp_path: Path) -> None:
    """fleet_state_purge_data: true left in a group's variables dropped the database in a run whose last message said
    the database was kept; -e sco_purge_data=true beside an inventory's false kept it without a word."""
    group = "  children:\n    sco_control:\n      hosts:\n        c1: {}\n      vars:\n"
    group += "        fleet_state_purge_data: true\n"
    r = with_inventory(tmp_path, group)
    assert r.returncode == 2, (r.stdout[-3000:], r.stderr[-2000:])
    said = 'fleet_state_purge_data=\\"True\\" on c1 says otherwise than sco_purge_data (false)'
    assert said in r.stdout, r.stdout[-3000:]
    assert "PLAY [Node agents" not in r.stdout
    r = with_inventory(tmp_path, group, "-e", "sco_purge_data=true")  # the same: taken (c1 itself is not reached)
    assert "says otherwise" not in r.stdout and "PLAY [Node agents" in r.stdout, r.stdout[-3000:]
    r = with_inventory(tmp_path, group.replace("data: true", "data: false"), "-e", "sco_purge_data=true")
    assert r.returncode == 2 and "says otherwise than sco_purge_data (true)" in r.stdout, r.stdout[-3000:]
    # switches this playbook does not map from sco_purge_data are the operator's own (checkpoint_store is run apart,
    # the monitoring play sets its own); one that follows sco_purge_data by a template is taken
    for own in ('checkpoint_store_purge_data: false', 'monitoring_purge_data: false',
                'fleet_state_purge_data: "{{ sco_purge_data }}"'):  # fmt: skip
        r = with_inventory(tmp_path, group.replace("fleet_state_purge_data: true", own), "-e", "sco_purge_data=true")
        assert "says otherwise" not in r.stdout and "PLAY [Node agents" in r.stdout, (own, r.stdout[-3000:])
