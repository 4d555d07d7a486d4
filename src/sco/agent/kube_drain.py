"""The Kubernetes drain path (seed view 19, first row): taint, evict in parallel through the Eviction API,
retry a PodDisruptionBudget's 429 until the pod's budget is spent and then delete with the grace that
remains, verify until no evictable pod is left ("drained") or the deadline comes ("overrun").

The scheduler's eviction does the work: this path never kills a container itself, so two systems never
evict the same pod. Every step is spooled before or as it is taken, so a restarted agent resumes the same
drain against the same deadline without tainting again or evicting twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sco.agent.budget import KubeBudgets, PodBudget, grace_seconds
from sco.agent.notices import Notice
from sco.agent.resume import DrainRecord
from sco.agent.spool import CRITICAL, ROUTINE, Spool
from sco.schedulers.kube import KubeClient, KubeError, KubeUnreachable

log = logging.getLogger("sco.agent.kube")

Obj = dict[str, Any]
POLL_S = 0.25
BACKOFF_START_S, BACKOFF_MAX_S = 0.2, 2.0


def evictable(pod: Obj) -> bool:
    """As ``kubectl drain``: DaemonSet and mirror pods are left to kubelet; finished pods block nothing."""
    md = pod["metadata"]
    if any(o.get("kind") == "DaemonSet" for o in md.get("ownerReferences") or []):
        return False
    if "kubernetes.io/config.mirror" in (md.get("annotations") or {}):
        return False
    return not (pod.get("status", {}).get("phase") in ("Succeeded", "Failed") and not md.get("deletionTimestamp"))


def _key(pod: Obj) -> str:
    return f"{pod['metadata'].get('namespace', '')}/{pod['metadata']['name']}"


@dataclass
class Resume(DrainRecord):
    """What the spool says was already done for a notice."""

    tainted: bool = False
    requested: dict[str, int] = field(default_factory=dict)  # pod uid -> grace asked for
    forced: dict[str, int] = field(default_factory=dict)

    def apply(self, type_: str, ev: dict[str, Any]) -> None:
        if type_ == "node.tainted":
            self.tainted = True
        elif type_ == "eviction.requested":
            self.requested[ev["uid"]] = int(ev["grace"])
        elif type_ == "eviction.forced":
            self.forced[ev["uid"]] = int(ev["grace"])


@dataclass
class PodState:
    key: str
    uid: str
    budget: PodBudget
    state: str = "pending"  # pending | blocked | requested | forced | gone
    forced: bool = False
    last_error: str = ""
    pod: Obj = field(default_factory=dict)


class KubernetesDrain:
    def __init__(
        self,
        *,
        kube: KubeClient,
        spool: Spool,
        budgets: KubeBudgets,
        node: str,
        taint_key: str,
        notice: Notice,
        margin: float,
        resume: Resume | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.kube, self.spool, self.budgets = kube, spool, budgets
        self.node, self.taint_key, self.notice = node, taint_key, notice
        self.deadline = notice.terminate_at
        self.margin = margin
        self.resume = resume or Resume()
        self.clock = clock
        self.started_at = self.resume.received_at or notice.received_at
        self.pods: dict[str, PodState] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.outcome: Obj | None = None
        self._unreachable_logged = False

    # --- helpers -----------------------------------------------------------------------------------

    def _event(self, type_: str, priority: int = ROUTINE, **fields: Any) -> None:
        self.spool.append(type_, priority, notice=self.notice.id, **fields)

    def update_deadline(self, terminate_at: float) -> None:
        if terminate_at < self.deadline:
            self.deadline = terminate_at

    def _left(self) -> float:
        return self.deadline - self.clock()

    def _unreachable(self, what: str, err: Exception) -> None:
        if not self._unreachable_logged:
            self._unreachable_logged = True
            self._event("scheduler.unreachable", what=what, error=str(err))
        log.warning("API server did not answer (%s): %s", what, err)

    # --- steps -------------------------------------------------------------------------------------

    async def _taint(self) -> None:
        if self.resume.tainted:
            return
        delay = BACKOFF_START_S
        while self._left() > 0:
            try:
                await self.kube.taint_node(self.node, self.taint_key, self.notice.id)
                first_action_ms = round((self.clock() - self.started_at) * 1000, 1)
                self._event("node.tainted", CRITICAL, key=self.taint_key, first_action_ms=first_action_ms)
                return
            except (KubeUnreachable, KubeError) as e:
                self._unreachable("taint", e)
                await asyncio.sleep(delay)
                delay = min(BACKOFF_MAX_S, delay * 2)

    async def _list(self) -> list[Obj] | None:
        try:
            return [p for p in await self.kube.pods_on_node(self.node) if evictable(p)]
        except (KubeUnreachable, KubeError) as e:
            self._unreachable("list pods", e)
            return None

    def _track(self, pod: Obj) -> None:
        uid = pod["metadata"]["uid"]
        if uid in self.pods:
            self.pods[uid].pod = pod
            return
        st = PodState(_key(pod), uid, self.budgets.for_pod(pod), pod=pod)
        self.pods[uid] = st
        if uid in self.resume.forced:
            st.state, st.forced = "forced", True
        elif uid in self.resume.requested:
            st.state = "requested"
        elif pod["metadata"].get("deletionTimestamp"):
            st.state = "requested"  # already terminating: someone else asked; do not ask twice
        else:
            self._tasks[uid] = asyncio.create_task(self._evict(st), name=f"evict:{st.key}")

    async def _evict(self, st: PodState) -> None:
        ns, name = st.key.split("/", 1)
        # The pod's budget runs from the notice; PDB retries stop when it is spent.
        budget_end = min(self.started_at + st.budget.drain_seconds, self.deadline - self.margin)
        delay = BACKOFF_START_S
        while True:
            now = self.clock()
            if now >= budget_end:
                await self._force(st, ns, name)
                return
            grace = grace_seconds(st.budget.drain_seconds, self.deadline, now, self.margin)
            try:
                r = await self.kube.evict(ns, name, grace)
            except KubeUnreachable as e:
                self._unreachable("evict", e)
                st.last_error = str(e)
            else:
                if r.accepted:
                    st.state = "requested"
                    self._event(
                        "eviction.requested", CRITICAL, pod=st.key, uid=st.uid, grace=grace, contract=st.budget.contract
                    )
                    return
                if r.status == 404:
                    return  # already gone; the verifier records it
                st.last_error = f"HTTP {r.status}: {r.message}"
                if r.status == 429 and st.state != "blocked":
                    st.state = "blocked"
                    self._event(
                        "eviction.blocked",
                        pod=st.key,
                        uid=st.uid,
                        reason=r.message,
                        budget_left_s=round(budget_end - now, 2),
                    )
            await asyncio.sleep(min(delay, max(0.0, budget_end - self.clock())))
            delay = min(BACKOFF_MAX_S, delay * 2)

    async def _force(self, st: PodState, ns: str, name: str) -> None:
        """Budget spent (a PDB never allowed): delete with the grace that remains (seed view 19, risk)."""
        while True:
            now = self.clock()
            grace = grace_seconds(st.budget.final_write_seconds, self.deadline, now, self.margin)
            try:
                r = await self.kube.delete_pod(ns, name, grace)
            except KubeUnreachable as e:
                self._unreachable("delete", e)
                if self._left() <= 0:
                    return
                await asyncio.sleep(BACKOFF_START_S)
                continue
            if r.status == 404:
                return
            if r.status < 300:
                st.state, st.forced = "forced", True
                self._event(
                    "eviction.forced",
                    CRITICAL,
                    pod=st.key,
                    uid=st.uid,
                    grace=grace,
                    reason=st.last_error or "drain budget spent",
                    contract=st.budget.contract,
                )
                return
            st.last_error = f"HTTP {r.status}: {r.message}"
            if self._left() <= 0:
                return
            await asyncio.sleep(BACKOFF_START_S)

    def _why(self, st: PodState) -> str:
        md = st.pod.get("metadata", {})
        phase = st.pod.get("status", {}).get("phase")
        if st.state in ("pending", "blocked"):
            return f"PodDisruptionBudget: {st.last_error}" if st.state == "blocked" else f"not evicted: {st.last_error}"
        if md.get("finalizers") and phase in ("Succeeded", "Failed"):
            return f"stuck finalizer: {', '.join(md['finalizers'])}"
        if md.get("deletionTimestamp"):
            return f"slow preStop or shutdown (grace {md.get('deletionGracePeriodSeconds')} s)"
        return f"still running after {st.state} eviction"

    async def run(self) -> Obj:
        """Drain, verify, and return the outcome event."""
        await self._taint()
        while True:
            pods = await self._list()
            if pods is not None:
                now_present = set()
                for p in pods:
                    self._track(p)
                    now_present.add(p["metadata"]["uid"])
                for st in self.pods.values():
                    if st.uid not in now_present and st.state != "gone":
                        st.state = "gone"
                        self._event(
                            "pod.gone", pod=st.key, uid=st.uid, after_s=round(self.clock() - self.started_at, 3)
                        )
                if not now_present:
                    return self._finish("drained")
            overrun_at = self.deadline - min(1.0, self.margin / 2)
            if self.clock() >= overrun_at:
                return self._finish("overrun")
            await asyncio.sleep(POLL_S)

    def _finish(self, outcome: str) -> Obj:
        for t in self._tasks.values():
            t.cancel()
        now = self.clock()
        fields: Obj = {
            "elapsed_s": round(now - self.started_at, 3),
            "deadline_in_s": round(self.deadline - now, 3),
            "pods": len(self.pods),
            "forced": sum(1 for s in self.pods.values() if s.forced),
        }
        if outcome == "overrun":
            fields["remaining"] = [{"pod": s.key, "why": self._why(s)} for s in self.pods.values() if s.state != "gone"]
        self._event(f"drain.{outcome}", CRITICAL, **fields)
        self.outcome = {"outcome": outcome, **fields}
        log.info("drain %s for notice %s: %s", outcome, self.notice.id, fields)
        return self.outcome
