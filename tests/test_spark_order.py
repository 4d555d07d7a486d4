"""Spark executor pods in the Kubernetes drain: executors evicted first with the remaining budget as grace, a
driver only once this node's executors are gone (the issue's case: every pod evicted at once, the driver gone
18 s before the last executor). The agent is its own process against the Kubernetes API stand-in."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sco.agent.kube.spark_order import driver_may_go, eviction_rank, in_eviction_order
from sco_devkit.standins.kube_apiserver import KubeApiStandIn
from tests.harness import AgentEnv, NatsServer, add_pod

WINDOW = 20.0


def _pod(name: str, role: str | None) -> dict[str, object]:
    return {"metadata": {"name": name, "labels": {"spark-role": role} if role else {}}}


def test_order_and_driver_rule() -> None:
    pods = [_pod("d", "driver"), _pod("web", None), _pod("e1", "executor"), _pod("e2", "executor")]
    assert [p["metadata"]["name"] for p in in_eviction_order(pods)] == ["e1", "e2", "web", "d"]  # type: ignore[index]
    assert [eviction_rank(p) for p in pods] == [2, 1, 0, 0]
    assert driver_may_go([], now=0)  # no executor on the node: nothing to wait for
    assert not driver_may_go([(True, 10), (False, 10)], now=5)
    assert driver_may_go([(True, 10), (False, 10)], now=10)  # out of budget: being forced, wait no longer
    assert driver_may_go([(True, 10), (True, 10)], now=5)


@pytest.fixture
def agent(tmp_path: Path, kube: KubeApiStandIn, nats_server: NatsServer) -> Iterator[AgentEnv]:
    env = AgentEnv(tmp_path / "agent", kube, nats_server)
    yield env
    env.stop()


def test_executors_first_driver_last(agent: AgentEnv, kube: KubeApiStandIn) -> None:
    # decommissioning takes the executors 2-3 s (their preStop); the driver would stop in 0.2 s
    for i, secs in enumerate((2.0, 3.0)):
        add_pod(kube, "batch", f"exec-{i}", agent.node, prestop=secs, labels={"spark-role": "executor", "app": "etl"})
    add_pod(kube, "batch", "driver", agent.node, prestop=0.2, labels={"spark-role": "driver", "app": "etl"})
    add_pod(kube, "web", "web-0", agent.node, prestop=0.2)
    agent.start().wait_subscribed()
    t0 = agent.send(agent.notice("spark-1", WINDOW))
    out = agent.outcome(WINDOW)
    assert out["type"] == "drain.drained" and out["at"] < t0 + WINDOW
    asked = {e["pod"]: e for e in agent.of("eviction.requested")}
    gone = {e["pod"]: e["at"] for e in agent.of("pod.gone")}
    executors = ["batch/exec-0", "batch/exec-1"]
    # executors asked at once, with the remaining budget (batch contract: 12 s) as grace
    assert all(asked[e]["grace"] == 12 for e in executors)
    # the driver outlived every executor on the node: it was held until the last had gone, then evicted
    assert gone["batch/driver"] > max(gone[e] for e in executors)
    assert asked["batch/driver"]["at"] >= max(gone[e] for e in executors)
    held = agent.of("spark.driver_held")
    assert held and held[0]["pod"] == "batch/driver" and held[0]["executors_left"] == 2
