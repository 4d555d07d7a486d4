"""The Kubernetes drain of this node: the API path (``sco.agent.kube_drain``) with two additions.

- Spark (``sco.agent.spark_order``): executor pods are evicted first, a driver only once this node's executors
  are gone (or out of budget), so decommissioning can migrate their blocks while the driver still coordinates.
- Around a silent API server (``sco.agent.kube_fallback``): the first call not answered within the timeout
  (800 ms) ends the API path; kubelet's graceful node shutdown does the rest under a logind delay lock.
"""

from __future__ import annotations

import asyncio
from typing import Any

from sco.agent.checkpoint import CheckpointServer
from sco.agent.inhibit import Logind
from sco.agent.kube_drain import KubernetesDrain, PodState
from sco.agent.kube_fallback import KubeFallback
from sco.agent.spark_order import DRIVER, EXECUTOR, driver_may_go, in_eviction_order, spark_role
from sco.agent.spool import ROUTINE
from sco.schedulers.kube import KubeUnreachable

DRIVER_POLL_S = 0.1


class KubeNodeDrain(KubernetesDrain):
    """The Kubernetes drain with Spark ordering, switching to :class:`KubeFallback` the first time the API server
    does not answer within the timeout (a refused or timed-out call; an HTTP error is an answer: API path)."""

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
        self._silent = asyncio.Event()
        self._silent_since: float | None = None
        self._silent_what = ""
        self.fallback: KubeFallback | None = None

    def _unreachable(self, what: str, err: Exception) -> None:
        super()._unreachable(what, err)
        if self.shutdown != "off" and isinstance(err, KubeUnreachable) and not self._silent.is_set():
            self._silent_since, self._silent_what = self.clock(), f"{what}: {err}"
            self._silent.set()

    async def run(self) -> dict[str, Any]:
        through = asyncio.create_task(super().run(), name=f"drain-through:{self.notice.id}")
        silent = asyncio.create_task(self._silent.wait(), name=f"api-silent:{self.notice.id}")
        try:
            await asyncio.wait({through, silent}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            silent.cancel()
        if through.done():
            return through.result()
        # Stop asking: cancel the API path and every eviction it has in flight.
        through.cancel()
        for t in self._tasks.values():
            t.cancel()
        await asyncio.gather(through, *self._tasks.values(), return_exceptions=True)
        self.fallback = KubeFallback(
            spool=self.spool,
            notice=self.notice,
            logind=self.logind,
            deadline=lambda: self.deadline,  # read live: a later notice may move it earlier
            margin=self.margin,
            started_at=self.started_at,
            api_silent_since=self._silent_since or self.clock(),
            reason=self._silent_what,
            checkpoint=self.checkpoint,
            shutdown=self.shutdown,
            clock=self.clock,
        )
        self.outcome = await self.fallback.run()
        return self.outcome

    # --- Spark: executors first, the driver last ----------------------------------------------------

    async def _list(self) -> list[dict[str, Any]] | None:
        pods = await super()._list()
        return None if pods is None else in_eviction_order(pods)

    def _executors(self) -> list[tuple[bool, float]]:
        return [
            (st.state == "gone", min(self.started_at + st.budget.drain_seconds, self.deadline - self.margin))
            for st in self.pods.values()
            if spark_role(st.pod) == EXECUTOR
        ]

    async def _evict(self, st: PodState) -> None:
        if spark_role(st.pod) == DRIVER and not driver_may_go(self._executors(), self.clock()):
            waiting = sum(1 for gone, _ in self._executors() if not gone)
            self._event("spark.driver_held", ROUTINE, pod=st.key, uid=st.uid, executors_left=waiting)
            while not driver_may_go(self._executors(), self.clock()):
                await asyncio.sleep(DRIVER_POLL_S)
            self._event("spark.driver_released", ROUTINE, pod=st.key, uid=st.uid)
        await super()._evict(st)
