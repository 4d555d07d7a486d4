"""Reconciliation: the fleet state made to agree with what Nova has, before anything is planned.

One tagged list call (``sco-hall=<hall>``) is compared with the hall's records:

* a server with no record (a run killed between Nova's answer and the fleet state's write) is **adopted** into
  its slot's record, or a new one;
* a record stuck in ``requested``/``launching`` is **settled** to what Nova says (ACTIVE -> ``active``; ERROR ->
  ``failed`` and the server deleted, with Nova's fault as the reason; a server already stopped, paused, suspended
  or shelved before it was settled will not run by itself: ``failed`` and deleted the same way, its status the
  reason, not waited for until the run's timeout);
* a record whose server the tagged list no longer shows but Nova still has (its tags removed by hand) gets its
  tags back (``retagged``; one GET by id tells it from a deleted one);
* a record whose server Nova no longer has is **lost** (why, when it was last listed, an ``instance.lost``
  event): deleted by an operator, or by Blazar's own preemption when a host lease starts. Lost is no capacity;
* a ``requested`` record with no server that Nova does not have either never reached Nova: ``failed``, once its
  create window (``create_window_s`` from the record's write) is over. Inside it the create may still be in Nova's
  API (a run killed mid-call: nova-api finishes the request), so the hall's reconciliation lists again until the
  server shows or the window ends, and the record keeps its slot meanwhile (nothing is launched into it);
* a record the product deleted whose server is still listed, a failed launch's server, or a second server in one
  slot is **surplus**: deleted, all at once, and waited for until Nova no longer lists it.

Instances under reclaim (``notified`` ... ``deleting`` with a reclaim id) are the reclaimer's: reconciliation
never moves them, and says when their server is gone. Nothing is relaunched here: what to launch is the plan's.

Shape (as a Kubernetes controller's): ``FleetIO.observe`` reads the fleet state and lists Nova once into a ``View``
(a frozen snapshot); ``decide`` and ``decide_builds`` turn a view into changes (``Adopt``, ``Move``, ``Lose``,
``Retag``, ``Delete``) without any I/O, so the unit tests call them with literals; ``FleetIO.apply`` is the only
place they reach Nova and the fleet state, each change written with its event. Check mode stops before ``apply``.
``FleetIO.settle_builds`` is the one wait for servers still building, for the hall's reconciliation and the
acquirer alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from sco.control.nova import (
    TAG,
    Meter,
    delete_all,
    entry_servers,
    hall_servers,
    restore_tags,
    server_still_there,
    slot_of,
    tag_value,
    wait_gone,
    wait_until,
)
from sco.state.fleet import LIVE, LOST, RECLAIMING, FleetState, Instance

SETTLING = ("requested", "launching")
# How long after a create was recorded its server may still appear: a killed run's POST finishes inside nova-api
# (the loop's calls have a 10-30 s deadline; nova-api's own request handling is bounded by its workers' timeouts).
CREATE_WINDOW_S = 60.0
# Nova's statuses a fresh server reaches only when something stopped it after its build (Nova's power sync stopping
# an instance whose host reported it off, an operator): none becomes ACTIVE without another action, so a launch
# still waiting on one is a failed launch. Transient ones (REBOOT, MIGRATING, UNKNOWN while a compute is down) wait.
STOPPED = frozenset({"SHUTOFF", "PAUSED", "SUSPENDED", "SHELVED", "SHELVED_OFFLOADED", "SOFT_DELETED"})
NEVER_REACHED = "the launch never reached Nova (its run stopped before the create was answered)"
SlotKey = tuple[str, str, int]


def _fault(server: Any) -> str:
    f = getattr(server, "fault", None)
    if isinstance(f, dict):
        return str(f.get("message") or f.get("details") or "")
    return str(f or "")


def _iso(epoch: float | None) -> str | None:
    return None if epoch is None else datetime.fromtimestamp(epoch, UTC).isoformat(timespec="seconds")


def build_seconds(server: Any) -> float | None:
    """Seconds from the server's create to its launch, by Nova's timestamps (None when either is missing)."""
    try:
        created = datetime.fromisoformat(str(server.created_at).replace("Z", "+00:00"))
        launched = datetime.fromisoformat(str(server.launched_at).replace("Z", "+00:00"))
    except (TypeError, ValueError, AttributeError):
        return None
    if created.tzinfo is None:
        created = created.replace(tzinfo=UTC)
    if launched.tzinfo is None:
        launched = launched.replace(tzinfo=UTC)
    took = (launched - created).total_seconds()
    return round(took, 1) if 0 <= took < 86400 else None


# --- what is observed -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Server:
    """What the decisions need of one Nova server; ``raw`` (openstacksdk's) only for ``apply``'s retag."""

    id: str
    name: str
    status: str
    pool: str | None = None
    entry: str | None = None
    slot: int | None = None
    created_at: str = ""
    fault: str = ""
    build_s: float | None = None
    raw: Any = field(default=None, compare=False, repr=False)


def server_view(s: Any) -> Server:
    return Server(
        id=str(s.id), name=str(s.name), status=str(s.status), pool=tag_value(s, "pool"), entry=tag_value(s, "entry"),
        slot=slot_of(s), created_at=str(getattr(s, "created_at", None) or ""), fault=_fault(s),
        build_s=build_seconds(s), raw=s,
    )  # fmt: skip


@dataclass(frozen=True)
class View:
    """One look at a scope (a hall, or one plan entry): Nova's tagged list and the fleet state's records."""

    hall: str
    servers: tuple[Server, ...]
    records: tuple[Instance, ...]
    """The scope's live and lost records."""
    past: Mapping[str, str] = field(default_factory=dict)
    """Listed servers whose record is not among ``records``: server id -> that record's state (deleted, failed)."""
    pools: frozenset[str] = frozenset()
    """The hall's pools in the fleet state (a server tagged with another is not the product's to touch)."""
    in_flight: Mapping[int, float] = field(default_factory=dict)
    """``requested`` records whose create may still be inside Nova: record id -> seconds left of its window."""
    still_there: Mapping[str, Server | None] = field(default_factory=dict)
    """Records' servers the tagged list did not show, looked up by id: the server (its tags removed) or None."""


# --- the changes ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Adopt:
    """A server Nova has and the fleet state does not: recorded into its slot."""

    server: Server
    state: str


@dataclass(frozen=True)
class Move:
    """A record moved to ``to`` with its ``event``: ``kind`` settle (to what Nova says), fail (its server in ERROR)
    or never_launched (its create never reached Nova)."""

    kind: str
    record: Instance
    to: str
    event: str
    only_from: tuple[str, ...] | None
    detail: Mapping[str, Any]
    server_id: str | None = None


@dataclass(frozen=True)
class Lose:
    """The record's server is gone from Nova, not by the product's hand."""

    record: Instance
    why: str


@dataclass(frozen=True)
class Retag:
    """The record's server is in Nova but not under the hall's tags (removed by hand): they are put back."""

    record: Instance
    server: Server
    tags: tuple[str, ...]


@dataclass(frozen=True)
class Delete:
    """A surplus server: a deleted record's, a failed launch's, a second one in a slot."""

    server_id: str
    name: str
    why: str


Change = Adopt | Move | Lose | Retag | Delete


@dataclass(frozen=True)
class Decisions:
    changes: tuple[Change, ...] = ()
    foreign: tuple[dict[str, Any], ...] = ()
    """Servers tagged with the hall that name no pool of the fleet state, or no slot: left alone, reported."""
    warnings: tuple[str, ...] = ()
    under_reclaim_gone: tuple[str, ...] = ()
    """Instances under reclaim whose server is gone already (the reclaimer confirms and records it)."""


# --- the decisions (pure) ---------------------------------------------------------------------------------------


def record_tags(hall: str, r: Instance) -> tuple[str, ...]:
    return (TAG.format("hall", hall), TAG.format("pool", r.pool), TAG.format("entry", r.plan_entry),
            TAG.format("slot", r.slot))  # fmt: skip


def lost_why(r: Instance) -> str:
    return (
        f"server {r.server_id} is no longer in Nova (last listed {_iso(r.last_seen) or 'never'}): deleted"
        " outside the product, e.g. by an operator or by a Blazar lease's preemption"
    )


def _settle_listed(r: Instance, s: Server, by: str | None, with_build: bool) -> list[Change]:
    """A record whose server the list shows: settled to what Nova says (ERROR, or stopped while still settling:
    failed, and the server deleted)."""
    said = {"by": by} if by else {}
    if s.status == "ERROR" and r.state in (*SETTLING, "active"):
        fault = s.fault[:500]
        return [
            Move("fail", r, "failed", "launch.failed", None, {"error": fault, "status": "ERROR", **said}, s.id),
            Delete(s.id, s.name, f"in ERROR: {fault[:300]}"),
        ]
    if r.state in SETTLING and s.status in STOPPED:
        why = f"{s.status} before it was ever settled ACTIVE" + (f": {s.fault[:300]}" if s.fault else "")
        return [
            Move("fail", r, "failed", "launch.failed", None, {"error": why, "status": s.status, **said}, s.id),
            Delete(s.id, s.name, why),
        ]
    if r.state in SETTLING and s.status == "ACTIVE":
        built = {"build_s": s.build_s} if with_build and s.build_s is not None else {}
        return [Move("settle", r, "active", "instance.active", SETTLING, {**built, **said}, s.id)]
    if r.state == "requested":  # the create was answered, the answer never recorded
        return [Move("settle", r, "launching", "launch.requested", ("requested",), said, s.id)]
    return []


def _unlisted(v: View, r: Instance, unseen_why: str | None = None) -> Change:
    """A record whose server the tagged list does not show: gone (lost), or its tags removed (one GET told them
    apart: it would run on unseen for ever while a replacement launched). Not looked up: ``unseen_why``."""
    assert r.server_id is not None
    if r.server_id not in v.still_there and unseen_why is not None:
        return Lose(r, unseen_why)
    srv = v.still_there.get(r.server_id)
    if srv is not None:
        return Retag(r, srv, record_tags(v.hall, r))
    return Lose(r, lost_why(r))


def decide(v: View, *, by: str = "reconcile") -> Decisions:
    """What makes the fleet state agree with Nova in ``v``'s scope (the module docstring's cases)."""
    changes: list[Change] = []
    foreign: list[dict[str, Any]] = []
    warnings: list[str] = []
    reclaim_gone: list[str] = []
    by_sid = {r.server_id: r for r in v.records if r.server_id}
    listed = {s.id for s in v.servers}
    # slot -> (name, server id) of the record holding it (live, not lost): who owns a slot when a second server
    # turns up in it; an adopted server holds its slot from then on
    holder: dict[tuple[Any, ...], tuple[str, str | None]] = {
        (r.pool, r.plan_entry, r.slot): (r.name, r.server_id) for r in v.records if r.state in LIVE
    }
    for s in sorted(v.servers, key=lambda s: (s.created_at, s.id)):
        rec = by_sid.get(s.id)
        if rec is None:
            if s.id in v.past:  # deleted or failed in the fleet state, still in Nova: finish the delete
                changes.append(Delete(s.id, s.name, f"its record is {v.past[s.id]}"))
                continue
            if s.pool is None or s.entry is None or s.slot is None:
                foreign.append({"name": s.name, "server_id": s.id, "why": "no sco-pool/entry/slot tags"})
                continue
            if s.pool not in v.pools:
                foreign.append({"name": s.name, "server_id": s.id, "why": f"pool {s.pool} is not in the fleet state"})
                continue
            if s.status == "ERROR":
                changes.append(Delete(s.id, s.name, f"a launch in ERROR: {s.fault[:300]}"))
                continue
            held = holder.get((s.pool, s.entry, s.slot))
            if held is not None and held[1] and held[1] != s.id:
                changes.append(Delete(s.id, s.name, f"slot {s.slot} is {held[0]}'s"))
                continue
            changes.append(Adopt(s, "active" if s.status == "ACTIVE" else "launching"))
            holder[(s.pool, s.entry, s.slot)] = (s.name, s.id)
            continue
        if rec.state == LOST:  # listed again (a partial list earlier, a cell back): it holds capacity again
            if (rec.pool, rec.plan_entry, rec.slot) in holder:
                changes.append(Delete(s.id, s.name, f"lost, and slot {rec.slot} is taken"))
                continue
            to = "active" if s.status == "ACTIVE" else "launching"
            changes.append(Move("settle", rec, to, "instance.found", (LOST,), {"status": s.status}, s.id))
            continue
        changes += _settle_listed(rec, s, by, with_build=False)

    adopted = {(c.server.pool, c.server.entry, c.server.slot) for c in changes if isinstance(c, Adopt)}
    for r in v.records:
        if r.state == LOST or (r.server_id and r.server_id in listed):
            continue
        if r.server_id is None:
            if r.id in v.in_flight:
                warnings.append(
                    f"{r.name}: its create may still be inside Nova ({v.in_flight[r.id]:.0f} s of its window"
                    " left): it keeps its slot, and a later run settles it"
                )
            elif r.state == "requested" and (r.pool, r.plan_entry, r.slot) not in adopted:
                error = {"error": NEVER_REACHED}
                changes.append(Move("never_launched", r, "failed", "launch.failed", ("requested",), error))
            continue
        if r.state in ("requested", "launching", "active"):
            changes.append(_unlisted(v, r))
        elif r.state in (*RECLAIMING, "deleting"):
            reclaim_gone.append(r.name)
    return Decisions(tuple(changes), tuple(foreign), tuple(warnings), tuple(reclaim_gone))


def decide_builds(v: View, *, by: str | None) -> Decisions:
    """Records still building (``requested``/``launching`` with a server) against one list call: ACTIVE settles
    (with Nova's build time), ERROR fails and its server goes, a server no longer listed is lost (or retagged,
    when the view looked it up); the rest are still building."""
    listed = {s.id: s for s in v.servers}
    changes: list[Change] = []
    for r in v.records:
        if r.state not in SETTLING or not r.server_id:
            continue
        s = listed.get(r.server_id)
        found = v.still_there.get(r.server_id)
        if s is None and found is not None and (found.pool, found.entry, found.slot) == (r.pool, r.plan_entry, r.slot):
            # looked up by id, its tags intact: the tagged list missed a server still building (under load Nova
            # listed 29 of 30 fresh creates once); what the GET says, not a loss
            s = found
        if s is None:  # created, then gone before it was ever ACTIVE
            changes.append(_unlisted(v, r, f"server {r.server_id} vanished while launching"))
        else:
            changes += _settle_listed(r, s, by, with_build=True)
    return Decisions(tuple(changes))


def building(records: Iterable[Instance]) -> list[Instance]:
    return [r for r in records if r.state in SETTLING and r.server_id]


def project(records: Iterable[Instance], changes: Iterable[Change]) -> list[Instance]:
    """The live records once ``changes`` are written (an adopted server's new record has id 0 until then)."""
    live: dict[tuple[Any, ...], Instance] = {}
    lost: dict[int, Instance] = {}
    for r in records:
        if r.state in LIVE:
            live[(r.pool, r.plan_entry, r.slot, r.id)] = r
        elif r.state == LOST:
            lost[r.id] = r
    by_id = {r.id: k for k, r in live.items()}
    for c in changes:
        if isinstance(c, Adopt):
            s = c.server
            empty = [k for k, r in live.items() if k[:3] == (s.pool, s.entry, s.slot) and r.server_id is None]
            if empty:  # the slot's record that never got its server takes it (FleetState.adopt)
                live[empty[0]] = replace(live[empty[0]], state=c.state, server_id=s.id)
            else:
                new = Instance(0, "", str(s.pool), str(s.entry), int(s.slot or 0), s.name, s.id, c.state, None, None)
                live[(s.pool, s.entry, s.slot, -len(live) - 1)] = new
        elif isinstance(c, Move) and c.record.id in by_id:
            k = by_id[c.record.id]
            if c.to in LIVE:
                live[k] = replace(live[k], state=c.to)
            else:
                live.pop(k, None)
        elif isinstance(c, Move) and c.record.id in lost and c.to in LIVE:  # found
            r = lost.pop(c.record.id)
            live[(r.pool, r.plan_entry, r.slot, r.id)] = replace(r, state=c.to)
        elif isinstance(c, Lose) and c.record.id in by_id:
            live.pop(by_id[c.record.id], None)
    return sorted(live.values(), key=lambda r: (r.pool, r.plan_entry, r.slot, r.id))


def resolved(d: Decisions) -> int:
    """Records a builds decision took out of settling (active, failed or lost)."""
    return sum(1 for c in d.changes if isinstance(c, Lose) or (isinstance(c, Move) and c.to not in SETTLING))


# --- the report ---------------------------------------------------------------------------------------------------


@dataclass
class Reconciliation:
    hall: str
    listed: int = 0
    adopted: list[dict[str, Any]] = field(default_factory=list)
    settled: list[dict[str, Any]] = field(default_factory=list)
    lost: list[dict[str, Any]] = field(default_factory=list)
    never_launched: list[dict[str, Any]] = field(default_factory=list)
    surplus: list[dict[str, Any]] = field(default_factory=list)
    under_reclaim_gone: list[str] = field(default_factory=list)
    """Instances under reclaim whose server is gone already (the reclaimer confirms and records it)."""
    retagged: list[dict[str, Any]] = field(default_factory=list)
    """Records whose server Nova still has but no longer lists under the hall's tags: the tags put back."""
    foreign: list[dict[str, Any]] = field(default_factory=list)
    """Servers tagged with the hall that name no pool of the fleet state, or no slot: left alone, reported."""
    warnings: list[str] = field(default_factory=list)
    api_calls: int = 0
    check: bool = False

    def add(self, d: Decisions) -> None:
        """Say what ``d`` changes (or, in check mode, would change)."""
        for c in d.changes:
            if isinstance(c, Adopt):
                s = c.server
                self.adopted.append(
                    {"name": s.name, "server_id": s.id, "status": s.status, "pool": s.pool, "entry": s.entry,
                     "slot": s.slot}
                )  # fmt: skip
            elif isinstance(c, Move) and c.kind == "never_launched":
                self.never_launched.append({"name": c.record.name, "slot": c.record.slot})
            elif isinstance(c, Move):
                self.settled.append({"name": c.record.name, "server_id": c.server_id, "from": c.record.state,
                                     "to": c.to})  # fmt: skip
            elif isinstance(c, Lose):
                r = c.record
                self.lost.append({"name": r.name, "server_id": r.server_id, "why": c.why, "last_seen": r.last_seen})
            elif isinstance(c, Retag):
                r = c.record
                self.retagged.append({"name": r.name, "server_id": r.server_id, "tags": list(c.tags)})
            else:
                self.surplus.append({"name": c.name, "server_id": c.server_id, "why": c.why})
        self.foreign += d.foreign
        self.warnings += d.warnings
        self.under_reclaim_gone += d.under_reclaim_gone

    @property
    def drift(self) -> int:
        """Differences found between the fleet state and Nova (0: they agreed)."""
        found = len(self.adopted) + len(self.settled) + len(self.lost) + len(self.never_launched) + len(self.surplus)
        return found + len(self.retagged)

    @property
    def changed(self) -> bool:
        return self.drift > 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "hall": self.hall,
            "listed": self.listed,
            "drift": self.drift,
            "adopted": self.adopted,
            "settled": self.settled,
            "lost": self.lost,
            "never_launched": self.never_launched,
            "surplus": self.surplus,
            "retagged": self.retagged,
            "under_reclaim_gone": self.under_reclaim_gone,
            "foreign": self.foreign,
            "api_calls": self.api_calls,
        }

    def explain(self) -> list[str]:
        lines = [f"hall {self.hall}: Nova lists {self.listed} servers; drift {self.drift}"]
        lines += [f"adopted {a['name']} ({a['server_id']}, {a['status']})" for a in self.adopted]
        lines += [f"settled {s['name']}: {s['from']} -> {s['to']}" for s in self.settled]
        lines += [f"lost {x['name']} ({x['server_id']}): {x['why']}" for x in self.lost]
        lines += [f"never launched {x['name']}: marked failed" for x in self.never_launched]
        lines += [f"surplus {x['name']} ({x['server_id']}): {x['why']}" for x in self.surplus]
        lines += [
            f"retagged {x['name']} ({x['server_id']}): its tags were removed outside the product" for x in self.retagged
        ]
        return lines


# --- observe and apply: the only I/O --------------------------------------------------------------------------


@dataclass
class Applied:
    adopted: dict[SlotKey, Instance] = field(default_factory=dict)
    """The records adopted servers went into, by slot."""
    deleted: list[str] = field(default_factory=list)
    """Servers whose DELETE Nova accepted."""
    warnings: list[str] = field(default_factory=list)


class FleetIO:
    """Nova and the fleet state for one scope: a hall, or (``pool`` and ``entry``) one plan entry of it. The caller
    holds the hall's writer lock."""

    def __init__(
        self,
        cloud: Any,
        state: FleetState,
        meter: Meter,
        hall: str,
        *,
        pool: str | None = None,
        entry: str | None = None,
        concurrency: int = 8,
        delete_timeout_s: float = 120.0,
        create_window_s: float = CREATE_WINDOW_S,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.cloud, self.state, self.meter, self.hall = cloud, state, meter, hall
        self.pool, self.entry = pool, entry
        self.concurrency = concurrency
        self.delete_timeout_s = delete_timeout_s
        self.create_window_s = create_window_s
        self.sleep = sleep

    def servers(self) -> list[Server]:
        """One tagged list call for the scope."""
        if self.pool is not None and self.entry is not None:
            raw = entry_servers(self.cloud, self.meter, self.hall, self.pool, self.entry)
        else:
            raw = hall_servers(self.cloud, self.meter, self.hall)
        return [server_view(s) for s in raw]

    def records(self, states: tuple[str, ...] | None) -> list[Instance]:
        return self.state.instances(self.hall, pool=self.pool, plan_entry=self.entry, states=states)

    def observe(
        self, records: list[Instance], servers: list[Server], *, wait_in_flight: bool, pools: frozenset[str] | None
    ) -> View:
        """``servers`` (the scope's list) and ``records`` (its live and lost ones) with what deciding needs besides:
        creates still inside Nova waited for (``wait_in_flight``), listed servers' records outside the scope (one
        query), the hall's pools (``pools``, else one query), the unlisted records' servers looked up by id."""
        if wait_in_flight:
            in_flight = {r.id for r in records if r.state == "requested" and r.server_id is None}
            if in_flight:
                servers = self.await_in_flight(servers, in_flight)
        by_sid = {r.server_id for r in records if r.server_id}
        unrecorded = [s for s in servers if s.id not in by_sid]
        past = {sid: r.state for sid, r in self.state.by_servers([s.id for s in unrecorded]).items()}
        if pools is None:
            pools = frozenset(self.state.pool_names(self.hall)) if unrecorded else frozenset()
        window = {}
        if any(r.state == "requested" and r.server_id is None for r in records):
            window = self.state.in_flight(self.hall, self.create_window_s)
        listed = {s.id for s in servers}
        still = {
            r.server_id: self._get(r.server_id)
            for r in records
            if r.server_id and r.server_id not in listed and r.state in ("requested", "launching", "active")
        }
        return View(self.hall, tuple(servers), tuple(records), past, pools, window, still)

    def _get(self, server_id: str) -> Server | None:
        s = server_still_there(self.cloud, self.meter, server_id)
        return None if s is None else server_view(s)

    def await_in_flight(self, servers: list[Server], ids: set[int] | None = None) -> list[Server]:
        """Creates recorded but not answered (their run died mid-call) are listed again until their server shows
        in its slot or their window ends, so this run settles them instead of failing a record whose server then
        lands, and the plan counts them. One list call per poll, at ``next_poll``'s pace."""
        window = self.state.in_flight(self.hall, self.create_window_s)
        if not window or (ids is not None and not ids & set(window)):
            return servers
        recs = {r.id: (r.pool, r.plan_entry, r.slot) for r in self.records(("requested",))}
        want = {iid: recs[iid] for iid in window if iid in recs and (ids is None or iid in ids)}
        started = time.monotonic()
        got = [servers]

        def poll() -> tuple[int, int]:
            slots = {(s.pool, s.entry, s.slot) for s in got[0]}
            now = time.monotonic() - started
            waiting = [i for i, slot in want.items() if slot not in slots and window[i] > now]
            if waiting:
                got[0] = self.servers()
                slots = {(s.pool, s.entry, s.slot) for s in got[0]}
                waiting = [i for i in waiting if want[i] not in slots]
            return len(want) - len(waiting), len(want)

        wait_until(poll, started=started, timeout_s=max(window.values()), sleep=self.sleep, cap=2.0)
        return got[0]

    def apply(self, d: Decisions, *, seen: Iterable[str] | None = None, wait_deletes: bool = True) -> Applied:
        """Write each change with its event, in order; mark ``seen`` (the listed servers, and those retagged) as
        seen now; then delete the surplus servers all at once and, with ``wait_deletes``, wait until Nova no
        longer lists them."""
        st, out = self.state, Applied()
        seen_ids = None if seen is None else set(seen)
        deletes: dict[str, Delete] = {}
        for c in d.changes:
            if isinstance(c, Adopt):
                s = c.server
                assert s.pool is not None and s.entry is not None and s.slot is not None
                row = st.adopt(self.hall, s.pool, s.entry, s.slot, s.name, s.id, c.state, status=s.status)
                if row is not None:
                    out.adopted[(s.pool, s.entry, s.slot)] = row
            elif isinstance(c, Move):
                st.transition(c.record.id, c.to, c.event, only_from=c.only_from, **c.detail)
            elif isinstance(c, Lose):
                st.lose(c.record.id, c.why, server_id=c.record.server_id)
            elif isinstance(c, Retag):
                r = c.record
                restore_tags(self.cloud, self.meter, c.server.raw, list(c.tags))
                st.event(self.hall, "server.retagged", instance_id=r.id, pool=r.pool, server_id=r.server_id)
                if seen_ids is not None and r.server_id:
                    seen_ids.add(r.server_id)
            else:
                deletes[c.server_id] = c
        if seen_ids is not None:
            st.seen(sorted(seen_ids))
        if deletes:
            t0 = time.monotonic()
            accepted, refused = delete_all(self.cloud, self.meter, list(deletes), concurrency=self.concurrency)
            out.deleted = accepted
            for sid, msg in refused.items():
                out.warnings.append(f"deleting surplus server {deletes[sid].name} ({sid}): {msg}")
            if wait_deletes:
                left = wait_gone(
                    lambda: self.servers(), accepted, started=t0, timeout_s=self.delete_timeout_s, sleep=self.sleep
                )
                for sid in left:
                    out.warnings.append(f"surplus server {deletes[sid].name} ({sid}) still listed after the timeout")
            for sid in accepted:
                x = deletes[sid]
                st.event(self.hall, "server.deleted", name=x.name, server_id=sid, why=x.why, by="reconcile")
        return out

    def settle_builds(
        self,
        act: Callable[[Decisions], None],
        *,
        by: str | None,
        look_up: bool,
        started: float,
        first_wait: float,
        timeout_s: float,
    ) -> bool:
        """Wait for the scope's servers still building, so what follows counts settled instances: one list call
        per poll (not a GET per server), the first after ``first_wait`` and the next when the rest should be
        ready at the pace seen so far (``nova.next_poll``). Each poll's ``decide_builds`` goes to ``act`` (the
        caller's apply); ``look_up``: a server no longer listed is looked up by id (retagged, or lost), else it
        vanished. True when none is left building within ``timeout_s`` of ``started``."""
        total = 0

        def poll() -> tuple[int, int]:
            nonlocal total
            waiting = building(self.records(SETTLING))
            total = max(total, len(waiting))
            if not waiting:
                return total, total
            servers = self.servers()
            listed = {s.id for s in servers}
            gone = [r.server_id for r in waiting if look_up and r.server_id and r.server_id not in listed]
            still = {sid: self._get(sid) for sid in gone}
            d = decide_builds(View(self.hall, tuple(servers), tuple(waiting), still_there=still), by=by)
            act(d)
            return total - (len(waiting) - resolved(d)), total

        self.sleep(first_wait)
        return wait_until(poll, started=started, timeout_s=timeout_s, sleep=self.sleep)


class Reconciler:
    def __init__(
        self,
        cloud: Any,
        state: FleetState,
        meter: Meter,
        *,
        concurrency: int = 8,
        delete_timeout_s: float = 120.0,
        settle_timeout_s: float = 300.0,
        create_window_s: float = CREATE_WINDOW_S,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.settle_timeout_s = settle_timeout_s
        self.create_window_s = create_window_s
        self.cloud = cloud
        self.state = state
        self.meter = meter
        self.concurrency = concurrency
        self.delete_timeout_s = delete_timeout_s
        self.sleep = sleep

    def hall(self, hall: str, *, check: bool = False, run_id: int | None = None) -> Reconciliation:
        """Reconcile the whole hall (the loop's ``reconcile`` step): observe, decide, and (unless ``check``) apply
        and wait for the builds. The caller holds the hall's writer lock."""
        calls0 = self.meter.calls
        io = FleetIO(
            self.cloud, self.state, self.meter, hall, concurrency=self.concurrency,
            delete_timeout_s=self.delete_timeout_s, create_window_s=self.create_window_s, sleep=self.sleep,
        )  # fmt: skip
        servers = io.servers()
        view = io.observe(io.records((*LIVE, LOST)), servers, wait_in_flight=not check, pools=None)
        d = decide(view)
        out = Reconciliation(hall, listed=len(view.servers), check=check)
        out.add(d)
        if not check:
            out.warnings += io.apply(d, seen=[s.id for s in view.servers]).warnings
            if building(project(view.records, d.changes)):

                def act(b: Decisions) -> None:
                    out.add(b)
                    out.warnings += io.apply(b).warnings

                # polled at once and then when they should be ready; 0.5 s first: an adopted build is seconds in
                if not io.settle_builds(
                    act, by="reconcile", look_up=True, started=time.monotonic(), first_wait=0.5,
                    timeout_s=self.settle_timeout_s,
                ):  # fmt: skip
                    out.warnings.append(
                        f"servers still building after {self.settle_timeout_s:.0f} s: the next run settles them"
                    )
        out.api_calls = self.meter.calls - calls0
        if not check:
            self.state.record_reconcile(hall, run_id, out.listed, out.drift, out.to_dict())
        return out
