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

from sco.standins.kube_apiserver import KubeApiStandIn, _Handler
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
        for d in yaml.safe_load_all((ROOT / "kyverno" / "rbac" / "agent.yaml").read_text())
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
