"""The PyTorch DCP training workload in the tests: its contract's store provisioned on the real Ceph RGW, the
workload's environment, a small model's uninterrupted reference run and the bitwise comparison with it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from sco.provider.checkpoint_store import ContractStore, StoreAdmin
from sco_devkit.devcluster.ceph import CephCluster

ROOT = Path(__file__).resolve().parents[1]


SMALL = ["--inputs", "32", "--hidden", "64", "--batch", "16", "--threads", "1"]


def provision(ceph: CephCluster, contract: str, prefix: str = "runs/", keep: int = 2) -> dict[str, Any]:
    return StoreAdmin(ceph.endpoint, ceph.access_key, ceph.secret_key).ensure(
        ContractStore(contract, f"sco-ckpt-{contract}", prefix, keep)
    )


def workload_env(ceph: CephCluster, creds: dict[str, Any]) -> dict[str, str]:
    return {
        **os.environ,
        "AWS_ACCESS_KEY_ID": creds["access_key"],
        "AWS_SECRET_ACCESS_KEY": creds["secret_key"],
        "AWS_ENDPOINT_URL": ceph.endpoint,
        "PYTHONPATH": str(ROOT / "src"),
    }


def reference(steps: int, *extra: str) -> dict[str, Any]:
    from sco_workloads.dcp_train import parse, uninterrupted

    return uninterrupted(parse(["--run", "ref", "--store", "/nonexistent", "--steps", str(steps), *extra]))


def assert_bitwise(out: Path, ref: dict[str, Any]) -> None:
    import torch

    got = torch.load(out)
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert torch.equal(got[k], v), f"{k}: max abs diff {(got[k] - v).abs().max().item()}"


def lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]
