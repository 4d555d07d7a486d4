"""fallback_switch: the Kubernetes API stand-in silent from the start; from the agent accepting the notice to the
switch to the kubelet graceful-shutdown fallback (``drain.fallback``) and to holding logind's delay lock (a real
dbus-daemon with the logind stand-in). The agent is its own process; the API timeout is the hall's 800 ms."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.harness import AgentEnv, NatsServer, add_pod, ensure_stream, wait_for

from sco.standins.kube_apiserver import KubeApiStandIn
from sco.standins.logind import LogindStandIn, PrivateBus

REPEATS = 5


def _once(root: Path) -> dict[str, float]:
    with contextlib.ExitStack() as stack:  # every server stopped, whatever fails
        nats = NatsServer(root / "nats").start()
        stack.callback(nats.stop)
        asyncio.run(ensure_stream(nats.url))
        kube = KubeApiStandIn().start()
        stack.callback(kube.stop)
        bus = PrivateBus().start()
        stack.callback(bus.stop)
        logind = LogindStandIn(bus.address, inhibit_delay_max_s=30).start()
        stack.callback(logind.stop)
        env = AgentEnv(root / "a", kube, nats, logind_bus=bus.address, kube_fallback="wait")
        stack.callback(env.stop)
        for i in range(10):
            add_pod(kube, "web", f"web-{i}", env.node)
        env.start().wait_subscribed()
        kube.go_silent(60)
        stack.callback(lambda: setattr(kube, "silent", False))
        stack.callback(lambda: setattr(kube, "latency_s", 0))
        env.send(env.notice("fb", 20))
        fb = wait_for(lambda: env.of("drain.fallback"), 10, "drain.fallback")[0]
        taken = wait_for(lambda: env.of("inhibitor.taken"), 10, "inhibitor.taken")[0]
        accepted = env.of("notice.accepted")[0]
        # the lock really was held on the bus (released again once the outcome was spooled: no kubelet here)
        wait_for(lambda: any(i.who == "sco-agent" for i, _ in logind.released), 10, "the lock's release")
        return {
            "notice_to_fallback_ms": float(fb["notice_to_fallback_ms"]),
            "notice_to_inhibitor_ms": (float(taken["at"]) - float(accepted["received_at"])) * 1000,
        }
    raise AssertionError("unreachable")


def bench_fallback_switch() -> Iterator[dict[str, Any]]:
    runs = []
    for _ in range(REPEATS):
        with tempfile.TemporaryDirectory() as tmp:
            runs.append(_once(Path(tmp)))
    yield {
        "api_timeout_ms": 800,
        "notice_to_fallback_ms": round(statistics.median(r["notice_to_fallback_ms"] for r in runs), 1),
        "notice_to_inhibitor_ms": round(statistics.median(r["notice_to_inhibitor_ms"] for r in runs), 1),
        "max_notice_to_fallback_ms": round(max(r["notice_to_fallback_ms"] for r in runs), 1),
        "repeats": REPEATS,
    }


BENCHES = {"fallback_switch": bench_fallback_switch}
