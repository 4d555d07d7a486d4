"""The Kubernetes drain path (seed view 19, first row): taint, evict in parallel through the Eviction API,
retry a PodDisruptionBudget's 429 until the pod's budget is spent and then delete with the grace that
remains, verify until every evictable pod seen is gone ("drained") or the overrun time comes ("overrun").

The scheduler's eviction does the work: this path never kills a container itself, so two systems never
evict the same pod. Every step is spooled before or as it is taken, so a restarted agent resumes the same
drain against the same deadline without tainting again or evicting twice.

What a real API server makes necessary (upstream 1.30, kubectl ``pkg/drain``):
- grace is never 0 (a grace-0 delete removes the object at once while kubelet still runs the containers), so
  a pod is gone when its uid has left the API, or its phase is terminal;
- every eviction and delete carries ``preconditions.uid``: a pod recreated under the same name is never hit;
- the taint is retried beside the evictions, never in front of them; "drained" needs the taint;
- pods are watched, not polled (one consistent list, then a watch; 410 Gone means list again);
- one :class:`~sco.agent.deadline.Deadline` read live: a later notice with an earlier time cuts graces
  already granted (a second delete with a shorter grace), and the outcome is spooled at the overrun time
  however the API behaves: no call runs past it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sco._retry import Backoff
from sco.agent.budget import KubeBudgets, PodBudget
from sco.agent.config import AgentConfig
from sco.agent.deadline import Deadline
from sco.agent.kube.events import KubeEvents
from sco.agent.metrics import count_eviction
from sco.agent.notices import Notice
from sco.agent.resume import DrainRecord
from sco.agent.spool import CRITICAL, ROUTINE, Spool
from sco.contract.bundle import Bundle
from sco.schedulers.kube import (
    Credentials,
    KubeClient,
    KubeCredentialError,
    KubeError,
    KubeGone,
    KubeUnreachable,
)

log = logging.getLogger("sco.agent.kube")

Obj = dict[str, Any]
BACKOFF_START_S, BACKOFF_MAX_S = 0.2, 2.0
# Silence (ARCHITECTURE.md, "What counts as silence"): nothing received from the API server for the API timeout
# (800 ms) while a request is outstanding. During a drain a probe keeps one outstanding: one at a time, sent at
# most every PROBE_PERIOD_S, so silence is found 800 ms after the last answer, and an API answering up to
# 800 ms - PROBE_PERIOD_S late is never taken for silent. Cost: at most 10 one-item lists a second per
# draining node, each served from the API server's watch cache (resourceVersion=0).
PROBE_PERIOD_S = 0.1
NOTICE_ANNOTATION = "sco.dev/reclaim-notice"
TERMINAL = ("Succeeded", "Failed")


def evictable(pod: Obj) -> bool:
    """As ``kubectl drain``: DaemonSet and mirror pods are left to kubelet; finished pods block nothing."""
    md = pod["metadata"]
    if any(o.get("kind") == "DaemonSet" for o in md.get("ownerReferences") or []):
        return False
    if "kubernetes.io/config.mirror" in (md.get("annotations") or {}):
        return False
    return not (pod.get("status", {}).get("phase") in TERMINAL and not md.get("deletionTimestamp"))


def taint_value(notice_id: str) -> str:
    """A taint value must be a label value (63 characters of [A-Za-z0-9-_.]): a short hash of the notice id;
    the id itself goes into the node's ``sco.dev/reclaim-notice`` annotation."""
    return "n-" + hashlib.sha256(notice_id.encode()).hexdigest()[:16]


def _key(pod: Obj) -> str:
    return f"{pod['metadata'].get('namespace', '')}/{pod['metadata']['name']}"


def _ts(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
    except ValueError:
        return None


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


@dataclass
class Resume(DrainRecord):
    """What the spool says was already done for a notice."""

    tainted: bool = False
    requested: dict[str, int] = field(default_factory=dict)  # pod uid -> grace asked for
    forced: dict[str, int] = field(default_factory=dict)
    asked_at: dict[str, float] = field(default_factory=dict)  # pod uid -> when its grace started

    def apply(self, type_: str, ev: dict[str, Any]) -> None:
        if type_ == "node.tainted":
            self.tainted = True
        elif type_ in ("eviction.requested", "grace.shortened"):
            self.requested[ev["uid"]] = int(ev["grace"])
            self.asked_at[ev["uid"]] = float(ev["at"])
        elif type_ == "eviction.forced":
            self.forced[ev["uid"]] = int(ev["grace"])
            self.asked_at[ev["uid"]] = float(ev["at"])

    def summary(self) -> dict[str, Any]:
        return {"tainted": self.tainted, "requested": len(self.requested), "forced": len(self.forced)}


@dataclass
class PodState:
    key: str
    uid: str
    budget: PodBudget
    state: str = "pending"  # pending | blocked | requested | forced | gone | replaced
    forced: bool = False
    last_error: str = ""
    pod: Obj = field(default_factory=dict)
    grace_ends: float | None = None  # when the grace granted (by us or someone else) runs out
    held: bool = False  # terminal but kept by finalizers: its containers have stopped
    refusals: int = 0  # the PodDisruptionBudget's 429s before the eviction (or the delete) went through

    @property
    def gone(self) -> bool:
        return self.state in ("gone", "replaced")


class KubernetesDrain:
    Record = Resume

    def __init__(
        self,
        *,
        kube: KubeClient,
        spool: Spool,
        budgets: KubeBudgets,
        node: str,
        taint_key: str,
        notice: Notice,
        deadline: Deadline,
        api_timeout: float = 0.8,
        resume: Resume | None = None,
    ) -> None:
        self.kube, self.spool, self.budgets = kube, spool, budgets
        self.node, self.taint_key, self.notice = node, taint_key, notice
        self.deadline = deadline
        self.api_timeout = api_timeout
        self.resume = resume or Resume()
        self.pods: dict[str, PodState] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.outcome: Obj | None = None
        self.tainted = self.resume.tainted
        self.taint_error = ""
        self.inventoried = False  # the first full list has been seen
        self.began = self.deadline.now()  # the API is judged from here (a resumed drain: from the restart)
        self.silent_since: float | None = None  # set once silence is found (the last answer, or began)
        self._changed = asyncio.Event()
        self._logged: set[str] = set()
        # Kubernetes Events for kubectl describe: fire-and-forget, bounded, never awaited by the drain
        self.kevents = KubeEvents(kube, spool, node, notice.id)

    # --- helpers -----------------------------------------------------------------------------------

    @property
    def started_at(self) -> float:
        return self.deadline.started_at

    def _event(self, type_: str, priority: int = ROUTINE, **fields: Any) -> None:
        self.spool.append(type_, priority, notice=self.notice.id, **fields)

    def update_deadline(self, terminate_at: float) -> bool:
        moved = self.deadline.move_earlier(terminate_at)
        if moved:
            self._changed.set()  # the verifier cuts graces that now end past the kill time
        return moved

    def summary(self) -> Obj:
        return self.resume.summary()

    def progress(self) -> tuple[int, int]:
        """(pods verifiably gone, pods seen): the "draining n/m" of the agent's sd_notify STATUS."""
        return sum(1 for st in self.pods.values() if st.gone), len(self.pods)

    @property
    def heard_at(self) -> float:
        """When the API server last said anything (a response, a watch event), or when this drain began."""
        h = self.kube.hearing.heard_at
        return self.began if h is None else max(h, self.began)

    def _api_problem(self, what: str, err: Exception) -> None:
        """Recorded once per kind: silence (unreachable), a credential refused (401/403, TLS), or an answer that
        refused the request (422, 404, 5xx...: once per request kind, since each says something different)."""
        fields: Obj = {"what": what, "error": str(err)}
        if isinstance(err, KubeCredentialError):
            kind, key, priority = "scheduler.credentials", "scheduler.credentials", CRITICAL
        elif isinstance(err, KubeError):  # the API answered: not "unreachable", whatever the drain does next
            kind, key, priority = "scheduler.refused", f"scheduler.refused:{what}", CRITICAL
        else:
            kind, key, priority = "scheduler.unreachable", "scheduler.unreachable", ROUTINE
        if isinstance(err, KubeError):
            fields["status"] = err.status
        if key not in self._logged:
            self._logged.add(key)
            self._event(kind, priority, **fields)
        log.warning("API server (%s): %s", what, err)

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        self._tasks[name] = asyncio.create_task(coro, name=name)

    def _timeout(self) -> float:
        return self.deadline.call_timeout(self.api_timeout)

    async def _pause(self, delay: float) -> None:
        await asyncio.sleep(max(0.0, min(delay, self.deadline.until_overrun())))

    # --- the taint, beside the evictions ------------------------------------------------------------

    async def _taint(self) -> None:
        if self.tainted:
            return
        backoff = Backoff(BACKOFF_START_S, BACKOFF_MAX_S)
        while not self.deadline.overrun():
            try:
                await self.kube.taint_node(
                    self.node,
                    self.taint_key,
                    taint_value(self.notice.id),
                    annotations={NOTICE_ANNOTATION: self.notice.id},
                    timeout=self._timeout(),
                )
            except (KubeUnreachable, KubeError) as e:
                if isinstance(e, KubeError):
                    if e.status == 404:
                        self.taint_error = f'node "{self.node}" not found (404): {e.message}'
                    elif isinstance(e, KubeCredentialError):
                        self.taint_error = f'credential may not patch node "{self.node}" ({e})'
                    else:
                        self.taint_error = str(e)
                else:
                    self.taint_error = f"API server did not answer: {e}"
                self._api_problem("taint", e)
                await self._pause(backoff.next())
                continue
            self.tainted = True
            self.kevents.node_event(
                "SpotReclaimTainted", f"tainted {self.taint_key}=NoSchedule for notice {self.notice.id}"
            )
            first_action_ms = round(self.deadline.elapsed() * 1000, 1)
            self._event(
                "node.tainted",
                CRITICAL,
                key=self.taint_key,
                value=taint_value(self.notice.id),
                first_action_ms=first_action_ms,
            )
            self._changed.set()
            return

    # --- observing the node's pods: one list, then a watch -----------------------------------------

    async def _observe(self) -> None:
        rv: str | None = None
        backoff = Backoff(BACKOFF_START_S, BACKOFF_MAX_S)
        while not self.deadline.overrun():
            try:
                if rv is None:
                    items, rv = await self.kube.pods_on_node(self.node, timeout=self._timeout())
                    self._sync(items)
                    backoff.reset()
                async for ev in self.kube.watch_pods(self.node, rv, timeout_s=300):
                    obj = ev.get("object") or {}
                    rv = str((obj.get("metadata") or {}).get("resourceVersion") or rv)
                    if ev.get("type") in ("ADDED", "MODIFIED"):
                        self._seen(obj)
                    elif ev.get("type") == "DELETED":
                        self._left(obj)
            except KubeGone:
                rv = None  # compacted: list again (a consistent read) and watch from there
                continue
            except (KubeUnreachable, KubeError) as e:
                self._api_problem("list/watch pods", e)
            await self._pause(backoff.next())

    def _sync(self, items: list[Obj]) -> None:
        present = set()
        for p in items:
            present.add(p["metadata"]["uid"])
            self._seen(p)
        for st in self.pods.values():
            if st.uid not in present and not st.gone:
                self._mark_gone(st, "left the API")
        if not self.inventoried:  # how many pods the drain has to see go (a drill's "evicting n/m")
            self._event("pods.listed", pods=len(self.pods))
        self.inventoried = True
        self._changed.set()

    def _seen(self, pod: Obj) -> None:
        uid = pod["metadata"]["uid"]
        st = self.pods.get(uid)
        if st is None:
            if not evictable(pod):
                return
            st = self._track(pod)
        st.pod = pod
        md = pod["metadata"]
        end = _ts(md.get("deletionTimestamp"))
        if end is not None and (st.grace_ends is None or end < st.grace_ends):
            st.grace_ends = end
        if pod.get("status", {}).get("phase") in TERMINAL and not st.gone:
            st.held = bool(md.get("finalizers"))
            self._mark_gone(st, "terminal phase")  # its containers have stopped
        self._changed.set()

    def _left(self, pod: Obj) -> None:
        st = self.pods.get(pod["metadata"]["uid"])
        if st is not None and not st.gone:
            self._mark_gone(st, "left the API")

    def _mark_gone(self, st: PodState, how: str) -> None:
        st.state = "gone"
        t = self._tasks.pop(f"evict:{st.uid}", None)
        if t is not None:
            t.cancel()
        self._event("pod.gone", pod=st.key, uid=st.uid, how=how, after_s=round(self.deadline.elapsed(), 3))
        self._changed.set()

    def _track(self, pod: Obj) -> PodState:
        uid = pod["metadata"]["uid"]
        st = PodState(_key(pod), uid, self.budgets.for_pod(pod), pod=pod)
        self.pods[uid] = st
        if uid in self.resume.asked_at:
            g = self.resume.requested.get(uid, self.resume.forced.get(uid, 0))
            st.grace_ends = self.resume.asked_at[uid] + g
        if uid in self.resume.forced:
            st.state, st.forced = "forced", True
        elif uid in self.resume.requested:
            st.state = "requested"
        elif pod["metadata"].get("deletionTimestamp"):
            st.state = "requested"  # already terminating: someone else asked; only its grace may be cut
        else:
            self._spawn(self._evict(st), f"evict:{uid}")
        return st

    # --- evictions ---------------------------------------------------------------------------------

    async def _evict(self, st: PodState) -> None:
        ns, name = st.key.split("/", 1)
        backoff = Backoff(BACKOFF_START_S, BACKOFF_MAX_S)
        while True:
            # The pod's budget runs from the notice; read live, so an earlier deadline shortens it.
            budget_end = self.deadline.budget_end(st.budget.drain_seconds)
            if self.deadline.now() >= budget_end:
                await self._force(st, ns, name)
                return
            grace = self.deadline.grace(st.budget.drain_seconds)
            wait = backoff.next()
            try:
                r = await self.kube.evict(ns, name, grace, uid=st.uid, timeout=self._timeout())
            except (KubeUnreachable, KubeCredentialError) as e:
                count_eviction("error")
                self._api_problem("evict", e)
                st.last_error = str(e)
            else:
                count_eviction(r.status)
                if r.accepted:
                    st.state = "requested"
                    st.grace_ends = self.deadline.now() + grace
                    self.kevents.pod_event(
                        ns,
                        name,
                        st.uid,
                        "SpotReclaimEvicting",
                        f"eviction requested with a {grace} s grace: node {self.node} is reclaimed"
                        f" (notice {self.notice.id}, instance gone at {_iso(self.notice.terminate_at)})",
                    )
                    self._event(
                        "eviction.requested",
                        CRITICAL,
                        pod=st.key,
                        uid=st.uid,
                        grace=grace,
                        contract=st.budget.contract,
                        refusals=st.refusals,
                    )
                    return
                if r.status in (404, 409):
                    self._replaced(st, r.status)
                    return
                st.last_error = f"HTTP {r.status}: {r.message}"
                wait = max(wait, r.retry_after)
                st.refusals += r.status == 429
                if r.status == 429 and st.state != "blocked":
                    st.state = "blocked"
                    self._event(
                        "eviction.blocked",
                        pod=st.key,
                        uid=st.uid,
                        reason=r.message,
                        budget_left_s=round(budget_end - self.deadline.now(), 2),
                    )
            await asyncio.sleep(max(0.0, min(wait, budget_end - self.deadline.now())))

    def _replaced(self, st: PodState, status: int) -> None:
        """404: gone; 409 on the uid precondition: the name now belongs to another pod. Stop either way."""
        if status == 409 and not st.gone:
            st.state = "replaced"
            self._event("pod.replaced", pod=st.key, uid=st.uid, after_s=round(self.deadline.elapsed(), 3))
            self._changed.set()

    async def _force(self, st: PodState, ns: str, name: str) -> None:
        """Budget spent (a PDB never allowed): delete with the final-write grace that remains, at least 1 s."""
        backoff = Backoff(BACKOFF_START_S, BACKOFF_MAX_S / 2)  # the budget is spent: retry sooner
        while not self.deadline.overrun():
            grace = self.deadline.grace(st.budget.final_write_seconds)
            try:
                r = await self.kube.delete_pod(ns, name, grace, uid=st.uid, timeout=self._timeout())
            except (KubeUnreachable, KubeCredentialError) as e:
                self._api_problem("delete", e)
                st.last_error = str(e)
                await self._pause(backoff.next())
                continue
            if r.status in (404, 409):
                self._replaced(st, r.status)
                return
            if r.status < 300:
                st.state, st.forced = "forced", True
                st.grace_ends = self.deadline.now() + grace
                self.kevents.pod_event(
                    ns,
                    name,
                    st.uid,
                    "SpotReclaimForcedDelete",
                    f"deleted with a {grace} s grace, its drain budget spent"
                    f" ({st.last_error or 'drain budget spent'}; notice {self.notice.id})",
                    warning=True,
                )
                self._event(
                    "eviction.forced",
                    CRITICAL,
                    pod=st.key,
                    uid=st.uid,
                    grace=grace,
                    reason=st.last_error or "drain budget spent",
                    contract=st.budget.contract,
                    refusals=st.refusals,
                )
                return
            st.last_error = f"HTTP {r.status}: {r.message}"
            await self._pause(backoff.next())

    async def _shorten(self, st: PodState) -> None:
        """The deadline moved earlier: a grace that now ends past the kill time is cut by a second delete
        (upstream shortens a terminating pod's grace)."""
        ns, name = st.key.split("/", 1)
        grace = self.deadline.grace(float("inf"))  # all that is left before the kill time, at least 1 s
        try:
            r = await self.kube.delete_pod(ns, name, grace, uid=st.uid, timeout=self._timeout())
        except (KubeUnreachable, KubeCredentialError) as e:
            self._api_problem("delete (shorten grace)", e)
            return
        if r.status in (404, 409):
            self._replaced(st, r.status)
            return
        if r.status < 300:
            before = st.grace_ends
            st.grace_ends = self.deadline.now() + grace
            self._event(
                "grace.shortened",
                CRITICAL,
                pod=st.key,
                uid=st.uid,
                grace=grace,
                was_ending_in_s=round((before or 0) - self.deadline.now(), 2),
            )

    # --- the verifier ------------------------------------------------------------------------------

    async def run(self) -> Obj:
        """Drain, verify, and return the outcome, spooled at the overrun time at the latest."""
        self.kevents.node_event(
            "SpotReclaimDrainStarted",
            f"draining for notice {self.notice.id}: instance gone at {_iso(self.notice.terminate_at)}"
            f" (overrun at {_iso(self.deadline.overrun_at)})",
        )
        self._spawn(self._taint(), "taint")
        self._spawn(self._observe(), "observe")
        self._spawn(self._probe(), "probe")
        self._spawn(self._find_silence(), "silence")
        try:
            while True:
                self._changed.clear()
                if self.inventoried and self.tainted and all(st.gone for st in self.pods.values()):
                    return self._finish("drained")
                if self.deadline.overrun():
                    return self._finish("overrun")
                for st in list(self.pods.values()):
                    name = f"shorten:{st.uid}"
                    pending = name in self._tasks and not self._tasks[name].done()
                    if (
                        not st.gone
                        and not pending
                        and st.grace_ends is not None
                        and self.deadline.ends_too_late(st.grace_ends)
                    ):
                        self._spawn(self._shorten(st), name)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), max(0.0, min(0.25, self.deadline.until_overrun())))
        finally:
            for t in self._tasks.values():
                t.cancel()
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def _probe(self) -> None:
        """Keep a request outstanding while the drain runs, so silence is found 800 ms after the last answer
        even when nothing else is in flight: a one-item list served from the API server's watch cache
        (resourceVersion=0, cheap), one at a time, at most every PROBE_PERIOD_S."""
        while not self.deadline.overrun():
            sent = self.deadline.now()
            try:
                await self.kube.list_pods(self.node, resource_version="0", limit=1, timeout=self._timeout())
            except (KubeError, KubeUnreachable) as e:
                self._api_problem("probe", e)
            await asyncio.sleep(max(0.0, sent + PROBE_PERIOD_S - self.deadline.now()))

    async def _find_silence(self) -> None:
        """Silent: nothing received for the API timeout while a request is outstanding (or went unanswered)."""
        hearing = self.kube.hearing
        while not self.deadline.overrun():
            quiet = hearing.quiet_for(self.began)
            if quiet >= self.api_timeout and hearing.waiting:
                # Silence of the API, not of this process: if the agent itself stood still (a disk stalling an
                # fdatasync, a starved CPU), answers may be waiting unread in the sockets. Let the loop read what
                # has arrived (a few iterations), then look again.
                for _ in range(6):  # 3 iterations carry an answer from the socket to the client (measured)
                    await asyncio.sleep(0)
                quiet = hearing.quiet_for(self.began)
                if quiet < self.api_timeout or not hearing.waiting:
                    continue
                self.silent_since = self.heard_at
                what = (
                    f"nothing heard from the API server for {quiet:.3f} s with {hearing.outstanding} request(s)"
                    f" outstanding (last answer {_iso(self.silent_since)})"
                )
                self._event(
                    "scheduler.silent",
                    ROUTINE,  # not fdatasync'ed here: the switch must not wait for the disk
                    last_answer_at=self.silent_since,
                    found_after_ms=round(quiet * 1000, 1),
                    outstanding=hearing.outstanding,
                )
                self._on_silent(what)
                return
            await asyncio.sleep(max(0.005, self.api_timeout - quiet) if quiet < self.api_timeout else 0.02)

    def _on_silent(self, what: str) -> None:
        """The API path carries on (its calls retry until the overrun time); a subclass may drain around it."""
        log.warning("API server silent: %s", what)

    def _silent(self) -> bool:
        hearing = self.kube.hearing
        return hearing.waiting and hearing.quiet_for(self.began) >= self.api_timeout

    def _why(self, st: PodState) -> str:
        if self._silent():
            return f"unknown (API silent since {_iso(self.heard_at)})"
        md = st.pod.get("metadata", {})
        if st.state in ("pending", "blocked"):
            return f"PodDisruptionBudget: {st.last_error}" if st.state == "blocked" else f"not evicted: {st.last_error}"
        if md.get("deletionTimestamp"):
            return f"slow preStop or shutdown (grace {md.get('deletionGracePeriodSeconds')} s)"
        return f"still running after {st.state} eviction"

    def _finish(self, outcome: str) -> Obj:
        now = self.deadline.now()
        fields: Obj = {
            "elapsed_s": round(now - self.started_at, 3),
            "deadline_in_s": round(self.deadline.terminate_at - now, 3),
            "pods": len(self.pods),
            "forced": sum(1 for s in self.pods.values() if s.forced),
        }
        if self.deadline.late is not None:
            fields["late_notice"] = self.deadline.late  # drained best effort: the notice left no time
        held = [s.key for s in self.pods.values() if s.held]
        if held:
            fields["held_by_finalizers"] = held  # containers stopped; only the API object remains
        ck = getattr(self, "checkpoint", None)  # KubeNodeDrain's checkpoint socket
        if ck is not None:
            fields["workloads"] = ck.lost_work()  # lost work, per workload on the socket
        if outcome == "overrun":
            reasons = []
            if not self.tainted:
                reasons.append(f"node not tainted: {self.taint_error or 'no answer from the API server'}")
            if not self.inventoried:
                reasons.append(f"the node's pods could not be listed (API silent since {_iso(self.heard_at)})")
            if self.deadline.late is not None:
                reasons.append(
                    f"the notice left no time (terminateAt {_iso(self.deadline.late['terminate_at'])}): drained best"
                    " effort with the floor grace"
                )
            remaining = [s for s in self.pods.values() if not s.gone]
            if remaining:
                reasons.append(f"{len(remaining)} pod(s) not verifiably gone")
            fields["reasons"] = reasons
            fields["remaining"] = [{"pod": s.key, "uid": s.uid, "why": self._why(s)} for s in remaining]
            self.kevents.node_event(
                "SpotReclaimOverrun", f"drain overrun for notice {self.notice.id}: " + "; ".join(reasons), warning=True
            )
        else:
            self.kevents.node_event(
                "SpotReclaimDrained", f"drained for notice {self.notice.id}: {len(self.pods)} pod(s) gone"
            )
        fields["kube_events"] = self.kevents.counts()  # those still in flight are not counted yet
        self._event(f"drain.{outcome}", CRITICAL, **fields)
        self.outcome = {"outcome": outcome, **fields}
        log.log(
            logging.WARNING if outcome == "overrun" else logging.INFO,
            "drain %s for notice %s: %s",
            outcome,
            self.notice.id,
            fields,
        )
        return self.outcome


class KubePath:
    """The Kubernetes drain path for this node (see :class:`sco.agent.drain.DrainPath`)."""

    def __init__(
        self,
        *,
        kube: KubeClient,
        spool: Spool,
        bundle: Callable[[], Bundle | None],
        node: str,
        taint_key: str,
        api_timeout: float,
    ) -> None:
        self.kube, self.spool, self.bundle = kube, spool, bundle
        self.node, self.taint_key, self.api_timeout = node, taint_key, api_timeout

    @staticmethod
    def credentials(cfg: AgentConfig) -> Credentials:
        """In-cluster discovery, a kubeconfig, or the URL with a token file and a CA file (in that order)."""
        if cfg.kube_in_cluster:
            return Credentials.in_cluster()
        if cfg.kube_kubeconfig:
            return Credentials.from_kubeconfig(Path(cfg.kube_kubeconfig))
        return Credentials(
            cfg.kube_url,
            token_file=Path(cfg.kube_token_file) if cfg.kube_token_file else None,
            ca_file=cfg.kube_ca_file or None,
        )

    def record(self, spool: Spool, notice_id: str) -> Resume:
        return Resume.from_spool(spool, notice_id)

    def drain_kwargs(self, notice: Notice, deadline: Deadline, record: DrainRecord | None) -> dict[str, Any]:
        """What every Kubernetes drain of this node is built from (subclasses add their own)."""
        return {
            "kube": self.kube,
            "spool": self.spool,
            "budgets": KubeBudgets(self.bundle()),
            "node": self.node,
            "taint_key": self.taint_key,
            "notice": notice,
            "deadline": deadline,
            "api_timeout": self.api_timeout,
            "resume": record if isinstance(record, Resume) else None,
        }

    def drain(self, notice: Notice, deadline: Deadline, record: DrainRecord | None) -> KubernetesDrain:
        return KubernetesDrain(**self.drain_kwargs(notice, deadline, record))

    async def preflight(self) -> list[str]:
        return await self.kube.preflight(self.node)

    def follow_ups(self, stop: asyncio.Event) -> list[tuple[str, Coroutine[Any, Any, None]]]:
        return []  # nothing is ever done around the API server that it must be told later

    async def close(self) -> None:
        await self.kube.close()


__all__ = ["KubePath", "KubernetesDrain", "Resume", "evictable", "taint_value"]
