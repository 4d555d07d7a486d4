"""Contract compiler: a repository of YAML files -> one canonical bundle payload.

Stage one, per file: parse YAML, validate each document against the models (``sco.contract.model``),
resolve it to the plain dict the bundle carries. Files are independent, so large repositories are
processed by a pool of worker processes (YAML construction is CPU-bound Python).
Stage two, across files, on the resolved dicts: one hall policy, unique names, and feasibility: the drain
budget and final write fit the notice window less the margin, tier-1 floors fit the reserved capacity, no
two contracts select the same workloads, Slurm contracts are requeueable, Spark contracts enable
decommissioning. Every problem in every file is reported at once, each with its file and field path.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from sco.contract.bundle import MAX_SERIAL, bundle_lifetime_s, content_digest
from sco.contract.model import API_VERSION, SELECTOR_TAGS, Contract, HallPolicy
from sco.errors import ConfigError, ContractError, Problem

# libyaml when present: its parser is C, though PyYAML still constructs objects in Python.
_Base: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
MAX_FILE_BYTES = 1 << 20  # a contract is a few hundred bytes; a larger file is a mistake or an attack
MAX_ISSUED_AHEAD_S = 86_400  # clocks disagree by seconds, not days: a later issue time is a typo (ms for s)


def issued_at_problem(value: int, now: float | None = None) -> str | None:
    """Why ``value`` cannot be a bundle's issue time (None: it can). Nodes report a bundle's age from it."""
    now = time.time() if now is None else now
    if value < 0:
        return "expected Unix epoch seconds, not a negative number"
    if value > now + MAX_ISSUED_AHEAD_S:
        return f"more than a day in the future (now is {int(now)}; milliseconds instead of seconds?)"
    return None


_STR, _INT, _BOOL, _MAP, _SEQ, _MERGE = (
    f"tag:yaml.org,2002:{t}" for t in ("str", "int", "bool", "map", "seq", "merge")
)


class _Loader(_Base):  # type: ignore[misc]
    """Safe loading that refuses duplicate mapping keys (PyYAML silently keeps the last one).

    The hot path of a compile (10,000 contracts): PyYAML's constructor walks every node through
    ``construct_object`` (bookkeeping and generators per node), and the duplicate check once built every key a
    second time on top. Here the plain nodes a contract is made of (str, decimal int, bool, null, mappings and
    sequences without merge keys) are built in one recursive pass, with the duplicate check as the dict is
    filled; anything else (anchors shared by aliases, other tags, ``<<``) goes through PyYAML's own
    constructor, so the result is exactly SafeLoader's."""

    # The composer asks the resolver about every node. A plain scalar whose first character starts no implicit
    # type (bool, int, float, null, timestamp, merge, value) is a string: most of a contract ("wl-00042",
    # "team-7", "spot"); and SafeLoader has no path resolvers, so descending and ascending cost nothing.
    _TYPED_FIRST = frozenset(k for k in _Base.yaml_implicit_resolvers if k)
    assert None not in _Base.yaml_implicit_resolvers and not _Base.yaml_path_resolvers

    # Of the typed ones, a contract's are decimal integers (tiers, budgets) and booleans: told apart here without
    # PyYAML's regular expressions (the spellings of its bool resolver; a leading 0 is octal: PyYAML's path).
    _BOOL_WORDS = frozenset(
        w for b in ("yes", "no", "true", "false", "on", "off") for w in (b, b.capitalize(), b.upper())
    )

    def resolve(self, kind: Any, value: Any, implicit: Any) -> Any:
        if kind is yaml.ScalarNode and implicit[0] and value:
            first = value[0]
            if first not in self._TYPED_FIRST:
                return _STR
            if first != "0" and value.isascii() and value.isdigit():
                return _INT
            if value in self._BOOL_WORDS:
                return _BOOL
        return super().resolve(kind, value, implicit)

    def descend_resolver(self, current_node: Any, current_index: Any) -> None:
        return None

    def ascend_resolver(self) -> None:
        return None

    def construct_document(self, node: Any) -> Any:
        self._built: dict[int, Any] = {}  # id(node) -> its dict or list: an alias gets the same object
        try:
            return self._build(node)
        finally:
            # what PyYAML's construct_document resets (its constructor is only ever called with deep=True
            # here, so no state generators are left to run)
            self._built = {}
            self.constructed_objects: dict[Any, Any] = {}
            self.recursive_objects: dict[Any, Any] = {}

    def _build(self, node: Any) -> Any:
        tag = node.tag
        if tag == _STR:
            return node.value
        if tag in (_MAP, _SEQ):
            hit = self._built.get(id(node))
            if hit is not None:
                return hit
            if tag == _SEQ:
                seq: list[Any] = []
                self._built[id(node)] = seq
                seq.extend(self._build(v) for v in node.value)
                return seq
            out: dict[Any, Any] = {}
            self._built[id(node)] = out
            for k, v in node.value:
                if k.tag == _MERGE:
                    del self._built[id(node)]
                    return self.construct_object(node, deep=True)
                key = self._build(k)
                try:
                    dup = key in out
                except TypeError:
                    del self._built[id(node)]
                    return self.construct_object(node, deep=True)  # unhashable: PyYAML's own error
                if dup:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark, f"duplicate key {key!r}", k.start_mark
                    )
                out[key] = self._build(v)
            return out
        value = node.value
        if tag == _INT and value.isascii() and value.isdigit() and (value[0] != "0" or value == "0"):
            return int(value)  # plain decimal (a leading 0 is octal in YAML 1.1: PyYAML's path)
        if tag == _BOOL and value in self._BOOL_WORDS:  # a !!bool the file names itself may be any spelling
            return self.bool_values[value.lower()]
        return self.construct_object(node, deep=True)

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        """PyYAML's path (merge keys): the same duplicate check, on the keys as written."""
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                dup = key in seen
            except TypeError:
                continue  # unhashable: the base constructor reports it
            if dup:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return dict(super().construct_mapping(node, deep=deep))


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _Loader.construct_mapping)

_KINDS: dict[str, type[BaseModel]] = {"WorkloadContract": Contract, "HallPolicy": HallPolicy}
PARALLEL_MIN_FILES = 16  # below this a pool costs more than it saves
CHUNKS_PER_WORKER = 4


@dataclass(frozen=True)
class Resolved:
    """One valid document, as the bundle will carry it."""

    kind: str  # "WorkloadContract" | "HallPolicy"
    where: str  # "contracts/etl.yaml", or "contracts/etl.yaml#2" for a file's second document
    name: str
    body: dict[str, Any]


def list_files(repo: Path) -> list[str]:
    """Every YAML file under ``repo`` (hidden directories such as .git skipped), in path order, and every
    symlink leading out of it: rglob does not follow a directory symlink, so one leading out would be skipped
    silently; listed, :func:`load_file` refuses it by name as it does a file symlink."""
    root = repo.resolve()
    out: list[str] = []
    for p in repo.rglob("*"):
        rel = p.relative_to(repo)
        if any(part.startswith(".") for part in rel.parts):
            continue
        yaml_file = p.suffix in (".yaml", ".yml") and (p.is_file() or p.is_symlink())
        if yaml_file or (p.is_symlink() and not _inside(p, root)):
            out.append(rel.as_posix())
    return sorted(out)


def _inside(link: Path, root: Path) -> bool:
    try:
        return link.resolve().is_relative_to(root)
    except (OSError, RuntimeError):  # a symlink loop: listed, and load_file says it cannot be read
        return False


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in SELECTOR_TAGS:
            continue
        else:
            out += f".{part}" if out else str(part)
    return out


def _problems(where: str, err: ValidationError) -> list[Problem]:
    return [
        Problem(where, _loc(e["loc"]), e["msg"].removeprefix("Value error, ")) for e in err.errors(include_url=False)
    ]


def _resolve(where: str, model: BaseModel) -> Resolved:
    if isinstance(model, HallPolicy):
        # exclude_none: an unset checkpointStore leaves the payload (and older halls' bundles) as they were
        spec = model.spec.model_dump(by_alias=True, mode="json", exclude_none=True)
        return Resolved("HallPolicy", where, model.metadata.name, spec)
    assert isinstance(model, Contract)
    body: dict[str, Any] = model.spec.model_dump(by_alias=True, mode="json", exclude_none=True)
    body.update(name=model.metadata.name, owner=model.metadata.owner, source=where)
    return Resolved("WorkloadContract", where, model.metadata.name, body)


def load_file(repo: Path, rel: str) -> tuple[list[Resolved], list[Problem]]:
    """Stage one for one file: every document validated and resolved, or the problems found."""
    path = repo / rel
    try:
        real = path.resolve(strict=True)
        if not real.is_relative_to(repo.resolve()):
            return [], [Problem(rel, "", f"a symlink that leaves the repository (to {real}): refused")]
        size = real.stat().st_size
        if size > MAX_FILE_BYTES:
            return [], [Problem(rel, "", f"{size} bytes, more than the {MAX_FILE_BYTES} a contract file may hold")]
    except OSError as e:
        return [], [Problem(rel, "", f"cannot read: {e}")]
    except RuntimeError:  # pathlib's word for a symlink loop
        return [], [Problem(rel, "", "cannot read: a symlink loop")]
    try:
        docs = [d for d in yaml.load_all(path.read_text(encoding="utf-8"), Loader=_Loader) if d is not None]
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        line = f"line {mark.line + 1}: " if mark is not None else ""
        what = "invalid YAML" if "duplicate key" not in str(e.problem) else "refused"
        return [], [Problem(rel, "", f"{line}{what}: {e.problem}")]
    except (yaml.YAMLError, UnicodeDecodeError, OSError) as e:
        return [], [Problem(rel, "", f"cannot read: {e}")]
    out: list[Resolved] = []
    problems: list[Problem] = []
    for i, doc in enumerate(docs):
        where = rel if len(docs) == 1 else f"{rel}#{i + 1}"
        if not isinstance(doc, dict):
            problems.append(Problem(where, "", "expected a mapping with apiVersion and kind"))
            continue
        if doc.get("apiVersion") != API_VERSION:
            problems.append(Problem(where, "apiVersion", f"expected {API_VERSION!r}"))
            continue
        model = _KINDS.get(str(doc.get("kind")))
        if model is None:
            problems.append(Problem(where, "kind", f"expected one of {', '.join(sorted(_KINDS))}"))
            continue
        try:
            out.append(_resolve(where, model.model_validate(doc)))
        except ValidationError as e:
            problems.extend(_problems(where, e))
    return out, problems


def _load_chunk(repo: Path, rels: list[str]) -> tuple[list[Resolved], list[Problem]]:
    out: list[Resolved] = []
    problems: list[Problem] = []
    for rel in rels:
        r, p = load_file(repo, rel)
        out += r
        problems += p
    return out, problems


def load(repo: Path, workers: int | None = None) -> tuple[list[Resolved], list[Problem]]:
    if not repo.is_dir():
        return [], [Problem(str(repo), "", "not a directory")]
    files = list_files(repo)
    workers = workers if workers is not None else (os.cpu_count() or 1)
    if workers <= 1 or len(files) < PARALLEL_MIN_FILES:
        return _load_chunk(repo, files)
    # Contiguous chunks keep the output in path order, so results do not depend on the pool; several per worker,
    # so a worker the machine runs slower (a shared host) takes fewer of them instead of holding up the end.
    size = -(-len(files) // (workers * CHUNKS_PER_WORKER))
    chunks = [files[i : i + size] for i in range(0, len(files), size)]
    ctx = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(max_workers=min(workers, len(chunks)), mp_context=ctx) as pool:
        results = list(pool.map(_load_chunk, [repo] * len(chunks), chunks))
    out: list[Resolved] = []
    problems: list[Problem] = []
    for r, p in results:
        out += r
        problems += p
    return out, problems


def _k8s_overlap(a: dict[str, Any], b: dict[str, Any]) -> bool:
    # Equality-only selectors overlap unless some key is required with two different values:
    # a pod carrying the union of both label sets would match both.
    if a["namespace"] != b["namespace"]:
        return False
    small, big = sorted((a.get("matchLabels", {}), b.get("matchLabels", {})), key=len)
    return all(big.get(k, v) == v for k, v in small.items())


def _slurm_overlap(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["account"] != b["account"]:
        return False
    pa, pb = a.get("partitions") or [], b.get("partitions") or []
    return not pa or not pb or bool(set(pa) & set(pb))


def _checkpoint_fits(c: Resolved, hall: dict[str, Any]) -> list[Problem]:
    """A declared checkpoint must fit the drain budget at the hall's measured store throughput."""
    store = c.body["checkpoint"].get("store")
    if not store:
        return []
    where = "spec.checkpoint.store.sizeMiB"
    hs = hall.get("checkpointStore")
    if not hs:
        return [
            Problem(
                c.where,
                where,
                f"a {store['sizeMiB']} MiB checkpoint cannot be checked: the hall policy has no checkpointStore"
                " (endpoint, throughputMiBPerSecond)",
            )
        ]
    size, rate, budget = store["sizeMiB"], hs["throughputMiBPerSecond"], c.body["drainBudgetSeconds"]
    save_s = size / rate
    if save_s > budget:
        return [
            Problem(
                c.where,
                where,
                f"a {size} MiB checkpoint takes {save_s:.1f} s at the hall's measured store throughput of {rate}"
                f" MiB/s, more than the drain budget of {budget} s (drainBudgetSeconds): raise the budget to at"
                f" least {math.ceil(save_s)} s or make the checkpoint smaller than {rate * budget} MiB",
            )
        ]
    return []


def feasibility(policy: Resolved, contracts: list[Resolved]) -> list[Problem]:
    problems: list[Problem] = []
    spec = policy.body
    window, margin = spec["noticeWindowSeconds"], spec["safetyMarginSeconds"]
    usable = window - margin
    floors: list[tuple[str, dict[str, int]]] = []
    k8s_by_ns: dict[str, list[Resolved]] = defaultdict(list)
    slurm_by_account: dict[str, list[Resolved]] = defaultdict(list)

    for c in contracts:
        s = c.body
        budget, final = s["drainBudgetSeconds"], s["finalWriteSeconds"]
        if budget + final > usable:
            problems.append(
                Problem(
                    c.where,
                    "spec.drainBudgetSeconds",
                    f"drain budget {budget} s + final write {final} s = {budget + final} s does not fit the "
                    f"notice window {window} s less the safety margin {margin} s ({usable} s)",
                )
            )
        problems.extend(_checkpoint_fits(c, spec))
        if s["scheduler"] == "slurm" and s["requeue"]["policy"] == "never":
            problems.append(
                Problem(c.where, "spec.requeue.policy", "slurm contracts must be requeueable (not 'never')")
            )
        if s["scheduler"] == "spark" and not s.get("spark", {}).get("decommission"):
            problems.append(
                Problem(c.where, "spec.spark.decommission", "spark contracts must enable decommissioning (true)")
            )
        if "floor" in s:
            floors.append((c.name, s["floor"]))
        if "account" in s["selector"]:
            slurm_by_account[s["selector"]["account"]].append(c)
        else:
            k8s_by_ns[s["selector"]["namespace"]].append(c)

    reserved = spec["reservedCapacity"]
    for unit, field in (("vCPU", "vcpus"), ("GiB", "memoryGiB")):
        total = sum(f[field] for _, f in floors)
        if total > reserved[field]:
            parts = ", ".join(f"{name} {f[field]}" for name, f in floors)
            problems.append(
                Problem(
                    policy.where,
                    f"spec.reservedCapacity.{field}",
                    f"tier-1 floors need {total} {unit} ({parts}) but only {reserved[field]} are reserved",
                )
            )

    for groups, overlap in ((k8s_by_ns, _k8s_overlap), (slurm_by_account, _slurm_overlap)):
        for group in groups.values():
            for i, a in enumerate(group):
                for b in group[i + 1 :]:
                    if overlap(a.body["selector"], b.body["selector"]):
                        problems.append(
                            Problem(
                                b.where,
                                "spec.selector",
                                f"selects the same workloads as contract {a.name!r} ({a.where})",
                            )
                        )
    return problems


def compile_repo(
    repo: Path,
    *,
    previous: dict[str, Any] | None = None,
    serial: int | None = None,
    issued_at: int | None = None,
    workers: int | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    """The bundle payload for ``repo``; raises ContractError listing every problem.

    Serial: ``serial`` if given (it must exceed the previous one); otherwise the previous serial when the
    content is unchanged (same input, same bytes), else the previous serial + 1 (1 with no previous).
    Expiry: ``now`` (the signing time) + the policy's bundleLifetimeSeconds; an unchanged bundle keeps the previous
    one's ``expiresAt`` (same bytes) while more than half of that lifetime is left, else it is re-dated.
    """
    if issued_at is not None and (why := issued_at_problem(issued_at)):
        raise ConfigError(f"issued_at {issued_at}: {why}")
    loaded, problems = load(Path(repo), workers)
    policies = [x for x in loaded if x.kind == "HallPolicy"]
    contracts = [x for x in loaded if x.kind == "WorkloadContract"]
    if len(policies) != 1 and not any(p.field == "" and p.where == str(repo) for p in problems):
        where = ", ".join(p.where for p in policies) or str(repo)
        problems.append(Problem(where, "kind", f"expected exactly one HallPolicy, found {len(policies)}"))
    seen: dict[str, str] = {}
    for c in contracts:
        if c.name in seen:
            problems.append(Problem(c.where, "metadata.name", f"{c.name!r} is already defined in {seen[c.name]}"))
        else:
            seen[c.name] = c.where
    if not problems:
        problems.extend(feasibility(policies[0], contracts))
    if problems:
        raise ContractError(f"{len(problems)} problem(s) in {repo}", problems)

    hall, policy = policies[0].name, policies[0].body
    resolved = sorted((c.body for c in contracts), key=lambda d: d["name"])
    digest = content_digest(hall, policy, resolved)

    prev_serial = int(previous.get("serial", 0)) if previous else 0
    unchanged = bool(previous and previous.get("contentDigest") == digest and previous.get("hall") == hall)
    if serial is not None:
        if not 1 <= serial <= MAX_SERIAL:
            raise ContractError(f"--serial {serial}: expected 1 to {MAX_SERIAL} (2^53 - 1, the bound nodes keep)")
        if serial <= prev_serial and not unchanged:
            raise ContractError(f"--serial {serial} must be above the previous bundle's serial {prev_serial}")
        new_serial = serial
    elif unchanged:
        new_serial = prev_serial
        if issued_at is None and previous is not None and (inherited := previous.get("issuedAt")) is not None:
            # the previous bundle may predate the bound (or be hand-made): its time is checked like a given one
            if not isinstance(inherited, int) or isinstance(inherited, bool):
                raise ConfigError(f"issuedAt {inherited!r} of the previous bundle: expected Unix epoch seconds")
            if why := issued_at_problem(inherited):
                raise ConfigError(f"issuedAt {inherited} of the previous bundle: {why}; give issued_at to replace it")
            issued_at = inherited
    else:
        new_serial = prev_serial + 1

    payload: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "kind": "ContractBundle",
        "hall": hall,
        "serial": new_serial,
        "contentDigest": digest,
        "policy": policy,
        "contracts": resolved,
    }
    if issued_at is not None:
        payload["issuedAt"] = int(issued_at)
    now = time.time() if now is None else now
    lifetime = bundle_lifetime_s(policy)
    kept = previous.get("expiresAt") if previous is not None and unchanged else None
    if isinstance(kept, int) and not isinstance(kept, bool) and kept - now > lifetime / 2:
        payload["expiresAt"] = kept
    else:
        payload["expiresAt"] = int(now) + lifetime
    if issued_at is not None and payload["expiresAt"] <= issued_at:
        raise ConfigError(f"issued_at {issued_at}: after the bundle's expiry {payload['expiresAt']} (now + lifetime)")
    return payload
