"""The collection's roles (node_agent, slurm_admission) through real Ansible runs over SSH to a test host: a Debian
rootfs in its own network namespace. Check mode, for real, and again (idempotent); then what they installed runs."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sco.contract.signing import generate, write_keypair
from tests.testhosts import REPO, TestHost


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sco and its run-time dependencies as wheels: what an air-gapped hall or an image build installs from."""
    w = tmp_path_factory.mktemp("wheelhouse")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(w), str(REPO)],
        check=True,
        timeout=600,
        capture_output=True,
    )
    return w


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestHost]:
    h = TestHost(tmp_path_factory.mktemp("hosts"), "spot-a").create()
    yield h
    h.destroy()


def play(
    tmp: Path, host: TestHost, extravars: dict[str, Any], check: bool = False, playbook: str = "node_agent.yml"
) -> Any:
    import ansible_runner

    pdd = tmp / f"runner-{len(list(tmp.glob('runner-*')))}"
    (pdd / "project").mkdir(parents=True)
    (pdd / "project" / playbook).write_text((REPO / "playbooks" / playbook).read_text())
    hosts = {"hosts": {host.name: host.inventory_vars()}}
    inventory = {"all": {"children": {"sco_nodes": hosts, "slurm_controllers": hosts}}}
    return ansible_runner.run(
        private_data_dir=str(pdd),
        playbook=playbook,
        inventory=inventory,
        extravars=extravars,
        cmdline="--check" if check else None,
        quiet=True,
        envvars={
            "ANSIBLE_COLLECTIONS_PATH": str(REPO / "collections"),
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
            "ANSIBLE_HOST_KEY_CHECKING": "False",
        },
    )


def test_node_agent_role_check_real_again(tmp_path: Path, host: TestHost, wheelhouse: Path) -> None:
    key = generate()
    write_keypair(key, tmp_path / "hall.key", tmp_path / "hall.pub")
    ev = {
        "node_agent_hall": "local",
        "node_agent_wheelhouse": str(wheelhouse),
        "node_agent_trusted_keys": [str(tmp_path / "hall.pub")],
        "node_agent_kube_url": "http://127.0.0.1:6443",
        "node_agent_metadata_url": "",
        "node_agent_nats_url": "nats://127.0.0.1:4222",
    }

    r = play(tmp_path, host, ev, check=True)
    assert r.rc == 0, r.stdout.read()
    assert r.stats["changed"].get(host.name, 0) > 0
    assert host.ssh("test", "-e", "/opt/sco", check=False).returncode != 0  # check mode did nothing

    r = play(tmp_path, host, ev)
    assert r.rc == 0, r.stdout.read()
    assert r.stats["changed"].get(host.name, 0) > 0

    r = play(tmp_path, host, ev)
    assert r.rc == 0 and r.stats["changed"].get(host.name, 0) == 0  # idempotent

    # what the role left behaves: the config passes the agent's own check, the unit is enabled and points
    # at the virtual environment, and the agent starts and spools from it
    out = host.ssh("/opt/sco/bin/sco-agent", "check-config", "--config", "/etc/sco/agent.toml").stdout
    assert f"node {host.name}, hall local, kubernetes" in out
    assert host.ssh("systemctl", "is-enabled", "sco-agent.service").stdout.strip() == "enabled"
    dropin = host.ssh("cat", "/etc/systemd/system/sco-agent.service.d/10-ansible.conf").stdout
    assert "ExecStart=/opt/sco/bin/sco-agent run --config /etc/sco/agent.toml" in dropin
    assert host.ssh("stat", "-c", "%a", "/etc/sco/trusted/hall.pub").stdout.strip() == "644"
    run = host.ssh("timeout", "4", "/opt/sco/bin/sco-agent", "run", "--config", "/etc/sco/agent.toml", check=False)
    assert run.returncode == 124, run.stderr  # still running when the timeout stopped it
    events = host.ssh("/opt/sco/bin/sco-agent", "events", "--state-dir", "/var/lib/sco").stdout
    assert '"type": "agent.started"' in events
    pkgs = host.ssh("/opt/sco/bin/python", "-m", "pip", "list", "--format=freeze").stdout.lower()
    assert "sco==" in pkgs and "aiohttp" not in pkgs  # the agent's environment stays lean


def test_node_agent_role_refuses_bad_settings(tmp_path: Path, host: TestHost) -> None:
    r = play(tmp_path, host, {"node_agent_hall": "Bad Hall", "node_agent_trusted_keys": []})
    assert r.rc != 0
    failed = [e for e in r.events if e.get("event") == "runner_on_failed"]
    assert failed and "set node_agent_hall" in failed[0]["event_data"]["res"]["msg"]


def test_slurm_admission_role(tmp_path: Path, host: TestHost, wheelhouse: Path) -> None:
    from tests.harness import hall_bundle

    key = generate()
    write_keypair(key, tmp_path / "hall.key", tmp_path / "hall.pub")
    (host.root / "root" / "bundle.json").write_bytes(hall_bundle(tmp_path, key))  # as the distributor would
    ev = {
        "slurm_admission_bundle_file": "/root/bundle.json",
        "slurm_admission_wheelhouse": str(wheelhouse),
        "slurm_admission_trusted_keys": [str(tmp_path / "hall.pub")],
        "slurm_admission_reclaimable_partitions": ["spot", "preempt"],
    }
    r = play(tmp_path, host, ev, playbook="slurm_admission.yml")
    assert r.rc == 0, r.stdout.read()
    again = play(tmp_path, host, ev, playbook="slurm_admission.yml")
    assert again.rc == 0 and again.stats["changed"].get(host.name, 0) == 0
    table = host.ssh("cat", "/etc/slurm/sco_contracts.lua").stdout
    assert 'reclaimable = {["preempt"] = true, ["spot"] = true}' in table and '["genomics-ckpt"]' in table
    assert host.ssh("cat", "/etc/slurm/sco_contracts.serial").stdout == "1\n"
    assert (REPO / "slurm_plugins" / "job_submit.lua").read_text() == host.ssh(
        "cat", "/etc/slurm/job_submit.lua"
    ).stdout
    # a tampered bundle is refused and the table on disk stays as it was
    raw = (host.root / "root" / "bundle.json").read_bytes()
    (host.root / "root" / "bundle.json").write_bytes(raw.replace(b'"drainBudgetSeconds":6', b'"drainBudgetSeconds":9'))
    bad = play(tmp_path, host, ev, playbook="slurm_admission.yml")
    assert bad.rc != 0
    assert host.ssh("cat", "/etc/slurm/sco_contracts.lua").stdout == table
