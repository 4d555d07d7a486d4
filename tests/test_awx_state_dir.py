"""An AWX job (awx_job_id set) never makes the hall's secrets in its throw-away container: site.yml refuses to start
when sco_state_dir has no credentials/ of earlier jobs, naming the directory and what to do (docs/AWX.md). Real
ansible-playbook on the collection's own site playbook (its controller play: --tags always), and its upgrade
playbook, which reads the same secrets (it did not check: an upgrade run as an AWX job without kept state made them
anew)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.testhosts import REPO

BIN = Path(sys.executable).parent


PLAYBOOKS = pytest.mark.parametrize("playbook", ["site", "upgrade"])


def site(tmp: Path, *extra: str, playbook: str = "site") -> subprocess.CompletedProcess[str]:
    inv = tmp / "inventory.yml"
    inv.write_text("all:\n  hosts:\n    localhost:\n      ansible_connection: local\n")
    return subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", str(inv), f"sco.orchestrator.{playbook}", "--tags", "always",
         "-e", "sco_hall=awxhall", "-e", f"ansible_python_interpreter={sys.executable}", *extra],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(REPO / "collections"), "ANSIBLE_NOCOLOR": "1"},
    )  # fmt: skip


@PLAYBOOKS
def test_an_awx_job_without_the_halls_kept_state_is_refused_naming_the_directory(tmp_path: Path, playbook: str) -> None:
    state = tmp_path / "state"
    r = site(tmp_path, "-e", "awx_job_id=42", "-e", f"sco_state_dir={state}", playbook=playbook)
    assert r.returncode != 0
    assert f"AWX job 42: {state}/credentials does not exist" in r.stdout, r.stdout
    assert "sco_state_dir_first_job=true" in r.stdout and "docs/AWX.md" in r.stdout
    assert not state.exists()  # nothing made


@PLAYBOOKS
def test_an_awx_job_with_kept_state_a_first_job_and_a_run_outside_awx_start(tmp_path: Path, playbook: str) -> None:
    kept = tmp_path / "kept"
    (kept / "credentials").mkdir(parents=True)
    for extra in (
        ("-e", "awx_job_id=42", "-e", f"sco_state_dir={kept}"),
        ("-e", "tower_job_id=7", "-e", f"sco_state_dir={kept}"),
        ("-e", "awx_job_id=42", "-e", f"sco_state_dir={tmp_path / 'new'}", "-e", "sco_state_dir_first_job=true"),
        ("-e", f"sco_state_dir={tmp_path / 'cli'}"),  # ansible-playbook run by hand: the default applies
    ):
        r = site(tmp_path, *extra, playbook=playbook)
        assert r.returncode == 0, (extra, r.stdout[-2000:], r.stderr[-2000:])
