"""The Kyverno policies of ``kyverno/``: schemas, and every rule's allowed and refused cases.

Kyverno itself cannot run here; ``tests/kyverno_engine.py`` says exactly what is evaluated and how (CEL by
cel-python, JMESPath by jmespath, mutations by Kyverno's documented merge and anchor semantics). The
ConfigMap every case reads is the one ``sco contract publish-configmap`` renders from the sample hall.
"""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft7Validator
from kubernetes import client

from sco.contract.bundle import Bundle
from sco.contract.compiler import compile_repo
from sco.contract.signing import Keyring, generate, sign
from sco.schedulers.kube_contracts import configmap
from tests.harness import sample_repo
from tests.kyverno_engine import ROOT, agent_request, apply_rule, cel, load_policies, request, rule

KYVERNO = ROOT / "kyverno"
POLICIES = load_policies()
Obj = dict[str, Any]


def _contracts_cm() -> Obj:
    key = generate()
    b = Bundle.from_bytes(sign(compile_repo(sample_repo(), serial=7), [key]), Keyring([key.public]))
    return configmap(b)


CM = _contracts_cm()
CMS = {("sco-system", "sco-contracts"): CM}
TOLERATE = [{"key": "sco.dev/reclaim", "operator": "Exists", "effect": "NoSchedule"}]


def pod(ns: str = "ci", labels: Obj | None = None, **spec: Any) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": ns, "labels": labels or {}},
        "spec": {"containers": [{"name": "main", "image": "busybox"}], **spec},
    }


def job(restart: str = "Never", pfp: Obj | None = None, **tspec: Any) -> Obj:
    j: Obj = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "j", "namespace": "ci"},
        "spec": {
            "template": {
                "metadata": {"labels": {"role": "runner", "sco.dev/contract": "ci-runners"}},
                "spec": {"restartPolicy": restart, "containers": [{"name": "main", "image": "busybox"}], **tspec},
            }
        },
    }
    if pfp is not None:
        j["spec"]["podFailurePolicy"] = pfp
    return j


def node(name: str, **spec: Any) -> Obj:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {}}, "spec": dict(spec)}


RUNNER = {"role": "runner", "sco.dev/contract": "ci-runners"}
AFFINITY = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {"matchExpressions": [{"key": "sco.dev/capacity", "operator": "In", "values": ["reclaimable"]}]}
            ]
        }
    }
}


# --- schemas -------------------------------------------------------------------------------------


def _strict(schema: Any) -> Any:
    """A CRD's structural schema as JSON Schema that also refuses unknown fields (the API server would
    prune them silently, or refuse them under strict field validation: either way a typo must fail here)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items() if not k.startswith("x-kubernetes")}
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if schema.get("nullable"):
        out.pop("nullable")
        if "type" in out:
            out["type"] = [out["type"], "null"]
    if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)
    return out


def _crd_validator() -> Draft7Validator:
    crd = yaml.safe_load((KYVERNO / "schemas" / "kyverno.io_clusterpolicies.yaml").read_text())
    v1 = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return Draft7Validator(_strict(v1["schema"]["openAPIV3Schema"]))


VALIDATOR = _crd_validator()


def test_vendored_crd_is_the_upstream_file() -> None:
    raw = (KYVERNO / "schemas" / "kyverno.io_clusterpolicies.yaml").read_bytes()
    assert hashlib.sha256(raw).hexdigest() in (KYVERNO / "schemas" / "SOURCE.md").read_text()


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_matches_the_kyverno_clusterpolicy_schema(name: str) -> None:
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in VALIDATOR.iter_errors(POLICIES[name])]
    assert errors == []


def test_the_schema_check_catches_a_typo() -> None:
    bad = copy.deepcopy(POLICIES["sco-require-contract"])
    bad["spec"]["rules"][0]["validate"]["cel"]["paramRef"]["parameterNotFoundActoin"] = "Deny"
    assert any("parameterNotFoundActoin" in e.message for e in VALIDATOR.iter_errors(bad))


_MODELS = {
    ("v1", "Namespace"): "V1Namespace",
    ("v1", "ServiceAccount"): "V1ServiceAccount",
    ("v1", "ConfigMap"): "V1ConfigMap",
    ("v1", "Secret"): "V1Secret",
    ("v1", "Pod"): "V1Pod",
    ("batch/v1", "Job"): "V1Job",
    ("rbac.authorization.k8s.io/v1", "ClusterRole"): "V1ClusterRole",
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"): "V1ClusterRoleBinding",
    ("rbac.authorization.k8s.io/v1", "Role"): "V1Role",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "V1RoleBinding",
}
_API = client.ApiClient()


def k8s_valid(obj: Obj) -> None:
    """Round-trip through the official client's model: required fields checked, and any field the
    Kubernetes schema does not know is dropped, so the round trip differs and the assert names it."""
    model = _MODELS[(obj["apiVersion"], obj["kind"])]
    typed = _API._ApiClient__deserialize(copy.deepcopy(obj), model)  # type: ignore[attr-defined]
    back = _API.sanitize_for_serialization(typed)
    assert back == obj, f"{obj['kind']}: not a valid Kubernetes object (unknown or mistyped fields)"


def test_rbac_objects_are_valid_kubernetes_objects() -> None:
    docs = list(d for f in sorted((KYVERNO / "rbac").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()))
    assert {d["kind"] for d in docs} >= {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding"}
    for d in docs:
        k8s_valid(d)
    k8s_valid(CM)


def test_the_kubernetes_check_catches_a_typo() -> None:
    with pytest.raises(AssertionError, match="not a valid"):
        k8s_valid({**pod(), "spec": {"containers": [{"name": "c", "image": "x"}], "terminationGraceSeconds": 3}})


def test_agent_clusterrole_is_the_smallest_the_drain_needs() -> None:
    role = next(
        d
        for d in (d for f in sorted((KYVERNO / "rbac").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()))
        if d["kind"] == "ClusterRole"
    )
    grants = {(r, v) for rr in role["rules"] for r in rr["resources"] for v in rr["verbs"]}
    # what sco.schedulers.kube.KubeClient does: get_node, taint_node (patch), pods_on_node (list), watch_pods,
    # evict, delete; tests/test_agent_scope.py checks it against the real agent's requests
    assert grants == {
        ("nodes", "get"),
        ("nodes", "patch"),
        ("pods", "list"),
        ("pods", "watch"),
        ("pods", "delete"),
        ("pods/eviction", "create"),
        ("events", "create"),  # sco.agent.kube.events: kubectl describe shows the drain
    }


def test_the_agent_may_create_tokens_for_its_own_account_only() -> None:
    """sco.agent.kube.credential renews its token (TokenRequest): a Role in the account's namespace, the
    account named (resourceNames), create only; bound to that account alone."""
    docs = [d for f in sorted((KYVERNO / "rbac").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text())]
    roles = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "sco-agent-token"]
    (role,) = roles
    assert role["metadata"]["namespace"] == "sco-system"
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["serviceaccounts/token"], "resourceNames": ["sco-agent"], "verbs": ["create"]}
    ]
    (binding,) = [d for d in docs if d["kind"] == "RoleBinding" and d["roleRef"]["name"] == "sco-agent-token"]
    assert binding["metadata"]["namespace"] == "sco-system" and binding["roleRef"]["kind"] == "Role"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "sco-agent", "namespace": "sco-system"}]
    # nothing else grants it serviceaccounts/token (a ClusterRole would reach every namespace's accounts); the one
    # other role that may (the enrolment service's, for an instance's first token) names sco-agent alone too and is
    # bound to the enrolment service alone
    others = [
        d
        for d in docs
        if d["kind"] in ("Role", "ClusterRole") and d is not role
        for r in d["rules"]
        if any("serviceaccounts" in x for x in r["resources"])
    ]
    assert [(d["kind"], d["metadata"]["name"], d["rules"]) for d in others] == [
        ("Role", "sco-enrol-token", role["rules"])
    ]
    bound = [d["subjects"] for d in docs if d["kind"].endswith("Binding") and d["roleRef"]["name"] == "sco-enrol-token"]
    assert bound == [[{"kind": "ServiceAccount", "name": "sco-enrol", "namespace": "sco-system"}]]


# --- rule cases ----------------------------------------------------------------------------------

REQUIRE = ("sco-require-contract", "reclaimable-pods-name-a-contract")
JOBS = ("sco-require-contract", "reclaimable-jobs-restart-never")
NODES = ("sco-agent-own-node-only", "agent-changes-only-its-node")
DELETES = ("sco-agent-own-node-only", "agent-deletes-only-pods-on-its-node")
EVICTIONS = ("sco-agent-own-node-only", "agent-evicts-only-pods-on-its-node")
EVENTS = ("sco-agent-own-node-only", "agent-creates-events-only-about-its-node")
TOKENS = ("sco-agent-own-node-only", "agent-requests-tokens-only-for-its-node")
DIRECT = ("sco-require-contract", "pods-bound-to-reclaimable-nodes-tolerate-the-taint")
DRIVERS = ("sco-require-contract", "spark-drivers-stay-off-reclaimable-nodes")


def _evict(ns: str = "ci", name: str = "p") -> Obj:
    return {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": ns}}


def _token_request(bound: Obj | None, sa: str = "sco-agent", ns: str = "sco-system") -> Obj:
    """A TokenRequest as sco.agent.kube.credential sends it (the API server names it after the account)."""
    spec: Obj = {"expirationSeconds": 86400}
    if bound is not None:
        spec["boundObjectRef"] = bound
    return {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "metadata": {"name": sa, "namespace": ns},
        "spec": spec,
    }


def _node_ref(name: str) -> Obj:
    return {"kind": "Node", "apiVersion": "v1", "name": name, "uid": f"uid-{name}"}


def _kevent(kind: str, name: str, ns: str) -> Obj:
    """A core/v1 Event as sco.agent.kube.events makes it (Node events in default, pod events in the pod's)."""
    ref = {"apiVersion": "v1", "kind": kind, "name": name, "uid": name, **({"namespace": ns} if kind != "Node" else {})}
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{name}.0123456789abcdef", "namespace": ns},
        "involvedObject": ref,
        "reason": "SpotReclaimDrainStarted",
        "message": "draining",
        "type": "Normal",
    }


def _on(node_name: str) -> Obj:
    p = pod(labels=RUNNER, nodeName=node_name)
    return p


API = {
    "/api/v1/namespaces/ci/pods/on-a": {"spec": {"nodeName": "node-a"}},
    "/api/v1/namespaces/ci/pods/on-b": {"spec": {"nodeName": "node-b"}},
    "/api/v1/namespaces/ci/pods/pending": {"spec": {}},
    "/api/v1/nodes/spot-1": {"metadata": {"name": "spot-1", "labels": {"sco.dev/capacity": "reclaimable"}}},
    "/api/v1/nodes/reserved-1": {"metadata": {"name": "reserved-1", "labels": {"sco.dev/capacity": "reserved"}}},
}

# (id, rule, request, configmaps, expected status, text the message must contain)
CASES: list[tuple[str, tuple[str, str], Obj, Any, str, str]] = [
    # require a contract: allowed
    ("contract-ok", REQUIRE, request("CREATE", pod(labels=RUNNER, tolerations=TOLERATE)), CMS, "pass", ""),
    (
        "spark-contract-ok",
        REQUIRE,
        request(
            "CREATE",
            pod(
                "etl",
                {"spark-role": "executor", "sco.dev/contract": "etl-nightly"},
                nodeSelector={"sco.dev/capacity": "reclaimable"},
            ),
        ),
        CMS,
        "pass",
        "",
    ),
    (
        "selector-only-empty-match-ok",
        REQUIRE,
        request("CREATE", pod("training", {"sco.dev/contract": "pytorch-training"}, affinity=AFFINITY)),
        CMS,
        "pass",
        "",
    ),
    ("not-reclaimable-skipped", REQUIRE, request("CREATE", pod()), CMS, "skip", ""),
    (
        "other-taint-skipped",
        REQUIRE,
        request("CREATE", pod(tolerations=[{"key": "gpu", "operator": "Exists"}])),
        CMS,
        "skip",
        "",
    ),
    (
        "daemonset-skipped",
        REQUIRE,
        request(
            "CREATE",
            pod(tolerations=[{"operator": "Exists"}]),
            username="system:serviceaccount:kube-system:daemon-set-controller",
        ),
        CMS,
        "skip",
        "",
    ),
    (
        "update-without-placement-change-skipped",
        REQUIRE,
        request("UPDATE", pod(tolerations=TOLERATE), pod(tolerations=TOLERATE)),
        CMS,
        "skip",
        "",
    ),
    # require a contract: refused
    (
        "no-label",
        REQUIRE,
        request("CREATE", pod(labels={"role": "runner"}, tolerations=TOLERATE)),
        CMS,
        "fail",
        "add the label sco.dev/contract=<name>, one of the contracts for namespace ci: ci-cache-warmers, ci-runners",
    ),
    (
        "tolerate-everything-no-label",
        REQUIRE,
        request("CREATE", pod(tolerations=[{"operator": "Exists"}])),
        CMS,
        "fail",
        "names no contract",
    ),
    (
        "no-contract-for-namespace",
        REQUIRE,
        request("CREATE", pod("web", nodeSelector={"sco.dev/capacity": "reclaimable"})),
        CMS,
        "fail",
        "no contract of bundle serial 7 of hall local covers namespace web",
    ),
    (
        "unknown-contract",
        REQUIRE,
        request("CREATE", pod(labels={"role": "runner", "sco.dev/contract": "ci-runnerz"}, tolerations=TOLERATE)),
        CMS,
        "fail",
        "sco.dev/contract=ci-runnerz names no contract of bundle serial 7",
    ),
    (
        "slurm-contract",
        REQUIRE,
        request("CREATE", pod(labels={"sco.dev/contract": "genomics-align"}, tolerations=TOLERATE)),
        CMS,
        "fail",
        "genomics-align is a slurm contract",
    ),
    (
        "other-namespace-contract",
        REQUIRE,
        request("CREATE", pod(labels={"sco.dev/contract": "pytorch-training"}, tolerations=TOLERATE)),
        CMS,
        "fail",
        "covers namespace training, not ci",
    ),
    (
        "labels-do-not-match",
        REQUIRE,
        request("CREATE", pod(labels={"role": "builder", "sco.dev/contract": "ci-runners"}, tolerations=TOLERATE)),
        CMS,
        "fail",
        "selects pods labelled role=runner",
    ),
    (
        "no-configmap-published",
        REQUIRE,
        request("CREATE", pod(labels=RUNNER, tolerations=TOLERATE)),
        {},
        "fail",
        'configmaps "sco-contracts" not found',
    ),
    (
        "update-removes-label",
        REQUIRE,
        request(
            "UPDATE", pod(labels={"role": "runner"}, tolerations=TOLERATE), pod(labels=RUNNER, tolerations=TOLERATE)
        ),
        CMS,
        "fail",
        "names no contract",
    ),
    (
        "update-adds-toleration",
        REQUIRE,
        request("UPDATE", pod(tolerations=TOLERATE), pod()),
        CMS,
        "fail",
        "names no contract",
    ),
    # Spark drivers stay off reclaimable nodes
    ("driver-on-demand-ok", DRIVERS, request("CREATE", pod("etl", {"spark-role": "driver"})), CMS, "skip", ""),
    (
        "executor-on-reclaimable-ok",
        DRIVERS,
        request("CREATE", pod("etl", {"spark-role": "executor"}, tolerations=TOLERATE)),
        CMS,
        "pass",
        "",
    ),
    (
        "driver-on-reclaimable-refused",
        DRIVERS,
        request("CREATE", pod("etl", {"spark-role": "driver"}, nodeSelector={"sco.dev/capacity": "reclaimable"})),
        CMS,
        "fail",
        "Spark drivers must not run on reclaimable nodes",
    ),
    # Jobs on reclaimable capacity need restartPolicy Never
    ("job-never-ok", JOBS, request("CREATE", job(tolerations=TOLERATE)), CMS, "pass", ""),
    ("job-not-reclaimable-skipped", JOBS, request("CREATE", job("OnFailure")), CMS, "skip", ""),
    (
        "job-onfailure-refused",
        JOBS,
        request("CREATE", job("OnFailure", tolerations=TOLERATE)),
        CMS,
        "fail",
        "set spec.template.spec.restartPolicy: Never",
    ),
    # pods bound directly to a node (no scheduler): the node is looked up by apiCall
    ("direct-reserved-ok", DIRECT, request("CREATE", pod(nodeName="reserved-1")), API, "pass", ""),
    (
        "direct-reclaimable-tolerating-ok",
        DIRECT,
        request("CREATE", pod(labels=RUNNER, nodeName="spot-1", tolerations=TOLERATE)),
        API,
        "pass",
        "",
    ),
    ("scheduled-pod-skipped", DIRECT, request("CREATE", pod()), API, "skip", ""),
    (
        "mirror-pod-skipped",
        DIRECT,
        request("CREATE", pod(nodeName="spot-1"), username="system:node:spot-1", groups=["system:nodes"]),
        API,
        "skip",
        "",
    ),
    (
        "direct-reclaimable-refused",
        DIRECT,
        request("CREATE", pod(labels=RUNNER, nodeName="spot-1")),
        API,
        "fail",
        "bound directly (spec.nodeName) to spot-1, a reclaimable node: add the toleration sco.dev/reclaim",
    ),
    # the agent and nodes
    (
        "agent-taints-own-node",
        NODES,
        agent_request("UPDATE", node("node-a", unschedulable=True, taints=TOLERATE), node("node-a")),
        CMS,
        "pass",
        "",
    ),
    (
        "agent-noop-update-other-node",
        NODES,
        agent_request("UPDATE", node("node-b"), node("node-b")),
        CMS,
        "pass",
        "",
    ),
    (
        "others-not-matched",
        NODES,
        request("UPDATE", node("node-b", unschedulable=True), node("node-b")),
        CMS,
        "skip",
        "",
    ),
    (
        "agent-taints-other-node",
        NODES,
        agent_request("UPDATE", node("node-b", taints=TOLERATE), node("node-b")),
        CMS,
        "fail",
        "the SCO agent of node node-a may taint, cordon or relabel only its own node, not node node-b",
    ),
    (
        "agent-cordons-other-node",
        NODES,
        agent_request("UPDATE", node("node-b", unschedulable=True), node("node-b")),
        CMS,
        "fail",
        "not node node-b",
    ),
    (
        "agent-untaints-other-node",
        NODES,
        agent_request("UPDATE", node("node-b"), node("node-b", taints=TOLERATE)),
        CMS,
        "fail",
        "not node node-b",
    ),
    (
        "agent-relabels-other-node",
        NODES,
        agent_request(
            "UPDATE", {**node("node-b"), "metadata": {"name": "node-b", "labels": {"x": "y"}}}, node("node-b")
        ),
        CMS,
        "fail",
        "not node node-b",
    ),
    (
        "unbound-agent-token",
        NODES,
        agent_request("UPDATE", node("node-a", unschedulable=True), node("node-a"), node=None),
        CMS,
        "fail",
        "not bound to a node",
    ),
    # the agent and pod deletes
    ("agent-deletes-own-pod", DELETES, agent_request("DELETE", None, _on("node-a")), CMS, "pass", ""),
    ("others-delete-not-matched", DELETES, request("DELETE", None, _on("node-b")), CMS, "skip", ""),
    (
        "agent-deletes-other-nodes-pod",
        DELETES,
        agent_request("DELETE", None, _on("node-b")),
        CMS,
        "fail",
        "may delete only pods on its own node; pod ci/p is on node node-b",
    ),
    (
        "agent-deletes-unbound-pod",
        DELETES,
        agent_request("DELETE", None, pod()),
        CMS,
        "fail",
        "is not bound to a node",
    ),
    (
        "unbound-agent-deletes",
        DELETES,
        agent_request("DELETE", None, _on("node-a"), node=None),
        CMS,
        "fail",
        "not bound to a node",
    ),
    # the agent and evictions (the pod's node looked up by apiCall)
    ("agent-evicts-own-pod", EVICTIONS, agent_request("CREATE", _evict(name="on-a")), API, "pass", ""),
    ("others-evict-not-matched", EVICTIONS, request("CREATE", _evict(name="on-b")), API, "skip", ""),
    (
        "agent-evicts-other-nodes-pod",
        EVICTIONS,
        agent_request("CREATE", _evict(name="on-b")),
        API,
        "fail",
        "pod ci/on-b is on node 'node-b'",
    ),
    ("agent-evicts-pending-pod", EVICTIONS, agent_request("CREATE", _evict(name="pending")), API, "fail", "on node ''"),
    ("agent-evicts-missing-pod", EVICTIONS, agent_request("CREATE", _evict(name="gone")), API, "fail", "on node ''"),
    (
        "unbound-agent-evicts",
        EVICTIONS,
        agent_request("CREATE", _evict(name="on-a"), node=None),
        API,
        "fail",
        "of node ''",
    ),
]


CASES += [
    ("agent-events-own-node", EVENTS, agent_request("CREATE", _kevent("Node", "node-a", "default")), API, "pass", ""),
    ("agent-events-own-pod", EVENTS, agent_request("CREATE", _kevent("Pod", "on-a", "ci")), API, "pass", ""),
    (
        "agent-events-other-node",  # the agent of node A cannot create an event about node B
        EVENTS,
        agent_request("CREATE", _kevent("Node", "node-b", "default")),
        API,
        "fail",
        "about Node node-b",
    ),
    ("agent-events-other-pod", EVENTS, agent_request("CREATE", _kevent("Pod", "on-b", "ci")), API, "fail", "'node-b'"),
    ("agent-events-unbound-pod", EVENTS, agent_request("CREATE", _kevent("Pod", "pending", "ci")), API, "fail", ""),
    (
        "agent-events-other-kind",  # an event about anything else (a Deployment, a Namespace): refused
        EVENTS,
        agent_request("CREATE", _kevent("Namespace", "node-a", "default")),
        API,
        "fail",
        "about Namespace",
    ),
    (
        "unbound-agent-events",
        EVENTS,
        agent_request("CREATE", _kevent("Node", "node-a", "default"), node=None),
        API,
        "fail",
        "of node ''",
    ),
    ("others-events-skipped", EVENTS, request("CREATE", _kevent("Node", "node-b", "default")), API, "skip", ""),
]


CASES += [
    ("agent-token-own-node", TOKENS, agent_request("CREATE", _token_request(_node_ref("node-a"))), CMS, "pass", ""),
    (
        "agent-token-other-node",  # the agent of node A asks for node B's credential
        TOKENS,
        agent_request("CREATE", _token_request(_node_ref("node-b"))),
        CMS,
        "fail",
        "may request only tokens bound to its own Node; this one is bound to Node node-b",
    ),
    (
        "agent-token-unbound",
        TOKENS,
        agent_request("CREATE", _token_request(None)),
        CMS,
        "fail",
        "bound to nothing",
    ),
    (
        "agent-token-bound-to-a-pod",
        TOKENS,
        agent_request("CREATE", _token_request({"kind": "Pod", "apiVersion": "v1", "name": "node-a"})),
        CMS,
        "fail",
        "bound to Pod node-a",
    ),
    (
        "agent-token-for-another-account",
        TOKENS,
        agent_request("CREATE", _token_request(_node_ref("node-a"), sa="cluster-admin-sa", ns="kube-system")),
        CMS,
        "fail",
        "only for its own ServiceAccount sco-system/sco-agent, not kube-system/cluster-admin-sa",
    ),
    (
        "unbound-agent-token-asks",
        TOKENS,
        agent_request("CREATE", _token_request(_node_ref("node-a")), node=None),
        CMS,
        "fail",
        "not bound to a node",
    ),
    ("others-tokens-skipped", TOKENS, request("CREATE", _token_request(_node_ref("node-b"))), CMS, "skip", ""),
]


@pytest.mark.parametrize(("rule_id", "policy_rule", "req", "data", "want", "text"), CASES, ids=[c[0] for c in CASES])
def test_rule_case(rule_id: str, policy_rule: tuple[str, str], req: Obj, data: Any, want: str, text: str) -> None:
    r = rule(POLICIES, *policy_rule)
    # the eviction and direct-binding rules read the API (apiCall); the others read the contracts ConfigMap
    res = (
        apply_rule(r, req, api=data)
        if policy_rule in (EVICTIONS, DIRECT, EVENTS)
        else apply_rule(r, req, configmaps=data)
    )
    assert res.status == want, res
    assert text in res.message, res.message
    for o in (req["object"], req["oldObject"]):
        if o is not None and o["kind"] in ("Pod", "Job"):
            k8s_valid(o)


def test_every_validate_rule_has_allowed_and_refused_cases() -> None:
    seen: dict[tuple[str, str], set[str]] = {}
    for _, pr, *_rest, want, _t in CASES:
        seen.setdefault(pr, set()).add(want)
    validate_rules = {(p, r["name"]) for p, pol in POLICIES.items() for r in pol["spec"]["rules"] if "validate" in r}
    assert set(seen) == validate_rules
    for pr, outcomes in seen.items():
        assert {"pass", "fail"} <= outcomes, pr


def test_every_cel_expression_of_the_contract_rule_refuses_something() -> None:
    """Each expression is the one that refuses at least one case (none is dead code)."""
    r = rule(POLICIES, *REQUIRE)
    messages = {c[0]: apply_rule(r, c[2], configmaps=c[3]).message for c in CASES if c[1] == REQUIRE and c[4] == "fail"}
    starts = ["this pod can land", "label sco.dev/contract=", "is a slurm contract", "covers namespace", "selects pods"]
    for s in starts:
        assert any(s in m for m in messages.values()), s


# --- mutations -----------------------------------------------------------------------------------

DEFAULTS = "sco-reclaimable-defaults"
DISRUPTION_RULE = {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}


def _mutate(name: str, obj: Obj, operation: str = "CREATE") -> Any:
    res = apply_rule(rule(POLICIES, DEFAULTS, name), request(operation, obj), configmaps=CMS)
    if res.patched is not None:
        k8s_valid(res.patched)
    return res


def test_job_on_reclaimable_capacity_ignores_disruption() -> None:
    for tspec in (
        {"tolerations": TOLERATE},
        {"nodeSelector": {"sco.dev/capacity": "reclaimable"}},
        {"affinity": AFFINITY},
    ):
        res = _mutate("job-ignores-disruption", job(**tspec))
        assert res.status == "pass", (tspec, res)
        assert res.patched["spec"]["podFailurePolicy"] == {"rules": [DISRUPTION_RULE]}
        assert res.patched["spec"]["template"] == job(**tspec)["spec"]["template"]


def test_job_mutation_leaves_others_alone() -> None:
    assert _mutate("job-ignores-disruption", job()).status == "skip"  # not on reclaimable capacity
    assert _mutate("job-ignores-disruption", job("OnFailure", tolerations=TOLERATE)).status == "skip"
    own = {"rules": [{"action": "FailJob", "onExitCodes": {"operator": "In", "values": [42]}}]}
    assert _mutate("job-ignores-disruption", job(pfp=own, tolerations=TOLERATE)).status == "skip"


def test_job_with_its_own_policy_gets_the_ignore_rule_first() -> None:
    own = {"rules": [{"action": "FailJob", "onExitCodes": {"operator": "In", "values": [42]}}]}
    res = _mutate("job-ignores-disruption-first", job(pfp=own, tolerations=TOLERATE))
    assert res.status == "pass", res
    assert res.patched["spec"]["podFailurePolicy"]["rules"] == [DISRUPTION_RULE, *own["rules"]]
    already = {"rules": [DISRUPTION_RULE, *own["rules"]]}
    assert _mutate("job-ignores-disruption-first", job(pfp=already, tolerations=TOLERATE)).status == "skip"
    assert _mutate("job-ignores-disruption-first", job(pfp=own)).status == "skip"
    assert _mutate("job-ignores-disruption-first", job(tolerations=TOLERATE)).status == "skip"


def test_grace_comes_from_the_contract() -> None:
    res = _mutate("grace-from-contract", pod("training", {"sco.dev/contract": "pytorch-training"}))
    assert res.status == "pass" and res.patched["spec"]["terminationGracePeriodSeconds"] == 100  # 75 + 25
    # a pod's own value is replaced: the contract is the budget the agent and kubelet honour
    res = _mutate("grace-from-contract", pod(labels=RUNNER, terminationGracePeriodSeconds=600))
    assert res.patched["spec"]["terminationGracePeriodSeconds"] == 20
    assert _mutate("grace-from-contract", pod(labels={"role": "runner"})).status == "skip"  # no label
    assert _mutate("grace-from-contract", pod(labels={"sco.dev/contract": "nope"})).status == "skip"
    assert _mutate("grace-from-contract", pod(labels={"sco.dev/contract": "genomics-align"})).status == "skip"
    res = apply_rule(
        rule(POLICIES, DEFAULTS, "grace-from-contract"), request("CREATE", pod(labels=RUNNER)), configmaps={}
    )
    assert res.status == "error"  # no ConfigMap: the rule errors and failurePolicy Fail refuses the pod


def test_spark_executor_on_reclaimable_capacity_gets_the_decommission_prestop() -> None:
    ex = pod(
        "etl",
        {"spark-role": "executor", "sco.dev/contract": "etl-nightly"},
        tolerations=TOLERATE,
        containers=[{"name": "spark-kubernetes-executor", "image": "spark"}, {"name": "sidecar", "image": "x"}],
    )
    res = _mutate("spark-executor-decommission-prestop", ex)
    assert res.status == "pass", res
    c0, c1 = res.patched["spec"]["containers"]
    assert c0["lifecycle"] == {"preStop": {"exec": {"command": ["/opt/decom.sh"]}}}
    assert "lifecycle" not in c1
    own = copy.deepcopy(ex)
    own["spec"]["containers"][0]["lifecycle"] = {"preStop": {"exec": {"command": ["/bin/true"]}}}
    assert _mutate("spark-executor-decommission-prestop", own).patched["spec"]["containers"][0]["lifecycle"] == {
        "preStop": {"exec": {"command": ["/bin/true"]}}
    }
    driver = copy.deepcopy(ex)
    driver["metadata"]["labels"]["spark-role"] = "driver"
    assert _mutate("spark-executor-decommission-prestop", driver).status == "skip"
    on_demand = pod("etl", {"spark-role": "executor"}, containers=ex["spec"]["containers"])
    assert _mutate("spark-executor-decommission-prestop", on_demand).status == "skip"


# --- the two spellings of "can land on reclaimable nodes" agree -----------------------------------

SPECS = [
    {},
    {"tolerations": TOLERATE},
    {"tolerations": [{"operator": "Exists"}]},
    {"tolerations": [{"key": "", "operator": "Exists"}]},
    {"tolerations": [{"key": "gpu", "operator": "Exists"}]},
    {"tolerations": [{"key": "sco.dev/reclaim", "operator": "Equal", "value": "x"}]},
    {"nodeSelector": {"sco.dev/capacity": "reclaimable"}},
    {"nodeSelector": {"sco.dev/capacity": "reserved"}},
    {"affinity": AFFINITY},
    {
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": "sco.dev/capacity", "operator": "NotIn", "values": ["reclaimable"]}
                            ]
                        }
                    ]
                }
            }
        }
    },
]


@pytest.mark.parametrize("spec", SPECS)
def test_cel_and_jmespath_predicates_agree(spec: Obj) -> None:
    pre = rule(POLICIES, *REQUIRE)["celPreconditions"][0]["expression"]
    assert rule(POLICIES, *DRIVERS)["celPreconditions"][0]["expression"] == pre  # one predicate, written twice
    p = pod(**spec)
    in_cel = bool(cel(pre, {"object": p, "oldObject": None, "request": request("CREATE", p)}))
    j = job(**spec)
    res = apply_rule(rule(POLICIES, DEFAULTS, "job-ignores-disruption"), request("CREATE", j), configmaps=CMS)
    assert res.status in ("pass", "skip"), res
    assert in_cel == (res.status == "pass"), spec
    job_pre = rule(POLICIES, *JOBS)["celPreconditions"][0]["expression"]
    assert bool(cel(job_pre, {"object": j, "oldObject": None, "request": request("CREATE", j)})) == in_cel


def test_kyverno_readme_says_kyverno_did_not_run_here() -> None:
    text = (KYVERNO / "README.md").read_text()
    assert "could not be run" in text and "kyverno test" in text


def test_cli_test_manifests_name_existing_files() -> None:
    for t in sorted((KYVERNO / "tests").rglob("kyverno-test.yaml")):
        doc = yaml.safe_load(t.read_text())
        for rel in [*doc["policies"], *doc["resources"], *([doc["variables"]] if "variables" in doc else [])]:
            assert (t.parent / rel).exists(), f"{t}: {rel}"
        for res in doc["results"]:
            assert res["policy"] in POLICIES
            assert any(r["name"] == res["rule"] for r in POLICIES[res["policy"]]["spec"]["rules"])


def _cli_case(t: Path) -> list[tuple[str, str, Obj, str, Obj | None, dict[Any, Obj], dict[str, Obj]]]:
    """What one kyverno-test.yaml expects, in this engine's terms (requests are CREATE, as the CLI assumes)."""
    doc = yaml.safe_load(t.read_text())
    objs = [o for rel in doc["resources"] for o in yaml.safe_load_all((t.parent / rel).read_text())]
    cms = {(o["metadata"]["namespace"], o["metadata"]["name"]): o for o in objs if o["kind"] == "ConfigMap"}
    values = yaml.safe_load((t.parent / doc["variables"]).read_text()) if "variables" in doc else {}
    extra: dict[str, list[str]] = {}
    username = "alice"
    if "userinfo" in doc:
        ui = yaml.safe_load((t.parent / doc["userinfo"]).read_text())["userInfo"]
        username, extra = ui["username"], ui.get("extra", {})
    api: dict[str, Obj] = {}
    for pol in values.get("policies", []):
        for r in pol.get("rules", []):
            if "contracts.data" in r["values"]:
                cms[("sco-system", "sco-contracts")] = {"data": r["values"]["contracts.data"]}
        for res in pol.get("resources", []):
            v = res["values"]
            api[f"/api/v1/namespaces/{v['request.namespace']}/pods/{v['request.name']}"] = {
                "spec": {"nodeName": v["podNode"]}
            }
    out = []
    for res in doc["results"]:
        patched = None
        if "patchedResources" in res:
            patched = yaml.safe_load((t.parent / res["patchedResources"]).read_text())
        for name in res["resources"]:
            obj = next(o for o in objs if o["metadata"]["name"] == name and o["kind"] == res["kind"])
            req = request("CREATE", obj, username=username, extra=extra)
            out.append((res["policy"], res["rule"], req, res["result"], patched, cms, api))
    return out


CLI_CASES = [c for t in sorted((KYVERNO / "tests").rglob("kyverno-test.yaml")) for c in _cli_case(t)]


@pytest.mark.parametrize(("policy", "rule_name", "req", "want", "patched", "cms", "api"), CLI_CASES)
def test_cli_manifests_expect_what_the_policies_do(
    policy: str, rule_name: str, req: Obj, want: str, patched: Obj | None, cms: Any, api: Any
) -> None:
    res = apply_rule(rule(POLICIES, policy, rule_name), req, configmaps=cms, api=api)
    assert res.status == want, res
    if patched is not None:
        # the CLI compares the resource after every rule of the policy
        obj = req["object"]
        for r in POLICIES[policy]["spec"]["rules"]:
            step = apply_rule(r, request("CREATE", obj), configmaps=cms, api=api)
            if step.patched is not None:
                obj = step.patched
        assert obj == patched
