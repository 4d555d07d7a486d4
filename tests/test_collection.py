"""The collection's contract_bundle module through real ansible-playbook runs: check, real, again."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from sco.contract.signing import Keyring, PrivateKey, verify, write_keypair
from tests.conftest import SAMPLE

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

PLAY = """
- name: Compile the hall's contracts
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Compile and sign
      sco.orchestrator.contract_bundle:
        repo: "{{ repo }}"
        dest: "{{ dest }}"
        signing_keys: ["{{ key }}"]
"""


def playbook(tmp: Path, extra: dict[str, str], *flags: str) -> dict[str, Any]:
    """Run the play through ansible-runner (as AWX does) and return the task's result for localhost."""
    import ansible_runner

    pdd = tmp / f"runner-{len(list(tmp.glob('runner-*')))}"
    (pdd / "project").mkdir(parents=True)
    (pdd / "project" / "play.yml").write_text(PLAY)
    r = ansible_runner.run(
        private_data_dir=str(pdd),
        playbook="play.yml",
        extravars={**extra, "ansible_python_interpreter": sys.executable},
        cmdline=" ".join(flags) or None,
        envvars={"ANSIBLE_COLLECTIONS_PATH": str(ROOT / "collections"), "PATH": f"{BIN}:{os.environ['PATH']}"},
        quiet=True,
    )
    results = [
        e["event_data"]["res"]
        for e in r.events
        if e.get("event") in ("runner_on_ok", "runner_on_failed") and e["event_data"].get("task") == "Compile and sign"
    ]
    assert len(results) == 1, r.stdout.read()
    res: dict[str, Any] = results[0]
    res["_rc"] = r.rc
    return res


@pytest.fixture
def keyfile(tmp_path: Path, key: PrivateKey) -> Path:
    write_keypair(key, tmp_path / "k.key", tmp_path / "k.pub")
    return tmp_path / "k.key"


def test_check_then_real_then_idempotent(tmp_path: Path, keyfile: Path, keyring: Keyring) -> None:
    dest = tmp_path / "out" / "bundle.json"
    vars_ = {"repo": str(SAMPLE), "dest": str(dest), "key": str(keyfile)}
    check = playbook(tmp_path, vars_, "--check")
    assert check["_rc"] == 0 and check["changed"] is True and check["serial"] == 1
    assert not dest.exists()  # check mode did nothing
    real = playbook(tmp_path, vars_)
    assert real["changed"] is True and real["contracts"] == 8
    assert verify(dest.read_bytes(), keyring).payload["serial"] == 1
    again = playbook(tmp_path, vars_)
    assert again["_rc"] == 0 and again["changed"] is False and again["serial"] == 1


def test_problems_fail_the_task_with_every_line(tmp_path: Path, keyfile: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "c.yaml").write_text("apiVersion: sco.dev/v1\nkind: WorkloadContract\nmetadata: {name: x}\n")
    res = playbook(tmp_path, {"repo": str(repo), "dest": str(tmp_path / "b.json"), "key": str(keyfile)})
    assert res["_rc"] != 0 and "problem(s)" in res["msg"]
    assert "c.yaml: spec: Field required" in res["problems"]
    assert any("expected exactly one HallPolicy" in line for line in res["problems"])
