"""Kubernetes Events about a drain: on the Node (drain started, tainted, drained / overrun
with the reasons) and on each evicted pod, as ``kubectl describe`` lists them; never delaying the drain.
Before: no event at all, and the stand-in had no events endpoint (404)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from sco_devkit.standins.kube_apiserver import Identity, KubeApiStandIn
from tests.harness import AgentEnv, NatsServer, add_pod, wait_for


def _call(kube: KubeApiStandIn, method: str, path: str, body: Any = None, token: str = "") -> tuple[int, Any]:
    req = urllib.request.Request(kube.url + path, method=method, data=json.dumps(body).encode() if body else None)
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _ev(kind: str, name: str, ns: str | None, evname: str = "x.1") -> dict[str, Any]:
    ref = {"apiVersion": "v1", "kind": kind, "name": name, **({"namespace": ns} if ns else {})}
    return {"metadata": {"name": evname}, "involvedObject": ref, "reason": "R", "message": "m", "type": "Normal"}


def test_the_standin_events_endpoint_keeps_the_api_servers_rules() -> None:
    kube = KubeApiStandIn(tokens={"ok": Identity("a"), "no": Identity("b", deny=("create events",))}).start()
    try:
        kube.cluster.add_node("n1")
        assert _call(kube, "POST", "/api/v1/namespaces/default/events", _ev("Node", "n1", None), "ok")[0] == 201
        # an event about a Node anywhere but default: 422, as pkg/apis/core/validation/events.go
        code, st = _call(kube, "POST", "/api/v1/namespaces/web/events", _ev("Node", "n1", None, "x.2"), "ok")
        assert code == 422 and "does not match event.namespace" in st["message"]
        code, st = _call(kube, "POST", "/api/v1/namespaces/default/events", _ev("Pod", "p", "web", "x.3"), "ok")
        assert code == 422
        assert _call(kube, "POST", "/api/v1/namespaces/web/events", _ev("Pod", "p", "web", "x.3"), "ok")[0] == 201
        code, st = _call(kube, "POST", "/api/v1/namespaces/default/events", _ev("Node", "n1", None), "ok")
        assert code == 409  # same name
        code, st = _call(kube, "POST", "/api/v1/namespaces/default/events", _ev("Node", "n1", None, "Bad_Name"), "ok")
        assert code == 422
        code, st = _call(kube, "POST", "/api/v1/namespaces/default/events", _ev("Node", "n1", None, "x.9"), "no")
        assert code == 403 and 'cannot create resource "events"' in st["message"]
        sel = "?fieldSelector=involvedObject.kind%3DNode,involvedObject.name%3Dn1"
        code, lst = _call(kube, "GET", "/api/v1/namespaces/default/events" + sel, None, "ok")
        assert code == 200 and [e["metadata"]["name"] for e in lst["items"]] == ["x.1"]
        assert _call(kube, "GET", "/api/v1/events?fieldSelector=bogus%3D1", None, "ok")[0] == 400
    finally:
        kube.stop()


def _node_events(kube: KubeApiStandIn, node: str) -> list[dict[str, Any]]:
    return [
        e
        for (ns, _), e in sorted(kube.cluster.events.items())
        if ns == "default" and e["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node}
    ]


@pytest.mark.parametrize("denied", [False, True])
def test_a_drain_is_told_in_events_and_a_refusal_never_holds_it(
    tmp_path: Path, nats_server: NatsServer, denied: bool
) -> None:
    ident = Identity("sco-agent", deny=("create events",) if denied else ())
    kube = KubeApiStandIn(tokens={"agent": ident}).start()
    tok = tmp_path / "token"
    tok.write_text("agent\n")
    env = AgentEnv(tmp_path / "a", kube, nats_server, kube_token_file=str(tok))
    try:
        for i in range(3):
            add_pod(kube, "web", f"w-{i}", env.node, prestop=0.2)
        env.start().wait_subscribed()
        t0 = env.send(env.notice("ev-1", 10))
        out = env.outcome(12)
        assert out["type"] == "drain.drained", out
        first = min(e["at"] for e in env.of("eviction.requested"))
        assert first - t0 < 2  # the first drain action within 2 s, events refused or not
        if denied:
            assert not kube.cluster.events
            failed = env.of("kube.event_failed")
            assert len(failed) == 1 and "403" in failed[0]["error"], failed  # counted once, never retried
            assert out["kube_events"]["failed"] >= 1 and out["kube_events"]["sent"] == 0
            return
        wait_for(lambda: len(_node_events(kube, env.node)) >= 3, 5, "the node's events")
        reasons = [e["reason"] for e in _node_events(kube, env.node)]
        assert {"SpotReclaimDrainStarted", "SpotReclaimTainted", "SpotReclaimDrained"} <= set(reasons), reasons
        started = next(e for e in _node_events(kube, env.node) if e["reason"] == "SpotReclaimDrainStarted")
        assert "ev-1" in started["message"] and "instance gone at" in started["message"]
        assert started["source"] == {"component": "sco-agent", "host": env.node}
        pods = [e for (ns, _), e in kube.cluster.events.items() if ns == "web"]
        assert {e["involvedObject"]["name"] for e in pods} == {"w-0", "w-1", "w-2"}
        assert all("grace" in e["message"] and e["reason"] == "SpotReclaimEvicting" for e in pods)
        assert not env.of("kube.event_failed")
    finally:
        env.stop()
        kube.stop()


def test_an_overrun_event_names_its_reasons(tmp_path: Path, nats_server: NatsServer) -> None:
    kube = KubeApiStandIn(tokens={"agent": Identity("sco-agent", deny=("patch nodes",))}).start()
    tok = tmp_path / "token"
    tok.write_text("agent\n")
    env = AgentEnv(tmp_path / "a", kube, nats_server, kube_token_file=str(tok))
    try:
        add_pod(kube, "web", "w", env.node, prestop=0.2)
        env.start().wait_subscribed()
        env.send(env.notice("ov-1", 6))
        assert env.outcome(10)["type"] == "drain.overrun"
        ev = wait_for(
            lambda: [e for e in _node_events(kube, env.node) if e["reason"] == "SpotReclaimOverrun"], 5, "overrun"
        )
        assert ev[0]["type"] == "Warning" and "403" in ev[0]["message"] and "taint" in ev[0]["message"]
    finally:
        env.stop()
        kube.stop()


def test_an_event_about_a_pod_with_a_253_character_name_is_accepted(tmp_path: Path) -> None:
    import asyncio

    from sco.agent.kube.events import KubeEvents
    from sco.agent.spool import Spool
    from sco.schedulers.kube import KubeClient

    kube = KubeApiStandIn().start()
    name = "p" * 253  # the longest pod name: the event's name (name + "." + 16 hex) must still be <= 253

    async def go() -> KubeEvents:
        client = KubeClient(kube.url)
        ev = KubeEvents(client, Spool(tmp_path / "spool"), "n1", "notice-1")
        ev.pod_event("web", name, "uid-1", "SpotReclaimEvicting", "eviction requested")
        while ev._tasks:
            await asyncio.sleep(0.01)
        await client.close()
        return ev

    try:
        ev = asyncio.run(go())
        assert ev.counts() == {"sent": 1, "failed": 0, "dropped": 0}
        ((ns, evname),) = kube.cluster.events
        assert ns == "web" and len(evname) <= 253
    finally:
        kube.stop()
