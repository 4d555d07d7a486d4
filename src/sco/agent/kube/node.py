"""The Kubernetes drain of this node: the API path (``sco.agent.kube.drain``) with two additions.

- Spark (``sco.agent.kube.spark_order``): executor pods are evicted first, a driver only once this node's executors
  are gone (or out of budget), so decommissioning can migrate their blocks while the driver still coordinates.
- Around a silent API server (``sco.agent.kube.fallback``): nothing heard from it for the timeout (800 ms)
  while a request is outstanding ends the API path; kubelet's graceful node shutdown does the rest under a
  logind delay lock, and the API server is told once it answers again (a follow-up task).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from sco.agent.checkpoint import CheckpointServer
from sco.agent.deadline import Deadline
from sco.agent.inhibit import InhibitError, Logind
from sco.agent.kube.drain import KubePath, KubernetesDrain, PodState
from sco.agent.kube.fallback import KubeFallback, report_late
from sco.agent.kube.spark_order import DRIVER, EXECUTOR, driver_may_go, in_eviction_order, spark_role
from sco.agent.notices import Notice
from sco.agent.resume import DrainRecord
from sco.agent.spool import CRITICAL, ROUTINE, Spool
from sco.schedulers.kube import KubeClient

DRIVER_POLL_S = 0.1
MIN_INHIBIT_DELAY_S = 10.0  # logind's default is 5 s; anything this short cannot hold a graceful shutdown

log = logging.getLogger("sco.agent.kube.node")


class KubeNodeDrain(KubernetesDrain):
    """The Kubernetes drain with Spark ordering, switching to :class:`KubeFallback` once the API server is silent:
    nothing received from it for the timeout (800 ms) while a request is outstanding (the probe keeps one
    outstanding; a refused connection is retried within the timeout; an HTTP error is an answer)."""

    def __init__(
        self,
        *args: Any,
        logind: Logind,
        checkpoint: CheckpointServer | None = None,
        shutdown: str = "poweroff",
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.logind, self.checkpoint, self.shutdown = logind, checkpoint, shutdown
        self._api_silent = asyncio.Event()
        self._api_silent_since: float | None = None
        self._api_silent_what = ""
        self._api_silent_found: float | None = None
        self.fallback: KubeFallback | None = None

    def _on_silent(self, what: str) -> None:
        super()._on_silent(what)
        if self.shutdown != "off" and not self._api_silent.is_set():
            self._api_silent_since, self._api_silent_what = self.silent_since, what
            self._api_silent_found = self.deadline.now()
            self._api_silent.set()

    async def run(self) -> dict[str, Any]:
        through = asyncio.create_task(super().run(), name=f"drain-through:{self.notice.id}")
        silent = asyncio.create_task(self._api_silent.wait(), name=f"api-silent:{self.notice.id}")
        try:
            await asyncio.wait({through, silent}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            silent.cancel()
        if through.done():
            return through.result()
        # Stop asking: the API path's run() cancels every call it has in flight (evictions, watch, taint).
        through.cancel()
        await asyncio.gather(through, return_exceptions=True)
        self.fallback = KubeFallback(
            spool=self.spool,
            notice=self.notice,
            logind=self.logind,
            deadline=self.deadline,
            api_silent_since=self._api_silent_since or self.deadline.now(),
            reason=self._api_silent_what,
            checkpoint=self.checkpoint,
            shutdown=self.shutdown,
            pods_left=lambda: sorted(st.key for st in self.pods.values() if not st.gone),
            inventoried=lambda: self.inventoried,
            found_at=self._api_silent_found,
        )
        # The API server is silent: this event most likely fails (counted, never retried); report_late taints
        # the node once it answers again.
        self.kevents.node_event(
            "SpotReclaimFallback",
            f"API server silent ({self._api_silent_what}): draining around it for notice {self.notice.id}"
            " (logind inhibitor, kubelet graceful node shutdown)",
            warning=True,
        )
        self.outcome = await self.fallback.run()
        return self.outcome

    # --- Spark: executors first, the driver last ----------------------------------------------------

    def _sync(self, items: list[dict[str, Any]]) -> None:
        super()._sync(in_eviction_order(items))

    def _executors(self) -> list[tuple[bool, float]]:
        return [
            (st.gone, self.deadline.budget_end(st.budget.drain_seconds))
            for st in self.pods.values()
            if spark_role(st.pod) == EXECUTOR
        ]

    async def _evict(self, st: PodState) -> None:
        if spark_role(st.pod) == DRIVER and not driver_may_go(self._executors(), self.deadline.now()):
            waiting = sum(1 for gone, _ in self._executors() if not gone)
            self._event("spark.driver_held", ROUTINE, pod=st.key, uid=st.uid, executors_left=waiting)
            while not driver_may_go(self._executors(), self.deadline.now()):
                await asyncio.sleep(DRIVER_POLL_S)
            self._event("spark.driver_released", ROUTINE, pod=st.key, uid=st.uid)
        await super()._evict(st)


class KubeNodePath(KubePath):
    """:class:`KubePath` making :class:`KubeNodeDrain` drains, and owing the API server a late report after a
    drain done around it."""

    def __init__(
        self,
        *,
        kube: KubeClient,
        spool: Spool,
        logind: Logind,
        checkpoint: CheckpointServer | None = None,
        shutdown: str = "poweroff",
        **kwargs: Any,
    ) -> None:
        super().__init__(kube=kube, spool=spool, **kwargs)
        self.logind, self.checkpoint, self.shutdown = logind, checkpoint, shutdown
        self._reporting: set[str] = set()
        self._fallback_said: list[str] = []

    def drain(self, notice: Notice, deadline: Deadline, record: DrainRecord | None) -> KubeNodeDrain:
        return KubeNodeDrain(
            **self.drain_kwargs(notice, deadline, record),
            logind=self.logind,
            checkpoint=self.checkpoint,
            shutdown=self.shutdown,
        )

    async def preflight(self) -> list[str]:
        """The API path's problems; the fallback's own (logind unreachable, its delay cap left at the 5 s default)
        are spooled apart as ``fallback.preflight``: the API path works without them."""
        problems = await super().preflight()
        if self.shutdown == "off":
            return problems
        mine: list[str] = []
        try:
            cap = await self.logind.delay_max()
            if cap < MIN_INHIBIT_DELAY_S:
                mine.append(
                    f"logind's InhibitDelayMaxSec is {cap:g} s: around a silent API server kubelet's graceful node"
                    " shutdown and the agent's final write would be cut short (role kubelet_graceful_shutdown sets it)"
                )
        except InhibitError as e:
            mine.append(f"{e}: the fallback around a silent API server cannot take a shutdown inhibitor")
        if mine and mine != self._fallback_said:  # the preflight repeats: said when it changes, not each time
            for m in mine:
                log.error("preflight: %s", m)
            self.spool.append("fallback.preflight", CRITICAL, problems=mine)
        self._fallback_said = mine
        return problems

    def follow_ups(self, stop: asyncio.Event) -> list[tuple[str, Coroutine[Any, Any, None]]]:
        """Taint the node once the API answers, for every drain done around it that the spool has not closed."""
        pending: set[str] = set()
        for ev in self.spool.events():
            if ev["type"] == "scheduler.report_pending":
                pending.add(str(ev["notice"]))
            elif ev["type"] == "scheduler.told":
                pending.discard(str(ev["notice"]))
        out: list[tuple[str, Coroutine[Any, Any, None]]] = []
        for nid in sorted(pending - self._reporting):
            self._reporting.add(nid)
            coro = report_late(self.kube, self.spool, self.node, self.taint_key, nid, stop, self.api_timeout)
            out.append((f"report:{nid}", coro))
        return out
