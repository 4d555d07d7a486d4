"""A notice already past its time: ``terminateAt`` in the past, with an ``issuedAt``. The
instance may still be there (clock skew, a late delete, an agent restarted past T): the node is tainted and its
pods evicted with the floor grace, and the outcome says what was seen and done and how late the notice was.
Before: accepted and reported "overrun" at once, no taint, no eviction, ``pods: 0`` with 10 pods running."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sco_devkit.standins.kube_apiserver import KubeApiStandIn
from tests.harness import AgentEnv, NatsServer, add_pod, wait_for


@pytest.fixture
def agent(tmp_path: Path, kube: KubeApiStandIn, nats_server: NatsServer) -> Iterator[AgentEnv]:
    env = AgentEnv(tmp_path / "agent", kube, nats_server)
    yield env
    env.stop()


@pytest.mark.parametrize("past_by", [5.0, -2.0])  # past, and inside the safety margin (no room for any grace)
def test_a_notice_past_its_time_is_drained_best_effort(agent: AgentEnv, kube: KubeApiStandIn, past_by: float) -> None:
    for i in range(10):
        add_pod(kube, "web", f"web-{i}", agent.node)
    agent.start().wait_subscribed()
    now = time.time()
    agent.send(agent.notice("late-1", -past_by, issuedAt=now - 60))
    out = agent.outcome(10)
    assert agent.of("node.tainted"), "the node was not tainted"
    # every pod evicted (or, past the kill time of now + 1 s, deleted) with the floor grace, as the API saw it
    hits = [a for a in kube.cluster.audit if a["verb"] in ("evict", "delete") and a["name"].startswith("web-")]
    assert {a["name"] for a in hits} == {f"web-{i}" for i in range(10)} and {a["grace"] for a in hits} == {1}
    late = agent.of("notice.late")[0]
    assert late["past_by_s"] == pytest.approx(past_by, abs=1.0)
    assert out["pods"] == 10 and out["late_notice"]["past_by_s"] == late["past_by_s"]
    if out["type"] == "drain.overrun":
        assert any("the notice left no time" in r for r in out["reasons"]), out
    else:
        assert out["type"] == "drain.drained"
    # the outcome came within the best-effort window (4 s), not at once and not never
    assert out["elapsed_s"] <= 4.0
    wait_for(lambda: not [k for k in kube.cluster.pods if k[0] == "web"], 10, "the pods to go")
