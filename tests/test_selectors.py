"""One set of contract-selection rules (``sco.contract.selectors``) for the agent's budgets and the demand intake."""

from __future__ import annotations

from typing import Any

from sco.agent.budget import KubeBudgets
from sco.contract.selectors import contract_from_comment, kube_contract, kube_selectors, slurm_contract
from sco.control.intake import DemandReport, from_pods, merge

CONTRACTS: dict[str, Any] = {
    "web": {"scheduler": "kubernetes", "tier": 3, "selector": {"namespace": "web", "matchLabels": {"app": "w"}}},
    "web-any": {"scheduler": "kubernetes", "tier": 3, "selector": {"namespace": "shop"}},
    "sims": {"scheduler": "slurm", "tier": 2, "selector": {"account": "climate", "partitions": ["spot"]}},
    "sims-2": {"scheduler": "slurm", "tier": 2, "selector": {"account": "climate"}},
}


def test_kubernetes_selection() -> None:
    sel = kube_selectors(CONTRACTS)
    assert kube_contract(sel, "web", {"app": "w", "x": "y"}) == "web"
    assert kube_contract(sel, "web", {"app": "other"}) is None
    assert kube_contract(sel, "shop", {}) == "web-any"


def test_slurm_selection() -> None:
    assert contract_from_comment("x=1; sco-contract=sims-2 other") == "sims-2"
    assert slurm_contract(CONTRACTS, "climate", ["spot"], "") == "sims"
    assert slurm_contract(CONTRACTS, "climate", ["batch"], "") == "sims-2"
    assert slurm_contract(CONTRACTS, "climate", ["batch"], "sco-contract=sims") is None  # named, does not fit
    assert slurm_contract(CONTRACTS, "other", ["spot"], "") is None


def test_the_intake_and_the_agent_agree_on_a_pods_contract() -> None:
    class _Bundle:
        contracts = CONTRACTS

        def budget(self, name: str) -> Any:
            return type("B", (), {"contract": name, "drain_seconds": 1, "final_write_seconds": 0})()

    pod = {
        "metadata": {"namespace": "web", "name": "p", "labels": {"app": "w"}},
        "spec": {"tolerations": [{"operator": "Exists"}], "containers": [{"resources": {"requests": {"cpu": "1"}}}]},
        "status": {"phase": "Pending"},
    }
    assert KubeBudgets(_Bundle()).for_pod(pod).contract == "web"  # type: ignore[arg-type]
    assert [d.contract for d in from_pods([pod], CONTRACTS).demand] == ["web"]


def test_request_sizes_survive_a_merge_and_a_round_trip() -> None:
    pods = [
        {
            "metadata": {"namespace": "shop", "name": f"p{k}"},
            "spec": {"tolerations": [{"operator": "Exists"}], "containers": [{"resources": {"requests": {"cpu": c}}}]},
            "status": {"phase": "Pending"},
        }
        for k, c in enumerate(["1", "2", "2"])
    ]
    a = from_pods(pods[:1], CONTRACTS)
    b = DemandReport.from_dict(from_pods(pods[1:], CONTRACTS).to_dict())
    (d,) = merge(a, b).demand
    assert (d.units_milli, d.items, dict(d.requests_milli)) == (5000, 3, {1000: 1, 2000: 2})
    old = {"demand": [{"contract": "web-any", "tier": 3, "scheduler": "kubernetes", "units_milli": 700, "items": 2}]}
    (d,) = merge(DemandReport.from_dict(old), a).demand  # a report without sizes: the total, sizes unknown
    assert (d.units_milli, d.items, dict(d.requests_milli)) == (1700, 3, {})
