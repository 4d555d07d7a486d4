"""Drain budgets from the cached bundle only: which contract a workload falls under, and its grace."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sco.contract.bundle import Budget, Bundle
from sco.contract.selectors import contract_from_comment, kube_contract, kube_selectors


@dataclass(frozen=True)
class PodBudget:
    contract: str | None
    drain_seconds: float  # the contract's drain budget (or the pod's own grace when no contract names it)
    final_write_seconds: float


class KubeBudgets:
    """Maps pods to contracts by namespace and labels (the compiler guarantees at most one match)."""

    def __init__(self, bundle: Bundle | None) -> None:
        self.bundle = bundle
        self._by_ns = kube_selectors(bundle.contracts) if bundle is not None else {}

    def contract_for(self, pod: dict[str, Any]) -> Budget | None:
        md = pod["metadata"]
        name = kube_contract(self._by_ns, md.get("namespace", ""), md.get("labels") or {})
        if name is None:
            return None
        assert self.bundle is not None
        return self.bundle.budget(name)

    def for_pod(self, pod: dict[str, Any]) -> PodBudget:
        b = self.contract_for(pod)
        if b is not None:
            return PodBudget(b.contract, float(b.drain_seconds), float(b.final_write_seconds))
        # Admission refuses work without a contract; a pod that got here anyway keeps its own grace,
        # still capped by the deadline.
        own = pod.get("spec", {}).get("terminationGracePeriodSeconds", 30)
        return PodBudget(None, float(own), 0.0)


class SlurmBudgets:
    """Slurm jobs to contracts: the contract the job names (job_submit guarantees one on reclaimable
    partitions), else the contract selecting its account and partition."""

    def __init__(self, bundle: Bundle | None) -> None:
        self.bundle = bundle
        self._by_account: dict[str, list[tuple[list[str], str]]] = {}
        if bundle is not None:
            for name, c in bundle.contracts.items():
                if c["scheduler"] == "slurm":
                    sel = c["selector"]
                    self._by_account.setdefault(sel["account"], []).append((sel.get("partitions") or [], name))

    def for_job(
        self, account: str, partition: str, comment: str, default_drain_s: float
    ) -> tuple[Budget | None, float, float, str]:
        """(budget or None, drain seconds, final-write seconds, signal). A job no contract covers (admission
        refuses those on reclaimable partitions) gets ``default_drain_s``: what the deadline leaves."""
        b: Budget | None = None
        if self.bundle is not None:
            named = contract_from_comment(comment)
            if named:
                b = self.bundle.budget(named)
            if b is None:
                for parts, name in self._by_account.get(account, []):
                    if not parts or partition in parts:
                        b = self.bundle.budget(name)
                        break
        if b is None:
            return None, default_drain_s, 0.0, "USR1"
        return b, float(b.drain_seconds), float(b.final_write_seconds), b.signal
