"""STAND-IN for the Kubernetes API server (core/v1 and policy/v1, following Kubernetes 1.30 semantics).

No kube-apiserver can run on the project's machines, so the tests and the demo run this instead: a real HTTP
server speaking the same JSON protocol for the part of the API the node agent and the control plane use.
The official ``kubernetes`` Python client works against it unchanged (``tests/test_kube_standin.py``). It is
meant to be as unkind as the real server where that hurts a client (upstream source: apiserver's pod
registry and eviction subresource, the disruption controller, kubelet's ``killContainer``, NodeRestriction).

Implemented:
- nodes: list, get, patch (JSON merge, strategic merge, JSON patch; ``spec.taints`` is atomic under strategic
  merge, as upstream: the list is replaced, never merged by key), ``metadata.resourceVersion`` optimistic
  concurrency (409), taint validation (422: key a qualified name, value a label value of at most 63
  characters, effect NoSchedule/PreferNoSchedule/NoExecute, no duplicate key+effect), ``?dryRun=All``; delete
  with DeleteOptions ``preconditions`` (uid, resourceVersion: 409), at once (Nodes carry no finalizers), which ends
  every token bound to the Node;
- pods: create, list (``fieldSelector`` on the fields upstream supports for pods, 400 for any other;
  ``labelSelector`` with =, ==, !=, in, notin, exists, !exists; ``limit``/``continue`` paging), get, patch,
  delete with ``gracePeriodSeconds`` and DeleteOptions ``preconditions`` (uid, resourceVersion: 409 when they
  do not match), and watch (``?watch=true``: ADDED/MODIFIED/DELETED, resuming from a ``resourceVersion`` in
  the retained history, an ERROR event with 410 Expired for one older than that, BOOKMARK events every
  ``bookmark_interval_s`` with ``allowWatchBookmarks=true``);
- the Eviction subresource (policy/v1): preconditions as for delete (409); a pod that is terminating,
  Pending, Succeeded or Failed is deleted without a PodDisruptionBudget check (and its grace may be
  shortened); otherwise PDB semantics: 201 when allowed, 429 with a DisruptionBudget cause when not, 429 with
  ``Retry-After: 10`` while the PDB's status is stale (observedGeneration behind generation, see
  ``pdb_observe_delay_s``), 500 when more than one PDB selects the pod;
- poddisruptionbudgets (policy/v1): create, list, get, delete; selectors as upstream (``{}`` selects every
  pod of the namespace, no selector selects none, ``matchLabels`` and ``matchExpressions``), ``minAvailable``
  and ``maxUnavailable`` as integers or percentages (rounded up, of the pods the PDB selects: the real
  controller takes the owning controller's scale); status computed live;
- configmaps: create, list, get, replace (PUT, resourceVersion required, 409 on a stale one), delete; keys and
  the 1 MiB size validated (422) as the real server does (namespaces are not modelled: any exists);
- a kubelet for every pod bound to a node: a graceful delete sets ``deletionTimestamp`` and
  ``deletionGracePeriodSeconds``; the preStop hook (annotation ``standin.sco.dev/prestop-seconds``) runs for at
  most the grace, then the container (``standin.sco.dev/shutdown-seconds`` to exit after TERM) gets what is
  left of the grace but at least 2 s (kubelet's minimum) before it is killed; a shorter second delete
  shortens a running termination; the pod then leaves the API (finalizers keep it until cleared);
- grace 0 removes the pod object at once, as the real server does, while its containers keep running up to
  the pod's own grace (at least 2 s): ``Cluster.ghosts()`` lists such containers for tests;
- optional TLS (``tls=(certfile, keyfile)``) and bearer-token authentication (every 401 answered is kept in
  ``unauthorized``, every request let in in ``authenticated``; ``revoke`` drops a token): ``tokens`` maps a token to an
  :class:`Identity` (401 for a missing or unknown token). An identity is node-bound when its user is
  ``system:node:<name>`` (the kubelet's identity) or its ``extra`` carries
  ``authentication.kubernetes.io/node-name`` (a bound service-account token): as with NodeRestriction, it gets
  403 on patching any other node and on evicting or deleting pods bound to another node. ``Identity.deny``
  lists "verb resource" pairs refused with 403 (an RBAC-like stand-in for a credential that may not, say,
  ``patch nodes``). The mapping is given when starting: ``KubeApiStandIn(tokens=...)``, or on the command line
  ``--token-auth-file`` (upstream's CSV: ``token,user,uid,"group1,group2"``) or ``--tokens-json``
  (``{"<token>": {"user": ..., "groups": [...], "extra": {...}, "deny": ["patch nodes"]}}``).

TokenRequest (``POST /api/v1/namespaces/NS/serviceaccounts/SA/token``, authentication.k8s.io/v1): the
account must exist (``add_serviceaccount``; 404), ``expirationSeconds`` at least 600 and at most 2^32 (422),
``boundObjectRef`` of kind Node (Pod and Secret: 400 here, not modelled), its node existing (404) with the uid
given (409 otherwise); the lifetime is clamped to ``max_token_expiration_s`` (upstream
``--service-account-max-token-expiration``; tests set seconds, far below what a real server allows) and the
answer's ``status.expirationTimestamp`` says it. Issued tokens (``issue_token`` makes one as ``kubectl create
token`` would) are JWTs with ``iat``/``exp``/``sub`` and the ``kubernetes.io`` claims, authenticate as the
service account with the node's name and uid in ``extra``, and get 401 once expired, once their Node is gone or
replaced by another object of the name, or once the account is gone (upstream: "the token is valid only while
the bound object exists"; TokenRequest's boundObjectRef docs). TokenReview (``POST
/apis/authentication.k8s.io/v1/tokenreviews``) answers what the authenticator says of a token: unauthenticated,
``token has been invalidated``, once its Node is gone. Every TokenRequest is kept in
``token_requests`` (its spec) and every issued token in ``issued``.

core/v1 Events: create (the API server's namespace rules: an event about a Node lives in ``default``, one about a pod
in its namespace; 422 otherwise, 403 when ``deny`` has "create events") and list (with involvedObject field
selectors, as ``kubectl describe`` asks), kept in ``Cluster.events``, apart from ``audit``.

Not implemented: other resources (TokenRequest bound to a Pod or Secret among them), server-side apply,
protobuf, field managers, RBAC beyond ``deny``.
``/_standin/*`` does not exist: test hooks are methods (``Cluster.compact``, ``ghosts``, ``reads``, ``audit``).
"""

from __future__ import annotations

import base64
import contextlib
import copy
import heapq
import itertools
import json
import math
import queue
import re
import socket
import ssl
import threading
import time
import urllib.parse
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
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


# spec.taints has no patchStrategy upstream: atomic, replaced whole (a client that sends one taint drops the rest).
_MERGE_KEYS = {"conditions": "type", "containers": "name", "ownerReferences": "uid"}


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


# --- validation ---------------------------------------------------------------------------------

_NAME_RE = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS_SUBDOMAIN_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_VALUE_MSG = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must "
    "start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used for "
    "validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')"
)
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def qualified_name_errors(key: str) -> list[str]:
    """apimachinery's IsQualifiedName: an optional DNS-subdomain prefix and a name of at most 63 characters."""
    prefix, _, name = key.rpartition("/")
    errs = []
    if "/" in prefix or (key.count("/") and not prefix):
        errs.append("prefix part must be a DNS subdomain")
    elif prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN_RE.match(prefix)):
        errs.append("prefix part a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters")
    if not name:
        errs.append("name part must be non-empty")
    elif len(name) > 63:
        errs.append("name part must be no more than 63 characters")
    elif not _NAME_RE.match(name):
        errs.append(
            "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
            "alphanumeric character"
        )
    return errs


def label_value_errors(value: str) -> list[str]:
    if len(value) > 63:
        return ["must be no more than 63 characters"]
    if value and not _NAME_RE.match(value):
        return [_LABEL_VALUE_MSG]
    return []


def validate_taints(node_name: str, taints: Any) -> None:
    causes: list[Obj] = []

    def bad(fld: str, value: Any, msg: str, kind: str = "FieldValueInvalid") -> None:
        causes.append({"reason": kind, "field": fld, "message": f"Invalid value: {json.dumps(value)}: {msg}"})

    seen: set[tuple[str, str]] = set()
    for i, t in enumerate(taints or []):
        at = f"spec.taints[{i}]"
        if not isinstance(t, dict):
            bad(at, t, "expected an object")
            continue
        key, value, effect = str(t.get("key") or ""), str(t.get("value") or ""), t.get("effect")
        for m in qualified_name_errors(key):
            bad(f"{at}.key", key, m)
        for m in label_value_errors(value):
            bad(f"{at}.value", value, m)
        if effect not in TAINT_EFFECTS:
            bad(
                f"{at}.effect",
                effect,
                f"supported values: {', '.join(map(repr, TAINT_EFFECTS))}",
                "FieldValueNotSupported",
            )
        if (key, str(effect)) in seen:
            causes.append(
                {
                    "reason": "FieldValueDuplicate",
                    "field": f"{at}",
                    "message": f"Duplicate value: taints must be unique by key and effect pair ({key}:{effect})",
                }
            )
        seen.add((key, str(effect)))
    if causes:
        summary = ", ".join(f"{c['field']}: {c['message']}" for c in causes)
        raise ApiError(
            422,
            "Invalid",
            f'Node "{node_name}" is invalid: {summary}',
            {"name": node_name, "kind": "Node", "causes": causes},
        )


POD_FIELDS = {
    "metadata.name",
    "metadata.namespace",
    "spec.nodeName",
    "spec.restartPolicy",
    "spec.schedulerName",
    "spec.serviceAccountName",
    "spec.hostNetwork",
    "status.phase",
    "status.podIP",
    "status.podIPs",
    "status.nominatedNodeName",
}
NODE_FIELDS = {"metadata.name", "spec.unschedulable"}
EVENT_FIELDS = {
    "involvedObject.kind",
    "involvedObject.name",
    "involvedObject.namespace",
    "involvedObject.uid",
    "reason",
    "type",
    "source",
    "metadata.name",
    "metadata.namespace",
}


def check_field_selector(sel: str | None, supported: set[str]) -> None:
    """Upstream answers 400 for a field it cannot select on (not an empty list)."""
    for term in (sel or "").split(","):
        if not term.strip():
            continue
        key = re.split("!=|==?", term, maxsplit=1)[0].strip()
        if key not in supported:
            raise ApiError(
                400,
                "BadRequest",
                f'Unable to find "/v1, Resource=pods" that match label selector "", '
                f'field selector "{sel}": field label not supported: {key}',
            )


def pdb_selector(selector: Obj | None) -> Callable[[dict[str, str]], bool]:
    """policy/v1: no selector selects no pods; ``{}`` selects every pod; matchLabels AND matchExpressions."""
    if selector is None:
        return lambda labels: False
    ml = selector.get("matchLabels") or {}
    exprs = selector.get("matchExpressions") or []

    def match(labels: dict[str, str]) -> bool:
        if any(labels.get(k) != v for k, v in ml.items()):
            return False
        for e in exprs:
            k, op, vals = e["key"], e["operator"], set(e.get("values") or [])
            if op == "In" and labels.get(k) not in vals:
                return False
            if op == "NotIn" and k in labels and labels[k] in vals:
                return False
            if op == "Exists" and k not in labels:
                return False
            if op == "DoesNotExist" and k in labels:
                return False
        return True

    return match


def scaled(value: Any, total: int) -> int:
    """IntOrString as the disruption controller reads it: an int, or a percentage of ``total`` rounded up."""
    if isinstance(value, str) and value.endswith("%"):
        return math.ceil(int(value[:-1]) * total / 100)
    return int(value)


# --- identities -----------------------------------------------------------------------------------

NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"


@dataclass(frozen=True)
class Identity:
    """Who a bearer token is. Node-bound when the user is ``system:node:<name>`` or ``extra`` names a node."""

    user: str
    groups: tuple[str, ...] = ()
    extra: tuple[tuple[str, tuple[str, ...]], ...] = ()
    deny: tuple[str, ...] = ()  # "verb resource" refused with 403, e.g. "patch nodes"

    @property
    def node(self) -> str | None:
        if self.user.startswith("system:node:"):
            return self.user.removeprefix("system:node:")
        for k, v in self.extra:
            if k == NODE_NAME_EXTRA and v:
                return v[0]
        return None

    @classmethod
    def from_json(cls, doc: Obj) -> Identity:
        return cls(
            str(doc["user"]),
            tuple(doc.get("groups") or ()),
            tuple((k, tuple(v)) for k, v in (doc.get("extra") or {}).items()),
            tuple(doc.get("deny") or ()),
        )


def _token_id(token: str) -> str:
    """A short hash naming a token in the stand-in's logs (the token itself is a secret there too)."""
    import hashlib

    return hashlib.sha256(token.encode()).hexdigest()[:12] if token else ""


def load_token_auth_file(path: str) -> dict[str, Identity]:
    """Upstream's static token file: ``token,user,uid,"group1,group2"`` per line."""
    import csv

    out: dict[str, Identity] = {}
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if len(row) < 3 or row[0].startswith("#"):
                continue
            groups = tuple(g for g in (row[3].split(",") if len(row) > 3 else []) if g)
            out[row[0].strip()] = Identity(row[1].strip(), groups)
    return out


def load_tokens_json(path: str) -> dict[str, Identity]:
    with open(path) as f:
        return {tok: Identity.from_json(doc) for tok, doc in json.load(f).items()}


# --- the store ------------------------------------------------------------------------------------


@dataclass
class _Containers:
    """A pod's containers on its node, as the stand-in's kubelet runs them."""

    ns: str
    name: str
    uid: str
    node: str
    prestop: float
    shutdown: float
    spec_grace: int
    term_started: float | None = None  # monotonic
    exit_at: float | None = None  # monotonic
    killed: bool = False
    gen: int = 0


def kill_after(prestop: float, shutdown: float, grace: float) -> tuple[float, bool]:
    """kubelet's killContainer: the preStop hook runs for at most the grace; TERM then gets what is left of
    the grace but at least 2 s (minimumGracePeriodInSeconds) before KILL. Returns (seconds, killed)."""
    hook = min(prestop, grace)
    after_term = max(2.0, grace - hook)
    return hook + min(shutdown, after_term), prestop > grace or shutdown > after_term


class Cluster:
    """State of the stand-in cluster; every mutation goes through here under one lock."""

    def __init__(self, history: int = 1000) -> None:
        self.lock = threading.RLock()
        self._rv = itertools.count(1)
        self.last_rv = 0
        self.nodes: dict[str, Obj] = {}
        self.pods: dict[tuple[str, str], Obj] = {}
        self.pdbs: dict[tuple[str, str], Obj] = {}
        self.containers: dict[str, _Containers] = {}  # pod uid -> running containers
        self.configmaps: dict[tuple[str, str], Obj] = {}  # (namespace, name); see the ConfigMap section
        self.events: dict[tuple[str, str], Obj] = {}  # core/v1 Events, (namespace, name)
        self.watchers: list[tuple[Callable[[Obj], bool], queue.Queue[Obj | None]]] = []
        self.history: deque[tuple[int, Obj]] = deque(maxlen=history)  # pod watch events kept for resumption
        self.oldest_rv = 1  # a watch from an older resourceVersion gets 410 Expired
        self.pdb_observe_delay_s = 0.0  # how long the "disruption controller" takes to observe a new PDB
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._wake = threading.Condition(self.lock)
        self.audit: list[Obj] = []  # mutations, for tests and benchmarks
        self.reads: list[Obj] = []  # list and watch requests: {"at", "verb", "resourceVersion", "limit"}
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
        self.last_rv = next(self._rv)
        return str(self.last_rv)

    def _record(self, verb: str, obj: Obj, **extra: Any) -> None:
        self.audit.append(
            {
                "at": time.time(),
                "verb": verb,
                "kind": obj.get("kind"),
                "name": obj["metadata"]["name"],
                "uid": obj["metadata"].get("uid"),
                **extra,
            }
        )

    def _notify(self, etype: str, obj: Obj) -> None:
        ev = {"type": etype, "object": copy.deepcopy(obj)}
        if obj.get("kind") == "Pod":
            if len(self.history) == self.history.maxlen:
                self.oldest_rv = self.history[0][0] + 1
            self.history.append((int(obj["metadata"]["resourceVersion"]), ev))
        for match, q in list(self.watchers):
            if match(obj):
                q.put(ev)

    def drop_watches(self) -> None:
        """Test hook: end every open watch (as an API server restart or a load balancer's idle cut does)."""
        with self.lock:
            for _, q in self.watchers:
                q.put(None)

    def compact(self) -> None:
        """Test hook: forget the watch history, as etcd compaction does (watches from before now get 410)."""
        with self.lock:
            self.history.clear()
            self.oldest_rv = self.last_rv + 1

    def ghosts(self) -> list[Obj]:
        """Containers still running whose pod object has left the API (after a grace-0 delete)."""
        with self.lock:
            live = {p["metadata"]["uid"] for p in self.pods.values()}
            now = time.monotonic()
            return [
                {
                    "namespace": c.ns,
                    "name": c.name,
                    "uid": c.uid,
                    "node": c.node,
                    "exits_in_s": (c.exit_at or now) - now,
                }
                for c in self.containers.values()
                if c.uid not in live
            ]

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

    def delete_node(self, name: str, opts: Obj | None = None) -> Obj:
        """DELETE a Node (no finalizers on Nodes: it leaves at once), honouring DeleteOptions preconditions (uid,
        resourceVersion: 409 when they do not match). Tokens bound to it stop authenticating (issued_valid)."""
        with self.lock:
            node = self.get_node(name)
            self._preconditions(node, opts or {})  # the same checks and messages as for a pod
            del self.nodes[name]
            node["metadata"]["deletionTimestamp"] = _now_iso()
            self._record("delete", node)
            return node

    def get_node(self, name: str) -> Obj:
        with self.lock:
            node = self.nodes.get(name)
            if node is None:
                raise ApiError(404, "NotFound", f'nodes "{name}" not found', {"name": name, "kind": "nodes"})
            return copy.deepcopy(node)

    def patch_node(self, name: str, ctype: str, body: Any, dry_run: bool = False, user: str = "") -> Obj:
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
            validate_taints(name, new.get("spec", {}).get("taints"))
            if dry_run:
                return new
            new["metadata"]["resourceVersion"] = self.rv()
            self.nodes[name] = new
            self._record(
                "patch",
                new,
                taints=copy.deepcopy(new["spec"].get("taints", [])),
                unschedulable=new["spec"].get("unschedulable", False),
                user=user,
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
            if running:
                ann = md.get("annotations") or {}
                self.containers[md["uid"]] = _Containers(
                    ns,
                    md["name"],
                    md["uid"],
                    spec["nodeName"],
                    float(ann.get(PRESTOP_ANNOTATION, 0)),
                    float(ann.get(SHUTDOWN_ANNOTATION, 0)),
                    int(spec["terminationGracePeriodSeconds"]),
                )
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
        check_field_selector(fields, POD_FIELDS)
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
            md = new["metadata"]
            done = new["status"].get("phase") in ("Succeeded", "Failed") or md.get("deletionGracePeriodSeconds") == 0
            if md.get("deletionTimestamp") and not md.get("finalizers") and done:
                self._remove(ns, name)
            return copy.deepcopy(new)

    def _healthy(self, p: Obj) -> bool:
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
        return p["status"].get("phase") == "Running" and ready and not p["metadata"].get("deletionTimestamp")

    def _pdb_pods(self, pdb: Obj) -> list[Obj]:
        ns = pdb["metadata"]["namespace"]
        match = pdb_selector(pdb["spec"].get("selector"))
        return [p for (pns, _), p in self.pods.items() if pns == ns and match(p["metadata"].get("labels", {}))]

    def pdb_status(self, pdb: Obj) -> Obj:
        pods = self._pdb_pods(pdb)
        healthy = sum(1 for p in pods if self._healthy(p))
        spec = pdb["spec"]
        if "minAvailable" in spec:
            desired = scaled(spec["minAvailable"], len(pods))
        else:
            desired = max(0, len(pods) - scaled(spec.get("maxUnavailable", 0), len(pods)))
        return {
            "currentHealthy": healthy,
            "desiredHealthy": desired,
            "expectedPods": len(pods),
            "disruptionsAllowed": max(0, healthy - desired),
            "observedGeneration": pdb["_observed"],
        }

    def _pdbs_for(self, pod: Obj) -> list[Obj]:
        labels = pod["metadata"].get("labels", {})
        return [
            pdb
            for (ns, _), pdb in sorted(self.pdbs.items())
            if ns == pod["metadata"]["namespace"] and pdb_selector(pdb["spec"].get("selector"))(labels)
        ]

    @staticmethod
    def _preconditions(pod: Obj, opts: Obj) -> None:
        pre = opts.get("preconditions") or {}
        md = pod["metadata"]
        kind = pod.get("kind", "Pod")
        if pre.get("uid") is not None and pre["uid"] != md["uid"]:
            raise ApiError(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {kind} "{md["name"]}": Precondition failed: UID in precondition: '
                f"{pre['uid']}, UID in object meta: {md['uid']}",
                {"name": md["name"], "kind": kind},
            )
        if pre.get("resourceVersion") is not None and pre["resourceVersion"] != md["resourceVersion"]:
            raise ApiError(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {kind} "{md["name"]}": Precondition failed: ResourceVersion in '
                f"precondition: {pre['resourceVersion']}, ResourceVersion in object meta: {md['resourceVersion']}",
                {"name": md["name"], "kind": kind},
            )

    def evict(self, ns: str, name: str, body: Obj) -> Obj:
        with self.lock:
            pod = self.get_pod(ns, name)
            opts = body.get("deleteOptions") or {}
            self._preconditions(pod, opts)
            grace = opts.get("gracePeriodSeconds")
            terminating = bool(pod["metadata"].get("deletionTimestamp"))
            if terminating or pod["status"].get("phase") in ("Pending", "Succeeded", "Failed"):
                # Upstream's canIgnorePDB: deleted straight away (a shorter grace shortens the termination).
                self._record("evict", pod, grace=grace, already_terminating=terminating)
                self._delete(ns, name, None if grace is None else int(grace))
                return status_obj(201, "", "")
            pdbs = self._pdbs_for(pod)
            if len(pdbs) > 1:
                raise ApiError(
                    500,
                    "InternalError",
                    "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support.",
                )
            if pdbs:
                pdb = pdbs[0]
                pname = pdb["metadata"]["name"]
                if pdb["_observed"] < pdb["metadata"]["generation"]:
                    self._record("evict-refused", pod, pdb=pname, stale=True)
                    raise ApiError(
                        429,
                        "TooManyRequests",
                        "Cannot evict pod as it would violate the pod's disruption budget.",
                        {
                            "causes": [
                                {
                                    "reason": "DisruptionBudget",
                                    "message": f"The disruption budget {pname} is still being processed by the server.",
                                }
                            ],
                            "retryAfterSeconds": 10,
                        },
                    )
                st = self.pdb_status(pdb)
                if self._healthy(pod) and st["disruptionsAllowed"] <= 0:
                    self._record("evict-refused", pod, pdb=pname)
                    raise ApiError(
                        429,
                        "TooManyRequests",
                        "Cannot evict pod as it would violate the pod's disruption budget.",
                        {
                            "causes": [
                                {
                                    "reason": "DisruptionBudget",
                                    "message": f"The disruption budget {pname} needs "
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
            self._delete(ns, name, None if grace is None else int(grace))
            return status_obj(201, "", "")

    def delete_pod(self, ns: str, name: str, grace: int | None, opts: Obj | None = None) -> Obj:
        """Returns the pod as it stands after the delete (as the real server does for a graceful delete)."""
        with self.lock:
            pod = self.pods.get((ns, name))
            if pod is None:
                self.get_pod(ns, name)  # raises the 404
            assert pod is not None
            self._preconditions(pod, opts or {})
            self._record("delete", pod, grace=grace)
            self._delete(ns, name, grace)
            return copy.deepcopy(pod)

    def _delete(self, ns: str, name: str, grace: int | None) -> None:
        pod = self.pods[(ns, name)]
        md, spec = pod["metadata"], pod["spec"]
        g = int(spec.get("terminationGracePeriodSeconds", 30) if grace is None else grace)
        if not spec.get("nodeName") or pod["status"].get("phase") in ("Succeeded", "Failed"):
            g = 0  # upstream: unscheduled and finished pods are deleted at once
        if md.get("deletionTimestamp") and g >= md.get("deletionGracePeriodSeconds", g):
            return  # a second delete may only shorten the grace period, as in the real server
        md["deletionTimestamp"] = _now_iso(time.time() + g)
        md["deletionGracePeriodSeconds"] = g
        md["resourceVersion"] = self.rv()
        c = self.containers.get(md["uid"])
        if g == 0:
            # Removed from the API at once; kubelet learns of it later and stops the containers with the
            # pod's own grace: they outlive the object ("ghosts").
            if c is not None:
                self._terminate(c, max(c.spec_grace, 0))
            if md.get("finalizers"):
                self._notify("MODIFIED", pod)
                return
            self._remove(ns, name)
            return
        self._notify("MODIFIED", pod)
        if c is not None:
            self._terminate(c, g)

    def _terminate(self, c: _Containers, grace: float) -> None:
        now = time.monotonic()
        if c.term_started is None:
            c.term_started = now
            prestop_left, shutdown_left = c.prestop, c.shutdown
        else:
            elapsed = now - c.term_started
            prestop_left = max(0.0, c.prestop - elapsed)
            shutdown_left = c.shutdown if prestop_left > 0 else max(0.0, c.shutdown - (elapsed - c.prestop))
        after, killed = kill_after(prestop_left, shutdown_left, grace)
        if c.exit_at is not None and now + after >= c.exit_at:
            return
        c.exit_at, c.killed = now + after, killed
        c.gen += 1
        gen, uid = c.gen, c.uid
        self._after(after, lambda: self._exit(uid, gen))

    def _exit(self, uid: str, gen: int) -> None:
        c = self.containers.get(uid)
        if c is None or c.gen != gen:
            return
        del self.containers[uid]
        self.audit.append(
            {"at": time.time(), "verb": "exited", "kind": "Pod", "name": c.name, "uid": uid, "killed": c.killed}
        )
        pod = self.pods.get((c.ns, c.name))
        if pod is None or pod["metadata"]["uid"] != uid:
            return  # a ghost's containers end: nothing in the API to update
        if c.killed:
            pod["metadata"].setdefault("annotations", {})["standin.sco.dev/killed-at-grace"] = "true"
        self._finish(c.ns, c.name, "Failed" if c.killed else "Succeeded")

    def _finish(self, ns: str, name: str, phase: str) -> None:
        pod = self.pods[(ns, name)]
        pod["status"]["phase"] = phase
        for cond in pod["status"]["conditions"]:
            if cond["type"] == "Ready":
                cond["status"] = "False"
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
            pdb["_observed"] = 0 if self.pdb_observe_delay_s > 0 else 1
            self.pdbs[(ns, md["name"])] = pdb
            if self.pdb_observe_delay_s > 0:

                def observe() -> None:
                    pdb["_observed"] = pdb["metadata"]["generation"]

                self._after(self.pdb_observe_delay_s, observe)
            return self._pdb_view(pdb)

    def _pdb_view(self, pdb: Obj) -> Obj:
        out = {k: copy.deepcopy(v) for k, v in pdb.items() if not k.startswith("_")}
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

    def create_event(self, ns: str, ev: Obj) -> Obj:
        """core/v1 Event create with the API server's validation (pkg/apis/core/validation/events.go):
        an event about a cluster-scoped object (a Node) lives in ``default`` (or no namespace), one about a
        namespaced object in that object's namespace; name, involvedObject, reason and type checked."""
        with self.lock:
            ev = copy.deepcopy(ev)
            md = ev.setdefault("metadata", {})
            if not isinstance(md, dict) or not md.get("name"):
                raise ApiError(422, "Invalid", "Event is invalid: metadata.name: Required value: name is required")
            if md.get("namespace", ns) != ns:
                raise ApiError(
                    400,
                    "BadRequest",
                    "the namespace of the provided object does not match the namespace sent on the request",
                )
            name = str(md["name"])
            if not _DNS_SUBDOMAIN_RE.match(name) or len(name) > 253:
                raise ApiError(
                    422,
                    "Invalid",
                    f'Event "{name}" is invalid: metadata.name: Invalid value: "{name}": a '
                    "lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' "
                    "or '.'",
                )
            ref = ev.get("involvedObject")
            if not isinstance(ref, dict) or not ref.get("kind") or not ref.get("name"):
                raise ApiError(422, "Invalid", f'Event "{name}" is invalid: involvedObject: Required value')
            ref_ns = str(ref.get("namespace") or "")
            if (ref_ns == "" and ns not in ("", "default")) or (ref_ns != "" and ref_ns != ns):
                raise ApiError(
                    422,
                    "Invalid",
                    f'Event "{name}" is invalid: involvedObject.namespace: Invalid value: "{ref_ns}": does not match'
                    " event.namespace",
                )
            if ev.get("type", "Normal") not in ("Normal", "Warning"):
                raise ApiError(
                    422, "Invalid", f'Event "{name}" is invalid: type: Unsupported value: "{ev.get("type")}"'
                )
            if len(str(ev.get("reason") or "")) > 128:
                raise ApiError(
                    422, "Invalid", f'Event "{name}" is invalid: reason: Too long: must have at most 128 bytes'
                )
            if (ns, name) in self.events:
                raise ApiError(409, "AlreadyExists", f'events "{name}" already exists')
            ev.update(apiVersion="v1", kind="Event")
            md.update(namespace=ns, uid=str(uuid.uuid4()), resourceVersion=self.rv(), creationTimestamp=_now_iso())
            self.events[(ns, name)] = ev  # not in the audit: tests count the drain's calls there
            return copy.deepcopy(ev)

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
        ("GET", r"^/api$", "discovery_versions"),
        ("GET", r"^/apis$", "discovery_groups"),
        ("GET", r"^/api/(v1)$", "discovery_resources"),
        ("GET", r"^/apis/([^/]+/[^/]+)$", "discovery_resources"),
        ("GET", r"^/api/v1/nodes$", "list_nodes"),
        ("GET", r"^/api/v1/nodes/([^/]+)$", "get_node"),
        ("PATCH", r"^/api/v1/nodes/([^/]+)$", "patch_node"),
        ("DELETE", r"^/api/v1/nodes/([^/]+)$", "delete_node"),
        ("POST", r"^/apis/authentication\.k8s\.io/v1/tokenreviews$", "token_review"),
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
        ("POST", r"^/api/v1/namespaces/([^/]+)/serviceaccounts/([^/]+)/token$", "token_request"),
        ("GET", r"^/api/v1/namespaces/([^/]+)/configmaps$", "list_configmaps"),
        ("POST", r"^/api/v1/namespaces/([^/]+)/events$", "create_event"),
        ("GET", r"^/api/v1/namespaces/([^/]+)/events$", "list_events"),
        ("GET", r"^/api/v1/events$", "list_events"),
        ("POST", r"^/api/v1/namespaces/([^/]+)/configmaps$", "create_configmap"),
        ("GET", r"^/api/v1/namespaces/([^/]+)/configmaps/([^/]+)$", "get_configmap"),
        ("PUT", r"^/api/v1/namespaces/([^/]+)/configmaps/([^/]+)$", "replace_configmap"),
        ("DELETE", r"^/api/v1/namespaces/([^/]+)/configmaps/([^/]+)$", "delete_configmap"),
    ]
]
# Objects kept as given (namespaces, service accounts, Secrets, RBAC): (namespace or "", resource, name or "")
_OBJECT_PATHS = [
    re.compile(r"^/api/v1/()(namespaces)(?:/([^/]+))?$"),
    re.compile(r"^/api/v1/namespaces/([^/]+)/(serviceaccounts|secrets)(?:/([^/]+))?$"),
    re.compile(r"^/apis/rbac\.authorization\.k8s\.io/v1/()(clusterroles|clusterrolebindings)(?:/([^/]+))?$"),
    re.compile(r"^/apis/rbac\.authorization\.k8s\.io/v1/namespaces/([^/]+)/(roles|rolebindings)(?:/([^/]+))?$"),
]
_OBJECT_KINDS = {
    "namespaces": ("v1", "Namespace"),
    "serviceaccounts": ("v1", "ServiceAccount"),
    "secrets": ("v1", "Secret"),
    "clusterroles": ("rbac.authorization.k8s.io/v1", "ClusterRole"),
    "clusterrolebindings": ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"),
    "roles": ("rbac.authorization.k8s.io/v1", "Role"),
    "rolebindings": ("rbac.authorization.k8s.io/v1", "RoleBinding"),
}
# The API group RBAC rules name a resource by (the core group "" for the rest; pods/eviction is core's subresource)
_GROUPS = {
    "poddisruptionbudgets": "policy",
    "tokenreviews": "authentication.k8s.io",
    **{r: "rbac.authorization.k8s.io" for r in ("clusterroles", "clusterrolebindings", "roles", "rolebindings")},
}
# Discovery (what clients such as kubernetes.core's dynamic client read first): group/version -> the resources
# served, (name, kind, namespaced, verbs)
_DISCOVERY: dict[str, list[tuple[str, str, bool, list[str]]]] = {
    "v1": [
        ("nodes", "Node", False, ["get", "list", "watch", "patch", "delete"]),
        ("pods", "Pod", True, ["create", "get", "list", "watch", "patch", "delete"]),
        ("pods/eviction", "Eviction", True, ["create"]),
        ("namespaces", "Namespace", False, ["create", "get", "list", "update", "delete"]),
        ("configmaps", "ConfigMap", True, ["create", "get", "list", "update", "delete"]),
        ("events", "Event", True, ["create", "list"]),
        ("secrets", "Secret", True, ["create", "get", "list", "update", "delete"]),
        ("serviceaccounts", "ServiceAccount", True, ["create", "get", "list", "update", "delete"]),
        ("serviceaccounts/token", "TokenRequest", True, ["create"]),
    ],
    "policy/v1": [
        ("poddisruptionbudgets", "PodDisruptionBudget", True, ["create", "get", "list", "delete"]),
    ],
    "authentication.k8s.io/v1": [("tokenreviews", "TokenReview", False, ["create"])],
    "rbac.authorization.k8s.io/v1": [
        ("clusterroles", "ClusterRole", False, ["create", "get", "list", "update", "delete"]),
        ("clusterrolebindings", "ClusterRoleBinding", False, ["create", "get", "list", "update", "delete"]),
        ("roles", "Role", True, ["create", "get", "list", "update", "delete"]),
        ("rolebindings", "RoleBinding", True, ["create", "get", "list", "update", "delete"]),
    ],
}
SA_TOKEN_SECRET = "kubernetes.io/service-account-token"
SA_NAME_ANNOTATION = "kubernetes.io/service-account.name"


class _Handler(BaseHTTPRequestHandler):
    server: KubeApiStandIn
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # as Go's net/http (the real server) does; else 40 ms delayed-ACK stalls

    def log_message(self, format: str, *args: object) -> None:
        pass

    identity: Identity | None = None

    def setup(self) -> None:
        if isinstance(self.request, ssl.SSLSocket):
            self.request.settimeout(10)
            self.request.do_handshake()  # in the request's own thread, not the accepting one
            self.request.settimeout(None)
        super().setup()

    def _json(self, code: int, obj: Obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        retry = (obj.get("details") or {}).get("retryAfterSeconds") if obj.get("kind") == "Status" else None
        if retry:
            self.send_header("Retry-After", str(retry))
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.server.last_answer_at = time.time()

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
            self._authenticate(url.path)
            for m, pat, handler in _ROUTES:
                match = pat.match(url.path)
                if m == method and match:
                    getattr(self, "h_" + handler)(q, *[urllib.parse.unquote(g) for g in match.groups()])
                    return
            for pat in _OBJECT_PATHS:
                match = pat.match(url.path)
                if match:
                    ns, res, name = (urllib.parse.unquote(g or "") for g in match.groups())
                    self.h_object(method, q, ns, res, name)
                    return
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({url.path})")
        except ApiError as e:
            self._json(e.code, e.status)
        except (KeyError, TypeError, ValueError) as e:
            self._json(400, status_obj(400, "BadRequest", f"bad request: {e}"))

    def _authenticate(self, path: str) -> None:
        tokens = self.server.tokens
        if tokens is None or path == "/version":
            return
        auth = self.headers.get("Authorization", "")
        token = auth[7:].strip() if auth.startswith("Bearer ") else ""
        ident = tokens.get(token) if token else None
        seen = {"at": time.time(), "method": self.command, "path": path, "token": _token_id(token)}
        issued = self.server.issued.get(token) if ident is not None else None
        if issued is not None and not self.server.issued_valid(issued):
            ident = None  # expired, or its node is gone (deleted, or recreated under the name: another uid)
        if ident is None:
            self.server.unauthorized.append(seen)  # list.append is atomic: handler threads share it
            raise ApiError(401, "Unauthorized", "Unauthorized")
        self.server.authenticated.append({**seen, "user": ident.user})
        self.identity = ident

    def _authorize(self, verb: str, resource: str, name: str, ns: str = "", pod_node: str | None = None) -> None:
        """RBAC (when the server enforces it: ``rbac=True``), the ``deny`` list and NodeRestriction-like node
        binding (upstream messages)."""
        ident = self.identity
        if ident is None:
            return
        kind = resource.split("/")[0]
        if self.server.rbac and not self.server.rbac_allows(ident, verb, resource, name, ns):
            scope = f'in the namespace "{ns}"' if ns else "at the cluster scope"
            what = f'{kind} "{name}"' if name else kind
            raise ApiError(
                403,
                "Forbidden",
                f'{what} is forbidden: User "{ident.user}" cannot {verb} resource "{resource}" in API group '
                f'"{_GROUPS.get(kind, "")}" {scope}',
                {"name": name, "kind": kind},
            )
        if f"{verb} {resource}" in ident.deny:
            scope = f'in the namespace "{ns}"' if ns else "at the cluster scope"
            group = "policy" if resource == "pods/eviction" else ""
            raise ApiError(
                403,
                "Forbidden",
                f'{kind} "{name}" is forbidden: User "{ident.user}" cannot {verb} resource "{resource}" in API '
                f'group "{group}" {scope}',
                {"name": name, "kind": kind},
            )
        node = ident.node
        if node is None:
            return
        if resource == "nodes" and verb == "patch" and name != node:
            raise ApiError(
                403,
                "Forbidden",
                f'nodes "{name}" is forbidden: node "{node}" is not allowed to modify node "{name}"',
                {"name": name, "kind": "nodes"},
            )
        if resource in ("pods", "pods/eviction") and verb in ("delete", "create") and pod_node != node:
            what = "evict" if resource == "pods/eviction" else "delete"
            raise ApiError(
                403,
                "Forbidden",
                f'pods "{name}" is forbidden: node "{node}" can only {what} pods with spec.nodeName set to itself',
                {"name": name, "kind": "pods"},
            )

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

    def h_discovery_versions(self, q: dict[str, str]) -> None:
        self._json(200, {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []})

    def h_discovery_groups(self, q: dict[str, str]) -> None:
        groups = []
        for gv in sorted(_DISCOVERY):
            if "/" in gv:
                name, version = gv.split("/")
                ver = {"groupVersion": gv, "version": version}
                groups.append({"name": name, "versions": [ver], "preferredVersion": ver})
        self._json(200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})

    def h_discovery_resources(self, q: dict[str, str], gv: str) -> None:
        if gv not in _DISCOVERY:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({gv})")
        resources = [
            {"name": n, "singularName": "", "namespaced": ns, "kind": k, "verbs": v} for n, k, ns, v in _DISCOVERY[gv]
        ]
        self._json(200, {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources})

    def h_list_nodes(self, q: dict[str, str]) -> None:
        self._authorize("watch" if q.get("watch") in ("true", "1") else "list", "nodes", "")
        check_field_selector(q.get("fieldSelector"), NODE_FIELDS)
        lm = label_matcher(q.get("labelSelector"))
        with self.c.lock:
            items = [copy.deepcopy(n) for _, n in sorted(self.c.nodes.items()) if lm(n["metadata"]["labels"])]
        self._list("NodeList", items)

    def h_get_node(self, q: dict[str, str], name: str) -> None:
        self._authorize("get", "nodes", name)
        self._json(200, self.c.get_node(name))

    def h_patch_node(self, q: dict[str, str], name: str) -> None:
        ctype = self.headers.get("Content-Type", "application/merge-patch+json")
        body = self._body()
        self._authorize("patch", "nodes", name)
        user = self.identity.user if self.identity else ""
        self._json(200, self.c.patch_node(name, ctype, body, dry_run=q.get("dryRun") == "All", user=user))

    def h_delete_node(self, q: dict[str, str], name: str) -> None:
        body = self._body()
        self._authorize("delete", "nodes", name)
        self._json(200, self.c.delete_node(name, body if isinstance(body, dict) else {}))

    def h_token_review(self, q: dict[str, str]) -> None:
        """TokenReview (authentication.k8s.io/v1): what the API server's own authenticator says of a token, with
        the bound object checked (a token bound to a Node is unauthenticated once that Node is gone)."""
        body = self._body()
        self._authorize("create", "tokenreviews", "")
        spec = body.get("spec") or {}
        token = str(spec.get("token") or "")
        ident = (self.server.tokens or {}).get(token) if token else None
        issued = self.server.issued.get(token)
        status: Obj = {"authenticated": False}
        if ident is None:
            status["error"] = "invalid bearer token"
        elif issued is not None and not self.server.issued_valid(issued):
            why = "token has expired" if time.time() >= issued["exp"] else "token has been invalidated"
            status["error"] = f"[invalid bearer token, {why}]"
        else:
            status = {
                "authenticated": True,
                "user": {
                    "username": ident.user,
                    "groups": list(ident.groups),
                    "extra": {k: list(v) for k, v in ident.extra},
                },
                "audiences": list(spec.get("audiences") or self.server.audiences),
            }
        self._json(
            201,
            {"kind": "TokenReview", "apiVersion": "authentication.k8s.io/v1", "metadata": {"creationTimestamp": None},
             "spec": spec, "status": status},
        )  # fmt: skip

    def h_list_pods(self, q: dict[str, str], ns: str | None = None) -> None:
        watching = q.get("watch") in ("true", "1")
        self._authorize("watch" if watching else "list", "pods", "", ns or "")
        self.c.reads.append(
            {
                "at": time.time(),
                "verb": "watch" if watching else "list",
                "resourceVersion": q.get("resourceVersion"),
                "limit": q.get("limit"),
                "fieldSelector": q.get("fieldSelector"),
            }
        )
        if watching:
            self._watch(ns, q)
            return
        with self.c.lock:
            items = self.c.list_pods(ns, q.get("labelSelector"), q.get("fieldSelector"))
            rv = str(self.c.last_rv)
        meta: Obj = {"resourceVersion": rv}
        if q.get("continue"):
            try:
                token = json.loads(base64.urlsafe_b64decode(q["continue"]))
                start, rv = token["start"], token["rv"]
            except (ValueError, KeyError) as e:
                raise ApiError(400, "BadRequest", f"invalid continue token: {e}") from None
            items = [p for p in items if f"{p['metadata']['namespace']}/{p['metadata']['name']}" > start]
            meta["resourceVersion"] = rv
        limit = int(q.get("limit") or 0)
        if limit > 0 and len(items) > limit:
            rest = len(items) - limit
            items = items[:limit]
            last = items[-1]["metadata"]
            start = f"{last['namespace']}/{last['name']}"
            meta["continue"] = base64.urlsafe_b64encode(json.dumps({"rv": rv, "start": start}).encode()).decode()
            meta["remainingItemCount"] = rest
        self._json(200, {"kind": "PodList", "apiVersion": "v1", "metadata": meta, "items": items})

    def _watch(self, ns: str | None, q: dict[str, str]) -> None:
        check_field_selector(q.get("fieldSelector"), POD_FIELDS)
        lm, fm = label_matcher(q.get("labelSelector")), field_matcher(q.get("fieldSelector"))

        def match(p: Obj) -> bool:
            return (ns is None or p["metadata"]["namespace"] == ns) and lm(p["metadata"].get("labels", {})) and fm(p)

        events: queue.Queue[Obj | None] = queue.Queue()
        since = q.get("resourceVersion")
        with self.c.lock:
            if since in (None, "", "0"):
                for p in self.c.list_pods(ns, q.get("labelSelector"), q.get("fieldSelector")):
                    events.put({"type": "ADDED", "object": p})
            elif int(since) + 1 < self.c.oldest_rv:
                # Upstream answers 200 and then an ERROR event carrying 410 Expired; the client relists.
                expired = status_obj(410, "Expired", f"too old resource version: {since} ({self.c.oldest_rv - 1})")
                events.put({"type": "ERROR", "object": expired})
                events.put(None)
            else:
                for rv, old in self.c.history:
                    if rv > int(since) and match(old["object"]):
                        events.put(old)
            self.c.watchers.append((match, events))
        bookmarks = q.get("allowWatchBookmarks") in ("true", "1")
        interval = self.server.bookmark_interval_s
        next_bookmark = time.monotonic() + interval
        deadline = time.monotonic() + float(q.get("timeoutSeconds", 1800))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            while time.monotonic() < deadline:
                if bookmarks and time.monotonic() >= next_bookmark:
                    next_bookmark = time.monotonic() + interval
                    mark = {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": str(self.c.last_rv)}}
                    events.put({"type": "BOOKMARK", "object": mark})
                wait = min(1.0, max(0.01, deadline - time.monotonic()))
                if bookmarks:
                    wait = min(wait, max(0.01, next_bookmark - time.monotonic()))
                if self.server.silent:
                    time.sleep(0.05)  # a partitioned server: the connection stays open, nothing arrives
                    continue
                try:
                    ev = events.get(timeout=wait)
                except queue.Empty:
                    continue
                if ev is None:
                    break
                line = json.dumps(ev).encode() + b"\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()
                self.server.last_answer_at = time.time()
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass
        finally:
            with self.c.lock:
                self.c.watchers = [w for w in self.c.watchers if w[1] is not events]
            self.close_connection = True

    def h_create_pod(self, q: dict[str, str], ns: str) -> None:
        body = self._body()
        self._authorize("create", "pods", str((body.get("metadata") or {}).get("name", "")), ns)
        self._json(201, self.c.create_pod(ns, body))

    def h_get_pod(self, q: dict[str, str], ns: str, name: str) -> None:
        self._authorize("get", "pods", name, ns)
        self._json(200, self.c.get_pod(ns, name))

    def h_patch_pod(self, q: dict[str, str], ns: str, name: str) -> None:
        ctype = self.headers.get("Content-Type", "application/merge-patch+json")
        self._json(200, self.c.patch_pod(ns, name, ctype, self._body()))

    def _pod_node(self, ns: str, name: str) -> str | None:
        with self.c.lock:
            pod = self.c.pods.get((ns, name))
            return pod["spec"].get("nodeName") if pod else None

    def h_delete_pod(self, q: dict[str, str], ns: str, name: str) -> None:
        body = self._body()
        opts = body if isinstance(body, dict) else {}
        grace = opts.get("gracePeriodSeconds", q.get("gracePeriodSeconds"))
        self._authorize("delete", "pods", name, ns, self._pod_node(ns, name))
        self._json(200, self.c.delete_pod(ns, name, None if grace is None else int(grace), opts))

    def h_evict(self, q: dict[str, str], ns: str, name: str) -> None:
        body = self._body()
        if body.get("kind") not in (None, "Eviction") or body.get("apiVersion") not in (None, "policy/v1"):
            raise ApiError(400, "BadRequest", "expected a policy/v1 Eviction")
        self._authorize("create", "pods/eviction", name, ns, self._pod_node(ns, name))
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

    def h_token_request(self, q: dict[str, str], ns: str, name: str) -> None:
        body = self._body()
        self._authorize("create", "serviceaccounts/token", name, ns)
        spec = body.get("spec") or {}
        seconds = spec.get("expirationSeconds", 3600)
        ref = spec.get("boundObjectRef")
        if not isinstance(seconds, int) or isinstance(seconds, bool) or seconds < 600 or seconds > 1 << 32:
            why = "may not specify a duration less than 10 minutes" if isinstance(seconds, int) else "must be an int"
            if isinstance(seconds, int) and seconds > 1 << 32:
                why = "may not specify a duration larger than 2^32 seconds"
            raise ApiError(
                422,
                "Invalid",
                f'TokenRequest.authentication.k8s.io "{name}" is invalid: spec.expirationSeconds: Invalid value:'
                f" {seconds}: {why}",
                {"name": name, "group": "authentication.k8s.io", "kind": "TokenRequest"},
            )
        resp = self.server.token_request(ns, name, spec, ref)
        self._json(201, resp)

    def h_list_configmaps(self, q: dict[str, str], ns: str) -> None:
        self._authorize("list", "configmaps", "", ns)
        with self.c.lock:
            items = [copy.deepcopy(c) for (cns, _), c in sorted(self.c.configmaps.items()) if cns == ns]
        self._list("ConfigMapList", items)

    def h_create_event(self, q: dict[str, str], ns: str) -> None:
        body = self._body()
        self._authorize("create", "events", str((body.get("metadata") or {}).get("name", "")), ns)
        self._json(201, self.c.create_event(ns, body))

    def h_list_events(self, q: dict[str, str], ns: str | None = None) -> None:
        """With fieldSelector (involvedObject.kind=Node,involvedObject.name=n1), as kubectl describe asks."""
        self._authorize("list", "events", "", ns or "")
        check_field_selector(q.get("fieldSelector"), EVENT_FIELDS)
        match = field_matcher(q.get("fieldSelector"))
        with self.c.lock:
            items = [copy.deepcopy(e) for (ens, _), e in sorted(self.c.events.items()) if ns in (None, ens)]
        self._list("EventList", [e for e in items if match(e)])

    def h_create_configmap(self, q: dict[str, str], ns: str) -> None:
        body = self._body()
        self._authorize("create", "configmaps", str((body.get("metadata") or {}).get("name", "")), ns)
        self._json(201, self.c.create_configmap(ns, body))

    def h_get_configmap(self, q: dict[str, str], ns: str, name: str) -> None:
        self._authorize("get", "configmaps", name, ns)
        self._json(200, self.c.get_configmap(ns, name))

    def h_replace_configmap(self, q: dict[str, str], ns: str, name: str) -> None:
        self._authorize("update", "configmaps", name, ns)
        self._json(200, self.c.replace_configmap(ns, name, self._body()))

    def h_delete_configmap(self, q: dict[str, str], ns: str, name: str) -> None:
        with self.c.lock:
            if self.c.configmaps.pop((ns, name), None) is None:
                raise ApiError(404, "NotFound", f'configmaps "{name}" not found')
        self._json(200, status_obj(200, "", ""))

    def h_object(self, method: str, q: dict[str, str], ns: str, res: str, name: str) -> None:
        """Namespaces, ServiceAccounts, Secrets and RBAC objects: create, get, list, replace, delete, kept as given
        (no validation beyond names; RBAC objects take effect at once, as the real authorizer's cache within ms)."""
        verbs = {("POST", False): "create", ("GET", False): "list", ("GET", True): "get", ("PUT", True): "update"}
        verb = verbs.get((method, bool(name)), "delete" if method == "DELETE" and name else "")
        if not verb:
            raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")
        body = self._body() if method in ("POST", "PUT") else {}
        if verb == "create":
            name = str((body.get("metadata") or {}).get("name") or "")
        self._authorize(verb, res, name, ns)
        srv = self.server
        if verb == "list":
            with srv.objects_lock:
                items = [copy.deepcopy(o) for (ons, r, _), o in sorted(srv.objects.items()) if r == res and ons == ns]
            api, kind = _OBJECT_KINDS[res]
            self._list(f"{kind}List", items, api)
        elif verb == "get":
            self._json(200, srv.get_object(res, ns, name))
        elif verb == "delete":
            self._json(200, srv.delete_object(res, ns, name))
        else:
            self._json(
                201 if verb == "create" else 200, srv.put_object(res, ns, body, create=verb == "create", name=name)
            )


class KubeApiStandIn(ThreadingHTTPServer):
    """The stand-in server. ``latency_s`` delays every request (to test the 800 ms path around the API)."""

    daemon_threads = True
    request_queue_size = 512

    def __init__(
        self,
        address: tuple[str, int] = ("127.0.0.1", 0),
        *,
        tokens: dict[str, Identity] | None = None,
        tls: tuple[str, str] | None = None,
        bookmark_interval_s: float = 60.0,
        rbac: bool = False,
    ) -> None:
        self.cluster = Cluster()
        # RBAC enforced (rbac.authorization.k8s.io/v1 objects created through the API; group system:masters passes
        # every check, as upstream): every request is authorized against the roles bound to its identity.
        # Off (the default): the ``deny`` lists alone.
        self.rbac = rbac
        self.objects: dict[tuple[str, str, str], Obj] = {}  # (namespace or "", resource, name)
        self.objects_lock = threading.RLock()
        # the token controller fills a service-account-token Secret after this long (it is asynchronous upstream)
        self.token_controller_delay_s = 0.2
        self.latency_s = 0.0
        self.silent = False  # True: requests hang and open watches deliver nothing (see ``go_silent``)
        self.last_answer_at = 0.0  # when a response or a watch event was last written (tests of silence)
        self._conns: set[Any] = set()
        self._conns_lock = threading.Lock()
        self._listening = threading.Event()
        self._listening.set()
        self.tokens = tokens  # None: no authentication (any or no token is accepted)
        # every request answered 401 and every one authenticated: {"at", "method", "path", "token"} (a short
        # hash of the token, never the token), "user" for the latter; tests assert "no 401" on these
        self.unauthorized: list[Obj] = []
        self.authenticated: list[Obj] = []
        # TokenRequest: the service accounts that exist ((namespace, name) -> uid), what each issued token is
        # ({"exp", "node", "node_uid", "sa"}), every TokenRequest answered (spec kept, for tests), and the
        # longest lifetime issued (upstream --service-account-max-token-expiration; None: as requested)
        self.serviceaccounts: dict[tuple[str, str], str] = {}
        self.issued: dict[str, Obj] = {}
        self.token_requests: list[Obj] = []
        self.max_token_expiration_s: float | None = None
        self.audiences = ["https://kubernetes.default.svc.cluster.local"]
        self.bookmark_interval_s = bookmark_interval_s
        super().__init__(address, _Handler)
        self.tls = tls is not None
        self._tls_ctx: ssl.SSLContext | None = None
        if tls is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(*tls)
            self._tls_ctx = ctx
            self.socket = ctx.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)

    def handle_error(self, request: Any, client_address: Any) -> None:
        import sys

        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            return  # the client gave up on its call (its timeout): not the server's error
        super().handle_error(request, client_address)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._conns_lock:
            self._conns.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._conns_lock:
            self._conns.discard(request)
        super().shutdown_request(request)

    def refuse_for(self, seconds: float) -> threading.Event:
        """Test hook: a restart, as an API server's during a drain. Every open connection is dropped (keep-alive
        and watches), the port refuses connections (RST: ECONNREFUSED) for ``seconds``, then it listens again on
        the same port with the same cluster. Returns an event set once it listens again."""
        self._listening.clear()
        self.shutdown()
        self.socket.close()
        with self._conns_lock:
            conns, self._conns = list(self._conns), set()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        tls = self._tls_ctx

        def reopen() -> None:
            time.sleep(seconds)
            sock = socket.socket(self.address_family, self.socket_type)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(self.server_address)
            sock.listen(self.request_queue_size)
            self.socket = tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False) if tls else sock
            self._listening.set()
            self.serve_forever()

        threading.Thread(target=reopen, name="kube-standin-restart", daemon=True).start()
        return self._listening

    def add_serviceaccount(self, ns: str, name: str) -> str:
        uid = self.serviceaccounts.setdefault((ns, name), str(uuid.uuid4()))
        return uid

    # --- objects kept as given, RBAC --------------------------------------------------------------------

    def get_object(self, res: str, ns: str, name: str) -> Obj:
        with self.objects_lock:
            obj = self.objects.get((ns, res, name))
            if obj is None:
                raise ApiError(404, "NotFound", f'{res} "{name}" not found', {"name": name, "kind": res})
            return copy.deepcopy(obj)

    def put_object(self, res: str, ns: str, body: Obj, *, create: bool, name: str = "") -> Obj:
        """Create (409 when it exists) or replace (404 when it does not; resourceVersion, when given, must match)."""
        api, kind = _OBJECT_KINDS[res]
        obj = copy.deepcopy(body)
        md = obj.setdefault("metadata", {})
        name = str(md.get("name") or name)
        if not re.match(r"^[a-z0-9]([-a-z0-9.:]*[a-z0-9])?$", name) or (
            not create and md.get("name") not in (None, name)
        ):
            raise ApiError(422, "Invalid", f'{kind} "{name}" is invalid: metadata.name: Invalid value: "{name}"')
        with self.objects_lock:
            old = self.objects.get((ns, res, name))
            if create and old is not None:
                raise ApiError(409, "AlreadyExists", f'{res} "{name}" already exists', {"name": name, "kind": res})
            if not create:
                if old is None:
                    raise ApiError(404, "NotFound", f'{res} "{name}" not found', {"name": name, "kind": res})
                if md.get("resourceVersion") not in (None, old["metadata"]["resourceVersion"]):
                    raise ApiError(
                        409, "Conflict", f'Operation cannot be fulfilled on {res} "{name}": the object has been'
                        " modified; please apply your changes to the latest version and try again",
                    )  # fmt: skip
            obj["apiVersion"], obj["kind"] = api, kind
            md.update(name=name, resourceVersion=self.cluster.rv())
            md["uid"] = old["metadata"]["uid"] if old else str(uuid.uuid4())
            md.setdefault("creationTimestamp", old["metadata"]["creationTimestamp"] if old else _now_iso())
            if ns:
                md["namespace"] = ns
            if res == "secrets" and old is not None and old.get("type") == SA_TOKEN_SECRET:
                obj["data"] = {**(old.get("data") or {}), **(obj.get("data") or {})}  # the controller's data stays
            self.objects[(ns, res, name)] = obj
        if res == "serviceaccounts":
            self.serviceaccounts[(ns, name)] = md["uid"]
        if res == "secrets" and obj.get("type") == SA_TOKEN_SECRET and old is None:
            self.cluster._after(self.token_controller_delay_s, lambda: self._fill_token_secret(ns, name))
        return copy.deepcopy(obj)

    def delete_object(self, res: str, ns: str, name: str) -> Obj:
        with self.objects_lock:
            obj = self.objects.pop((ns, res, name), None)
        if obj is None:
            raise ApiError(404, "NotFound", f'{res} "{name}" not found', {"name": name, "kind": res})
        if res == "serviceaccounts":  # its tokens die with it (issued_valid)
            self.serviceaccounts.pop((ns, name), None)
        return status_obj(200, "", "")

    def _fill_token_secret(self, ns: str, name: str) -> None:
        """The token controller: a Secret of type kubernetes.io/service-account-token naming an existing account
        gets a token that authenticates as that account while the Secret and the account exist (no expiry)."""
        with self.objects_lock:
            secret = self.objects.get((ns, "secrets", name))
            if secret is None:
                return
            sa = ((secret.get("metadata") or {}).get("annotations") or {}).get(SA_NAME_ANNOTATION, "")
            if (ns, sa) not in self.serviceaccounts:
                return  # upstream: the controller leaves it (and the garbage collector removes it)
            token, _ = self.issue_token(ns, sa, seconds=10 * 365 * 86400)
            self.issued[token]["secret"] = (ns, name)
            b64 = base64.b64encode
            secret["data"] = {**(secret.get("data") or {}), "token": b64(token.encode()).decode(),
                              "namespace": b64(ns.encode()).decode()}  # fmt: skip

    def rbac_allows(self, ident: Identity, verb: str, resource: str, name: str, ns: str) -> bool:
        """Upstream's RBAC authorizer for one request: allowed when a ClusterRoleBinding, or a RoleBinding of the
        request's namespace, binds a subject the identity is to a role with a rule matching the API group, the
        resource (a subresource as "pods/eviction"), the verb and, when the rule names any, the object's name."""
        if "system:masters" in ident.groups:
            return True
        group = _GROUPS.get(resource.split("/")[0], "")

        def subject(s: Obj) -> bool:
            if s.get("kind") == "User":
                return bool(s.get("name") == ident.user)
            if s.get("kind") == "Group":
                return s.get("name") in ident.groups
            if s.get("kind") == "ServiceAccount":
                return ident.user == f"system:serviceaccount:{s.get('namespace')}:{s.get('name')}"
            return False

        def rule(r: Obj) -> bool:
            return (
                bool({verb, "*"} & set(r.get("verbs") or ()))
                and bool({group, "*"} & set(r.get("apiGroups") or ()))
                and bool({resource, "*"} & set(r.get("resources") or ()))
                and (not r.get("resourceNames") or (bool(name) and name in r["resourceNames"]))
            )

        with self.objects_lock:
            objs = dict(self.objects)
        for (bns, res, _), b in objs.items():
            if res not in ("clusterrolebindings", "rolebindings") or (res == "rolebindings" and bns != ns):
                continue
            if not any(subject(s) for s in b.get("subjects") or ()):
                continue
            ref = b.get("roleRef") or {}
            role = (
                objs.get(("", "clusterroles", ref.get("name", "")))
                if ref.get("kind") == "ClusterRole"
                else (objs.get((bns, "roles", ref.get("name", ""))) if res == "rolebindings" else None)
            )
            if role is not None and any(rule(r) for r in role.get("rules") or ()):
                return True
        return False

    def issue_token(
        self,
        ns: str,
        sa: str,
        *,
        node: str | None = None,
        seconds: float = 3600,
        audiences: list[str] | None = None,
        deny: tuple[str, ...] = (),
    ) -> tuple[str, float]:
        """A service-account token as the TokenRequest API issues it (``kubectl create token SA
        --bound-object-kind Node --bound-object-name NODE``): a JWT with ``iat``/``exp``/``sub`` and the
        ``kubernetes.io`` claims, refused with 401 once expired or once its node is gone. (token, exp)."""
        sa_uid = self.add_serviceaccount(ns, sa)
        now = time.time()
        exp = now + seconds
        node_uid = None
        claims: Obj = {
            "iss": "https://kubernetes.default.svc.cluster.local",
            "sub": f"system:serviceaccount:{ns}:{sa}",
            "aud": audiences or self.audiences,
            "iat": int(now),
            "nbf": int(now),
            "exp": int(exp),
            "jti": str(uuid.uuid4()),
            "kubernetes.io": {"namespace": ns, "serviceaccount": {"name": sa, "uid": sa_uid}},
        }
        extra: list[tuple[str, tuple[str, ...]]] = [("authentication.kubernetes.io/credential-id", (claims["jti"],))]
        if node is not None:
            node_uid = self.cluster.get_node(node)["metadata"]["uid"]
            claims["kubernetes.io"]["node"] = {"name": node, "uid": node_uid}
            extra += [(NODE_NAME_EXTRA, (node,)), ("authentication.kubernetes.io/node-uid", (node_uid,))]

        def b64(doc: Obj) -> str:
            return base64.urlsafe_b64encode(json.dumps(doc).encode()).rstrip(b"=").decode()

        # signed by nobody: the stand-in is the only verifier and it looks the token up
        token = f"{b64({'alg': 'RS256', 'kid': 'standin'})}.{b64(claims)}.{uuid.uuid4().hex}"
        groups = ("system:serviceaccounts", f"system:serviceaccounts:{ns}", "system:authenticated")
        if self.tokens is None:
            self.tokens = {}
        self.tokens[token] = Identity(claims["sub"], groups, tuple(extra), deny)
        self.issued[token] = {"exp": int(exp), "node": node, "node_uid": node_uid, "sa": (ns, sa)}
        return token, float(int(exp))

    def issued_valid(self, issued: Obj) -> bool:
        if time.time() >= issued["exp"]:
            return False
        secret = issued.get("secret")
        if secret is not None and (secret[0], "secrets", secret[1]) not in self.objects:
            return False  # a Secret's token: revoked by deleting the Secret
        if issued["node"] is not None:
            node = self.cluster.nodes.get(issued["node"])
            if node is None or node["metadata"]["uid"] != issued["node_uid"]:
                return False
        return issued["sa"] in self.serviceaccounts

    def token_request(self, ns: str, name: str, spec: Obj, ref: Obj | None) -> Obj:
        """POST .../serviceaccounts/NAME/token, after authorization and validation (upstream's token REST)."""
        if (ns, name) not in self.serviceaccounts:
            raise ApiError(
                404, "NotFound", f'serviceaccounts "{name}" not found', {"name": name, "kind": "serviceaccounts"}
            )
        node = None
        if ref:
            kind, api = ref.get("kind"), ref.get("apiVersion", "v1")
            if kind not in ("Pod", "Node", "Secret") or api != "v1":
                raise ApiError(400, "BadRequest", f"cannot bind token for object of kind {api}, Kind={kind}")
            if kind != "Node":
                raise ApiError(400, "BadRequest", f"stand-in: binding to a {kind} is not implemented")
            with self.cluster.lock:
                target = self.cluster.nodes.get(str(ref.get("name")))
                if target is None:
                    raise ApiError(404, "NotFound", f'nodes "{ref.get("name")}" not found', {"kind": "nodes"})
                if ref.get("uid") and ref["uid"] != target["metadata"]["uid"]:
                    raise ApiError(
                        409,
                        "Conflict",
                        f'Operation cannot be fulfilled on Node "{ref.get("name")}": the UID in the bound object'
                        f" reference ({ref['uid']}) does not match the UID in record. The object might have been"
                        " deleted and then recreated",
                    )
            node = str(ref["name"])
        seconds = float(spec.get("expirationSeconds", 3600))
        if self.max_token_expiration_s is not None:
            seconds = min(seconds, self.max_token_expiration_s)
        user = f"system:serviceaccount:{ns}:{name}"
        # the account's RBAC-like denials carry over to its new token (they are the account's, not the token's)
        with self.cluster.lock:  # one issuer at a time: the token map is read and grown here
            deny = next((ident.deny for ident in list((self.tokens or {}).values()) if ident.user == user), ())
            token, exp = self.issue_token(
                ns, name, node=node, seconds=seconds, audiences=spec.get("audiences"), deny=deny
            )
        self.token_requests.append({"at": time.time(), "namespace": ns, "name": name, "spec": copy.deepcopy(spec)})
        # as upstream: the answer's spec says the audiences and lifetime issued (the API server's audiences when
        # none were asked; the clamped lifetime)
        status_spec = {**spec, "audiences": spec.get("audiences") or self.audiences, "expirationSeconds": int(seconds)}
        return {
            "kind": "TokenRequest",
            "apiVersion": "authentication.k8s.io/v1",
            "metadata": {"name": name, "namespace": ns, "creationTimestamp": None},
            "spec": status_spec,
            "status": {"token": token, "expirationTimestamp": _now_iso(exp)},
        }

    def revoke(self, token: str) -> None:
        """Test hook: the token stops authenticating at once (a deleted service account or Secret, a rotated
        static token); requests with it get 401 from now on."""
        if self.tokens is not None:
            self.tokens.pop(token, None)

    def go_silent(self, seconds: float = 3600.0) -> None:
        """Test hook: from now on, answer nothing (every request waits ``seconds``; watches go quiet)."""
        self.latency_s = seconds
        self.silent = True

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"{'https' if self.tls else 'http'}://{host!s}:{port}"

    def start(self) -> KubeApiStandIn:
        threading.Thread(target=self.serve_forever, name="kube-standin", daemon=True).start()
        return self

    def stop(self) -> None:
        self.cluster.stop()
        self._listening.wait(30)  # a restart under way: let it listen again, then stop it
        self.shutdown()
        self.server_close()


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description="Kubernetes API STAND-IN (see module docstring)")
    p.add_argument("--listen", default="127.0.0.1:6443")
    p.add_argument("--node", action="append", default=[], help="create a node with this name")
    p.add_argument("--token-auth-file", help='upstream CSV: token,user,uid,"group1,group2" (system:node:NAME binds)')
    p.add_argument("--tokens-json", help='{"<token>": {"user", "groups", "extra", "deny"}} (see the docstring)')
    p.add_argument("--tls-cert-file")
    p.add_argument("--tls-private-key-file")
    a = p.parse_args()
    host, _, port = a.listen.rpartition(":")
    tokens: dict[str, Identity] | None = None
    if a.token_auth_file or a.tokens_json:
        tokens = {}
        if a.token_auth_file:
            tokens.update(load_token_auth_file(a.token_auth_file))
        if a.tokens_json:
            tokens.update(load_tokens_json(a.tokens_json))
    tls = (a.tls_cert_file, a.tls_private_key_file) if a.tls_cert_file else None
    srv = KubeApiStandIn((host or "127.0.0.1", int(port)), tokens=tokens, tls=tls)
    for n in a.node:
        srv.cluster.add_node(n)
    print(f"kube-apiserver STAND-IN (Kubernetes {API_VERSION_FOLLOWED} semantics) at {srv.url}", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
