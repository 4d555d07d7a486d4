"""The node agent end to end: a real NATS server, the Kubernetes API stand-in, the agent as its own process.

The notice window is 20 s in these tests (margin 2 s); outcomes are asserted against that deadline.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sco.contract.notice import sign_notice
from sco.errors import ConfigError
from sco_devkit.standins.kube_apiserver import KubeApiStandIn
from tests.harness import (
    BIN,
    AgentEnv,
    MetadataServer,
    NatsServer,
    add_pod,
    free_port,
    reachable,
    stream_events,
    wait_for,
)

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
    assert out["type"] == "drain.drained", (out, agent.logtext()[-4000:])
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


def test_a_taint_the_api_refuses_is_spooled_as_refused(tmp_path: Path, nats_server: NatsServer) -> None:
    from sco_devkit.standins.kube_apiserver import KubeApiStandIn

    kube = KubeApiStandIn().start()
    env = AgentEnv(tmp_path / "a", kube, nats_server)
    # a taint written before validation was this strict: the API validates the whole list on every update (422)
    kube.cluster.nodes[env.node]["spec"]["taints"] = [{"key": "bad key!", "effect": "NoSchedule"}]
    try:
        add_pod(kube, "web", "w-0", env.node, prestop=0.2)
        env.start().wait_subscribed()
        env.send(env.notice("refused-1", 10))
        out = env.outcome(12)
        assert out["type"] == "drain.overrun"  # never "drained" on an untainted node: the outcome is unchanged
        assert any("422" in r for r in out["reasons"]), out["reasons"]
        refused = env.of("scheduler.refused")
        assert refused and refused[0]["what"] == "taint" and refused[0]["status"] == 422, env.events()
        assert not env.of("scheduler.unreachable"), env.of("scheduler.unreachable")
        # `sco-agent events` prints it as it is
        p = subprocess.run(
            [str(BIN / "sco-agent"), "events", "--state-dir", str(env.state)], capture_output=True, text=True
        )
        assert '"scheduler.refused"' in p.stdout and '"status": 422' in p.stdout, p.stdout
    finally:
        env.stop()
        kube.stop()


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


def test_pdb_that_never_allows_is_forced_when_budget_spent(agent: AgentEnv, kube: KubeApiStandIn) -> None:
    add_pod(kube, "guarded", "g-0", agent.node, labels={"app": "g"}, grace=30, prestop=0.5)
    add_pod(kube, "batch", "long", agent.node, grace=60, prestop=6)  # keeps the drain going past g-0's budget
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
    # terminal but held by a finalizer: its containers have stopped, so it does not hold the drain back
    add_pod(kube, "web", "fin", agent.node, grace=30, finalizers=["example.com/hold"])
    # already being deleted by someone else with a 60 s grace that ends after the instance: the agent does not
    # evict it again, but cuts its grace to the kill time (a second delete)
    add_pod(kube, "batch", "slow", agent.node, grace=60, prestop=60)
    kube.cluster.delete_pod("batch", "slow", 60)
    # preStop outlives its grace and the shutdown after TERM outlives kubelet's 2 s minimum: still there
    add_pod(kube, "web", "stubborn", agent.node, grace=30, prestop=60, shutdown=30)
    add_pod(kube, "web", "quick", agent.node, prestop=0.2)
    agent.start().wait_subscribed()
    t0 = agent.send(agent.notice("over-1", 8))
    out = agent.outcome(12)
    assert out["type"] == "drain.overrun"
    assert t0 + 6 < out["at"] < t0 + 7.2  # declared at the overrun time, a second before the instance is gone
    why = {r["pod"]: r["why"] for r in out["remaining"]}
    assert set(why) == {"web/stubborn"}
    assert why["web/stubborn"].startswith("slow preStop or shutdown (grace ")
    assert out["held_by_finalizers"] == ["web/fin"]
    assert len(audit(kube, "evict", "slow")) == 0
    cut = [int(d["grace"]) for d in audit(kube, "delete", "slow")]  # type: ignore[call-overload]
    assert cut[0] == 60 and len(cut) == 2 and cut[1] <= 6  # someone else's 60 s, then the agent's cut


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
    assert out["type"] == "drain.drained", (out, agent.logtext()[-4000:])
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
        reachable(env.state)  # the agent's own (SCO_TEST_AGENT_USER), as role node_agent gives it
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


# --- A real cluster is less kind than the old stand-in (each test failed before its fix) -----------


def _terminate_at(agent: AgentEnv) -> float:
    return float(agent.of("notice.accepted")[0]["terminate_at"])


def _exited_at(kube: KubeApiStandIn, uid: str) -> float:
    return float(next(a["at"] for a in kube.cluster.audit if a["verb"] == "exited" and a["uid"] == uid))  # type: ignore[arg-type]


def test_defect1_never_grace_zero_and_gone_means_containers_stopped(agent: AgentEnv, kube: KubeApiStandIn) -> None:
    # no contract covers namespace "free": the pod keeps its own grace (3 s) and a final write of 0
    p = add_pod(kube, "free", "f-0", agent.node, labels={"app": "f"}, grace=3, prestop=20)
    kube.cluster.create_pdb("free", {"metadata": {"name": "all"}, "spec": {"minAvailable": "100%", "selector": {}}})
    agent.start().wait_subscribed()
    agent.send(agent.notice("g0-1", WINDOW))
    out = agent.outcome(WINDOW)
    deletes = audit(kube, "delete", "f-0")
    assert deletes and all(int(d["grace"]) >= 1 for d in deletes)  # type: ignore[call-overload]
    assert out["type"] == "drain.drained"
    # "drained" only once the containers have stopped, not when the object left the API
    assert out["at"] >= _exited_at(kube, p["metadata"]["uid"])
    assert not kube.cluster.ghosts()


def test_defect2_unknown_node_is_an_overrun_with_reasons(agent: AgentEnv, kube: KubeApiStandIn) -> None:
    del kube.cluster.nodes[agent.node]  # the API knows this node by another name (an FQDN, a cloud name)
    kube.cluster.add_node(f"{agent.node}.example.org")
    add_pod(kube, "web", "w-0", f"{agent.node}.example.org", prestop=0.2)
    agent.start().wait_subscribed()
    agent.send(agent.notice("unknown-1", 10))
    out = agent.outcome(12)
    assert out["type"] == "drain.overrun"
    assert any("not found (404)" in r for r in out["reasons"])
    assert out["at"] <= _terminate_at(agent) - 0.8  # spooled at the overrun time, 1 s before the end


def test_defect2_check_config_names_an_unknown_node_and_a_refused_credential(
    tmp_path: Path, kube: KubeApiStandIn, nats_server: NatsServer
) -> None:
    import subprocess

    from sco_devkit.standins.kube_apiserver import Identity

    env = AgentEnv(tmp_path / "a", kube, nats_server, node="node-7")
    del kube.cluster.nodes["node-7"]
    exe = str(Path(sys.executable).parent / "sco-agent")
    r = subprocess.run([exe, "check-config", "--api", "--config", str(env.config)], capture_output=True, text=True)
    assert r.returncode == 5, r.stdout + r.stderr
    assert 'node "node-7" is not known to the API server (404)' in r.stderr
    kube.cluster.add_node("node-7")
    kube.tokens = {"ro": Identity("viewer", deny=("patch nodes",))}
    tok = tmp_path / "token"
    tok.write_text("ro\n")
    env2 = AgentEnv(tmp_path / "b", kube, nats_server, node="node-7", kube_token_file=str(tok))
    r = subprocess.run([exe, "check-config", "--api", "--config", str(env2.config)], capture_output=True, text=True)
    assert r.returncode == 5 and "may not patch node" in r.stderr and "403" in r.stderr, r.stderr
    tok.write_text("nobody\n")
    r = subprocess.run([exe, "check-config", "--api", "--config", str(env2.config)], capture_output=True, text=True)
    assert r.returncode == 5 and "401" in r.stderr and "credential" in r.stderr, r.stderr


def test_defect2_taint_refused_evictions_go_ahead(tmp_path: Path, nats_server: NatsServer) -> None:
    from sco_devkit.standins.kube_apiserver import Identity

    kube = KubeApiStandIn(tokens={"agent": Identity("sco-agent", deny=("patch nodes",))}).start()
    tok = tmp_path / "token"
    tok.write_text("agent\n")
    env = AgentEnv(tmp_path / "a", kube, nats_server, kube_token_file=str(tok))
    try:
        for i in range(3):
            add_pod(kube, "web", f"w-{i}", env.node, prestop=0.5)
        env.start().wait_subscribed()
        t0 = env.send(env.notice("forbidden-1", 10))
        out = env.outcome(12)
        first = min(e["at"] for e in env.of("eviction.requested"))
        assert first - t0 < 2  # seed view 19: first drain action within 2 s, taint or not
        assert len(env.of("eviction.requested")) == 3
        assert out["type"] == "drain.overrun"  # never "drained" on an untainted node
        assert any("403" in r and "taint" in r for r in out["reasons"])
    finally:
        env.stop()
        kube.stop()


def test_defect3_taint_value_is_a_label_value_and_the_id_an_annotation(agent: AgentEnv, kube: KubeApiStandIn) -> None:
    nid = "reclaim/2026-11-29T14:00:00Z#42 (nova)"
    add_pod(kube, "web", "w", agent.node, prestop=0.2)
    agent.start().wait_subscribed()
    agent.send(agent.notice(nid, 10))
    out = agent.outcome(12)
    assert out["type"] == "drain.drained", (out, agent.logtext()[-4000:])
    node = kube.cluster.nodes[agent.node]
    (taint,) = [t for t in node["spec"]["taints"] if t["key"] == "sco.dev/reclaim"]
    assert re.fullmatch(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]", taint["value"]) and len(taint["value"]) <= 63
    assert node["metadata"]["annotations"]["sco.dev/reclaim-notice"] == nid


def test_defect4_a_pod_recreated_under_the_same_name_is_left_alone(agent: AgentEnv, kube: KubeApiStandIn) -> None:
    add_pod(kube, "guarded", "g-0", agent.node, labels={"app": "g"}, grace=30, prestop=0.5)
    add_pod(kube, "batch", "long", agent.node, grace=60, prestop=6)  # keeps the drain going past g-0's budget
    kube.cluster.create_pdb(
        "guarded",
        {"metadata": {"name": "g"}, "spec": {"minAvailable": "100%", "selector": {"matchLabels": {"app": "g"}}}},
    )
    agent.start().wait_subscribed()
    agent.send(agent.notice("same-1", WINDOW))
    wait_for(lambda: agent.of("eviction.blocked"), 5, "the PDB's 429")
    # someone force-deletes it and a StatefulSet replaces it under the same name, on another node, between
    # two of the agent's eviction retries
    with kube.cluster.lock:
        kube.cluster.delete_pod("guarded", "g-0", 0)
        new = add_pod(kube, "guarded", "g-0", "node-2", labels={"app": "g"}, grace=30)
    agent.outcome(WINDOW + 2)
    time.sleep(0.5)
    live = kube.cluster.pods[("guarded", "g-0")]
    assert live["metadata"]["uid"] == new["metadata"]["uid"] and not live["metadata"].get("deletionTimestamp")
    touched = [a for a in kube.cluster.audit if a["uid"] == new["metadata"]["uid"] and a["verb"] in ("evict", "delete")]
    assert touched == []


def test_defect5_a_rotated_token_is_read_again(tmp_path: Path, nats_server: NatsServer) -> None:
    from sco_devkit.standins.kube_apiserver import Identity

    kube = KubeApiStandIn(tokens={"t1": Identity("system:node:node-1")}).start()
    tok = tmp_path / "token"
    tok.write_text("t1\n")
    env = AgentEnv(tmp_path / "a", kube, nats_server, kube_token_file=str(tok))
    try:
        add_pod(kube, "web", "w", env.node, prestop=0.2)
        env.start().wait_subscribed()
        # the kubelet rotates the bound token (default lifetime 1 h): the old one stops working
        tok.write_text("t2\n")
        kube.tokens = {"t2": Identity("system:node:node-1")}
        agent_out = env.send(env.notice("rot-1", WINDOW))
        out = env.outcome(WINDOW)
        assert out["type"] == "drain.drained" and out["at"] < agent_out + WINDOW
        assert [a["user"] for a in audit(kube, "patch", env.node)] == ["system:node:node-1"]
    finally:
        env.stop()
        kube.stop()


def test_a_rotation_revoking_the_old_token_mid_drain_costs_no_failed_call(
    tmp_path: Path, nats_server: NatsServer
) -> None:
    """The token file rewritten and the old token revoked at the same moment, while a drain
    retries an eviction a PDB blocks: the next request carries the new token (the file is stat'ed before each
    request), a request already in flight is answered 401 at most once and sent again, and the drain finishes."""
    import os

    from sco_devkit.standins.kube_apiserver import NODE_NAME_EXTRA, Identity, _token_id

    def sa() -> Identity:
        return Identity("system:serviceaccount:sco-system:sco-agent", extra=((NODE_NAME_EXTRA, ("node-1",)),))

    kube = KubeApiStandIn(tokens={"old-token": sa()}).start()
    tok = tmp_path / "token"
    tok.write_text("old-token\n")
    env = AgentEnv(tmp_path / "a", kube, nats_server, kube_token_file=str(tok))
    try:
        add_pod(kube, "web", "w-0", env.node, prestop=0.2)
        add_pod(kube, "guarded", "g-0", env.node, labels={"app": "g"}, prestop=0.2)
        kube.cluster.create_pdb(
            "guarded",
            {"metadata": {"name": "g"}, "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "g"}}}},
        )
        env.start().wait_subscribed()
        env.send(env.notice("rot-mid", WINDOW))
        wait_for(lambda: env.of("eviction.blocked"), 8, "the PDB's 429")
        new = tmp_path / "token.new"
        new.write_text("new-token\n")
        kube.tokens["new-token"] = sa()  # type: ignore[index]
        os.replace(new, tok)  # as an atomic writer (or kubelet's ..data swap) does
        kube.revoke("old-token")
        rotated_at = time.time()
        time.sleep(1.5)  # eviction retries go on, blocked, with the new token
        with kube.cluster.lock:
            del kube.cluster.pdbs[("guarded", "g")]
        out = env.outcome(WINDOW)
        assert out["type"] == "drain.drained", out
        # A request the agent sent with the old token just before the swap can reach the server after the
        # revocation (CI under load: one event POST): answered 401, it is sent again with the file read again. No
        # request begun after the rotation carries the old token: a 401 later than that would be one
        in_flight = [u for u in kube.unauthorized if u["at"] <= rotated_at + 1.0]
        assert in_flight == kube.unauthorized and len(in_flight) <= 2, kube.unauthorized
        for u in in_flight:
            assert any(
                a["method"] == u["method"] and a["path"] == u["path"] and a["at"] >= u["at"] for a in kube.authenticated
            ), (u, kube.authenticated)
        after = [a for a in kube.authenticated if a["at"] > rotated_at]
        assert any(a["path"].endswith("/pods/g-0/eviction") for a in after), after
        assert {a["token"] for a in after} == {_token_id("new-token")}
    finally:
        env.stop()
        kube.stop()


def test_defect5_tls_needs_a_ca_and_a_wrong_one_is_a_credential_problem(
    tmp_path: Path, nats_server: NatsServer
) -> None:
    from tests.harness import make_tls

    ca, crt, key = make_tls(tmp_path / "tls")
    other_ca, _, _ = make_tls(tmp_path / "other")
    kube = KubeApiStandIn(tls=(str(crt), str(key))).start()
    try:
        good = AgentEnv(tmp_path / "good", kube, nats_server, kube_ca_file=str(ca))
        add_pod(kube, "web", "w", good.node, prestop=0.2)
        good.start().wait_subscribed()
        good.send(good.notice("tls-1", WINDOW))
        assert good.outcome(WINDOW)["type"] == "drain.drained"
        good.stop()
        bad = AgentEnv(tmp_path / "bad", kube, nats_server, kube_ca_file=str(other_ca))
        add_pod(kube, "web", "w2", bad.node, prestop=0.2)
        bad.start().wait_subscribed()
        bad.send(bad.notice("tls-2", 6))
        out = bad.outcome(8)
        assert out["type"] == "drain.overrun"
        creds = bad.of("scheduler.credentials")
        assert creds and "certificate" in creds[0]["error"] and not bad.of("scheduler.unreachable")
        bad.stop()
    finally:
        kube.stop()


def test_defect5_https_without_a_ca_is_refused_at_start(tmp_path: Path, nats_server: NatsServer) -> None:
    from sco.agent import config

    kube = KubeApiStandIn()
    try:
        env = AgentEnv(tmp_path / "a", kube, nats_server, kube_url="https://127.0.0.1:6443")
        with pytest.raises(ConfigError) as e:
            config.load(env.config, env={})
        assert any(p.field == "agent.kube_ca_file" and "system" in p.message for p in e.value.problems)
        env2 = AgentEnv(tmp_path / "b", kube, nats_server, kube_url="https://127.0.0.1:6443", kube_ca_file="system")
        assert config.load(env2.config, env={}).kube_ca_file == "system"  # the system store, said explicitly
    finally:
        kube.server_close()
        kube.cluster.stop()


def test_defect6_watches_instead_of_polling_and_relists_after_410(agent: AgentEnv, kube: KubeApiStandIn) -> None:
    for i in range(4):
        add_pod(kube, "batch", f"b-{i}", agent.node, grace=60, prestop=3 + i)
    agent.start().wait_subscribed()
    agent.send(agent.notice("watch-1", WINDOW))
    wait_for(lambda: len(agent.of("eviction.requested")) == 4, 5, "evictions")
    time.sleep(1.0)
    kube.cluster.compact()
    kube.cluster.drop_watches()  # the agent re-watches from its last resourceVersion: 410, so it relists
    out = agent.outcome(WINDOW)
    assert out["type"] == "drain.drained" and out["pods"] == 4
    reads = [r for r in kube.cluster.reads if r["fieldSelector"] == f"spec.nodeName={agent.node}"]
    consistent_lists = [r for r in reads if r["verb"] == "list" and r["resourceVersion"] in (None, "")]
    # one list to start and one after the 410, where a 250 ms poll made ~25 consistent reads from etcd
    assert len(consistent_lists) <= 3, reads
    assert any(r["verb"] == "watch" for r in reads)


def test_defect7_an_earlier_deadline_cuts_graces_already_granted(agent: AgentEnv, kube: KubeApiStandIn) -> None:
    add_pod(kube, "batch", "b", agent.node, grace=60, prestop=30)  # budget 12 s: granted 12 s under T+20
    agent.start().wait_subscribed()
    agent.send(agent.notice("late", WINDOW))
    wait_for(lambda: agent.of("eviction.requested"), 5, "eviction")
    t_early = time.time() + 8
    agent.send(agent.notice("early", 8))
    out = agent.outcome(WINDOW)
    assert agent.of("notice.deadline")[0]["terminate_at"] == pytest.approx(t_early, abs=0.5)
    # the 12 s grace ended past the new deadline less the margin: deleted again with the shorter grace
    shortened = agent.of("grace.shortened")
    assert shortened and shortened[0]["grace"] < 12
    assert [int(d["grace"]) for d in audit(kube, "delete", "b")] == [shortened[0]["grace"]]  # type: ignore[call-overload]
    assert out["type"] == "drain.drained" and out["at"] < t_early - 0.9


def test_defect8_a_silent_api_gets_an_honest_overrun_on_time(agent: AgentEnv, kube: KubeApiStandIn) -> None:
    for i in range(3):
        add_pod(kube, "batch", f"b-{i}", agent.node, grace=60, prestop=30)
    agent.start().wait_subscribed()
    agent.send(agent.notice("silent-1", 10))
    wait_for(lambda: len(agent.of("eviction.requested")) == 3, 5, "evictions")
    kube.go_silent()
    out = agent.outcome(12)
    assert out["type"] == "drain.overrun"
    # at the overrun time, 1 s before the instance is gone (a 0.8 s list timeout no longer pushes it later)
    assert out["at"] <= _terminate_at(agent) - 0.8
    assert {r["pod"] for r in out["remaining"]} == {f"batch/b-{i}" for i in range(3)}
    assert all(r["why"].startswith("unknown (API silent since") for r in out["remaining"])
