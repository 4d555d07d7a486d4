"""Where the distributor publishes. Before, role hall's sco_distributor_root was /var/lib/sco/distributor: inside the
agent's state directory, which on a host that is also a node is 0750 sco-agent since the agent runs as its own user.
The control loop's user (molecule hall-upgrade: "Read pending work ... Permission denied"), slurmctld reading the
published file and the distributor's own DynamicUser could not enter it. The root is now /var/lib/sco-distributor,
and role contract_distributor moves a hall's bundle published under a former root there once, so the serial nodes
hold continues (a node refuses a lower one) even when the controller's build directory is new."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from sco.contract.bundle import peek_payload
from sco.contract.signing import generate, write_keypair

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]
ROLES = REPO / "collections/ansible_collections/sco/orchestrator/roles"

PLAY = """
- name: Publish the hall's bundle, as role contract_distributor does it (its directories here)
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Publish
      ansible.builtin.include_role:
        name: sco.orchestrator.contract_distributor
        tasks_from: publish.yml
"""


def publish(tmp: Path, root: Path, build: Path, former: list[str]) -> subprocess.CompletedProcess[str]:
    play = tmp / "play.yml"
    play.write_text(PLAY)
    ev = {
        "ansible_python_interpreter": sys.executable,
        "contract_distributor_hall": "local", "contract_distributor_repo": str(tmp / "repo"),
        "contract_distributor_signing_keys": [str(tmp / "ctl" / "hall.key")],
        "contract_distributor_trusted_keys": [str(tmp / "ctl" / "hall.pub")],
        "contract_distributor_build_dir": str(build), "contract_distributor_root": str(root),
        "contract_distributor_trust_dir": str(tmp / "trusted"),
        "contract_distributor_venv": str(BIN.parent), "contract_distributor_former_roots": former,
    }  # fmt: skip
    env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(REPO / "collections"), "ANSIBLE_NOCOLOR": "1",
           "PATH": f"{BIN}:{os.environ['PATH']}"}  # fmt: skip
    p = subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", "localhost,", "-c", "local", str(play), "-e", json.dumps(ev)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    return p


def _serial(path: Path) -> int:
    return int((peek_payload(path.read_bytes()) or {})["serial"])


def test_a_bundle_published_under_the_former_root_moves_and_its_serial_continues(tmp_path: Path) -> None:
    (tmp_path / "ctl").mkdir()
    write_keypair(generate(), tmp_path / "ctl" / "hall.key", tmp_path / "ctl" / "hall.pub")
    shutil.copytree(REPO / "src/sco/samples/local", tmp_path / "repo")
    former = tmp_path / "var-lib-sco" / "distributor"
    root = tmp_path / "var-lib-sco-distributor"

    # an earlier release published twice under the former root
    publish(tmp_path, former, tmp_path / "build-old", [])
    ci = tmp_path / "repo" / "contracts" / "kubernetes" / "ci.yaml"
    ci.write_text(ci.read_text().replace("drainBudgetSeconds: 20", "drainBudgetSeconds: 21", 1))
    publish(tmp_path, former, tmp_path / "build-old", [])
    old = former / "local" / "bundle.json"
    before = _serial(old)
    assert before >= 2
    sibling = tmp_path / "var-lib-sco" / "spool"  # the agent's own entry beside it stays
    sibling.mkdir()

    # the upgrade: the new root, a fresh controller checkout (build directory), one more change to the contracts
    ci.write_text(ci.read_text().replace("drainBudgetSeconds: 21", "drainBudgetSeconds: 22", 1))
    p = publish(tmp_path, root, tmp_path / "build-new", [str(former)])
    assert "Move the hall's published bundle from a former root" in p.stdout
    new = root / "local" / "bundle.json"
    assert _serial(new) == before + 1, "the serial restarted: nodes holding the old one refuse the new bundle"
    assert not old.exists() and not former.exists(), "the former root stays behind"
    assert sibling.is_dir()

    # nothing new: a second run changes nothing, and nothing comes back under the former root
    again = publish(tmp_path, root, tmp_path / "build-new", [str(former)])
    assert "changed=0" in again.stdout, again.stdout[-3000:]
    assert _serial(new) == before + 1 and not former.exists()


def test_no_service_reads_the_bundle_inside_the_agents_state_directory() -> None:
    hall = yaml.safe_load((ROLES / "hall/defaults/main.yml").read_text())
    agent = yaml.safe_load((ROLES / "node_agent/defaults/main.yml").read_text())
    state = agent["node_agent_state_dir"].rstrip("/") + "/"
    assert not (hall["sco_distributor_root"].rstrip("/") + "/").startswith(state), hall["sco_distributor_root"]
    assert "sco_distributor_root" in hall["control_loop_bundle"]
    dist = yaml.safe_load((ROLES / "contract_distributor/defaults/main.yml").read_text())
    assert "/var/lib/sco/distributor" in dist["contract_distributor_former_roots"]
