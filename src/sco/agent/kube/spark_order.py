"""Spark on Kubernetes in the drain (seed view 19, second row).

Executor pods (label ``spark-role=executor``, set by Spark on every executor) are evicted first, with the
remaining budget as grace: their preStop (SIGPWR) starts decommissioning, and the executor migrates its shuffle
and cached blocks to peers or to the fallback store. That migration is coordinated by the driver, so a driver
(``spark-role=driver``; admission keeps drivers off reclaimable nodes, but one may be there) is evicted last:
only once this node's executors are gone, or when their budgets have run out.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

SPARK_ROLE = "spark-role"
EXECUTOR, DRIVER = "executor", "driver"


def spark_role(pod: dict[str, Any]) -> str | None:
    return ((pod.get("metadata") or {}).get("labels") or {}).get(SPARK_ROLE)


def eviction_rank(pod: dict[str, Any]) -> int:
    """Order in which evictions are sent: executors, then everything else, drivers last."""
    role = spark_role(pod)
    return 0 if role == EXECUTOR else 2 if role == DRIVER else 1


def in_eviction_order(pods: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(pods, key=eviction_rank)  # stable: the API's order within a rank


def driver_may_go(executors: Iterable[tuple[bool, float]], now: float) -> bool:
    """Given (gone, budget_end) for each executor pod on the node: the driver may be evicted once every one is
    gone, or once their budgets have all run out (they are then being forced; the driver waits no longer)."""
    return all(gone or now >= budget_end for gone, budget_end in executors)
