"""Which contract a workload falls under: the rules the node plane (drain budgets) and the control plane (demand
intake) both apply, so they cannot drift apart. Standard library only: the agent imports it.

- Kubernetes and Spark: a contract selects a namespace and, optionally, labels (``selector.matchLabels``); the
  compiler guarantees at most one contract matches a pod, and contracts are tried by name.
- Slurm: the contract a job names in its comment (``sco-contract=NAME``), else the first contract by name whose
  account matches and whose partitions (if any) include one of the job's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

CONTRACT_COMMENT_KEY = "sco-contract"

KubeSelectors = dict[str, list[tuple[dict[str, str], str]]]
"""Namespace -> [(matchLabels, contract name)], contracts by name."""


def contract_from_comment(comment: str) -> str | None:
    """The contract a Slurm job names in its comment: ``sco-contract=<name>`` (whitespace or ; separated)."""
    for tok in comment.replace(";", " ").split():
        key, _, value = tok.partition("=")
        if key == CONTRACT_COMMENT_KEY and value:
            return value
    return None


def kube_selectors(contracts: Mapping[str, Mapping[str, Any]]) -> KubeSelectors:
    by_ns: KubeSelectors = {}
    for name, c in sorted(contracts.items()):
        if c.get("scheduler") in ("kubernetes", "spark"):
            sel = c["selector"]
            by_ns.setdefault(sel["namespace"], []).append((dict(sel.get("matchLabels") or {}), name))
    return by_ns


def kube_contract(selectors: KubeSelectors, namespace: str, labels: Mapping[str, str]) -> str | None:
    """The contract selecting a pod of ``namespace`` with ``labels``, or None."""
    for match, name in selectors.get(namespace, []):
        if all(labels.get(k) == v for k, v in match.items()):
            return name
    return None


def slurm_fits(contract: Mapping[str, Any], account: str, partitions: Iterable[str]) -> bool:
    """A slurm contract's selector takes a job of ``account`` in any of ``partitions``."""
    if contract.get("scheduler") != "slurm":
        return False
    sel = contract["selector"]
    allowed = sel.get("partitions") or []
    return bool(sel["account"] == account and (not allowed or any(p in allowed for p in partitions)))


def slurm_contract(
    contracts: Mapping[str, Mapping[str, Any]], account: str, partitions: list[str], comment: str
) -> str | None:
    """The contract of a Slurm job: the one it names (if that contract takes it), else the first that selects it."""
    named = contract_from_comment(comment)
    if named:
        c = contracts.get(named)
        return named if c is not None and slurm_fits(c, account, partitions) else None
    return next((n for n, c in sorted(contracts.items()) if slurm_fits(c, account, partitions)), None)
