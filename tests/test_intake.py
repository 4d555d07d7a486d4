"""Demand intake: pending pods from the Kubernetes API stand-in through the official client, pending jobs from the
real slurmctld, normalised into milli-units per contract and tier; work without a contract reported, not counted."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sco.contract.bundle import Bundle
from sco.contract.signing import Keyring, generate
from sco.control import intake
from sco.control.intake import DemandReport, from_pods, pod_request_milli, tolerates
from sco.control.units import fmt, quantity, request_milli, units_milli
from sco.schedulers.slurm import SlurmClient
from sco_devkit.devcluster.slurm import SlurmCluster
from sco_devkit.standins.kube_apiserver import KubeApiStandIn
from tests.harness import hall_bundle, wait_for

TOLERATE = [{"key": "sco.dev/reclaim", "operator": "Equal", "value": "reclaimable", "effect": "NoSchedule"}]


@pytest.fixture(scope="module")
def contracts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    key = generate()
    root = tmp_path_factory.mktemp("bundle")
    return Bundle.from_bytes(hall_bundle(root, key), Keyring([key.public])).contracts


def pod(ns: str, name: str, cpu: str = "1", mem: str = "1Gi", **spec: Any) -> dict[str, Any]:
    labels = spec.pop("labels", {})
    return {
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {
            "containers": [{"name": "c", "image": "x", "resources": {"requests": {"cpu": cpu, "memory": mem}}}],
            "tolerations": spec.pop("tolerations", TOLERATE),
            **spec,
        },
    }


# --- the unit --------------------------------------------------------------------------------------


def test_unit_is_the_dominant_resource() -> None:
    assert units_milli(1000, 4 * 1024**3) == 1000  # 1 vCPU, 4 GiB: one unit
    assert units_milli(1000, 16 * 1024**3) == 4000  # memory dominates
    assert units_milli(500, 0, gpus=1) == 8000  # a GPU is 8 units
    assert units_milli(0, 1) == 1  # rounded up, never down to zero
    assert request_milli(0, 0) == 100  # a request of nothing still needs room
    assert fmt(12500) == "12.5" and fmt(3000) == "3"


def test_quantities_follow_kubernetes() -> None:
    assert quantity("500m") * 1000 == 500
    assert quantity("1.5Gi") == 1.5 * 1024**3
    assert quantity("2") == 2 and quantity(4) == 4
    assert quantity("1e3") == 1000 and quantity("1k") == 1000
    with pytest.raises(ValueError, match="'lots' is not a Kubernetes quantity"):
        quantity("lots")


def test_tolerations_follow_tolerates_taint() -> None:
    taint = intake.RECLAIMABLE_TAINT
    assert tolerates(TOLERATE, taint)
    assert tolerates([{"key": "sco.dev/reclaim", "operator": "Exists"}], taint)  # any value, any effect
    assert tolerates([{"operator": "Exists"}], taint)  # empty key + Exists tolerates everything
    assert not tolerates([{"key": "sco.dev/reclaim", "value": "reserved", "effect": "NoSchedule"}], taint)
    assert not tolerates([{"key": "sco.dev/reclaim", "operator": "Exists", "effect": "NoExecute"}], taint)
    assert not tolerates([{"key": "other", "operator": "Exists"}], taint)
    assert not tolerates([], taint)


def test_pod_request_is_what_the_scheduler_charges() -> None:
    p = pod("web", "p", cpu="1", mem="2Gi")
    p["spec"]["containers"].append({"name": "side", "resources": {"limits": {"cpu": "500m", "memory": "1Gi"}}})
    assert pod_request_milli(p) == 1500  # limits stand in for missing requests
    p["spec"]["initContainers"] = [{"name": "init", "resources": {"requests": {"cpu": "4"}}}]
    assert pod_request_milli(p) == 4000  # the largest init container wins when it is larger
    p["spec"]["overhead"] = {"cpu": "250m"}
    assert pod_request_milli(p) == 4250
    gpu = pod("web", "g", cpu="1", mem="1Gi")
    gpu["spec"]["containers"][0]["resources"]["limits"] = {"nvidia.com/gpu": "2"}
    assert pod_request_milli(gpu) == 16000


def test_pods_are_sorted_into_demand_uncontracted_ineligible_and_load(contracts: dict[str, Any]) -> None:
    pods = [
        pod("web", "w1", cpu="2", mem="1Gi"),
        pod("web", "w2", cpu="500m", mem="8Gi"),
        pod("guarded", "g1", cpu="1", mem="1Gi"),
        pod("nobody", "stray", cpu="1", mem="1Gi"),
        pod("web", "no-toleration", tolerations=[]),
        pod("web", "bound", cpu="3", mem="1Gi", nodeName="node-a"),
        pod("web", "bad", cpu="lots"),
    ]
    for p in pods:
        p["status"] = {"phase": "Pending"}
    report = from_pods(pods, contracts)
    assert [d.to_dict() for d in report.demand] == [
        {
            "contract": "guarded",
            "tier": 2,
            "scheduler": "kubernetes",
            "units_milli": 1000,
            "items": 1,
            "requests_milli": {"1000": 1},
        },
        {
            "contract": "web",
            "tier": 3,
            "scheduler": "kubernetes",
            "units_milli": 4000,
            "items": 2,
            "requests_milli": {"2000": 2},
        },  # 2 CPUs; 8 GiB
    ]
    assert [(u.ref, u.reason) for u in report.uncontracted] == [
        ("nobody/stray", "no contract selects namespace 'nobody' with labels {}")
    ]
    reasons = {u.ref: u.reason for u in report.ineligible}
    assert reasons["web/no-toleration"] == "does not tolerate sco.dev/reclaim=reclaimable:NoSchedule"
    assert "'lots' is not a Kubernetes quantity" in reasons["web/bad"]
    assert report.node_load_milli == {"node-a": 3000}
    assert DemandReport.from_dict(report.to_dict()).to_dict() == report.to_dict()


def test_pending_pods_from_the_standin_through_the_official_client(contracts: dict[str, Any]) -> None:
    srv = KubeApiStandIn().start()
    try:
        srv.cluster.add_node("spot-1")
        for i in range(3):
            srv.cluster.create_pod("web", pod("web", f"w{i}", cpu="2", mem="2Gi"))
        srv.cluster.create_pod("guarded", pod("guarded", "g", cpu="1", mem="12Gi"))
        srv.cluster.create_pod("ci", pod("ci", "stray"))
        srv.cluster.create_pod("web", pod("web", "running", cpu="1", nodeName="spot-1"))
        report = intake.from_pods(intake.kube_pods(intake.kube_api_client(srv.url), page=2), contracts)
    finally:
        srv.stop()
    assert {(d.contract, d.tier, d.units_milli, d.items) for d in report.demand} == {
        ("web", 3, 6000, 3),
        ("guarded", 2, 3000, 1),
    }
    assert [u.ref for u in report.uncontracted] == ["ci/stray"]
    assert report.node_load_milli == {"spot-1": 1000}


def test_kubernetes_unreachable_is_a_clear_error(contracts: dict[str, Any]) -> None:
    from tests.harness import free_port

    with pytest.raises(intake.IntakeError, match="kubernetes: listing pods"):
        intake.kube_pods(intake.kube_api_client(f"http://127.0.0.1:{free_port()}"))


def test_hostlists_expand() -> None:
    assert intake.expand_hostlist("n[1-3,7],gpu01") == ["n1", "n2", "n3", "n7", "gpu01"]
    assert intake.expand_hostlist("c[08-10]") == ["c08", "c09", "c10"]
    assert intake.expand_hostlist("solo") == ["solo"]


# --- Slurm (real slurmctld) ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    root = tmp_path_factory.mktemp("slurm")
    c = SlurmCluster(root, nodes=("n1",), extra_conf="PartitionName=onprem Nodes=n1 MaxTime=INFINITE State=UP\n")
    c.start()
    (root / "job.sh").write_text("#!/bin/bash\nsleep 300 & wait $!\n")
    yield c
    c.stop()


def test_pending_slurm_jobs_by_contract(slurm: SlurmCluster, contracts: dict[str, Any]) -> None:
    script = slurm.root / "job.sh"
    comment = "--comment=sco-contract=genomics-ckpt"
    filler = slurm.sbatch(script, "-A", "genomics", comment, "-c", "2")  # takes the node: the rest stay pending
    wait_for(lambda: slurm.job(filler).get("JobState") == "RUNNING", 30, "the filler job running")
    slurm.sbatch(script, "-A", "genomics", comment, "-c", "2", "--mem=900")  # CPU dominates 900 MB
    slurm.sbatch(script, "-A", "genomics", "--comment=note sco-contract=genomics-ckpt", "-n", "2", "--array=1-3")
    slurm.sbatch(script, "-A", "climate", "-c", "1")  # no comment: the contract selecting the account
    slurm.sbatch(script, "-A", "chemistry", "-c", "1")  # no contract at all
    slurm.sbatch(script, "-A", "genomics", "--comment=sco-contract=climate-sims", "-c", "1")  # wrong account
    slurm.sbatch(script, "-A", "genomics", comment, "-p", "onprem", "-c", "1")  # not a reclaimable partition
    slurm.sbatch(script, "-A", "genomics", comment, "--hold", "-c", "1")  # held: not demand yet
    report = asyncio.run(intake.slurm_demand(SlurmClient(slurm_conf=str(slurm.conf), timeout=10), contracts, ["spot"]))
    assert [d.to_dict() for d in report.demand] == [
        {
            "contract": "climate-sims",
            "tier": 2,
            "scheduler": "slurm",
            "units_milli": 1000,
            "items": 1,
            "requests_milli": {"1000": 1},
        },
        # 2 CPUs, then 3 array tasks of 2 CPUs each
        {
            "contract": "genomics-ckpt",
            "tier": 3,
            "scheduler": "slurm",
            "units_milli": 2000 + 3 * 2000,
            "items": 4,
            "requests_milli": {"2000": 4},
        },
    ]
    why = sorted(u.reason for u in report.uncontracted)
    assert why == [
        "names contract 'climate-sims', which is not a slurm contract for account 'genomics' in spot",
        "no contract selects account 'chemistry' in spot",
    ]
    assert sorted(u.reason for u in report.ineligible) == [
        "not runnable yet (JobHeldUser)",
        "partitions onprem are not reclaimable",
    ]
    assert report.node_load_milli == {"n1": 2000}


def test_slurm_unreachable_is_a_clear_error(tmp_path: Path, contracts: dict[str, Any]) -> None:
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=x\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort=1\nAuthType=auth/none\n")
    client = SlurmClient(slurm_conf=str(conf), timeout=2)
    with pytest.raises(intake.IntakeError, match="slurm: squeue"):
        asyncio.run(intake.slurm_demand(client, contracts, ["spot"]))
