"""The node agent end to end: a real NATS server, the Kubernetes API stand-in, the agent as its own process.

The notice window is 20 s in these tests (margin 2 s); outcomes are asserted against that deadline.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sco.contract.notice import sign_notice
from sco.standins.kube_apiserver import KubeApiStandIn
from tests.harness import AgentEnv, MetadataServer, NatsServer, add_pod, free_port, stream_events, wait_for

WINDOW = 20.0


@pytest.fixture
def agent(tmp_path: Path, kube: KubeApiStandIn, nats_server: NatsServer) -> Iterator[AgentEnv]:
    env = AgentEnv(tmp_path / "agent", kube, nats_server)
    yield env
    env.stop()


def taints(kube: KubeApiStandIn, node: str) -> list[str]:
    return [t["key"] for t in kube.cluster.nodes[node]["spec"].get("taints", [])]


def audit(kube: KubeApiStandIn, verb: str, name: str | None = None) -> list[dict[str, object]]:
    return [a for a in kube.cluster.audit if a["verb"] == verb and (name is None or a["name"] == name)]


def test_notice_over_nats_drains_inside_the_deadline(agent: AgentEnv, kube: KubeApiStandIn) -> None:
    for i in range(3):
        add_pod(kube, "web", f"web-{i}", agent.node, grace=30, prestop=1.0)
    add_pod(kube, "batch", "batch-0", agent.node, grace=60, prestop=0.5)
    add_pod(kube, "kube-system", "ds-0", agent.node, owner_kind="DaemonSet")
    add_pod(kube, "web", "elsewhere", "node-2")
    agent.start().wait_subscribed()
    t0 = agent.send(agent.notice("n-1", WINDOW))
    out = agent.outcome(WINDOW)
    assert out["type"] == "drain.drained"
    assert out["at"] < t0 + WINDOW and out["deadline_in_s"] > 0
    assert out["pods"] == 4  # the DaemonSet pod is left to kubelet, the other node's pod untouched
    tainted = agent.of("node.tainted")[0]
    assert tainted["first_action_ms"] < 2000  # seed view 19: first drain action within 2 s
    assert "sco.dev/reclaim" in taints(kube, agent.node) and kube.cluster.nodes[agent.node]["spec"]["unschedulable"]
    graces = {e["pod"]: e["grace"] for e in agent.of("eviction.requested")}
    # grace = min(contract budget, time left - margin): web 6 s, batch min(12, ~20 - 2) = 12 s
    assert graces == {"web/web-0": 6, "web/web-1": 6, "web/web-2": 6, "batch/batch-0": 12}
    assert {e["contract"] for e in agent.of("eviction.requested")} == {"web", "batch"}
    assert "kube-system/ds-0" not in graces
    assert ("kube-system", "ds-0") in kube.cluster.pods and ("web", "elsewhere") in kube.cluster.pods
    # evictions went out in parallel, not one by one: all four within a fraction of the first preStop
    ats = sorted(e["at"] for e in agent.of("eviction.requested"))
    assert ats[-1] - ats[0] < 0.9
    assert not audit(kube, "delete")  # the scheduler's eviction did the work
    assert agent.proc is not None
    maps = Path(f"/proc/{agent.proc.pid}/maps").read_text()
    assert "aiohttp" not in maps and "pydantic_core" not in maps  # the agent's memory budget


def test_metadata_poll_alone_with_nats_down(tmp_path: Path, kube: KubeApiStandIn, nats_server: NatsServer) -> None:
    meta = MetadataServer("node-1")
    env = AgentEnv(tmp_path / "a", kube, nats_server, metadata=meta, nats_url=f"nats://127.0.0.1:{free_port()}")
    try:
        add_pod(kube, "web", "w", "node-1", prestop=0.2)
        env.start()
        t0 = time.time()
        meta.reclaim("meta-1", t0 + WINDOW)
        out = env.outcome(WINDOW)
        assert out["type"] == "drain.drained" and out["at"] < t0 + WINDOW
        accepted = env.of("notice.accepted")
        assert [(e["notice"], e["source"]) for e in accepted] == [("meta-1", "metadata")]
        # the poll runs every second (policy override in the test hall): the taint follows within ~1 poll
        assert env.of("node.tainted")[0]["at"] - t0 < 2.5
    finally:
        env.stop()
        meta.shutdown()


def test_both_channels_at_once_make_one_drain(tmp_path: Path, kube: KubeApiStandIn, nats_server: NatsServer) -> None:
    meta = MetadataServer("node-1")
    env = AgentEnv(tmp_path / "a", kube, nats_server, metadata=meta)
    try:
        add_pod(kube, "web", "w", "node-1", prestop=1.5)
        env.start().wait_subscribed()
        t = time.time() + WINDOW
        meta.reclaim("both-1", t)
        env.send(env.notice("both-1", WINDOW))
        env.outcome(WINDOW)
        time.sleep(1.5)  # let the poll see the notice again after the drain
        assert len(env.of("notice.accepted")) == 1
        assert len(audit(kube, "patch", "node-1")) == 1
        assert len(audit(kube, "evict", "w")) == 1
    finally:
        env.stop()
        meta.shutdown()


def test_earliest_termination_wins(agent: AgentEnv, kube: KubeApiStandIn) -> None:
    add_pod(kube, "batch", "b", agent.node, grace=60, prestop=30)  # would linger: budget 12 s
    agent.start().wait_subscribed()
    agent.send(agent.notice("late", WINDOW))
    wait_for(lambda: agent.of("eviction.requested"), 5, "eviction")
    t_early = time.time() + 8
    agent.send(agent.notice("early", 8))
    out = agent.outcome(WINDOW)
    assert agent.of("notice.deadline")[0]["terminate_at"] == pytest.approx(t_early, abs=0.5)
    assert out["type"] == "drain.overrun"  # the pod took its whole 12 s grace; the deadline moved to 8 s
    assert out["at"] < t_early


def test_pdb_that_never_allows_is_forced_when_budget_spent(agent: AgentEnv, kube: KubeApiStandIn) -> None:
    add_pod(kube, "guarded", "g-0", agent.node, labels={"app": "g"}, grace=30, prestop=0.5)
    kube.cluster.create_pdb(
        "guarded", {"metadata": {"name": "g"}, "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "g"}}}}
    )
    agent.start().wait_subscribed()
    t0 = agent.send(agent.notice("pdb-1", WINDOW))
    out = agent.outcome(WINDOW)
    assert out["type"] == "drain.drained" and out["at"] < t0 + WINDOW and out["forced"] == 1
    blocked = agent.of("eviction.blocked")
    assert len(blocked) == 1 and "disruption budget" in blocked[0]["reason"]
    forced = agent.of("eviction.forced")[0]
    # the guarded contract's budget is 3 s: honoured until then, then DELETE with the final-write grace (1 s)
    assert 2.5 <= forced["at"] - t0 <= 5.5
    assert forced["grace"] == 1
    assert len(audit(kube, "evict-refused", "g-0")) >= 2  # retried with backoff
    assert audit(kube, "delete", "g-0")[0]["grace"] == 1


def test_prestop_longer_than_its_grace(agent: AgentEnv, kube: KubeApiStandIn) -> None:
    add_pod(kube, "web", "slow", agent.node, grace=30, prestop=60)  # budget caps the grace at 6 s
    agent.start().wait_subscribed()
    t0 = agent.send(agent.notice("slow-1", WINDOW))
    out = agent.outcome(WINDOW)
    assert out["type"] == "drain.drained" and out["at"] < t0 + WINDOW
    gone = agent.of("pod.gone")[0]
    assert 5.5 <= gone["at"] - t0 <= 8  # killed at its 6 s grace, not after its 60 s preStop


def test_overrun_names_each_pod_and_why(agent: AgentEnv, kube: KubeApiStandIn) -> None:
    add_pod(kube, "web", "fin", agent.node, grace=30, finalizers=["example.com/hold"])
    # already being deleted by someone else with a 60 s grace: the agent does not evict it a second time
    add_pod(kube, "batch", "slow", agent.node, grace=60, prestop=60)
    kube.cluster.delete_pod("batch", "slow", 60)
    add_pod(kube, "web", "quick", agent.node, prestop=0.2)
    agent.start().wait_subscribed()
    t0 = agent.send(agent.notice("over-1", 8))
    out = agent.outcome(12)
    assert out["type"] == "drain.overrun"
    assert t0 + 6 < out["at"] < t0 + 8  # declared before the instance is gone
    why = {r["pod"]: r["why"] for r in out["remaining"]}
    assert set(why) == {"web/fin", "batch/slow"}
    assert why["web/fin"] == "stuck finalizer: example.com/hold"
    assert why["batch/slow"] == "slow preStop or shutdown (grace 60 s)"
    assert len(audit(kube, "evict", "slow")) == 0


def test_malformed_and_foreign_notices_are_refused(agent: AgentEnv, kube: KubeApiStandIn) -> None:
    agent.start().wait_subscribed()
    agent.send(b"{not json")
    agent.send(agent.notice("x-1", WINDOW, node="node-9"))
    agent.send(agent.notice("x-2", 10_000))  # absurd: beyond twice the window
    agent.send(agent.notice("x-3", -100))  # stale
    agent.send(sign_notice({"id": "x-4", "node": "node-1"}, [agent.notice_key]))  # no terminateAt
    refused = wait_for(lambda: len(agent.of("notice.refused")) >= 5 and agent.of("notice.refused"), 10, "refusals")
    kinds = sorted(e["kind"] for e in refused)
    assert kinds == ["absurd", "absurd", "foreign", "malformed", "malformed"]
    assert any("node-9" in e["reason"] for e in refused)
    assert not agent.of("notice.accepted") and not taints(kube, agent.node)


def test_kill9_mid_drain_resumes_without_tainting_or_evicting_twice(agent: AgentEnv, kube: KubeApiStandIn) -> None:
    for i in range(5):
        add_pod(kube, "batch", f"b-{i}", agent.node, grace=60, prestop=4)
    agent.start().wait_subscribed()
    t0 = agent.send(agent.notice("k-1", WINDOW))
    wait_for(lambda: len(agent.of("eviction.requested")) == 5, 5, "five evictions")
    agent.kill9()
    assert not agent.of("drain.drained")
    agent.start()
    out = agent.outcome(WINDOW)
    assert out["type"] == "drain.drained" and out["at"] < t0 + WINDOW
    resumed = agent.of("drain.resumed")
    assert len(resumed) == 1 and resumed[0]["tainted"] and resumed[0]["requested"] == 5
    assert len(audit(kube, "patch", agent.node)) == 1  # tainted once
    for i in range(5):
        assert len(audit(kube, "evict", f"b-{i}")) == 1  # evicted once


def test_nats_outage_mid_drain_events_replayed_in_order(
    agent: AgentEnv, kube: KubeApiStandIn, nats_server: NatsServer
) -> None:
    import asyncio

    for i in range(3):
        add_pod(kube, "web", f"w-{i}", agent.node, prestop=2)
    agent.start().wait_subscribed()
    agent.send(agent.notice("o-1", WINDOW))
    wait_for(lambda: agent.of("eviction.requested"), 5, "evictions")
    nats_server.stop()
    out = agent.outcome(WINDOW)
    assert out["type"] == "drain.drained"
    nats_server.start()
    spooled = [e["seq"] for e in agent.events()]

    def published() -> list[int] | None:
        seqs = [e["seq"] for e in asyncio.run(stream_events(nats_server.url))]
        return seqs if seqs and seqs[-1] >= spooled[-1] else None

    seqs = wait_for(published, 20, "replay after the outage", 0.5)
    assert seqs == sorted(seqs) and len(seqs) == len(set(seqs))  # in order, no duplicates
    assert seqs == spooled[: len(seqs)] and seqs[-1] == spooled[-1]


def test_spool_full_keeps_outcomes_and_records_the_drop(
    tmp_path: Path, kube: KubeApiStandIn, nats_server: NatsServer
) -> None:
    from sco.agent.spool import ROUTINE, Spool

    meta = MetadataServer("node-1")
    # NATS unreachable: nothing gets published, so the bound must be kept by dropping unpublished events
    env = AgentEnv(
        tmp_path / "a",
        kube,
        nats_server,
        metadata=meta,
        spool_max_bytes=65536,
        nats_url=f"nats://127.0.0.1:{free_port()}",
    )
    try:
        spool = Spool(env.state / "spool", max_bytes=65536)
        for i in range(300):  # routine history fills most of the spool before the notice
            spool.append("notice.refused", ROUTINE, source="nats", kind="malformed", reason="x" * 80, n=i)
        spool.close()
        for i in range(30):
            add_pod(kube, "web", f"w-{i:02d}", "node-1", prestop=0.3)
        env.start()
        t0 = time.time()
        meta.reclaim("full-1", t0 + WINDOW)
        out = env.outcome(WINDOW)
        assert out["type"] == "drain.drained" and out["at"] < t0 + WINDOW
        events = env.events()
        assert (env.state / "spool" / "events.spool").stat().st_size <= 65536
        dropped = [e for e in events if e["type"] == "spool.dropped"]
        assert dropped and sum(d["routine"] for d in dropped) > 0
        assert all(d["critical_published"] == 0 for d in dropped)
        kept = {e["type"] for e in events}
        assert {"notice.accepted", "node.tainted", "eviction.requested", "drain.drained"} <= kept
        assert len([e for e in events if e["type"] == "eviction.requested"]) == 30  # critical: none dropped
    finally:
        env.stop()
        meta.shutdown()
