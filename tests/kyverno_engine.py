"""Applies the ClusterPolicies in ``kyverno/`` to admission requests, for the tests. NOT Kyverno.

Kyverno cannot run on these machines (no Kubernetes control plane, no container runtime). What runs here:

- every CEL expression (``celPreconditions``, ``validate.cel`` variables, expressions, messageExpressions) is
  evaluated by a real CEL implementation, cel-python, over the variables Kyverno's validate.cel handler gives
  (``object``, ``oldObject``, ``request``, ``params``, ``variables``; object is null on DELETE, oldObject on
  CREATE), with Kyverno's order: preconditions false -> skip; the first false expression -> fail with its
  messageExpression (else message); a paramRef that finds nothing with ``parameterNotFoundAction: Deny`` -> fail;
- every ``{{ }}`` variable is evaluated by a real JMESPath implementation (``jmespath``), innermost first,
  a whole-string variable keeping its type and a null result being an error, as Kyverno documents;
- rule context entries: ``configMap`` (from the test's ConfigMaps), ``apiCall`` (urlPath substituted, answered
  from the test's objects by path, then its jmesPath, ``default`` when nothing answers), ``variable``;
- ``preconditions``/``deny.conditions`` with the operators the policies use (Equals, NotEquals, GreaterThan);
- ``patchStrategicMerge`` with the anchors the policies use (``(key)`` conditional, ``+(key)`` add if absent),
  lists of containers merged by name, other lists replaced (as batch/v1 podFailurePolicy.rules, atomic);
  ``patchesJson6902`` with RFC 6902 add/replace/remove;
- ``match`` on kinds (``Kind`` and ``Kind/subresource``), operations, label selectors and ServiceAccount subjects.

Anything else in a policy raises ``Unsupported`` so a test can never pass by ignoring part of a rule.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import celpy
import jmespath
import yaml

from sco_devkit.standins.kube_apiserver import json_patch

ROOT = Path(__file__).resolve().parent.parent
POLICY_DIR = ROOT / "kyverno" / "policies"
Obj = dict[str, Any]


class Unsupported(Exception):
    """The policy uses something this engine does not model."""


class VariableError(Exception):
    """A variable resolved to null or could not be evaluated (Kyverno: the rule errors)."""


def load_policies() -> dict[str, Obj]:
    out: dict[str, Obj] = {}
    for p in sorted(POLICY_DIR.glob("*.yaml")):
        for doc in yaml.safe_load_all(p.read_text()):
            out[doc["metadata"]["name"]] = doc
    return out


def rule(policies: dict[str, Obj], policy: str, name: str) -> Obj:
    for r in policies[policy]["spec"]["rules"]:
        if r["name"] == name:
            return r
    raise KeyError(f"{policy}: no rule {name}")


# --- admission requests --------------------------------------------------------------------------

_GVK = {
    "Pod": ("", "v1", "pods"),
    "Node": ("", "v1", "nodes"),
    "Job": ("batch", "v1", "jobs"),
    "Eviction": ("policy", "v1", "pods"),
    "Event": ("", "v1", "events"),
    "TokenRequest": ("authentication.k8s.io", "v1", "serviceaccounts"),  # POST serviceaccounts/NAME/token
}
_SUBRESOURCE = {"Eviction": "eviction", "TokenRequest": "token"}


def request(
    operation: str,
    obj: Obj | None,
    old: Obj | None = None,
    *,
    username: str = "alice",
    groups: list[str] | None = None,
    extra: dict[str, list[str]] | None = None,
) -> Obj:
    """An admission.k8s.io/v1 AdmissionRequest as the API server sends it."""
    src = obj if obj is not None else old
    assert src is not None
    kind = src["kind"]
    group, version, resource = _GVK[kind]
    md = src.get("metadata", {})
    req: Obj = {
        "uid": "00000000-0000-0000-0000-000000000000",
        "kind": {"group": group, "version": version, "kind": kind},
        "resource": {"group": "" if kind in _SUBRESOURCE else group, "version": "v1", "resource": resource},
        "subResource": _SUBRESOURCE.get(kind, ""),
        "name": md.get("name", ""),
        "namespace": md.get("namespace", ""),
        "operation": operation,
        "userInfo": {"username": username, "groups": groups or ["system:authenticated"], "extra": extra or {}},
        "object": obj,
        "oldObject": old,
        "dryRun": False,
    }
    return req


def agent_request(operation: str, obj: Obj | None, old: Obj | None = None, node: str | None = "node-a") -> Obj:
    """A request by the node agent: ServiceAccount sco-system/sco-agent with a token bound to ``node``."""
    extra = {} if node is None else {"authentication.kubernetes.io/node-name": [node]}
    return request(
        operation,
        obj,
        old,
        username="system:serviceaccount:sco-system:sco-agent",
        groups=["system:serviceaccounts", "system:serviceaccounts:sco-system", "system:authenticated"],
        extra=extra,
    )


# --- match ---------------------------------------------------------------------------------------


def _selector_ok(sel: Obj, labels: dict[str, str]) -> bool:
    for k, v in (sel.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in sel.get("matchExpressions") or []:
        op, key, vals = e["operator"], e["key"], e.get("values") or []
        ok = {
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
            "In": labels.get(key) in vals,
            "NotIn": labels.get(key) not in vals,
        }.get(op)
        if ok is None:
            raise Unsupported(f"selector operator {op}")
        if not ok:
            return False
    return True


def matches(r: Obj, req: Obj) -> bool:
    m = r["match"]
    if set(m) - {"any"}:
        raise Unsupported(f"match keys {sorted(m)}")
    if "exclude" in r:
        raise Unsupported("exclude")
    kind = req["kind"]["kind"]
    if req["subResource"]:
        kind = (
            {"pods": "Pod", "serviceaccounts": "ServiceAccount"}[req["resource"]["resource"]] + "/" + req["subResource"]
        )
    obj = req["object"] if req["object"] is not None else req["oldObject"]
    labels = (obj.get("metadata") or {}).get("labels") or {} if req["subResource"] == "" else {}
    for f in m["any"]:
        if set(f) - {"resources", "subjects"}:
            raise Unsupported(f"match filter keys {sorted(f)}")
        res = f["resources"]
        if set(res) - {"kinds", "operations", "selector"}:
            raise Unsupported(f"resource filter keys {sorted(res)}")
        if kind not in res["kinds"] or req["operation"] not in res.get("operations", [req["operation"]]):
            continue
        if "selector" in res and not _selector_ok(res["selector"], labels):
            continue
        if "subjects" in f:
            users = set()
            for s in f["subjects"]:
                if s["kind"] != "ServiceAccount":
                    raise Unsupported(f"subject kind {s['kind']}")
                users.add(f"system:serviceaccount:{s['namespace']}:{s['name']}")
            if req["userInfo"]["username"] not in users:
                continue
        return True
    return False


# --- results -------------------------------------------------------------------------------------


@dataclass
class Result:
    status: str  # pass | fail | skip | error
    message: str = ""
    patched: Obj | None = None
    evaluated: list[str] = field(default_factory=list)  # CEL/JMESPath expressions actually run

    def __repr__(self) -> str:
        return f"Result({self.status!r}, {self.message!r})"


# --- CEL -----------------------------------------------------------------------------------------

_ENV = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}


def cel(expr: str, activation: Obj) -> Any:
    prog = _PROGRAMS.get(expr)
    if prog is None:
        prog = _PROGRAMS[expr] = _ENV.program(_ENV.compile(expr))
    return prog.evaluate({k: celpy.json_to_cel(v) for k, v in activation.items()})


def _plain(v: Any) -> Any:
    """cel-python values back to JSON-like Python values."""
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if isinstance(v, celpy.celtypes.BoolType):
        return bool(v)
    if isinstance(v, celpy.celtypes.IntType):
        return int(v)
    if isinstance(v, celpy.celtypes.StringType):
        return str(v)
    return v


def run_cel_rule(r: Obj, req: Obj, configmaps: dict[tuple[str, str], Obj]) -> Result:
    v = r["validate"]
    c = v["cel"]
    if set(c) - {"paramKind", "paramRef", "variables", "expressions"}:
        raise Unsupported(f"validate.cel keys {sorted(c)}")
    act: Obj = {"object": req["object"], "oldObject": req["oldObject"], "request": req}
    ran: list[str] = []
    for pre in r.get("celPreconditions") or []:
        ran.append(pre["expression"])
        if not bool(cel(pre["expression"], act)):
            return Result("skip", f"cel precondition {pre['name']} not met", evaluated=ran)
    if "paramRef" in c:
        ref, kind = c["paramRef"], c["paramKind"]
        if (kind["apiVersion"], kind["kind"]) != ("v1", "ConfigMap") or "selector" in ref:
            raise Unsupported(f"paramKind {kind}, paramRef {ref}")
        params = configmaps.get((ref["namespace"], ref["name"]))
        if params is None:
            if ref["parameterNotFoundAction"] == "Deny":
                return Result("fail", f'no params found for policy: configmaps "{ref["name"]}" not found', None, ran)
            return Result("pass", "no params: allowed", None, ran)
        act["params"] = params
    variables: Obj = {}
    for var in c.get("variables") or []:
        act["variables"] = variables
        ran.append(var["expression"])
        variables[var["name"]] = _plain(cel(var["expression"], act))
    act["variables"] = variables
    for e in c["expressions"]:
        ran.append(e["expression"])
        if not bool(cel(e["expression"], act)):
            if "messageExpression" in e:
                ran.append(e["messageExpression"])
                return Result("fail", str(cel(e["messageExpression"], act)), evaluated=ran)
            return Result("fail", e.get("message", v.get("message", "")), evaluated=ran)
    return Result("pass", evaluated=ran)


# --- JMESPath variables --------------------------------------------------------------------------

_INNER = re.compile(r"\{\{((?:(?!\{\{|\}\}).)*)\}\}", re.S)


def jp(expr: str, ctx: Obj) -> Any:
    try:
        return jmespath.search(expr.strip(), ctx)
    except jmespath.exceptions.JMESPathError as e:
        raise VariableError(f"{expr.strip()}: {e}") from None


def substitute(value: Any, ctx: Obj, ran: list[str] | None = None) -> Any:
    if isinstance(value, dict):
        return {substitute(k, ctx, ran): substitute(v, ctx, ran) for k, v in value.items()}
    if isinstance(value, list):
        return [substitute(x, ctx, ran) for x in value]
    if not isinstance(value, str):
        return value
    s = value
    while True:
        m = _INNER.search(s)
        if m is None:
            return s
        expr = m.group(1)
        if ran is not None:
            ran.append(expr.strip())
        out = jp(expr, ctx)
        if out is None:
            raise VariableError(f"variable {{{{{expr}}}}} resolved to null")
        if m.group(0) == s.strip() and "{{" not in expr:
            return out  # the whole value is one variable: keeps its type
        text = out if isinstance(out, str) else json.dumps(out, separators=(",", ":"))
        s = s[: m.start()] + text + s[m.end() :]


def load_context(r: Obj, req: Obj, configmaps: dict[tuple[str, str], Obj], api: dict[str, Obj], ran: list[str]) -> Obj:
    ctx: Obj = {"request": req}
    for entry in r.get("context") or []:
        name = entry["name"]
        if "configMap" in entry:
            cm = configmaps.get((entry["configMap"]["namespace"], entry["configMap"]["name"]))
            if cm is None:
                raise VariableError(f"context {name}: configmap not found")
            ctx[name] = cm
        elif "apiCall" in entry:
            call = entry["apiCall"]
            if call.get("method", "GET") != "GET" or "service" in call:
                raise Unsupported(f"apiCall {call}")
            path = substitute(call["urlPath"], ctx, ran)
            obj = api.get(path)
            if obj is None:
                if "default" not in call:
                    raise VariableError(f"context {name}: GET {path}: 404")
                ctx[name] = call["default"]
                continue
            val = jp(call["jmesPath"], obj) if "jmesPath" in call else obj
            ran.append(call.get("jmesPath", ""))
            ctx[name] = call.get("default") if val is None else val
        elif "variable" in entry:
            var = entry["variable"]
            expr = substitute(var["jmesPath"], ctx, ran)
            ran.append(expr)
            val = jp(expr, ctx)
            if val is None:
                if "default" not in var:
                    raise VariableError(f"context {name}: {expr} resolved to null")
                val = var["default"]
            ctx[name] = val
        else:
            raise Unsupported(f"context entry {entry}")
    return ctx


def _num(x: Any) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        raise VariableError(f"{x!r} is not a number") from None


def condition(c: Obj, ctx: Obj, ran: list[str]) -> bool:
    key, value = substitute(c["key"], ctx, ran), substitute(c["value"], ctx, ran)
    op = c["operator"]
    if op == "Equals":
        return bool(key == value)
    if op == "NotEquals":
        return bool(key != value)
    if op == "GreaterThan":
        return _num(key) > _num(value)
    raise Unsupported(f"operator {op}")


def conditions_hold(block: Obj, ctx: Obj, ran: list[str]) -> bool:
    if set(block) - {"all", "any"}:
        raise Unsupported(f"conditions {sorted(block)}")
    all_ok = all(condition(c, ctx, ran) for c in block.get("all") or [])
    any_ok = not block.get("any") or any(condition(c, ctx, ran) for c in block["any"])
    return all_ok and any_ok


# --- strategic merge with Kyverno anchors --------------------------------------------------------

_ADD = re.compile(r"^\+\((.+)\)$")
_COND = re.compile(r"^\((.+)\)$")
_MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name", "env": "name"}


def _wild(pattern: Any, value: Any) -> bool:
    if isinstance(pattern, str) and isinstance(value, str):
        return re.fullmatch(re.escape(pattern).replace(r"\*", ".*").replace(r"\?", "."), value) is not None
    return bool(pattern == value)


def _strip(patch: Any) -> Any:
    if isinstance(patch, dict):
        out = {}
        for k, v in patch.items():
            if _COND.match(k) and not _ADD.match(k):
                raise Unsupported(f"conditional anchor {k} outside a list element")
            out[_ADD.match(k).group(1) if _ADD.match(k) else k] = _strip(v)
        return out
    if isinstance(patch, list):
        return [_strip(x) for x in patch]
    return patch


def smp(target: Any, patch: Any, fieldname: str = "") -> Any:
    if isinstance(patch, list):
        if not isinstance(target, list):
            return _strip(patch)
        key = _MERGE_KEYS.get(fieldname)
        items = copy.deepcopy(target)
        for p in patch:
            conds = {_COND.match(k).group(1): v for k, v in p.items() if _COND.match(k) and not _ADD.match(k)}
            rest = {k: v for k, v in p.items() if not (_COND.match(k) and not _ADD.match(k))}
            if conds:
                for i, it in enumerate(items):
                    if all(_wild(v, it.get(k)) for k, v in conds.items()):
                        items[i] = smp(it, rest)
            elif key is not None:
                for i, it in enumerate(items):
                    if it.get(key) == p.get(key):
                        items[i] = smp(it, p)
                        break
                else:
                    items.append(_strip(p))
            else:
                return _strip(patch)  # an atomic list: replaced
        return items
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        m = _ADD.match(k)
        if m:
            if m.group(1) not in out:
                out[m.group(1)] = _strip(v)
            continue
        if _COND.match(k):
            raise Unsupported(f"conditional anchor {k} outside a list element")
        out[k] = smp(out.get(k), v, k)
    return out


# --- one rule ------------------------------------------------------------------------------------


def apply_rule(
    r: Obj,
    req: Obj,
    *,
    configmaps: dict[tuple[str, str], Obj] | None = None,
    api: dict[str, Obj] | None = None,
) -> Result:
    """The outcome of one rule for one admission request, as Kyverno reports it."""
    configmaps = configmaps or {}
    api = api or {}
    if not matches(r, req):
        return Result("skip", "does not match")
    if "validate" in r and "cel" in r["validate"]:
        try:
            return run_cel_rule(r, req, configmaps)
        except celpy.evaluation.CELEvalError as e:
            return Result("error", f"CEL evaluation error: {e.args[0]}")
    ran: list[str] = []
    try:
        ctx = load_context(r, req, configmaps, api, ran)
        if "preconditions" in r and not conditions_hold(r["preconditions"], ctx, ran):
            return Result("skip", "preconditions not met", evaluated=ran)
        if "validate" in r:
            v = r["validate"]
            if set(v) - {"message", "deny", "failureAction"}:
                raise Unsupported(f"validate keys {sorted(v)}")
            if conditions_hold(v["deny"]["conditions"], ctx, ran):
                return Result("fail", str(substitute(v["message"], ctx, ran)), evaluated=ran)
            return Result("pass", evaluated=ran)
        mut = r["mutate"]
        resource = copy.deepcopy(req["object"])
        if "patchStrategicMerge" in mut:
            patched = smp(resource, substitute(mut["patchStrategicMerge"], ctx, ran))
        elif "patchesJson6902" in mut:
            ops = substitute(yaml.safe_load(mut["patchesJson6902"]), ctx, ran)
            patched = json_patch(resource, ops)
        else:
            raise Unsupported(f"mutate keys {sorted(mut)}")
        return Result("pass", patched=patched, evaluated=ran)
    except VariableError as e:
        return Result("error", str(e), evaluated=ran)
