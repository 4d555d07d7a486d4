"""The real node agent's requests against its scope of power (seed view 10).

The agent (its own process, real NATS) drains node-a on the Kubernetes API stand-in, which records every
request. Then: the ClusterRole in kyverno/rbac is exactly what it used (sufficient and smallest); every write,
turned into the admission request the API server would send for the agent's node-bound token, passes
sco-agent-own-node-only, and the same writes from a token bound to another node are refused; nothing on
node-b was touched.
"""

from __future__ import annotations

import copy
import re
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from sco_devkit.standins.kube_apiserver import KubeApiStandIn, _Handler
from tests.harness import AgentEnv, NatsServer, add_pod
from tests.kyverno_engine import ROOT, agent_request, apply_rule, load_policies, rule

WINDOW = 20.0
POLICY = "sco-agent-own-node-only"


class _Recording(_Handler):
    """The stand-in's handler, also keeping each request and the objects it touched, before and after."""

    def _dispatch(self, method: str) -> None:
        path = urllib.parse.urlsplit(self.path).path
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
        c = self.server.cluster
        entry: dict[str, Any] = {"method": method, "path": path, "watch": query.get("watch") == ["true"]}
        with c.lock:
            m = re.match(r"^/api/v1/nodes/([^/]+)$", path)
            if m and m.group(1) in c.nodes:
                entry["before"] = copy.deepcopy(c.nodes[m.group(1)])
            m = re.match(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)", path)
            if m and (m.group(1), m.group(2)) in c.pods:
                entry["before"] = copy.deepcopy(c.pods[(m.group(1), m.group(2))])
        self.server.requests.append(entry)  # type: ignore[attr-defined]  # before: a watch may never return
        super()._dispatch(method)
        with c.lock:
            m = re.match(r"^/api/v1/nodes/([^/]+)$", path)
            if m and m.group(1) in c.nodes:
                entry["after"] = copy.deepcopy(c.nodes[m.group(1)])


@pytest.fixture
def kube() -> Iterator[KubeApiStandIn]:
    srv = KubeApiStandIn()
    srv.RequestHandlerClass = _Recording
    srv.requests = []  # type: ignore[attr-defined]
    srv.start()
    yield srv
    srv.stop()


def _grant(method: str, path: str, watch: bool) -> tuple[str, str] | None:
    """(resource, verb) as the API server's RBAC authorizer sees the request; None for non-resource URLs."""
    if path == "/version" or path.startswith("/api/v1") is False:
        return None
    parts = path.split("/")[3:]  # after /api/v1
    if parts[0] == "namespaces" and len(parts) > 2:
        parts = parts[2:]
    resource = parts[0] + ("/" + parts[2] if len(parts) > 2 else "")
    named = len(parts) > 1
    verb = {
        "GET": ("watch" if watch else "get") if named else ("watch" if watch else "list"),
        "PATCH": "patch",
        "DELETE": "delete",
        "POST": "create",
        "PUT": "update",
    }[method]
    return resource, verb


def test_the_real_agent_stays_inside_its_scope(tmp_path: Path, kube: KubeApiStandIn, nats_server: NatsServer) -> None:
    agent = AgentEnv(tmp_path / "agent", kube, nats_server, node="node-a")
    kube.cluster.add_node("node-b")
    add_pod(kube, "web", "web-0", "node-a", grace=30, prestop=0.3)
    add_pod(kube, "guarded", "g-0", "node-a", labels={"app": "g"}, grace=30, prestop=0.3)
    kube.cluster.create_pdb(  # blocks the eviction: the agent deletes once the contract's budget is spent
        "guarded", {"metadata": {"name": "g"}, "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "g"}}}}
    )
    add_pod(kube, "web", "far", "node-b")
    try:
        agent.start().wait_subscribed()
        agent.send(agent.notice("scope-1", WINDOW))
        assert agent.outcome(WINDOW)["type"] == "drain.drained"
    finally:
        agent.stop()
    reqs: list[dict[str, Any]] = list(kube.requests)  # type: ignore[attr-defined]

    # 1. the ClusterRole is what the agent used: nothing missing, nothing spare
    role = next(
        d
        for d in (
            d for f in sorted((ROOT / "kyverno" / "rbac").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text())
        )
        if d["kind"] == "ClusterRole"
    )
    granted = {(r, v) for rr in role["rules"] for r in rr["resources"] for v in rr["verbs"]}
    used = {g for q in reqs if (g := _grant(q["method"], q["path"], q["watch"])) is not None}
    assert used == granted

    # 2. nothing on node-b: no request named it or its pod, and its pod still runs
    assert not [q for q in reqs if "node-b" in q["path"] or q["path"].endswith("/far")]
    assert ("web", "far") in kube.cluster.pods

    # 3. every write passes the own-node policy for a token bound to node-a, and is refused for node-b
    pols = load_policies()
    writes = [q for q in reqs if q["method"] in ("PATCH", "POST", "DELETE")]
    assert {q["method"] for q in writes} == {"PATCH", "POST", "DELETE"}

    def changes(q: dict[str, Any]) -> bool:
        # the agent's start-up preflight PATCHes its node with a dry-run no-op: nothing there to refuse
        keep = ("spec", "labels", "annotations")
        b, a = q["before"], q["after"]
        return any((b.get(k) or b["metadata"].get(k)) != (a.get(k) or a["metadata"].get(k)) for k in keep)

    assert any(q["method"] == "PATCH" and changes(q) for q in writes)  # the taint itself
    # the drain's Kubernetes Events (sco.agent.kube.events): about node-a or its pods, so refused for node-b
    seen_pods = {
        f"/api/v1/namespaces/{q['before']['metadata']['namespace']}/pods/{q['before']['metadata']['name']}": q["before"]
        for q in reqs
        if q.get("before", {}).get("kind") == "Pod"
    }
    events = list(kube.cluster.events.values())
    assert {e["involvedObject"]["kind"] for e in events} == {"Node", "Pod"}
    for ev in events:
        for bound, want in (("node-a", "pass"), ("node-b", "fail")):
            r = rule(pols, POLICY, "agent-creates-events-only-about-its-node")
            res = apply_rule(r, agent_request("CREATE", ev, node=bound), api=seen_pods)
            assert res.status == want, (ev["involvedObject"], bound, res)
    writes = [q for q in writes if not q["path"].endswith("/events")]
    for q in writes:
        other = "fail" if q["method"] != "PATCH" or changes(q) else "pass"
        for bound, want in (("node-a", "pass"), ("node-b", other)):
            if q["method"] == "PATCH":
                r = rule(pols, POLICY, "agent-changes-only-its-node")
                res = apply_rule(r, agent_request("UPDATE", q["after"], q["before"], node=bound))
            elif q["method"] == "DELETE":
                r = rule(pols, POLICY, "agent-deletes-only-pods-on-its-node")
                res = apply_rule(r, agent_request("DELETE", None, q["before"], node=bound))
            else:
                ns, name = q["path"].split("/")[4], q["path"].split("/")[6]
                eviction = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": ns}}
                r = rule(pols, POLICY, "agent-evicts-only-pods-on-its-node")
                api = {f"/api/v1/namespaces/{ns}/pods/{name}": q["before"]}
                res = apply_rule(r, agent_request("CREATE", eviction, node=bound), api=api)
            assert res.status == want, (q["method"], q["path"], bound, res)


AGENT_USER = "system:serviceaccount:sco-system:sco-agent"
AGENT_GROUPS = ("system:serviceaccounts", "system:serviceaccounts:sco-system", "system:authenticated")


def test_the_agent_of_node_a_can_touch_nothing_on_node_b(tmp_path: Path, nats_server: NatsServer) -> None:
    """The stand-in authenticates bearer tokens: the agent's token is sco-agent's, bound to node-a (user info
    extra authentication.kubernetes.io/node-name). The real agent drains node-a with it; the same agent
    binary holding that token but told to drain node-b (a compromised node A) gets 403 for every write, and
    node-b and its pods are untouched."""
    from sco_devkit.standins.kube_apiserver import NODE_NAME_EXTRA, Identity

    bound_a = Identity(AGENT_USER, AGENT_GROUPS, ((NODE_NAME_EXTRA, ("node-a",)),))
    kube = KubeApiStandIn(tokens={"tok-a": bound_a}).start()
    tok = tmp_path / "token"
    tok.write_text("tok-a\n")
    try:
        kube.cluster.add_node("node-b")
        add_pod(kube, "web", "near", "node-a", grace=30, prestop=0.2)
        add_pod(kube, "web", "far-0", "node-b", grace=30)
        add_pod(kube, "batch", "far-1", "node-b", grace=30)
        node_b_before = copy.deepcopy(kube.cluster.nodes["node-b"])

        # node A's agent drains node A with its bound token
        own = AgentEnv(tmp_path / "own", kube, nats_server, node="node-a", kube_token_file=str(tok))
        try:
            own.start().wait_subscribed()
            own.send(own.notice("own-1", WINDOW))
            assert own.outcome(WINDOW)["type"] == "drain.drained"
            # its token may do everything its drain needs (a preflight the loaded API server did not answer in time
            # says nothing of the token; the preflight repeats)
            denied = [p for e in own.of("scheduler.preflight") for p in e["problems"] if "did not answer" not in p]
            assert not denied, own.of("scheduler.preflight")
        finally:
            own.stop()
        assert ("web", "near") not in kube.cluster.pods
        assert "sco.dev/reclaim" in [t["key"] for t in kube.cluster.nodes["node-a"]["spec"].get("taints", [])]

        # the same token, aimed at node B
        rogue = AgentEnv(tmp_path / "rogue", kube, nats_server, node="node-b", kube_token_file=str(tok))
        try:
            rogue.start().wait_subscribed()
            rogue.send(rogue.notice("rogue-1", 10))
            out = rogue.outcome(10)
        finally:
            rogue.stop()
        assert out["type"] == "drain.overrun"
        assert any("403" in r and 'modify node "node-b"' in r for r in out["reasons"]), out["reasons"]
        # it tried every pod of node B, and every eviction or delete was refused
        assert sorted(p["pod"] for p in out["remaining"]) == ["batch/far-1", "web/far-0"]
        assert all("403" in p["why"] for p in out["remaining"]), out["remaining"]
        preflight = rogue.of("scheduler.preflight")[0]["problems"]
        assert any('may not patch node "node-b"' in p and "403" in p for p in preflight), preflight
        # nothing on node B changed: the node, and both pods (still there, not terminating)
        node_b = kube.cluster.nodes["node-b"]
        assert node_b["spec"] == node_b_before["spec"]
        assert node_b["metadata"].get("labels") == node_b_before["metadata"].get("labels")
        for key in (("web", "far-0"), ("batch", "far-1")):
            assert key in kube.cluster.pods and not kube.cluster.pods[key]["metadata"].get("deletionTimestamp")
        touched = [a for a in kube.cluster.audit if a["name"] in ("node-b", "far-0", "far-1") and a["verb"] != "create"]
        assert touched == []
    finally:
        kube.stop()
