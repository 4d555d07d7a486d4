"""The Kubernetes API stand-in, driven by the official ``kubernetes`` client unchanged.

Responses are deserialised into the client's own models, so a shape the real API would not send fails here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from sco.standins.kube_apiserver import PRESTOP_ANNOTATION, KubeApiStandIn


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
    # strategic merge (the client's default for dict bodies) merges taints by key
    core.patch_node("n1", {"spec": {"taints": [{"key": "other", "effect": "NoExecute"}]}})
    assert {t.key for t in core.read_node("n1").spec.taints} == {"sco.dev/reclaim", "other"}
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
