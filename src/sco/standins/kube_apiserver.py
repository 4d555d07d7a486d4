"""STAND-IN for the Kubernetes API server (core/v1 and policy/v1, following Kubernetes 1.30 semantics).

No kube-apiserver can run on the project's machines, so the tests and the demo run this instead: a real HTTP
server speaking the same JSON protocol for the part of the API the node agent and the control plane use.
The official ``kubernetes`` Python client works against it unchanged (``tests/test_kube_standin.py``).

Implemented:
- nodes: list, get, patch (merge, strategic-merge with taints merged by key, JSON patch), with
  ``metadata.resourceVersion`` optimistic concurrency (409 Conflict);
- pods: create, list (all namespaces or one, ``fieldSelector`` on spec.nodeName / metadata.name /
  metadata.namespace / status.phase, ``labelSelector`` with =, ==, !=, in, notin, exists, !exists),
  get, patch (to clear finalizers), delete with ``gracePeriodSeconds`` (query or DeleteOptions), and watch
  (``?watch=true``: ADDED/MODIFIED/DELETED lines, chunked);
- the Eviction subresource (policy/v1) with PodDisruptionBudget semantics: 201 Created when allowed,
  429 TooManyRequests with a DisruptionBudget cause when not, 404 NotFound for a missing pod,
  500 when more than one PDB selects the pod (as the real server);
- poddisruptionbudgets (policy/v1): create, list, get, delete; status.disruptionsAllowed computed live;
- configmaps: create, list, get, replace (PUT, resourceVersion required, 409 on a stale one), delete; keys and
  the 1 MiB size validated (422) as the real server does;
- a kubelet-like termination for every pod bound to a node: on delete or eviction, ``deletionTimestamp``
  and ``deletionGracePeriodSeconds`` are set, the preStop hook runs for the pod's
  ``standin.sco.dev/prestop-seconds`` annotation, the container then takes
  ``standin.sco.dev/shutdown-seconds`` to exit, and the pod is killed at its grace period if it takes
  longer; finalizers keep a terminated pod until they are cleared. Evicted pods get the
  ``DisruptionTarget`` condition (reason EvictionByEvictionAPI).

Not implemented: authentication and authorisation (any bearer token is accepted), other resources,
server-side apply, protobuf, field managers. ``/_standin/*`` endpoints are test hooks, not Kubernetes API.
"""

from __future__ import annotations

import copy
import heapq
import itertools
import json
import queue
import re
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

API_VERSION_FOLLOWED = "1.30"
PRESTOP_ANNOTATION = "standin.sco.dev/prestop-seconds"
SHUTDOWN_ANNOTATION = "standin.sco.dev/shutdown-seconds"

Obj = dict[str, Any]


def _now_iso(t: float | None = None) -> str:
    return datetime.fromtimestamp(time.time() if t is None else t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def status_obj(code: int, reason: str, message: str, details: Obj | None = None) -> Obj:
    out: Obj = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success" if code < 400 else "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details:
        out["details"] = details
    return out


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, details: Obj | None = None) -> None:
        super().__init__(message)
        self.status = status_obj(code, reason, message, details)
        self.code = code


# --- selectors ------------------------------------------------------------------------------------

_SET_RE = re.compile(r"^\s*([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _split_selector(sel: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in sel:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return parts


def _label_test(term: str) -> Callable[[dict[str, str]], bool]:
    m = _SET_RE.match(term)
    if m:
        key, op = m.group(1), m.group(2)
        values = {v.strip() for v in m.group(3).split(",") if v.strip()}
        return (lambda lb: lb.get(key) in values) if op == "in" else (lambda lb: lb.get(key) not in values)
    if "!=" in term:
        k, v = (x.strip() for x in term.split("!=", 1))
        return lambda lb: lb.get(k) != v
    if "=" in term:
        k, v = (x.strip() for x in re.split("==?", term, maxsplit=1))
        return lambda lb: lb.get(k) == v
    if term.startswith("!"):
        absent = term[1:].strip()
        return lambda lb: absent not in lb
    return lambda lb: term in lb


def label_matcher(sel: str | None) -> Callable[[dict[str, str]], bool]:
    tests = [_label_test(t.strip()) for t in _split_selector(sel or "")]
    return lambda labels: all(t(labels) for t in tests)


def _field(obj: Obj, path: str) -> str:
    cur: Any = obj
    for part in path.split("."):
        cur = cur.get(part) if isinstance(cur, dict) else None
    return "" if cur is None else str(cur)


def _field_test(term: str) -> Callable[[Obj], bool]:
    negate = "!=" in term
    k, v = (x.strip() for x in (term.split("!=", 1) if negate else re.split("==?", term, maxsplit=1)))
    return (lambda o: _field(o, k) != v) if negate else (lambda o: _field(o, k) == v)


def field_matcher(sel: str | None) -> Callable[[Obj], bool]:
    tests = [_field_test(t) for t in (sel or "").split(",") if t.strip()]
    return lambda obj: all(t(obj) for t in tests)


# --- patches --------------------------------------------------------------------------------------


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


_MERGE_KEYS = {"taints": "key", "conditions": "type", "containers": "name", "ownerReferences": "uid"}


def strategic_merge_patch(target: Any, patch: Any, field: str = "") -> Any:
    """Strategic merge patch for the lists this stand-in serves (merged by their patchMergeKey)."""
    if isinstance(patch, list) and field in _MERGE_KEYS and isinstance(target, list):
        key = _MERGE_KEYS[field]
        items = [copy.deepcopy(x) for x in target]
        for item in patch:
            if isinstance(item, dict) and item.get("$patch") == "delete":
                items = [x for x in items if x.get(key) != item.get(key)]
                continue
            for i, x in enumerate(items):
                if x.get(key) == item.get(key):
                    items[i] = strategic_merge_patch(x, item)
                    break
            else:
                items.append(copy.deepcopy(item))
        return items
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if k.startswith("$"):
            continue
        if v is None:
            out.pop(k, None)
        else:
            out[k] = strategic_merge_patch(out.get(k), v, k)
    return out


def json_patch(target: Obj, ops: list[Obj]) -> Obj:
    """RFC 6902 JSON patch: add, remove, replace, test."""
    doc = copy.deepcopy(target)
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")]
        parent: Any = doc
        for p in parts[:-1]:
            parent = parent[int(p)] if isinstance(parent, list) else parent.setdefault(p, {})
        last = parts[-1]
        kind = op["op"]
        if kind == "test":
            cur = parent[int(last)] if isinstance(parent, list) else parent.get(last)
            if cur != op.get("value"):
                raise ApiError(422, "Invalid", f"test operation failed at {op['path']}")
        elif kind in ("add", "replace"):
            if isinstance(parent, list):
                if last == "-":
                    parent.append(op["value"])
                elif kind == "add":
                    parent.insert(int(last), op["value"])
                else:
                    parent[int(last)] = op["value"]
            else:
                parent[last] = op["value"]
        elif kind == "remove":
            if isinstance(parent, list):
                del parent[int(last)]
            else:
                parent.pop(last, None)
        else:
            raise ApiError(422, "Invalid", f"unsupported JSON patch op {kind!r}")
    return doc


def apply_patch(obj: Obj, content_type: str, body: Any) -> Obj:
    """The patch kind the Content-Type names: JSON patch, strategic merge patch, or JSON merge patch."""
    if "json-patch" in content_type:
        return json_patch(obj, body)
    out: Obj = strategic_merge_patch(obj, body) if "strategic" in content_type else merge_patch(obj, body)
    return out


# --- the store ------------------------------------------------------------------------------------


class Cluster:
    """State of the stand-in cluster; every mutation goes through here under one lock."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._rv = itertools.count(1)
        self.nodes: dict[str, Obj] = {}
        self.pods: dict[tuple[str, str], Obj] = {}
        self.pdbs: dict[tuple[str, str], Obj] = {}
        self.configmaps: dict[tuple[str, str], Obj] = {}  # (namespace, name); see the ConfigMap section
        self.watchers: list[tuple[Callable[[Obj], bool], queue.Queue[Obj | None]]] = []
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._wake = threading.Condition(self.lock)
        self.audit: list[Obj] = []  # (time, verb, object) of mutations, for tests and benchmarks
        self._stop = False
        self._thread = threading.Thread(target=self._run_timers, name="standin-kubelet", daemon=True)
        self._thread.start()

    # timers: the "kubelet" side
    def _after(self, delay: float, fn: Callable[[], None]) -> None:
        with self.lock:
            heapq.heappush(self._timers, (time.monotonic() + max(0.0, delay), next(self._seq), fn))
            self._wake.notify()

    def _run_timers(self) -> None:
        with self.lock:
            while not self._stop:
                if not self._timers:
                    self._wake.wait(0.5)
                    continue
                due, _, fn = self._timers[0]
                now = time.monotonic()
                if due > now:
                    self._wake.wait(due - now)
                    continue
                heapq.heappop(self._timers)
                fn()

    def stop(self) -> None:
        with self.lock:
            self._stop = True
            self._wake.notify()
            for _, q in self.watchers:
                q.put(None)

    def rv(self) -> str:
        return str(next(self._rv))

    def _record(self, verb: str, obj: Obj, **extra: Any) -> None:
        self.audit.append(
            {"at": time.time(), "verb": verb, "kind": obj.get("kind"), "name": obj["metadata"]["name"], **extra}
        )

    def _notify(self, etype: str, obj: Obj) -> None:
        for match, q in list(self.watchers):
            if match(obj):
                q.put({"type": etype, "object": copy.deepcopy(obj)})

    # nodes
    def add_node(self, name: str, labels: dict[str, str] | None = None) -> Obj:
        with self.lock:
            node: Obj = {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "uid": str(uuid.uuid4()),
                    "labels": labels or {},
                    "resourceVersion": self.rv(),
                    "creationTimestamp": _now_iso(),
                },
                "spec": {},
                "status": {
                    "conditions": [
                        {
                            "type": "Ready",
                            "status": "True",
                            "lastHeartbeatTime": _now_iso(),
                            "lastTransitionTime": _now_iso(),
                            "reason": "KubeletReady",
                            "message": "stand-in kubelet is posting ready status",
                        }
                    ]
                },
            }
            self.nodes[name] = node
            self._record("create", node)
            return copy.deepcopy(node)

    def get_node(self, name: str) -> Obj:
        with self.lock:
            node = self.nodes.get(name)
            if node is None:
                raise ApiError(404, "NotFound", f'nodes "{name}" not found', {"name": name, "kind": "nodes"})
            return copy.deepcopy(node)

    def patch_node(self, name: str, ctype: str, body: Any) -> Obj:
        with self.lock:
            node = self.get_node(name)
            new = apply_patch(node, ctype, body)
            want_rv = (body.get("metadata") or {}).get("resourceVersion") if isinstance(body, dict) else None
            if want_rv is not None and want_rv != node["metadata"]["resourceVersion"]:
                raise ApiError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on nodes "{name}": the object '
                    "has been modified; please apply your changes to the latest version and try again",
                )
            new["metadata"]["resourceVersion"] = self.rv()
            self.nodes[name] = new
            self._record(
                "patch",
                new,
                taints=copy.deepcopy(new["spec"].get("taints", [])),
                unschedulable=new["spec"].get("unschedulable", False),
            )
            return copy.deepcopy(new)

    # pods
    def create_pod(self, ns: str, pod: Obj) -> Obj:
        with self.lock:
            pod = copy.deepcopy(pod)
            pod.setdefault("apiVersion", "v1")
            pod.setdefault("kind", "Pod")
            md = pod.setdefault("metadata", {})
            md["namespace"] = ns
            if "name" not in md:
                md["name"] = md.get("generateName", "pod-") + uuid.uuid4().hex[:5]
            key = (ns, md["name"])
            if key in self.pods:
                raise ApiError(409, "AlreadyExists", f'pods "{md["name"]}" already exists')
            md["uid"] = str(uuid.uuid4())
            md["resourceVersion"] = self.rv()
            md["creationTimestamp"] = _now_iso()
            md.setdefault("labels", {})
            spec = pod.setdefault("spec", {})
            spec.setdefault("terminationGracePeriodSeconds", 30)
            spec.setdefault("containers", [{"name": "main", "image": "standin"}])
            running = bool(spec.get("nodeName"))
            pod["status"] = {
                "phase": "Running" if running else "Pending",
                "conditions": [
                    {"type": "Ready", "status": "True" if running else "False", "lastTransitionTime": _now_iso()}
                ],
                "startTime": _now_iso(),
            }
            self.pods[key] = pod
            self._record("create", pod)
            self._notify("ADDED", pod)
            return copy.deepcopy(pod)

    def get_pod(self, ns: str, name: str) -> Obj:
        with self.lock:
            pod = self.pods.get((ns, name))
            if pod is None:
                raise ApiError(404, "NotFound", f'pods "{name}" not found', {"name": name, "kind": "pods"})
            return copy.deepcopy(pod)

    def list_pods(self, ns: str | None, labels: str | None, fields: str | None) -> list[Obj]:
        lm, fm = label_matcher(labels), field_matcher(fields)
        with self.lock:
            return [
                copy.deepcopy(p)
                for (pns, _), p in sorted(self.pods.items())
                if (ns is None or pns == ns) and lm(p["metadata"].get("labels", {})) and fm(p)
            ]

    def patch_pod(self, ns: str, name: str, ctype: str, body: Any) -> Obj:
        with self.lock:
            pod = self.get_pod(ns, name)
            new = apply_patch(pod, ctype, body)
            new["metadata"]["resourceVersion"] = self.rv()
            self.pods[(ns, name)] = new
            self._notify("MODIFIED", new)
            if (
                new["metadata"].get("deletionTimestamp")
                and not new["metadata"].get("finalizers")
                and new["status"].get("phase") in ("Succeeded", "Failed")
            ):
                self._remove(ns, name)
            return copy.deepcopy(new)

    def _healthy(self, p: Obj) -> bool:
        return p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")

    def pdb_status(self, pdb: Obj) -> Obj:
        ns = pdb["metadata"]["namespace"]
        match = label_matcher(
            ",".join(f"{k}={v}" for k, v in (pdb["spec"].get("selector", {}).get("matchLabels") or {}).items())
        )
        pods = [p for (pns, _), p in self.pods.items() if pns == ns and match(p["metadata"].get("labels", {}))]
        healthy = sum(1 for p in pods if self._healthy(p))
        spec = pdb["spec"]
        if "minAvailable" in spec:
            desired = int(spec["minAvailable"])
        else:
            desired = max(0, len(pods) - int(spec.get("maxUnavailable", 0)))
        return {
            "currentHealthy": healthy,
            "desiredHealthy": desired,
            "expectedPods": len(pods),
            "disruptionsAllowed": max(0, healthy - desired),
            "observedGeneration": 1,
        }

    def _pdbs_for(self, pod: Obj) -> list[Obj]:
        labels = pod["metadata"].get("labels", {})
        out = []
        for (ns, _), pdb in sorted(self.pdbs.items()):
            ml = (pdb["spec"].get("selector") or {}).get("matchLabels") or {}
            if ns == pod["metadata"]["namespace"] and ml and all(labels.get(k) == v for k, v in ml.items()):
                out.append(pdb)
        return out

    def evict(self, ns: str, name: str, body: Obj) -> Obj:
        with self.lock:
            pod = self.get_pod(ns, name)
            grace = (body.get("deleteOptions") or {}).get("gracePeriodSeconds")
            if pod["metadata"].get("deletionTimestamp"):
                # Already terminating: the real server lets the eviction through without a PDB check.
                self._record("evict", pod, grace=grace, already_terminating=True)
                return status_obj(201, "", "")
            pdbs = self._pdbs_for(pod)
            if len(pdbs) > 1:
                raise ApiError(
                    500,
                    "InternalError",
                    "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support.",
                )
            if pdbs and self._healthy(pod):
                st = self.pdb_status(pdbs[0])
                if st["disruptionsAllowed"] <= 0:
                    self._record("evict-refused", pod, pdb=pdbs[0]["metadata"]["name"])
                    raise ApiError(
                        429,
                        "TooManyRequests",
                        "Cannot evict pod as it would violate the pod's disruption budget.",
                        {
                            "causes": [
                                {
                                    "reason": "DisruptionBudget",
                                    "message": f"The disruption budget {pdbs[0]['metadata']['name']} needs "
                                    f"{st['desiredHealthy']} healthy pods and has {st['currentHealthy']} "
                                    "currently",
                                }
                            ]
                        },
                    )
            conds = [c for c in pod["status"]["conditions"] if c["type"] != "DisruptionTarget"]
            conds.append(
                {
                    "type": "DisruptionTarget",
                    "status": "True",
                    "reason": "EvictionByEvictionAPI",
                    "message": "Eviction API: evicting",
                    "lastTransitionTime": _now_iso(),
                }
            )
            self.pods[(ns, name)]["status"]["conditions"] = conds
            self._record("evict", pod, grace=grace)
            self._delete(ns, name, grace)
            return status_obj(201, "", "")

    def delete_pod(self, ns: str, name: str, grace: int | None) -> Obj:
        """Returns the pod as it stands after the delete (as the real server does for a graceful delete)."""
        with self.lock:
            pod = self.pods.get((ns, name))
            if pod is None:
                self.get_pod(ns, name)  # raises the 404
            assert pod is not None
            self._record("delete", pod, grace=grace)
            self._delete(ns, name, grace)
            return copy.deepcopy(pod)

    def _delete(self, ns: str, name: str, grace: int | None) -> None:
        pod = self.pods[(ns, name)]
        md, spec = pod["metadata"], pod["spec"]
        g = int(spec.get("terminationGracePeriodSeconds", 30) if grace is None else grace)
        if md.get("deletionTimestamp") and g >= md.get("deletionGracePeriodSeconds", g):
            return  # a second delete may only shorten the grace period, as in the real server
        now = time.time()
        md["deletionTimestamp"] = _now_iso(now + g)
        md["deletionGracePeriodSeconds"] = g
        md["resourceVersion"] = self.rv()
        self._notify("MODIFIED", pod)
        if not spec.get("nodeName"):
            self._finish(ns, name, md["uid"], "Failed")
            return
        ann = md.get("annotations") or {}
        needs = float(ann.get(PRESTOP_ANNOTATION, 0)) + float(ann.get(SHUTDOWN_ANNOTATION, 0))
        exit_after = min(needs, g)  # killed at the grace period if preStop + shutdown take longer
        uid = md["uid"]
        token = md["resourceVersion"]
        self._after(exit_after, lambda: self._exit(ns, name, uid, token, killed=needs > g))

    def _exit(self, ns: str, name: str, uid: str, token: str, killed: bool) -> None:
        pod = self.pods.get((ns, name))
        if pod is None or pod["metadata"]["uid"] != uid:
            return
        if pod["metadata"].get("deletionGracePeriodSeconds") is None:
            return
        if killed:
            pod["metadata"].setdefault("annotations", {})["standin.sco.dev/killed-at-grace"] = "true"
        self._finish(ns, name, uid, "Failed" if killed else "Succeeded")

    def _finish(self, ns: str, name: str, uid: str, phase: str) -> None:
        pod = self.pods[(ns, name)]
        pod["status"]["phase"] = phase
        for c in pod["status"]["conditions"]:
            if c["type"] == "Ready":
                c["status"] = "False"
        pod["metadata"]["resourceVersion"] = self.rv()
        if pod["metadata"].get("finalizers"):
            self._notify("MODIFIED", pod)  # stays until its finalizers are cleared
            return
        self._remove(ns, name)

    def _remove(self, ns: str, name: str) -> None:
        pod = self.pods.pop((ns, name))
        pod["metadata"]["resourceVersion"] = self.rv()
        self._record("gone", pod)
        self._notify("DELETED", pod)

    # pdbs
    def create_pdb(self, ns: str, pdb: Obj) -> Obj:
        with self.lock:
            pdb = copy.deepcopy(pdb)
            pdb.setdefault("apiVersion", "policy/v1")
            pdb.setdefault("kind", "PodDisruptionBudget")
            md = pdb.setdefault("metadata", {})
            md["namespace"] = ns
            md.update(uid=str(uuid.uuid4()), resourceVersion=self.rv(), creationTimestamp=_now_iso(), generation=1)
            self.pdbs[(ns, md["name"])] = pdb
            return self._pdb_view(pdb)

    def _pdb_view(self, pdb: Obj) -> Obj:
        out = copy.deepcopy(pdb)
        out["status"] = self.pdb_status(pdb)
        return out

    # configmaps (core/v1): create, get, list, replace (PUT with resourceVersion -> 409), delete.
    # Namespaces are not modelled: any namespace exists.
    def create_configmap(self, ns: str, cm: Obj) -> Obj:
        with self.lock:
            cm = copy.deepcopy(cm)
            md = cm.setdefault("metadata", {})
            if not md.get("name"):
                raise ApiError(422, "Invalid", "ConfigMap is invalid: metadata.name: Required value: name is required")
            if md.get("namespace", ns) != ns:
                raise ApiError(400, "BadRequest", "the namespace of the provided object does not match the request")
            _check_configmap_data(cm)
            if (ns, md["name"]) in self.configmaps:
                raise ApiError(409, "AlreadyExists", f'configmaps "{md["name"]}" already exists')
            cm.update(apiVersion="v1", kind="ConfigMap")
            md.update(namespace=ns, uid=str(uuid.uuid4()), resourceVersion=self.rv(), creationTimestamp=_now_iso())
            self.configmaps[(ns, md["name"])] = cm
            self._record("create", cm)
            return copy.deepcopy(cm)

    def get_configmap(self, ns: str, name: str) -> Obj:
        with self.lock:
            cm = self.configmaps.get((ns, name))
            if cm is None:
                raise ApiError(404, "NotFound", f'configmaps "{name}" not found', {"name": name, "kind": "configmaps"})
            return copy.deepcopy(cm)

    def replace_configmap(self, ns: str, name: str, cm: Obj) -> Obj:
        with self.lock:
            old = self.get_configmap(ns, name)
            cm = copy.deepcopy(cm)
            md = cm.setdefault("metadata", {})
            if md.get("name") != name:
                raise ApiError(400, "BadRequest", "the name of the object does not match the name on the URL")
            want_rv = md.get("resourceVersion")
            if not want_rv:
                raise ApiError(
                    422, "Invalid", "metadata.resourceVersion: Invalid value: must be specified for an update"
                )
            if want_rv != old["metadata"]["resourceVersion"]:
                raise ApiError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on configmaps "{name}": the object has been modified; '
                    "please apply your changes to the latest version and try again",
                )
            _check_configmap_data(cm)
            cm.update(apiVersion="v1", kind="ConfigMap")
            md.update(namespace=ns, uid=old["metadata"]["uid"], creationTimestamp=old["metadata"]["creationTimestamp"])
            md["resourceVersion"] = self.rv()
            self.configmaps[(ns, name)] = cm
            self._record("replace", cm)
            return copy.deepcopy(cm)


_CONFIGMAP_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")


def _check_configmap_data(cm: Obj) -> None:
    """As the real server: keys are ``[-._a-zA-Z0-9]+`` and the data may not exceed 1 MiB (422 otherwise)."""
    data = cm.get("data") or {}
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        raise ApiError(400, "BadRequest", "ConfigMap data: values must be strings")
    bad = sorted(k for k in data if not _CONFIGMAP_KEY.match(k) or k in (".", ".."))
    if bad:
        raise ApiError(422, "Invalid", f"ConfigMap is invalid: data[{bad[0]}]: Invalid value: a valid config key")
    if sum(len(k.encode()) + len(v.encode()) for k, v in data.items()) > 1024 * 1024:
        raise ApiError(422, "Invalid", "ConfigMap is invalid: []: Too long: must have at most 1048576 bytes")


# --- HTTP -----------------------------------------------------------------------------------------

_ROUTES: list[tuple[str, re.Pattern[str], str]] = [
    (m, re.compile(p), h)
    for m, p, h in [
        ("GET", r"^/version$", "version"),
        ("GET", r"^/api/v1/nodes$", "list_nodes"),
        ("GET", r"^/api/v1/nodes/([^/]+)$", "get_node"),
        ("PATCH", r"^/api/v1/nodes/([^/]+)$", "patch_node"),
        ("GET", r"^/api/v1/pods$", "list_pods"),
        ("GET", r"^/api/v1/namespaces/([^/]+)/pods$", "list_pods"),
        ("POST", r"^/api/v1/namespaces/([^/]+)/pods$", "create_pod"),
        ("GET", r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)$", "get_pod"),
        ("PATCH", r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)$", "patch_pod"),
        ("DELETE", r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)$", "delete_pod"),
        ("POST", r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)/eviction$", "evict"),
        ("GET", r"^/apis/policy/v1/namespaces/([^/]+)/poddisruptionbudgets$", "list_pdbs"),
        ("POST", r"^/apis/policy/v1/namespaces/([^/]+)/poddisruptionbudgets$", "create_pdb"),
        ("GET", r"^/apis/policy/v1/namespaces/([^/]+)/poddisruptionbudgets/([^/]+)$", "get_pdb"),
        ("DELETE", r"^/apis/policy/v1/namespaces/([^/]+)/poddisruptionbudgets/([^/]+)$", "delete_pdb"),
        ("GET", r"^/api/v1/namespaces/([^/]+)/configmaps$", "list_configmaps"),
        ("POST", r"^/api/v1/namespaces/([^/]+)/configmaps$", "create_configmap"),
        ("GET", r"^/api/v1/namespaces/([^/]+)/configmaps/([^/]+)$", "get_configmap"),
        ("PUT", r"^/api/v1/namespaces/([^/]+)/configmaps/([^/]+)$", "replace_configmap"),
        ("DELETE", r"^/api/v1/namespaces/([^/]+)/configmaps/([^/]+)$", "delete_configmap"),
    ]
]


class _Handler(BaseHTTPRequestHandler):
    server: KubeApiStandIn
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # as Go's net/http (the real server) does; else 40 ms delayed-ACK stalls

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _json(self, code: int, obj: Obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> Any:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except ValueError:
            raise ApiError(400, "BadRequest", "the request body is not JSON") from None

    def _dispatch(self, method: str) -> None:
        url = urllib.parse.urlsplit(self.path)
        q = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query).items()}
        delay = self.server.latency_s
        if delay:
            time.sleep(delay)
        try:
            for m, pat, handler in _ROUTES:
                match = pat.match(url.path)
                if m == method and match:
                    getattr(self, "h_" + handler)(q, *[urllib.parse.unquote(g) for g in match.groups()])
                    return
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({url.path})")
        except ApiError as e:
            self._json(e.code, e.status)
        except (KeyError, TypeError, ValueError) as e:
            self._json(400, status_obj(400, "BadRequest", f"bad request: {e}"))

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    # handlers
    @property
    def c(self) -> Cluster:
        return self.server.cluster

    def _list(self, kind: str, items: list[Obj], api_version: str = "v1") -> None:
        self._json(
            200,
            {
                "kind": kind,
                "apiVersion": api_version,
                "metadata": {"resourceVersion": str(next(self.c._rv))},
                "items": items,
            },
        )

    def h_version(self, q: dict[str, str]) -> None:
        self._json(200, {"major": "1", "minor": "30", "gitVersion": "v1.30.0-sco-standin", "platform": "linux/amd64"})

    def h_list_nodes(self, q: dict[str, str]) -> None:
        lm = label_matcher(q.get("labelSelector"))
        with self.c.lock:
            items = [copy.deepcopy(n) for _, n in sorted(self.c.nodes.items()) if lm(n["metadata"]["labels"])]
        self._list("NodeList", items)

    def h_get_node(self, q: dict[str, str], name: str) -> None:
        self._json(200, self.c.get_node(name))

    def h_patch_node(self, q: dict[str, str], name: str) -> None:
        ctype = self.headers.get("Content-Type", "application/merge-patch+json")
        self._json(200, self.c.patch_node(name, ctype, self._body()))

    def h_list_pods(self, q: dict[str, str], ns: str | None = None) -> None:
        if q.get("watch") in ("true", "1"):
            self._watch(ns, q)
            return
        self._list("PodList", self.c.list_pods(ns, q.get("labelSelector"), q.get("fieldSelector")))

    def _watch(self, ns: str | None, q: dict[str, str]) -> None:
        lm, fm = label_matcher(q.get("labelSelector")), field_matcher(q.get("fieldSelector"))

        def match(p: Obj) -> bool:
            return (ns is None or p["metadata"]["namespace"] == ns) and lm(p["metadata"].get("labels", {})) and fm(p)

        events: queue.Queue[Obj | None] = queue.Queue()
        with self.c.lock:
            if q.get("resourceVersion") in (None, "", "0"):
                for p in self.c.list_pods(ns, q.get("labelSelector"), q.get("fieldSelector")):
                    events.put({"type": "ADDED", "object": p})
            self.c.watchers.append((match, events))
        deadline = time.monotonic() + float(q.get("timeoutSeconds", 1800))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            while time.monotonic() < deadline:
                try:
                    ev = events.get(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
                except queue.Empty:
                    continue
                if ev is None:
                    break
                line = json.dumps(ev).encode() + b"\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass
        finally:
            with self.c.lock:
                self.c.watchers = [w for w in self.c.watchers if w[1] is not events]
            self.close_connection = True

    def h_create_pod(self, q: dict[str, str], ns: str) -> None:
        self._json(201, self.c.create_pod(ns, self._body()))

    def h_get_pod(self, q: dict[str, str], ns: str, name: str) -> None:
        self._json(200, self.c.get_pod(ns, name))

    def h_patch_pod(self, q: dict[str, str], ns: str, name: str) -> None:
        ctype = self.headers.get("Content-Type", "application/merge-patch+json")
        self._json(200, self.c.patch_pod(ns, name, ctype, self._body()))

    def h_delete_pod(self, q: dict[str, str], ns: str, name: str) -> None:
        body = self._body()
        grace = body.get("gracePeriodSeconds", q.get("gracePeriodSeconds")) if isinstance(body, dict) else None
        self._json(200, self.c.delete_pod(ns, name, None if grace is None else int(grace)))

    def h_evict(self, q: dict[str, str], ns: str, name: str) -> None:
        body = self._body()
        if body.get("kind") not in (None, "Eviction") or body.get("apiVersion") not in (None, "policy/v1"):
            raise ApiError(400, "BadRequest", "expected a policy/v1 Eviction")
        self._json(201, self.c.evict(ns, name, body))

    def h_list_pdbs(self, q: dict[str, str], ns: str) -> None:
        with self.c.lock:
            items = [self.c._pdb_view(p) for (pns, _), p in sorted(self.c.pdbs.items()) if pns == ns]
        self._list("PodDisruptionBudgetList", items, "policy/v1")

    def h_create_pdb(self, q: dict[str, str], ns: str) -> None:
        self._json(201, self.c.create_pdb(ns, self._body()))

    def h_get_pdb(self, q: dict[str, str], ns: str, name: str) -> None:
        with self.c.lock:
            pdb = self.c.pdbs.get((ns, name))
            if pdb is None:
                raise ApiError(404, "NotFound", f'poddisruptionbudgets.policy "{name}" not found')
            self._json(200, self.c._pdb_view(pdb))

    def h_delete_pdb(self, q: dict[str, str], ns: str, name: str) -> None:
        with self.c.lock:
            if self.c.pdbs.pop((ns, name), None) is None:
                raise ApiError(404, "NotFound", f'poddisruptionbudgets.policy "{name}" not found')
        self._json(200, status_obj(200, "", ""))

    def h_list_configmaps(self, q: dict[str, str], ns: str) -> None:
        with self.c.lock:
            items = [copy.deepcopy(c) for (cns, _), c in sorted(self.c.configmaps.items()) if cns == ns]
        self._list("ConfigMapList", items)

    def h_create_configmap(self, q: dict[str, str], ns: str) -> None:
        self._json(201, self.c.create_configmap(ns, self._body()))

    def h_get_configmap(self, q: dict[str, str], ns: str, name: str) -> None:
        self._json(200, self.c.get_configmap(ns, name))

    def h_replace_configmap(self, q: dict[str, str], ns: str, name: str) -> None:
        self._json(200, self.c.replace_configmap(ns, name, self._body()))

    def h_delete_configmap(self, q: dict[str, str], ns: str, name: str) -> None:
        with self.c.lock:
            if self.c.configmaps.pop((ns, name), None) is None:
                raise ApiError(404, "NotFound", f'configmaps "{name}" not found')
        self._json(200, status_obj(200, "", ""))


class KubeApiStandIn(ThreadingHTTPServer):
    """The stand-in server. ``latency_s`` delays every request (to test the 800 ms path around the API)."""

    daemon_threads = True
    request_queue_size = 512

    def __init__(self, address: tuple[str, int] = ("127.0.0.1", 0)) -> None:
        self.cluster = Cluster()
        self.latency_s = 0.0
        super().__init__(address, _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> KubeApiStandIn:
        threading.Thread(target=self.serve_forever, name="kube-standin", daemon=True).start()
        return self

    def stop(self) -> None:
        self.cluster.stop()
        self.shutdown()
        self.server_close()


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description="Kubernetes API STAND-IN (see module docstring)")
    p.add_argument("--listen", default="127.0.0.1:6443")
    p.add_argument("--node", action="append", default=[], help="create a node with this name")
    a = p.parse_args()
    host, _, port = a.listen.rpartition(":")
    srv = KubeApiStandIn((host or "127.0.0.1", int(port)))
    for n in a.node:
        srv.cluster.add_node(n)
    print(f"kube-apiserver STAND-IN (Kubernetes {API_VERSION_FOLLOWED} semantics) at {srv.url}", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
