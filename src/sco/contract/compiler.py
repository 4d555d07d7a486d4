"""Contract compiler: a repository of YAML files -> one canonical bundle payload.

Every problem in every file is reported at once (file and field path), then feasibility is checked
across contracts: the drain budget and final write fit the notice window less the margin, tier-1 floors
fit the reserved capacity, no two contracts select the same workloads, Slurm contracts are requeueable,
Spark contracts enable decommissioning.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from sco.contract.bundle import content_digest
from sco.contract.model import (
    API_VERSION,
    SELECTOR_TAGS,
    Contract,
    HallPolicy,
    KubernetesSelector,
    SlurmSelector,
)
from sco.errors import ContractError, Problem

# libyaml when present: ~10x faster on large repositories
_Loader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

_KINDS: dict[str, type[BaseModel]] = {"WorkloadContract": Contract, "HallPolicy": HallPolicy}


@dataclass(frozen=True)
class Source:
    """One YAML document of the repository."""

    where: str  # "contracts/etl.yaml", or "contracts/etl.yaml#2" for the second document of a file
    doc: Any


@dataclass(frozen=True)
class Loaded:
    where: str
    model: BaseModel


def iter_sources(repo: Path) -> Iterator[Source | Problem]:
    """Every YAML document under ``repo`` (hidden directories such as .git skipped), in path order."""
    if not repo.is_dir():
        yield Problem(str(repo), "", "not a directory")
        return
    files = sorted(
        p
        for p in repo.rglob("*")
        if p.suffix in (".yaml", ".yml")
        and p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(repo).parts)
    )
    for path in files:
        rel = path.relative_to(repo).as_posix()
        try:
            docs = [d for d in yaml.load_all(path.read_text(encoding="utf-8"), Loader=_Loader) if d is not None]
        except yaml.MarkedYAMLError as e:
            mark = e.problem_mark
            line = f"line {mark.line + 1}: " if mark is not None else ""
            yield Problem(rel, "", f"{line}invalid YAML: {e.problem}")
            continue
        except (yaml.YAMLError, UnicodeDecodeError, OSError) as e:
            yield Problem(rel, "", f"cannot read: {e}")
            continue
        for i, doc in enumerate(docs):
            yield Source(rel if len(docs) == 1 else f"{rel}#{i + 1}", doc)


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


def load(repo: Path) -> tuple[list[Loaded], list[Problem]]:
    loaded: list[Loaded] = []
    problems: list[Problem] = []
    for item in iter_sources(repo):
        if isinstance(item, Problem):
            problems.append(item)
            continue
        doc = item.doc
        if not isinstance(doc, dict):
            problems.append(Problem(item.where, "", "expected a mapping with apiVersion and kind"))
            continue
        if doc.get("apiVersion") != API_VERSION:
            problems.append(Problem(item.where, "apiVersion", f"expected {API_VERSION!r}"))
            continue
        model = _KINDS.get(str(doc.get("kind")))
        if model is None:
            problems.append(Problem(item.where, "kind", f"expected one of {', '.join(sorted(_KINDS))}"))
            continue
        try:
            loaded.append(Loaded(item.where, model.model_validate(doc)))
        except ValidationError as e:
            problems.extend(_problems(item.where, e))
    return loaded, problems


def _k8s_overlap(a: KubernetesSelector, b: KubernetesSelector) -> bool:
    # Equality-only selectors overlap unless some key is required with two different values:
    # a pod carrying the union of both label sets would match both.
    if a.namespace != b.namespace:
        return False
    small, big = sorted((a.match_labels, b.match_labels), key=len)
    return all(big.get(k, v) == v for k, v in small.items())


def _slurm_overlap(a: SlurmSelector, b: SlurmSelector) -> bool:
    if a.account != b.account:
        return False
    return not a.partitions or not b.partitions or bool(set(a.partitions) & set(b.partitions))


def _feasibility(policy: Loaded, contracts: list[Loaded]) -> list[Problem]:
    problems: list[Problem] = []
    hall = policy.model
    assert isinstance(hall, HallPolicy)
    window, margin = hall.spec.notice_window_seconds, hall.spec.safety_margin_seconds
    usable = window - margin
    floor_vcpus: list[tuple[str, int]] = []
    floor_mem: list[tuple[str, int]] = []
    k8s_by_ns: dict[str, list[Loaded]] = defaultdict(list)
    slurm_by_account: dict[str, list[Loaded]] = defaultdict(list)

    for c in contracts:
        m = c.model
        assert isinstance(m, Contract)
        s = m.spec
        need = s.drain_budget_seconds + s.final_write_seconds
        if need > usable:
            problems.append(
                Problem(
                    c.where,
                    "spec.drainBudgetSeconds",
                    f"drain budget {s.drain_budget_seconds} s + final write {s.final_write_seconds} s = {need} s "
                    f"does not fit the notice window {window} s less the safety margin {margin} s "
                    f"({usable} s)",
                )
            )
        if s.scheduler == "slurm" and s.requeue.policy == "never":
            problems.append(
                Problem(c.where, "spec.requeue.policy", "slurm contracts must be requeueable (not 'never')")
            )
        if s.scheduler == "spark" and (s.spark is None or not s.spark.decommission):
            problems.append(
                Problem(c.where, "spec.spark.decommission", "spark contracts must enable decommissioning (true)")
            )
        if s.floor is not None:
            floor_vcpus.append((m.metadata.name, s.floor.vcpus))
            floor_mem.append((m.metadata.name, s.floor.memory_gib))
        if isinstance(s.selector, SlurmSelector):
            slurm_by_account[s.selector.account].append(c)
        else:
            k8s_by_ns[s.selector.namespace].append(c)

    reserved = hall.spec.reserved_capacity
    for unit, floors, have, field in (
        ("vCPU", floor_vcpus, reserved.vcpus, "vcpus"),
        ("GiB", floor_mem, reserved.memory_gib, "memoryGiB"),
    ):
        total = sum(n for _, n in floors)
        if total > have:
            parts = ", ".join(f"{name} {n}" for name, n in floors)
            problems.append(
                Problem(
                    policy.where,
                    f"spec.reservedCapacity.{field}",
                    f"tier-1 floors need {total} {unit} ({parts}) but only {have} are reserved",
                )
            )

    def pairs(groups: dict[str, list[Loaded]], overlap: Any) -> None:
        for group in groups.values():
            for i, a in enumerate(group):
                for b in group[i + 1 :]:
                    sa, sb = a.model.spec.selector, b.model.spec.selector  # type: ignore[attr-defined]
                    if overlap(sa, sb):
                        problems.append(
                            Problem(
                                b.where,
                                "spec.selector",
                                f"selects the same workloads as contract {a.model.metadata.name!r} ({a.where})",  # type: ignore[attr-defined]
                            )
                        )

    pairs(k8s_by_ns, _k8s_overlap)
    pairs(slurm_by_account, _slurm_overlap)
    return problems


def _resolved(c: Loaded) -> dict[str, Any]:
    m = c.model
    assert isinstance(m, Contract)
    out: dict[str, Any] = m.spec.model_dump(by_alias=True, mode="json", exclude_none=True)
    out["name"] = m.metadata.name
    out["owner"] = m.metadata.owner
    out["source"] = c.where
    return out


def compile_repo(
    repo: Path,
    *,
    previous: dict[str, Any] | None = None,
    serial: int | None = None,
    issued_at: int | None = None,
) -> dict[str, Any]:
    """The bundle payload for ``repo``; raises ContractError listing every problem.

    Serial: ``serial`` if given (it must exceed the previous one); otherwise the previous serial when the
    content is unchanged (same input, same bytes), else the previous serial + 1 (1 with no previous).
    """
    loaded, problems = load(repo)
    policies = [x for x in loaded if isinstance(x.model, HallPolicy)]
    contracts = [x for x in loaded if isinstance(x.model, Contract)]
    if len(policies) != 1:
        where = ", ".join(p.where for p in policies) or str(repo)
        problems.append(Problem(where, "kind", f"expected exactly one HallPolicy, found {len(policies)}"))
    seen: dict[str, str] = {}
    for c in contracts:
        name = c.model.metadata.name  # type: ignore[attr-defined]
        if name in seen:
            problems.append(Problem(c.where, "metadata.name", f"{name!r} is already defined in {seen[name]}"))
        else:
            seen[name] = c.where
    if not problems:
        problems.extend(_feasibility(policies[0], contracts))
    if problems:
        raise ContractError(f"{len(problems)} problem(s) in {repo}", problems)

    hall_model = policies[0].model
    assert isinstance(hall_model, HallPolicy)
    hall = hall_model.metadata.name
    policy = hall_model.spec.model_dump(by_alias=True, mode="json")
    resolved = sorted((_resolved(c) for c in contracts), key=lambda d: d["name"])
    digest = content_digest(hall, policy, resolved)

    prev_serial = int(previous.get("serial", 0)) if previous else 0
    if serial is not None:
        if serial <= prev_serial and not (previous and previous.get("contentDigest") == digest):
            raise ContractError(f"--serial {serial} must be above the previous bundle's serial {prev_serial}")
        new_serial = serial
    elif previous and previous.get("contentDigest") == digest and previous.get("hall") == hall:
        new_serial = prev_serial
        if issued_at is None:
            issued_at = previous.get("issuedAt")
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
    return payload
