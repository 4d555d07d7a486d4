"""Kubernetes Events about a drain (core/v1, as ``kubectl describe node`` and ``describe pod`` show them).

Fire-and-forget: each event is one POST in its own task with a short deadline (``EVENT_TIMEOUT_S``), never awaited
by the drain and never retried; at most ``MAX_EVENTS`` per drain (a drain of hundreds of pods must not flood the
API server nor the agent's memory). Failures are counted (``counts()``: the drain's outcome carries them) and the
first failure of each drain is spooled as ``kube.event_failed`` with the API's own message.

Node events go to the ``default`` namespace with ``involvedObject`` kind Node and uid the node's name (what
kubelet does and ``kubectl describe node`` looks for); pod events to the pod's namespace. The credential needs
``create events`` only; the own-node policy (kyverno/) admits events about this node and its pods only.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any

from sco.agent.spool import ROUTINE, Spool
from sco.schedulers.kube import KubeClient, KubeError, KubeUnreachable

log = logging.getLogger(__name__)

EVENT_TIMEOUT_S = 0.5
MAX_EVENTS = 64
MESSAGE_MAX = 1024  # what kubelet's recorder keeps (events.k8s.io refuses a longer note)
COMPONENT = "sco-agent"


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


class KubeEvents:
    def __init__(self, kube: KubeClient, spool: Spool, node: str, notice_id: str) -> None:
        self.kube, self.spool, self.node, self.notice_id = kube, spool, node, notice_id
        self.sent = self.failed = self.dropped = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._said_failure = False

    def counts(self) -> dict[str, int]:
        return {"sent": self.sent, "failed": self.failed, "dropped": self.dropped}

    def node_event(self, reason: str, message: str, warning: bool = False) -> None:
        ref = {"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": self.node}
        self._fire("default", ref, reason, message, warning)

    def pod_event(self, ns: str, name: str, uid: str, reason: str, message: str, warning: bool = False) -> None:
        ref = {"apiVersion": "v1", "kind": "Pod", "namespace": ns, "name": name, "uid": uid}
        self._fire(ns, ref, reason, message, warning)

    def _fire(self, ns: str, ref: dict[str, str], reason: str, message: str, warning: bool) -> None:
        if self.sent + self.failed + self.dropped + len(self._tasks) >= MAX_EVENTS:
            self.dropped += 1
            return
        now = _iso(time.time())
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Event",
            # kubelet's naming: <object>.<unique hex>; names are DNS subdomains (a pod name is one)
            # (at most 253 characters: a 253-character pod name keeps its first 236)
            "metadata": {"name": f"{ref['name'][:236].rstrip('.-')}.{secrets.token_hex(8)}", "namespace": ns},
            "involvedObject": ref,
            "reason": reason,
            "message": message[:MESSAGE_MAX],
            "type": "Warning" if warning else "Normal",
            "source": {"component": COMPONENT, "host": self.node},
            "reportingComponent": COMPONENT,
            "reportingInstance": self.node,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            task = asyncio.get_running_loop().create_task(self._post(ns, body), name=f"kube-event:{reason}")
        except RuntimeError:  # no loop (a synchronous caller): an event is never worth blocking for
            self.dropped += 1
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _post(self, ns: str, body: dict[str, Any]) -> None:
        try:
            await asyncio.wait_for(self.kube.create_event(ns, body, timeout=EVENT_TIMEOUT_S), EVENT_TIMEOUT_S)
            self.sent += 1
        except (KubeError, KubeUnreachable, TimeoutError, OSError) as e:
            self.failed += 1
            if not self._said_failure:  # once per drain: a refused credential would otherwise say it 64 times
                self._said_failure = True
                log.warning("kubernetes event %s not recorded: %s", body["reason"], e)
                self.spool.append(
                    "kube.event_failed", ROUTINE, notice=self.notice_id, reason=body["reason"], error=str(e)
                )
