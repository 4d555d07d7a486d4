"""Around an API server that does not answer (seed view 19, fourth row).

When the Kubernetes API is silent (nothing received from it for the scheduler timeout, 800 ms, while a request
is outstanding: ARCHITECTURE.md), the agent stops asking. It takes
a systemd shutdown inhibitor (logind ``Inhibit``, mode ``delay``) so that the node's shutdown waits for the
final write, asks logind to power off (so kubelet's graceful node shutdown terminates the pods by priority,
locally, while the deadline still leaves time), waits for the workloads on the checkpoint socket and for
kubelet to release its own inhibitor, spools the outcome, and only then releases its lock. The scheduler is
told later, when its API answers again (:func:`report_late`): the node is going anyway.

Two systems never evict the same pod: once here, the agent sends no eviction; kubelet does the work.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from sco._retry import Backoff
from sco.agent.checkpoint import CheckpointServer
from sco.agent.deadline import Deadline
from sco.agent.inhibit import InhibitError, Lock, Logind
from sco.agent.notices import Notice
from sco.agent.spool import CRITICAL, ROUTINE, Spool
from sco.schedulers.kube import KubeClient, KubeError, KubeUnreachable

log = logging.getLogger("sco.agent.kube.fallback")

KUBELET_WHO = "kubelet"  # kubelet's graceful node shutdown takes its delay lock under this name
POLL_S = 0.25  # each look at logind's inhibitors is a short D-Bus connection: a few a second is plenty
SHUTDOWN_MODES = ("poweroff", "wait")


class KubeFallback:
    def __init__(
        self,
        *,
        spool: Spool,
        notice: Notice,
        logind: Logind,
        deadline: Deadline,
        api_silent_since: float,
        reason: str,
        checkpoint: CheckpointServer | None = None,
        shutdown: str = "poweroff",
        pods_left: Callable[[], list[str]] | None = None,
        inventoried: Callable[[], bool] | None = None,
        found_at: float | None = None,
    ) -> None:
        if shutdown not in SHUTDOWN_MODES:
            raise ValueError(f"shutdown: expected one of {SHUTDOWN_MODES}, got {shutdown!r}")
        self.spool, self.notice, self.logind = spool, notice, logind
        self.deadline = deadline  # the drain's one Deadline, read live (a later notice may move it earlier)
        self.started_at, self.clock = deadline.started_at, deadline.now
        self.api_silent_since, self.reason = api_silent_since, reason
        self.checkpoint, self.shutdown = checkpoint, shutdown
        self.pods_left = pods_left or (lambda: [])  # pods the API path saw and could not see go
        self.inventoried = inventoried or (lambda: True)  # whether the API path ever listed the node's pods
        self.lock: Lock | None = None
        self.found_at = found_at  # when the silence was found (api_silent_since + the timeout, give or take)

    def _event(self, type_: str, priority: int = ROUTINE, **fields: Any) -> None:
        self.spool.append(type_, priority, notice=self.notice.id, **fields)

    async def run(self) -> dict[str, Any]:
        now = self.clock()
        self._event(
            "drain.fallback",
            CRITICAL,
            reason=self.reason,
            api_silent_since=self.api_silent_since,
            notice_to_fallback_ms=round((now - self.started_at) * 1000, 1),
            last_answer_to_fallback_ms=round((now - self.api_silent_since) * 1000, 1),
            switch_ms=round((now - self.found_at) * 1000, 1) if self.found_at is not None else None,
            how="kubelet graceful node shutdown",
        )
        log.warning("API server silent (%s): draining around it through kubelet's graceful node shutdown", self.reason)
        kubelet_seen = await self._take_lock()
        if self.lock is not None and self.shutdown == "poweroff":
            try:
                await self.logind.poweroff()
                self._event("shutdown.requested", CRITICAL, via="logind PowerOff")
            except InhibitError as e:
                self._event("shutdown.failed", CRITICAL, error=str(e))
        try:
            return await self._wait_and_finish(kubelet_seen)
        finally:
            self.release()

    async def _take_lock(self) -> bool:
        """Take the delay lock; return whether kubelet holds one (graceful node shutdown configured)."""
        try:
            self.lock = await self.logind.inhibit(
                "sco-agent", f"final write of drain {self.notice.id}", what="shutdown", mode="delay"
            )
            self._event("inhibitor.taken", CRITICAL, mode="delay", what="shutdown")
        except InhibitError as e:
            # e.g. OperationInProgress: the shutdown has already begun; kubelet is at work; record and carry on
            self._event("inhibitor.failed", CRITICAL, error=str(e))
            log.error("no shutdown inhibitor: %s", e)
        try:
            held = await self.logind.inhibitors()
        except InhibitError as e:
            self._event("inhibitor.list_failed", error=str(e))
            return False
        return any(i["who"] == KUBELET_WHO and i["mode"] == "delay" for i in held)

    async def _kubelet_holds(self) -> bool | None:
        try:
            held = await self.logind.inhibitors()
        except InhibitError:
            return None
        return any(i["who"] == KUBELET_WHO and "shutdown" in i["what"].split(":") for i in held)

    async def _wait_and_finish(self, kubelet_seen: bool) -> dict[str, Any]:
        """Until the workloads have written (checkpoint socket) and kubelet has let go, or the overrun time."""
        kubelet_done = False
        kubelet_done_at: float | None = None
        while True:
            next_look = min(self.deadline.overrun_at, self.clock() + POLL_S)
            workloads_done = True
            if self.checkpoint is not None and self.checkpoint.notice is not None:
                # returns at once when every workload has settled, else at next_look
                workloads_done = (await self.checkpoint.wait_settled(until=next_look)).all_done
            if kubelet_seen and not kubelet_done:
                holds = await self._kubelet_holds()
                if holds is False:
                    kubelet_done, kubelet_done_at = True, self.clock()
                    self._event("kubelet.shutdown_done", CRITICAL, after_s=round(kubelet_done_at - self.started_at, 3))
            # Without kubelet's graceful shutdown nothing terminates the pods: holding the lock longer helps nobody.
            finished = workloads_done and (kubelet_done or not kubelet_seen)
            if finished or self.deadline.overrun():
                break
            await asyncio.sleep(max(0.0, next_look - self.clock()))
        return self._finish(kubelet_seen, kubelet_done, workloads_done)

    def _finish(self, kubelet_seen: bool, kubelet_done: bool, workloads_done: bool) -> dict[str, Any]:
        now = self.clock()
        reasons: list[str] = []
        if not kubelet_seen:
            reasons.append("kubelet holds no shutdown inhibitor: graceful node shutdown is not configured")
        elif not kubelet_done:
            reasons.append(
                "kubelet still held its shutdown lock at the overrun time (its graceful node shutdown had not"
                " finished, or the shutdown had not begun)"
            )
        pending = [] if self.checkpoint is None or workloads_done else self.checkpoint.settled().pending
        if pending:
            reasons.append(f"{len(pending)} workload(s) on the checkpoint socket not done")
        outcome = "drained" if not reasons else "overrun"
        silent = datetime.fromtimestamp(self.api_silent_since, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
        left = self.pods_left()
        if outcome == "overrun" and not self.inventoried():
            reasons.append(f"the node's pods were never listed (API silent since {silent})")
        remaining: list[dict[str, Any]] = [
            {"pod": p, "why": f"unknown (API silent since {silent}): left to kubelet's graceful node shutdown"}
            for p in left
        ]
        remaining += [{"workload": w["workload"], "why": f"checkpoint not done ({w['state']})"} for w in pending]
        body: dict[str, Any] = {
            "path": "around",
            "elapsed_s": round(now - self.started_at, 3),
            "deadline_in_s": round(self.deadline.terminate_at - now, 3),
            "inhibitor": self.lock is not None,
            "kubelet_shutdown": kubelet_done,
            "api_silent_since": self.api_silent_since,
        }
        if self.deadline.late is not None:
            body["late_notice"] = self.deadline.late
        if self.checkpoint is not None:
            body["checkpoint"] = self.checkpoint.settled().counts
            body["workloads"] = self.checkpoint.lost_work()  # lost work, per workload on the socket
        if outcome == "drained":
            body["terminated_by_kubelet"] = left  # kubelet let go of its lock: it has stopped their containers
        else:
            body["reasons"] = reasons
            body["remaining"] = remaining
        # The outcome is on disk (critical records are fdatasync'ed) before the lock is let go.
        self._event(f"drain.{outcome}", CRITICAL, **body)
        self._event("scheduler.report_pending", CRITICAL, reason=self.reason, scheduler="kubernetes")
        log.log(
            logging.WARNING if outcome == "overrun" else logging.INFO,
            "drain %s around the API server for notice %s: %s",
            outcome,
            self.notice.id,
            body,
        )
        return {"outcome": outcome, **body}

    def release(self) -> None:
        if self.lock is not None and self.lock.held:
            self.lock.release()
            self._event("inhibitor.released", CRITICAL)


async def report_late(
    kube: KubeClient,
    spool: Spool,
    node: str,
    taint_key: str,
    notice_id: str,
    stop: asyncio.Event,
    api_timeout: float = 0.8,
    interval: float = 2.0,
) -> None:
    """Tell the API server once it answers: the node tainted for the notice (nothing is evicted: kubelet did it)."""
    from sco.agent.kube.drain import NOTICE_ANNOTATION, taint_value

    backoff = Backoff(0.5, interval)
    while not stop.is_set():
        try:
            await kube.taint_node(
                node, taint_key, taint_value(notice_id), annotations={NOTICE_ANNOTATION: notice_id}, timeout=api_timeout
            )
            spool.append("scheduler.told", CRITICAL, notice=notice_id, scheduler="kubernetes", tainted=True)
            log.info("API server answers again: node %s tainted for notice %s", node, notice_id)
            return
        except KubeUnreachable:
            pass
        except KubeError as e:
            log.warning("telling the API server: %s", e)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), backoff.next())
