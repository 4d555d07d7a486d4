"""The Kubernetes API stand-in, driven by the official ``kubernetes`` client unchanged.

Responses are deserialised into the client's own models, so a shape the real API would not send fails here.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from sco_devkit.standins.kube_apiserver import PRESTOP_ANNOTATION, SHUTDOWN_ANNOTATION, KubeApiStandIn


@pytest.fixture
def api() -> Iterator[tuple[KubeApiStandIn, client.CoreV1Api, client.PolicyV1Api]]:
    srv = KubeApiStandIn().start()
    cfg = client.Configuration()
    cfg.host = srv.url
    cfg.api_key = {"authorization": "Bearer test"}
    cli = client.ApiClient(cfg)
    yield srv, client.CoreV1Api(cli), client.PolicyV1Api(cli)
    cli.close()
    srv.stop()


def pod(
    name: str,
    node: str = "n1",
    labels: dict[str, str] | None = None,
    grace: int = 30,
    annotations: dict[str, str] | None = None,
) -> client.V1Pod:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, labels=labels or {"app": "web"}, annotations=annotations),
        spec=client.V1PodSpec(
            node_name=node, termination_grace_period_seconds=grace, containers=[client.V1Container(name="c", image="x")]
        ),
    )


def test_nodes_taint_and_cordon_with_official_client(api) -> None:  # type: ignore[no-untyped-def]
    srv, core, _ = api
    srv.cluster.add_node("n1", {"role": "spot"})
    nodes = core.list_node(label_selector="role=spot")
    assert [n.metadata.name for n in nodes.items] == ["n1"]
    patched = core.patch_node(
        "n1", {"spec": {"unschedulable": True, "taints": [{"key": "sco.dev/reclaim", "effect": "NoSchedule"}]}}
    )
    assert patched.spec.unschedulable is True
    assert patched.spec.taints[0].key == "sco.dev/reclaim"
    # spec.taints is atomic under strategic merge (the client's default for dict bodies), as upstream:
    # a patch naming one taint replaces the whole list
    core.patch_node("n1", {"spec": {"taints": [{"key": "other", "effect": "NoExecute"}]}})
    assert [t.key for t in core.read_node("n1").spec.taints] == ["other"]
    with pytest.raises(ApiException) as e:
        core.read_node("nope")
    assert e.value.status == 404


def test_pods_field_and_label_selectors(api) -> None:  # type: ignore[no-untyped-def]
    _srv, core, _ = api
    core.create_namespaced_pod("a", pod("p1", "n1", {"app": "web", "tier": "x"}))
    core.create_namespaced_pod("a", pod("p2", "n2"))
    core.create_namespaced_pod("b", pod("p3", "n1", {"app": "db"}))
    on_n1 = core.list_pod_for_all_namespaces(field_selector="spec.nodeName=n1")
    assert sorted(p.metadata.name for p in on_n1.items) == ["p1", "p3"]
    assert [p.metadata.name for p in core.list_namespaced_pod("a", label_selector="app=web,tier in (x,y)").items] == [
        "p1"
    ]
    assert [p.metadata.name for p in core.list_namespaced_pod("a", label_selector="app!=web").items] == []
    assert core.read_namespaced_pod("p3", "b").status.phase == "Running"


def test_eviction_201_429_404_and_disruption_target(api) -> None:  # type: ignore[no-untyped-def]
    _srv, core, policy = api
    core.create_namespaced_pod("a", pod("p1", grace=1, labels={"app": "web"}, annotations={PRESTOP_ANNOTATION: "0.5"}))
    core.create_namespaced_pod("a", pod("p2", grace=1, labels={"app": "web"}))
    policy.create_namespaced_pod_disruption_budget(
        "a",
        client.V1PodDisruptionBudget(
            metadata=client.V1ObjectMeta(name="web"),
            spec=client.V1PodDisruptionBudgetSpec(
                min_available=1, selector=client.V1LabelSelector(match_labels={"app": "web"})
            ),
        ),
    )
    assert policy.read_namespaced_pod_disruption_budget("web", "a").status.disruptions_allowed == 1
    ev = client.V1Eviction(
        metadata=client.V1ObjectMeta(name="p1", namespace="a"),
        delete_options=client.V1DeleteOptions(grace_period_seconds=1),
    )
    core.create_namespaced_pod_eviction("p1", "a", ev)  # 201
    p1 = core.read_namespaced_pod("p1", "a")
    assert p1.metadata.deletion_timestamp is not None and p1.metadata.deletion_grace_period_seconds == 1
    assert any(c.type == "DisruptionTarget" and c.reason == "EvictionByEvictionAPI" for c in p1.status.conditions)
    with pytest.raises(ApiException) as e:
        core.create_namespaced_pod_eviction(
            "p2", "a", client.V1Eviction(metadata=client.V1ObjectMeta(name="p2", namespace="a"))
        )
    assert e.value.status == 429 and "disruption budget" in e.value.body
    with pytest.raises(ApiException) as e:
        core.create_namespaced_pod_eviction(
            "nope", "a", client.V1Eviction(metadata=client.V1ObjectMeta(name="nope", namespace="a"))
        )
    assert e.value.status == 404
    # p1 exits at its 1 s grace (no preStop), then is gone
    deadline = time.time() + 5
    while time.time() < deadline and any(p.metadata.name == "p1" for p in core.list_namespaced_pod("a").items):
        time.sleep(0.05)
    assert [p.metadata.name for p in core.list_namespaced_pod("a").items] == ["p2"]


def test_delete_honours_grace_prestop_and_finalizers(api) -> None:  # type: ignore[no-untyped-def]
    _srv, core, _ = api
    core.create_namespaced_pod("a", pod("slow", grace=1, annotations={PRESTOP_ANNOTATION: "30"}))
    fin = pod("fin", grace=0)
    fin.metadata.finalizers = ["example.com/hold"]
    core.create_namespaced_pod("a", fin)
    t0 = time.time()
    core.delete_namespaced_pod("slow", "a")  # the pod's own grace: 1 s, though its preStop wants 30 s
    core.delete_namespaced_pod("fin", "a", grace_period_seconds=0)
    w = watch.Watch()
    gone_at = None
    for ev in w.stream(core.list_namespaced_pod, "a", timeout_seconds=5):
        if ev["type"] == "DELETED" and ev["object"].metadata.name == "slow":
            gone_at = time.time() - t0
            w.stop()
    assert gone_at is not None and 0.9 <= gone_at < 3
    stuck = core.read_namespaced_pod("fin", "a")
    assert stuck.metadata.deletion_timestamp is not None and stuck.status.phase == "Succeeded"
    core.patch_namespaced_pod("fin", "a", {"metadata": {"finalizers": None}})
    with pytest.raises(ApiException) as e:
        core.read_namespaced_pod("fin", "a")
    assert e.value.status == 404


def test_watch_streams_added_modified_deleted(api) -> None:  # type: ignore[no-untyped-def]
    _srv, core, _ = api
    seen: list[tuple[str, str]] = []

    def watcher() -> None:
        w = watch.Watch()
        for ev in w.stream(core.list_pod_for_all_namespaces, field_selector="spec.nodeName=n1", timeout_seconds=5):
            seen.append((ev["type"], ev["object"].metadata.name))
            if ev["type"] == "DELETED":
                w.stop()

    t = threading.Thread(target=watcher)
    t.start()
    time.sleep(0.3)
    core.create_namespaced_pod("a", pod("w1", grace=0))
    core.create_namespaced_pod("a", pod("other", node="n2"))
    core.delete_namespaced_pod("w1", "a", grace_period_seconds=0)
    t.join(10)
    assert ("ADDED", "w1") in seen and ("DELETED", "w1") in seen
    assert all(name == "w1" for _, name in seen)


# --- strictness: what a real 1.30 API server does that hurts a client -----------------------------


def _client(url: str, token: str | None = None, ca: str | None = None) -> client.ApiClient:
    cfg = client.Configuration()
    cfg.host = url
    if token:
        cfg.api_key = {"authorization": f"Bearer {token}"}
    if ca:
        cfg.ssl_ca_cert = ca
    return client.ApiClient(cfg)


def _status(e: pytest.ExceptionInfo[ApiException]) -> dict:  # type: ignore[type-arg]
    return json.loads(e.value.body)


def test_taint_keys_and_values_are_validated_422(api) -> None:  # type: ignore[no-untyped-def]
    srv, core, _ = api
    srv.cluster.add_node("n1")
    for taint, fld in [
        ({"key": "sco.dev/reclaim", "value": "notice:2026-11-29T14:00:00Z", "effect": "NoSchedule"}, "value"),
        ({"key": "sco.dev/reclaim", "value": "x" * 64, "effect": "NoSchedule"}, "value"),
        ({"key": "bad key", "effect": "NoSchedule"}, "key"),
        ({"key": "Upper.Case/x", "effect": "NoSchedule"}, "key"),
        ({"key": "k", "effect": "Sometimes"}, "effect"),
    ]:
        with pytest.raises(ApiException) as e:
            core.patch_node("n1", {"spec": {"taints": [taint]}})
        assert e.value.status == 422, taint
        assert _status(e)["details"]["causes"][0]["field"] == f"spec.taints[0].{fld}"
    with pytest.raises(ApiException) as e:  # duplicate key and effect
        core.patch_node("n1", {"spec": {"taints": [{"key": "k", "effect": "NoSchedule"}] * 2}})
    assert e.value.status == 422
    assert not core.read_node("n1").spec.taints  # nothing was stored
    ok = {"key": "sco.dev/reclaim", "value": "n-3f2a9c_x.1", "effect": "NoSchedule"}
    assert core.patch_node("n1", {"spec": {"taints": [ok]}}).spec.taints[0].value == "n-3f2a9c_x.1"


def test_grace_zero_removes_the_object_while_containers_run(api) -> None:  # type: ignore[no-untyped-def]
    srv, core, _ = api
    core.create_namespaced_pod("a", pod("g", grace=3, annotations={PRESTOP_ANNOTATION: "30"}))
    uid = core.read_namespaced_pod("g", "a").metadata.uid
    core.delete_namespaced_pod("g", "a", grace_period_seconds=0)
    with pytest.raises(ApiException) as e:
        core.read_namespaced_pod("g", "a")
    assert e.value.status == 404  # gone from the API at once...
    ghosts = srv.cluster.ghosts()
    assert [(g["name"], g["uid"]) for g in ghosts] == [("g", uid)]  # ...while kubelet still runs it
    assert 2 < ghosts[0]["exits_in_s"] <= 3  # up to the pod's own grace
    deadline = time.time() + 6
    while srv.cluster.ghosts() and time.time() < deadline:
        time.sleep(0.05)
    assert not srv.cluster.ghosts()


def test_kubelet_gives_two_seconds_after_the_grace(api) -> None:  # type: ignore[no-untyped-def]
    _srv, core, _ = api
    # preStop eats the whole 1 s grace; the container still gets kubelet's 2 s minimum after TERM
    core.create_namespaced_pod(
        "a", pod("p", grace=30, annotations={PRESTOP_ANNOTATION: "10", SHUTDOWN_ANNOTATION: "1.5"})
    )
    t0 = time.time()
    core.delete_namespaced_pod("p", "a", grace_period_seconds=1)
    gone = _wait_gone(core, "a", "p", 6)
    assert 2.3 <= gone - t0 < 3.5  # 1 s preStop (cut at the grace) + 1.5 s shutdown, inside the 2 s minimum


def _wait_gone(core: client.CoreV1Api, ns: str, name: str, timeout: float) -> float:
    end = time.time() + timeout
    while time.time() < end:
        try:
            core.read_namespaced_pod(name, ns)
        except ApiException as e:
            if e.status == 404:
                return time.time()
            raise
        time.sleep(0.02)
    raise AssertionError(f"{ns}/{name} still there after {timeout} s")


def test_a_second_delete_shortens_a_running_termination(api) -> None:  # type: ignore[no-untyped-def]
    _srv, core, _ = api
    core.create_namespaced_pod("a", pod("p", grace=30, annotations={PRESTOP_ANNOTATION: "60"}))
    t0 = time.time()
    core.delete_namespaced_pod("p", "a", grace_period_seconds=20)
    core.delete_namespaced_pod("p", "a", grace_period_seconds=30)  # longer: ignored
    assert core.read_namespaced_pod("p", "a").metadata.deletion_grace_period_seconds == 20
    core.delete_namespaced_pod("p", "a", grace_period_seconds=1)
    assert _wait_gone(core, "a", "p", 6) - t0 < 3.5


def test_delete_and_evict_preconditions_409(api) -> None:  # type: ignore[no-untyped-def]
    _srv, core, _ = api
    core.create_namespaced_pod("a", pod("p", grace=1, annotations={PRESTOP_ANNOTATION: "5"}))
    live = core.read_namespaced_pod("p", "a").metadata
    for opts in (
        client.V1DeleteOptions(preconditions=client.V1Preconditions(uid="not-the-uid")),
        client.V1DeleteOptions(preconditions=client.V1Preconditions(resource_version="999999")),
    ):
        with pytest.raises(ApiException) as e:
            core.delete_namespaced_pod("p", "a", body=opts)
        assert e.value.status == 409 and "Precondition failed" in _status(e)["message"]
        with pytest.raises(ApiException) as e:
            core.create_namespaced_pod_eviction(
                "p", "a", client.V1Eviction(metadata=client.V1ObjectMeta(name="p", namespace="a"), delete_options=opts)
            )
        assert e.value.status == 409
    assert core.read_namespaced_pod("p", "a").metadata.deletion_timestamp is None
    ok = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=live.uid), grace_period_seconds=1)
    core.delete_namespaced_pod("p", "a", body=ok)
    assert core.read_namespaced_pod("p", "a").metadata.deletion_timestamp is not None


def _pdb(
    policy: client.PolicyV1Api, ns: str, name: str, selector: client.V1LabelSelector | None, **spec: object
) -> None:
    policy.create_namespaced_pod_disruption_budget(
        ns,
        client.V1PodDisruptionBudget(
            metadata=client.V1ObjectMeta(name=name), spec=client.V1PodDisruptionBudgetSpec(selector=selector, **spec)
        ),
    )


def _evict(core: client.CoreV1Api, ns: str, name: str, grace: int | None = None) -> None:
    opts = client.V1DeleteOptions(grace_period_seconds=grace) if grace is not None else None
    core.create_namespaced_pod_eviction(
        name, ns, client.V1Eviction(metadata=client.V1ObjectMeta(name=name, namespace=ns), delete_options=opts)
    )


def test_pdb_selectors_empty_and_match_expressions_and_percentages(api) -> None:  # type: ignore[no-untyped-def]
    _srv, core, policy = api
    for i in range(4):
        core.create_namespaced_pod("all", pod(f"p{i}", labels={"app": f"x{i}"}))
    _pdb(policy, "all", "every", client.V1LabelSelector(), min_available="50%")  # {}: every pod of the ns
    st = policy.read_namespaced_pod_disruption_budget("every", "all").status
    assert (st.expected_pods, st.desired_healthy, st.disruptions_allowed) == (4, 2, 2)
    for i in range(4):
        core.create_namespaced_pod(  # a long preStop: evicted pods stay (terminating) and count as expected
            "expr", pod(f"q{i}", labels={"tier": "db" if i < 3 else "web"}, annotations={PRESTOP_ANNOTATION: "30"})
        )
    sel = client.V1LabelSelector(
        match_expressions=[client.V1LabelSelectorRequirement(key="tier", operator="In", values=["db"])]
    )
    _pdb(policy, "expr", "db", sel, max_unavailable="34%")  # ceil(0.34 * 3) = 2 may go
    st = policy.read_namespaced_pod_disruption_budget("db", "expr").status
    assert (st.expected_pods, st.desired_healthy, st.disruptions_allowed) == (3, 1, 2)
    _pdb(policy, "none", "nil", None, min_available=1)  # no selector: selects nothing
    core.create_namespaced_pod("none", pod("free"))
    assert policy.read_namespaced_pod_disruption_budget("nil", "none").status.expected_pods == 0
    _evict(core, "none", "free")  # no PDB applies
    _evict(core, "expr", "q0")
    _evict(core, "expr", "q1")
    with pytest.raises(ApiException) as e:
        _evict(core, "expr", "q2")
    assert e.value.status == 429
    _evict(core, "expr", "q3")  # tier=web: outside the selector


def test_stale_pdb_gives_429_with_retry_after_10(api) -> None:  # type: ignore[no-untyped-def]
    srv, core, policy = api
    srv.cluster.pdb_observe_delay_s = 30
    core.create_namespaced_pod("a", pod("p1"))
    core.create_namespaced_pod("a", pod("p2"))
    _pdb(policy, "a", "web", client.V1LabelSelector(match_labels={"app": "web"}), max_unavailable=1)
    with pytest.raises(ApiException) as e:
        _evict(core, "a", "p1")
    assert e.value.status == 429 and e.value.headers["Retry-After"] == "10"
    assert "still being processed" in _status(e)["details"]["causes"][0]["message"]


def test_evicting_a_terminating_pod_deletes_it_without_pdb_check(api) -> None:  # type: ignore[no-untyped-def]
    _srv, core, policy = api
    core.create_namespaced_pod("a", pod("p", grace=30, annotations={PRESTOP_ANNOTATION: "60"}))
    _pdb(policy, "a", "never", client.V1LabelSelector(), min_available="100%")
    with pytest.raises(ApiException) as e:
        _evict(core, "a", "p")
    assert e.value.status == 429
    t0 = time.time()
    core.delete_namespaced_pod("p", "a", grace_period_seconds=30)
    _evict(core, "a", "p", grace=1)  # no PDB check now, and the grace is shortened
    assert core.read_namespaced_pod("p", "a").metadata.deletion_grace_period_seconds == 1
    assert _wait_gone(core, "a", "p", 6) - t0 < 3.5


def test_list_limit_and_continue(api) -> None:  # type: ignore[no-untyped-def]
    _srv, core, _ = api
    for i in range(7):
        core.create_namespaced_pod("a", pod(f"p{i}"))
    names, token, pages = [], None, 0
    while True:
        page = core.list_pod_for_all_namespaces(limit=3, _continue=token, field_selector="spec.nodeName=n1")
        names += [p.metadata.name for p in page.items]
        pages += 1
        token = page.metadata._continue
        if not token:
            break
        assert page.metadata.remaining_item_count == 7 - len(names)
    assert names == [f"p{i}" for i in range(7)] and pages == 3


def test_unsupported_field_selector_is_400(api) -> None:  # type: ignore[no-untyped-def]
    _srv, core, _ = api
    with pytest.raises(ApiException) as e:
        core.list_pod_for_all_namespaces(field_selector="spec.nodename=n1")  # a typo must not select nothing
    assert e.value.status == 400 and "field label not supported: spec.nodename" in _status(e)["message"]
    core.list_pod_for_all_namespaces(field_selector="spec.nodeName=n1,status.phase!=Succeeded")


def test_watch_resumes_gets_410_after_compaction_and_bookmarks(api) -> None:  # type: ignore[no-untyped-def]
    srv, core, _ = api
    srv.bookmark_interval_s = 0.3
    core.create_namespaced_pod("a", pod("p1"))
    rv = core.list_namespaced_pod("a").metadata.resource_version
    core.create_namespaced_pod("a", pod("p2"))
    # resuming from rv replays what happened since, then bookmarks with the latest resourceVersion
    w = watch.Watch()
    seen: list[str] = []
    for ev in w.stream(
        core.list_namespaced_pod, "a", resource_version=rv, allow_watch_bookmarks=True, timeout_seconds=3
    ):
        seen.append(ev["type"] if ev["type"] == "BOOKMARK" else f"{ev['type']}:{ev['object'].metadata.name}")
        if ev["type"] == "BOOKMARK":
            w.stop()
    assert seen == ["ADDED:p2", "BOOKMARK"]
    assert int(w.resource_version) >= int(rv)
    srv.cluster.compact()
    core.create_namespaced_pod("a", pod("p3"))
    resp = core.list_namespaced_pod("a", watch=True, resource_version=rv, _preload_content=False, timeout_seconds=2)
    first = json.loads(resp.readline())
    resp.release_conn()
    assert first["type"] == "ERROR" and first["object"]["code"] == 410 and first["object"]["reason"] == "Expired"


def test_tls_and_bearer_tokens_with_a_node_bound_identity(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from sco_devkit.standins.kube_apiserver import NODE_NAME_EXTRA, Identity
    from tests.harness import make_tls

    ca, crt, key = make_tls(tmp_path)
    tokens = {
        "kubelet-n1": Identity("system:node:n1", ("system:nodes",)),
        "sa-n2": Identity("system:serviceaccount:sco:agent", extra=((NODE_NAME_EXTRA, ("n2",)),)),
        "no-patch": Identity("viewer", deny=("patch nodes",)),
    }
    srv = KubeApiStandIn(tokens=tokens, tls=(str(crt), str(key))).start()
    try:
        assert srv.url.startswith("https://")
        srv.cluster.add_node("n1")
        srv.cluster.add_node("n2")
        taint = {"spec": {"taints": [{"key": "sco.dev/reclaim", "effect": "NoSchedule"}]}}
        with _client(srv.url, None, str(ca)) as anon, pytest.raises(ApiException) as e:
            client.CoreV1Api(anon).read_node("n1")
        assert e.value.status == 401
        with _client(srv.url, "wrong", str(ca)) as bad, pytest.raises(ApiException) as e:
            client.CoreV1Api(bad).read_node("n1")
        assert e.value.status == 401
        with _client(srv.url, "kubelet-n1", str(ca)) as c1, _client(srv.url, "sa-n2", str(ca)) as c2:
            core1, core2 = client.CoreV1Api(c1), client.CoreV1Api(c2)
            core1.patch_node("n1", taint)  # its own node
            with pytest.raises(ApiException) as e:
                core1.patch_node("n2", taint)
            assert e.value.status == 403 and 'node "n1" is not allowed to modify node "n2"' in _status(e)["message"]
            core2.patch_node("n2", taint)  # a bound service-account token carries its node in extra
            srv.cluster.create_pod("a", {"metadata": {"name": "on-n1"}, "spec": {"nodeName": "n1"}})
            srv.cluster.create_pod("a", {"metadata": {"name": "on-n2"}, "spec": {"nodeName": "n2"}})
            with pytest.raises(ApiException) as e:
                _evict(core1, "a", "on-n2")
            assert e.value.status == 403
            with pytest.raises(ApiException) as e:
                core1.delete_namespaced_pod("on-n2", "a")
            assert e.value.status == 403
            _evict(core1, "a", "on-n1", grace=1)
            core2.delete_namespaced_pod("on-n2", "a", grace_period_seconds=1)
        with _client(srv.url, "no-patch", str(ca)) as c3:
            with pytest.raises(ApiException) as e:
                client.CoreV1Api(c3).patch_node("n1", taint)
            assert e.value.status == 403 and 'cannot patch resource "nodes"' in _status(e)["message"]
            assert client.CoreV1Api(c3).read_node("n1").metadata.name == "n1"
    finally:
        srv.stop()


def test_token_auth_file_in_upstream_csv(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from sco_devkit.standins.kube_apiserver import load_token_auth_file, load_tokens_json

    f = tmp_path / "tokens.csv"
    f.write_text('t1,system:node:n1,uid1,"system:nodes"\nt2,admin,uid2,"system:masters,extra"\n')
    ids = load_token_auth_file(str(f))
    assert ids["t1"].node == "n1" and ids["t2"].node is None and ids["t2"].groups == ("system:masters", "extra")
    j = tmp_path / "tokens.json"
    j.write_text(json.dumps({"t3": {"user": "sa", "extra": {"authentication.kubernetes.io/node-name": ["n7"]}}}))
    assert load_tokens_json(str(j))["t3"].node == "n7"


def test_token_request_with_the_official_client() -> None:
    """The official client's create_namespaced_service_account_token deserialises the stand-in's TokenRequest
    (spec.audiences is required in its model: the answer says the audiences issued, as upstream does)."""
    srv = KubeApiStandIn(tokens={}).start()
    try:
        srv.cluster.add_node("n1")
        uid = srv.cluster.nodes["n1"]["metadata"]["uid"]
        boot, _ = srv.issue_token("sco-system", "sco-agent", node="n1", seconds=60)
        cfg = client.Configuration()
        cfg.host = srv.url
        cfg.api_key = {"authorization": f"Bearer {boot}"}
        with client.ApiClient(cfg) as cli:
            core = client.CoreV1Api(cli)
            ref = client.V1BoundObjectReference(kind="Node", api_version="v1", name="n1", uid=uid)
            body = client.AuthenticationV1TokenRequest(
                spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=3600, bound_object_ref=ref)
            )
            out = core.create_namespaced_service_account_token("sco-agent", "sco-system", body)
            assert out.status.token in srv.issued and out.spec.audiences == srv.audiences
            assert out.status.expiration_timestamp.timestamp() == pytest.approx(time.time() + 3600, abs=5)
            with pytest.raises(ApiException) as e:
                body.spec.expiration_seconds = 60
                core.create_namespaced_service_account_token("sco-agent", "sco-system", body)
            assert e.value.status == 422 and "less than 10 minutes" in _status(e)["message"]
    finally:
        srv.stop()
