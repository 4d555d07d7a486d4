"""Role ``checkpoint_store`` through real ansible-playbook runs (ansible-runner, as AWX runs it) against the real
one-node Ceph RGW: check mode changes nothing, a real run makes the contract's user, bucket, policy and lifecycle
rule and writes its credentials file (0600), a second run changes nothing; and a DCP workload given only that
file's settings checkpoints under the contract's prefix and keeps the contract's last ``keep``."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from sco.provider.checkpoint_store import StoreAdmin
from sco_devkit.devcluster.ceph import CephCluster
from tests.cli_run import sco
from tests.conftest import WriteFn, contract_yaml
from tests.dcp_runs import SMALL

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

PLAY = """
- name: The hall's checkpoint store
  hosts: localhost
  gather_facts: false
  roles:
    - role: sco.orchestrator.checkpoint_store
"""
TASK = "Converge the contracts' buckets, users, policies and lifecycle rules"


def role(tmp: Path, extra: dict[str, Any], *flags: str) -> tuple[dict[str, Any], str]:
    """The role's provisioning task's result for localhost, and the run's whole output."""
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
    out = r.stdout.read()
    results = [
        e["event_data"]["res"]
        for e in r.events
        if e.get("event") in ("runner_on_ok", "runner_on_failed") and e["event_data"].get("task") == TASK
    ]
    assert len(results) == 1, out
    res: dict[str, Any] = results[0]
    res["_rc"] = r.rc
    return res, out


def test_role_provisions_the_contract_store_and_the_workload_reads_its_file(
    tmp_path: Path, repo: Path, write: WriteFn, ceph: CephCluster
) -> None:
    hall = (repo / "hall.yaml").read_text()
    store = f"  checkpointStore: {{endpoint: '{ceph.endpoint}', throughputMiBPerSecond: 80}}\n"
    (repo / "hall.yaml").write_text(hall.replace("spec:\n", "spec:\n" + store, 1))
    ckpt = "{mode: signal, store: {prefix: jobs/, sizeMiB: 64, keep: 2}}"
    write("contracts/role-train.yaml", contract_yaml("role-train", checkpoint=ckpt))
    keys = tmp_path / "keys"
    assert sco("keygen", "--out-dir", keys, "--name", "k").returncode == 0
    bundle = tmp_path / "bundle.json"
    p = sco("contract", "compile", repo, "-o", bundle, "--signing-key", keys / "k.key", "--issued-at", "1764400000")
    assert p.returncode == 0, p.stderr
    creds_dir = tmp_path / "creds"
    extra = {
        "checkpoint_store_bundle": str(bundle),
        "checkpoint_store_trust": [str(keys / "k.pub")],
        "checkpoint_store_admin_access_key": ceph.access_key,
        "checkpoint_store_admin_secret_key": ceph.secret_key,
        "checkpoint_store_credentials_dir": str(creds_dir),
    }
    admin = StoreAdmin(ceph.endpoint, ceph.access_key, ceph.secret_key)

    check, _ = role(tmp_path, extra, "--check")
    assert check["_rc"] == 0 and check["changed"] is True
    (st,) = check["stores"]  # the one contract of the bundle that names a store; the endpoint from the bundle
    assert (st["contract"], st["bucket"], st["prefix"], st["keep"]) == ("role-train", "sco-ckpt-role-train", "jobs/", 2)
    assert st["changed"] == ["user", "bucket", "policy", "lifecycle"]
    assert admin.user("sco-ckpt-role-train") is None and not creds_dir.exists()

    real, out = role(tmp_path, extra)
    assert real["_rc"] == 0 and real["changed"] is True, out
    assert real["stores"][0]["changed"] == ["user", "bucket", "policy", "lifecycle", "credentials"]
    env_file = creds_dir / "role-train.env"
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    settings = dict(line.split("=", 1) for line in env_file.read_text().splitlines() if not line.startswith("#"))
    assert settings["SCO_CHECKPOINT_STORE"] == "s3://sco-ckpt-role-train/jobs/"
    assert settings["SCO_CHECKPOINT_KEEP"] == "2" and settings["AWS_ENDPOINT_URL"] == ceph.endpoint
    assert settings["AWS_SECRET_ACCESS_KEY"] not in out and settings["AWS_ACCESS_KEY_ID"] not in out  # no_log

    again, out = role(tmp_path, extra)
    assert again["_rc"] == 0 and again["changed"] is False and again["stores"][0]["changed"] == [], out

    # the workload of the contract, given only its credentials file: no --store, no --keep
    run = subprocess.run(
        [sys.executable, "-m", "sco_workloads.dcp_train", "--run", "r", "--steps", "6", "--every", "1", *SMALL],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
        env={**os.environ, **settings, "PYTHONPATH": str(ROOT / "src"), "SCO_CHECKPOINT_SOCKET": ""},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    s3 = ceph.s3(settings["AWS_ACCESS_KEY_ID"], settings["AWS_SECRET_ACCESS_KEY"])
    listed = s3.list_objects_v2(Bucket="sco-ckpt-role-train", Prefix="jobs/r/")["Contents"]
    assert {o["Key"].split("/")[2] for o in listed} == {"progress", "step-00000005", "step-00000006"}


def test_workload_without_a_store_or_with_a_bad_keep_says_which(tmp_path: Path) -> None:
    base = [sys.executable, "-m", "sco_workloads.dcp_train", "--run", "x"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCO_CHECKPOINT_")}
    p = subprocess.run(base, capture_output=True, text=True, cwd=ROOT, env=env)
    assert p.returncode == 2 and "--store: not given, and $SCO_CHECKPOINT_STORE is not set" in p.stderr, p.stderr
    for bad in ("two", "0"):
        bad_env = {**env, "SCO_CHECKPOINT_STORE": str(tmp_path), "SCO_CHECKPOINT_KEEP": bad}
        p = subprocess.run(base, capture_output=True, text=True, cwd=ROOT, env=bad_env)
        assert p.returncode == 2 and f"$SCO_CHECKPOINT_KEEP: expected a positive integer, got '{bad}'" in p.stderr
        assert "Traceback" not in p.stderr


def test_role_absent_removes_the_contract_user_and_keeps_its_checkpoints_unless_purged(
    tmp_path: Path, repo: Path, write: WriteFn, ceph: CephCluster
) -> None:
    """checkpoint_store_state absent (the uninstall): the contract's user (its keys), the bucket policy naming
    it and its credentials file go; the bucket and the checkpoint in it stay; a second run changes nothing; with
    checkpoint_store_purge_data the bucket and every object version go, and again nothing changes. Before: the role
    took no state (its argument spec refused checkpoint_store_state)."""
    hall = (repo / "hall.yaml").read_text()
    store = f"  checkpointStore: {{endpoint: '{ceph.endpoint}', throughputMiBPerSecond: 80}}\n"
    (repo / "hall.yaml").write_text(hall.replace("spec:\n", "spec:\n" + store, 1))
    write(
        "contracts/gone-train.yaml",
        contract_yaml("gone-train", checkpoint="{mode: signal, store: {prefix: jobs/, sizeMiB: 64, keep: 2}}"),
    )
    keys = tmp_path / "keys"
    assert sco("keygen", "--out-dir", keys, "--name", "k").returncode == 0
    bundle = tmp_path / "bundle.json"
    p = sco("contract", "compile", repo, "-o", bundle, "--signing-key", keys / "k.key", "--issued-at", "1764400000")
    assert p.returncode == 0, p.stderr
    creds_dir = tmp_path / "creds"
    extra = {
        "checkpoint_store_bundle": str(bundle),
        "checkpoint_store_trust": [str(keys / "k.pub")],
        "checkpoint_store_admin_access_key": ceph.access_key,
        "checkpoint_store_admin_secret_key": ceph.secret_key,
        "checkpoint_store_credentials_dir": str(creds_dir),
    }
    admin = StoreAdmin(ceph.endpoint, ceph.access_key, ceph.secret_key)
    bucket, uid = "sco-ckpt-gone-train", "sco-ckpt-gone-train"
    made, out = role(tmp_path, extra)
    assert made["_rc"] == 0 and made["changed"] is True, out
    settings = dict(ln.split("=", 1) for ln in (creds_dir / "gone-train.env").read_text().splitlines() if "=" in ln)
    s3 = ceph.s3(settings["AWS_ACCESS_KEY_ID"], settings["AWS_SECRET_ACCESS_KEY"])
    s3.put_object(Bucket=bucket, Key="jobs/r/step-00000001/a", Body=b"checkpoint")
    s3.put_object(Bucket=bucket, Key="jobs/r/step-00000001/a", Body=b"again")  # a second version if versioned

    gone, out = role(tmp_path, {**extra, "checkpoint_store_state": "absent"})
    assert gone["_rc"] == 0 and gone["changed"] is True, out
    assert gone["stores"][0]["changed"] == ["user", "policy", "credentials"]
    assert admin.user(uid) is None and not creds_dir.exists()
    listed = admin.s3.list_objects_v2(Bucket=bucket)["Contents"]
    assert [o["Key"] for o in listed] == ["jobs/r/step-00000001/a"]  # the checkpoint kept
    with pytest.raises(ClientError, match="NoSuchBucketPolicy"):
        admin.s3.get_bucket_policy(Bucket=bucket)
    again, out = role(tmp_path, {**extra, "checkpoint_store_state": "absent"})
    assert again["_rc"] == 0 and again["changed"] is False and again["stores"][0]["changed"] == [], out

    purge = {**extra, "checkpoint_store_state": "absent", "checkpoint_store_purge_data": True}
    purged, out = role(tmp_path, purge)
    assert purged["_rc"] == 0 and purged["stores"][0]["changed"] == ["bucket"], out
    assert bucket not in [b["Name"] for b in admin.s3.list_buckets()["Buckets"]]
    again, out = role(tmp_path, purge)
    assert again["_rc"] == 0 and again["changed"] is False, out
