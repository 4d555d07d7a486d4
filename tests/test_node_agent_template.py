"""The node_agent role's agent.toml template: the agent's settings it has variables for land in the config the
agent loads (rendered by Ansible's own template module with the role's defaults and vars)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sco.agent.config import load
from sco.contract.signing import generate, write_keypair
from sco.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
ROLE = REPO / "collections/ansible_collections/sco/orchestrator/roles/node_agent"
BIN = Path(sys.executable).parent

RENDER = """
- name: Render agent.toml with the role's template
  hosts: localhost
  gather_facts: false
  vars_files: ["{{ role }}/defaults/main.yml", "{{ role }}/vars/main.yml"]
  tasks:
    - name: Render
      ansible.builtin.template:
        src: "{{ role }}/templates/agent.toml.j2"
        dest: "{{ out }}"
        mode: "0600"
"""

# what role sco.orchestrator.hall maps from the hall-wide settings
HALL = {
    "node_agent_hall": "local",
    "node_agent_bundle_url": "http://127.0.0.1:8470/v1/halls/local/bundle.json",
    "node_agent_nats_url": "nats://127.0.0.1:4222",
    "node_agent_nats_password": "",
    "node_agent_metadata_url": "",
    "node_agent_kube_url": "http://127.0.0.1:6443",
    "node_agent_kube_ca_file": "",
}


def render(tmp: Path, **extravars: Any) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    play, out = tmp / "render.yml", tmp / "agent.toml"
    play.write_text(RENDER)
    (tmp / "etc/trusted").mkdir(parents=True)
    write_keypair(generate(), tmp / "hall.key", tmp / "etc/trusted/hall.pub")  # the agent needs a trusted key
    ev = {"role": str(ROLE), "out": str(out), "ansible_python_interpreter": sys.executable, **HALL,
          "node_agent_config_dir": str(tmp / "etc"), "node_agent_state_dir": str(tmp / "state"),
          **extravars}  # fmt: skip
    env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(REPO / "collections"), "PATH": f"{BIN}:{os.environ['PATH']}"}
    r = subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", "localhost,", "-c", "local", str(play), "-e", json.dumps(ev)],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    return out


@pytest.mark.parametrize(
    ("extravars", "renew", "preflight"),
    [
        ({}, 1, 300.0),  # the role's defaults are the agent's own
        ({"node_agent_kube_token_renew": False, "node_agent_preflight_seconds": 45}, 0, 45.0),
        ({"node_agent_kube_token_renew": "yes", "node_agent_preflight_seconds": 2.5}, 1, 2.5),
    ],
)
def test_token_renewal_and_preflight_period_reach_the_agents_config(
    tmp_path: Path, extravars: dict[str, Any], renew: int, preflight: float
) -> None:
    cfg = load(render(tmp_path, **extravars), env={})
    assert (cfg.kube_token_renew, cfg.preflight_seconds) == (renew, preflight)


def test_a_preflight_period_the_agent_refuses_is_named_by_check_config(tmp_path: Path) -> None:
    # the role's validate step (sco-agent check-config) names the setting rather than starting a broken agent
    with pytest.raises(ConfigError) as e:
        load(render(tmp_path, node_agent_preflight_seconds=0.5), env={})
    assert [p.field for p in e.value.problems] == ["agent.preflight_seconds"], e.value.problems


def test_the_checkpoint_sockets_group_cap_and_cgroup_root_reach_the_agents_config(tmp_path: Path) -> None:
    cfg = load(render(tmp_path), env={})
    assert (cfg.checkpoint_group, cfg.checkpoint_max_per_uid, cfg.kube_cgroup_root) == ("sco-checkpoint", 128, "/")
    cfg = load(render(tmp_path / "b", node_agent_checkpoint_max_per_uid=16, node_agent_kube_cgroup_root="/k8s"), env={})
    assert (cfg.checkpoint_max_per_uid, cfg.kube_cgroup_root) == (16, "/k8s")


def test_the_relay_identity_is_the_nodes_nkey_seed_in_a_file(tmp_path: Path) -> None:
    # role hall hands the node the seed notice_relay made for node-<node>; agent.toml names the file it goes to
    seed = "SUAMLK2ZNL35WSMW37E7UD4VZ7ELPKW7DHC3BWBSD2GCZ7IUQQXZIORRBU"
    out = render(tmp_path, node_agent_nats_nkey_seed=seed)
    text = out.read_text()
    assert seed not in text and "password" not in text
    (tmp_path / "etc/nats.nk").write_text(seed + "\n")  # the role's copy task, beside the template
    (tmp_path / "etc/nats.nk").chmod(0o600)  # mode "0600", as that task sets it
    cfg = load(out, env={})
    assert (cfg.nats_nkey_seed_file, cfg.nats_user, cfg.nats_password) == (str(tmp_path / "etc/nats.nk"), "", "")
    # a password only where no seed is given (a relay configured otherwise)
    cfg = load(render(tmp_path / "pw", node_agent_nats_password="pw"), env={})
    assert (cfg.nats_nkey_seed_file, cfg.nats_user, cfg.nats_password) == ("", "node-localhost", "pw")


def test_in_operator_mode_the_relay_identity_is_the_nodes_creds_file(tmp_path: Path) -> None:
    # A relay in operator mode. Role hall maps both the node's seed and its creds (the user JWT notice_relay
    # minted, with that seed); agent.toml names the creds file alone, and the agent's identity connects to a real
    # operator-mode relay and hears its own notices on it
    import asyncio

    from tests.relays import notices_reach, start_jwt_relay

    relay = start_jwt_relay(tmp_path / "relay")
    try:
        _, minted = relay.enrol("localhost")  # the node's name here: the inventory's, localhost
        creds = minted.read_text()
        seed = re.search(r"\bSU[A-Z2-7]{56}\b", creds)
        assert seed
        out = render(tmp_path / "etc-op", node_agent_nats_nkey_seed=seed.group(0), node_agent_nats_creds=creds.strip())
        text = out.read_text()
        assert "nats_nkey_seed_file" not in text and seed.group(0) not in text and "password" not in text
        path = tmp_path / "etc-op/etc/nats.creds"
        path.write_text(creds.strip() + "\n")  # the role's copy task: content "{{ node_agent_nats_creds | trim }}\n"
        path.chmod(0o600)  # mode "0600", as that task sets it
        cfg = load(out, env={})
        assert (cfg.nats_creds_file, cfg.nats_nkey_seed_file, cfg.nats_user) == (str(path), "", "")
        got = asyncio.run(notices_reach(relay.url, relay.users["reclaimer"], {"localhost": Path(cfg.nats_creds_file)}))
        assert got == {"localhost": [b"notice for localhost"]}, got
        # an image build gets neither: the instance enrols at first boot
        image = render(tmp_path / "image", node_agent_image_build=True, node_agent_nats_creds=creds.strip()).read_text()
        assert "nats_creds_file" not in image and "nats_nkey_seed_file" not in image
    finally:
        relay.srv.stop()


CONFIGURE = """
- name: The role's configure tasks, as the role runs them
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Settle the agent's user (what configure.yml reads)
      ansible.builtin.include_role:
        name: sco.orchestrator.node_agent
        tasks_from: user.yml
    - name: Configure
      ansible.builtin.include_role:
        name: sco.orchestrator.node_agent
        tasks_from: configure.yml
"""


def test_the_relay_password_is_not_in_the_diff_of_agent_toml(tmp_path: Path) -> None:
    """`--diff` printed agent.toml's nats_password, when the file was made and when it changed
    (and ansible-runner kept it in its artifacts). The role's own task runs here, -vvv --diff, twice."""
    (tmp_path / "trusted").mkdir()
    write_keypair(generate(), tmp_path / "hall.key", tmp_path / "trusted/hall.pub")
    (tmp_path / "play.yml").write_text(CONFIGURE)
    env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(REPO / "collections"), "PATH": f"{BIN}:{os.environ['PATH']}"}
    secrets = ["first-" + os.urandom(8).hex(), "second-" + os.urandom(8).hex()]
    for secret in secrets:
        ev = {
            "ansible_python_interpreter": sys.executable,
            **HALL,
            "node_agent_nats_password": secret,
            "node_agent_config_dir": str(tmp_path / "etc"),
            "node_agent_state_dir": str(tmp_path / "state"),
            "node_agent_venv": str(BIN.parent),
            "node_agent_trusted_keys": [str(tmp_path / "trusted/hall.pub")],
            # the role's tasks run on this machine for real: no group made, no user changed for the socket
            "node_agent_checkpoint_group": "",
        }
        r = subprocess.run(
            [str(BIN / "ansible-playbook"), "-vvv", "--diff", "-i", "localhost,", "-c", "local", "play.yml",
             "-e", json.dumps(ev)],
            capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
        )  # fmt: skip
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
        assert "changed: [localhost]" in r.stdout  # agent.toml was written (made, then changed)
        for s in secrets:
            assert s not in r.stdout + r.stderr, s
        assert load(tmp_path / "etc/agent.toml", env={}).nats_password == secret  # the agent does get it


def test_the_distributors_ca_and_the_metrics_certificate_reach_the_agents_config(tmp_path: Path) -> None:
    """With the hall's TLS (role hall maps the distributor's CA and sco_metrics_tls), agent.toml names the CA the
    role writes beside it and the /metrics certificate and key metrics_tls.yml deploys; an image build gets the CA
    but no /metrics certificate (every instance of the image would show the same node's)."""
    from tests.harness import make_tls

    ca, crt, key = make_tls(tmp_path / "pki")
    etc = tmp_path / "on" / "etc"
    (etc / "metrics-tls").mkdir(parents=True)
    # the role's copy tasks, beside the template
    (etc / "distributor-ca.crt").write_text(ca.read_text())
    (etc / "metrics-tls" / "metrics.crt").write_text(crt.read_text())
    (etc / "metrics-tls" / "metrics.key").write_text(key.read_text())
    tls = {"node_agent_distributor_ca": ca.read_text(), "node_agent_metrics_tls": True}
    cfg = load(render(tmp_path / "on", **tls), env={})
    assert cfg.bundle_ca_file == str(etc / "distributor-ca.crt")
    assert (cfg.metrics_tls_cert_file, cfg.metrics_tls_key_file) == (
        str(etc / "metrics-tls/metrics.crt"), str(etc / "metrics-tls/metrics.key"),
    )  # fmt: skip
    text = render(tmp_path / "image", **tls, node_agent_image_build=True).read_text()
    assert "bundle_ca_file" in text and "metrics_tls" not in text
    text = render(tmp_path / "off", node_agent_metrics_tls=True, node_agent_metrics_listen_tls=False).read_text()
    assert "bundle_ca_file" not in text and "metrics_tls" not in text
