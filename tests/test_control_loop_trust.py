"""The control loop's trust directory is the role's own: a control host that is neither a node (role node_agent's
/etc/sco/trusted) nor a distributor still gets the keys its runs verify the bundle with. Before, role control_loop
pointed its runs at /etc/sco/trusted and installed nothing there: on molecule hall-ha's control hosts every run failed
at its first read of the bundle ("trust: give the public keys the bundle must be signed with"). The role installs
control_loop_trusted_keys (role hall maps the hall's root key), removes a key taken off the list, and its runs'
extravars name that directory."""

from __future__ import annotations

import getpass
import grp
import os
import sys
from pathlib import Path

import yaml

from sco.contract.signing import generate, write_keypair
from tests.control_loop_run import lay_out

ROOT = Path(__file__).resolve().parents[1]


def test_the_role_fills_the_loops_trust_directory_and_removes_a_key_taken_off(tmp_path: Path) -> None:
    controller = tmp_path / "controller"
    controller.mkdir()
    write_keypair(generate(), controller / "hall.key", controller / "hall.pub")
    trust = tmp_path / "etc" / "control-loop-trusted"
    trust.mkdir(parents=True)
    (trust / "retired.pub").write_text("a key the hall no longer trusts\n")
    etc = tmp_path / "etc"
    _, _env = lay_out(
        tmp_path,
        {
            "control_loop_hall": "local", "control_loop_interval": "2min",
            "control_loop_venv": str(Path(sys.executable).parent.parent),
            "control_loop_collections_path": str(ROOT / "collections"),
            "control_loop_data_dir": str(tmp_path / "runner"), "control_loop_state_dsn": "host=db dbname=sco",
            "control_loop_bundle": str(tmp_path / "bundle.json"), "control_loop_trust_dir": str(trust),
            "control_loop_trusted_keys": [str(controller / "hall.pub")],
            "control_loop_signing_keys": [str(controller / "hall.key")], "control_loop_launch_key": "",
            "control_loop_kubernetes": {"url": "http://127.0.0.1:6443"},
            "control_loop_pools": [{"name": "spot", "kind": "reclaimable", "cap": 1, "flavor": "f", "image": "i",
                                    "vcpus": 1, "ramMiB": 512}],
            "control_loop_timer_enabled": False, "control_loop_configmap_enabled": False,
            "control_loop_enrolment_enabled": False, "control_loop_metrics_textfile_dir": "",
            "control_loop_user": getpass.getuser(), "control_loop_group": grp.getgrgid(os.getgid()).gr_name,
            "control_loop_create_user": False, "_control_loop_unit_dir": str(tmp_path / "units"),
            "_control_loop_env_file": str(etc / "control-loop.env"),
        },
    )  # fmt: skip
    # exactly the hall's key, as the controller has it; the retired one gone
    assert sorted(p.name for p in trust.iterdir()) == ["hall.pub"]
    assert (trust / "hall.pub").read_bytes() == (controller / "hall.pub").read_bytes()
    assert (trust / "hall.pub").stat().st_mode & 0o777 == 0o644
    extravars = yaml.safe_load((tmp_path / "runner" / "env" / "extravars").read_text())
    assert extravars["sco_trust_dir"] == str(trust)


def test_the_roles_default_trust_directory_is_its_own_and_role_hall_maps_the_halls_key() -> None:
    coll = ROOT / "collections/ansible_collections/sco/orchestrator/roles"
    defaults = yaml.safe_load((coll / "control_loop/defaults/main.yml").read_text())
    node_agent = yaml.safe_load((coll / "node_agent/vars/main.yml").read_text()) or {}
    # not the node agent's directory (a control host need not be a node)
    assert defaults["control_loop_trust_dir"] != "/etc/sco/trusted"
    assert defaults["control_loop_trust_dir"] not in str(node_agent)
    hall = yaml.safe_load((coll / "hall/defaults/main.yml").read_text())
    assert "sco_trusted_keys" in hall["control_loop_trusted_keys"]


def test_the_loops_data_directory_is_not_inside_the_agents_own_state_directory() -> None:
    """A control host is often a node too (the local hall): the agent's state directory is its user's (0750 sco-agent),
    so a loop directory inside it cannot be entered by the loop's user (hall-upgrade: Permission denied on
    project/control_loop.yml)."""
    coll = ROOT / "collections/ansible_collections/sco/orchestrator/roles"
    loop = yaml.safe_load((coll / "control_loop/defaults/main.yml").read_text())
    agent = yaml.safe_load((coll / "node_agent/defaults/main.yml").read_text())
    state = agent["node_agent_state_dir"].rstrip("/") + "/"
    for name in ("control_loop_data_dir", "control_loop_trust_dir"):
        assert not (loop[name].rstrip("/") + "/").startswith(state), (name, loop[name], state)
    configure = (coll / "node_agent/tasks/configure.yml").read_text()
    assert 'path: "{{ node_agent_state_dir }}"' in configure and 'mode: "0750"' in configure  # why it matters
