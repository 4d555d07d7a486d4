"""What a converged Slurm hall does (molecule scenario hall-b): the node's agent unit and config over SSH
(testinfra), and real jobs submitted to a real slurmctld that runs with the files the slurm_admission role wrote
beside the slurmctld host's slurm.conf (molecule/shared/slurm.py says where it runs)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import testinfra

SCENARIO = "hall-b"
WORK = Path("/var/tmp/sco-molecule") / SCENARIO
INVENTORY = Path(__file__).resolve().parents[1] / "inventory" / "hosts.yml"
REPO = Path(__file__).resolve().parents[3]
ETC_SLURM = WORK / "hosts" / "ctl" / "etc" / "slurm"
sys.path.insert(0, str(REPO / "molecule" / "shared"))
import verify  # noqa: E402  (molecule/shared/verify.py)


def get(name: str) -> Any:
    return testinfra.get_host(f"ansible://{name}", ansible_inventory=str(INVENTORY))


def test_agent_unit_enabled_hardened_and_config_checked() -> None:
    h = get("spot-s1")
    verify.check_agent_unit(h)
    out = h.run("/opt/sco/bin/sco-agent check-config --config /etc/sco/agent.toml")
    assert out.rc == 0, out.stderr
    assert "node spot-s1, hall hall-b, slurm" in out.stdout


def test_admission_files_beside_slurm_conf_and_revoked_key_gone() -> None:
    h = get("ctl")
    role_files = REPO / "collections/ansible_collections/sco/orchestrator/roles/slurm_admission/files"
    assert h.file("/etc/slurm/job_submit.lua").content_string == (role_files / "job_submit.lua").read_text()
    table = h.file("/etc/slurm/sco_contracts.lua").content_string
    assert '["genomics-align"]' in table and '["spot"] = true' in table and '["spot-gpu"] = true' in table
    assert h.run("ls /etc/slurm/sco-trusted").stdout.split() == ["hall.pub"]
    # a bundle signed by the retired key no longer renders
    repo = WORK / "contracts"  # prepare.yml's copy of the samples, named hall-b
    subprocess.run(
        [sys.executable, "-m", "sco.cli", "contract", "compile", str(repo), "-o", str(WORK / "hosts/ctl/root/old.json"),
         "--signing-key", str(WORK / "retired" / "retired.key"), "--issued-at", "1"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    refused = h.run(
        "/opt/sco/bin/sco slurm render-contracts /root/old.json --trust-dir /etc/slurm/sco-trusted "
        "--out-dir /tmp --reclaimable-partition spot"
    )
    assert refused.rc == 3, refused.stdout + refused.stderr


@pytest.fixture(scope="module")
def slurm() -> Iterator[Any]:
    from slurm import cluster  # molecule/shared/slurm.py

    c = cluster(ETC_SLURM)
    c.node_ports = {}  # the ports are in the slurm.conf prepare wrote; nothing is rewritten here
    c.start_ctld()
    c.start_slurmd("spot-s1")
    try:
        c.wait_idle(60)
        yield c
    finally:
        c.stop()


def test_real_sbatch_without_a_contract_is_refused(slurm: Any, tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\nsleep 1\n")
    refused = subprocess.run(
        ["sbatch", "--partition=spot", "--account=genomics", str(script)],
        env=slurm.env(), capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert refused.returncode != 0
    assert "add --comment=sco-contract=<name>" in refused.stderr and "genomics-align" in refused.stderr
    job = slurm.sbatch(script, "--partition=spot", "--account=genomics", "--comment=sco-contract=genomics-align")
    assert slurm.job(job)["Requeue"] == "1"  # accepted and made requeueable by job_submit.lua
