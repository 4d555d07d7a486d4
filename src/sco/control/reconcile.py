"""Reconciliation: the fleet state made to agree with what Nova has, before anything is planned.

One tagged list call (``sco-hall=<hall>``) is compared with the hall's records:

* a server with no record (a run killed between Nova's answer and the fleet state's write) is **adopted** into
  its slot's record, or a new one;
* a record stuck in ``requested``/``launching`` is **settled** to what Nova says (ACTIVE -> ``active``; ERROR ->
  ``failed`` and the server deleted, with Nova's fault as the reason);
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
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sco.control.nova import (
    TAG,
    Meter,
    delete_all,
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


def _fault(server: Any) -> str:
    f = getattr(server, "fault", None)
    if isinstance(f, dict):
        return str(f.get("message") or f.get("details") or "")
    return str(f or "")


def _iso(epoch: float | None) -> str | None:
    return None if epoch is None else datetime.fromtimestamp(epoch, UTC).isoformat(timespec="seconds")


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
        """Reconcile the whole hall (the loop's ``reconcile`` step). The caller holds the hall's writer lock."""
        calls0 = self.meter.calls
        servers = hall_servers(self.cloud, self.meter, hall)
        if not check:
            servers = self.await_in_flight(hall, servers)
        records = self.state.instances(hall, states=(*LIVE, LOST))
        out = self.apply(hall, servers, records, check=check)
        if not check:
            self._settle_builds(hall, out)
        out.api_calls = self.meter.calls - calls0
        if not check:
            self.state.record_reconcile(hall, run_id, out.listed, out.drift, out.to_dict())
        return out

    def await_in_flight(self, hall: str, servers: list[Any], ids: set[int] | None = None) -> list[Any]:
        """Creates recorded but not answered (their run died mid-call) are listed again until their server shows
        in its slot or their window ends, so this run settles them instead of failing a record whose server then
        lands, and the plan counts them. One list call per poll, at ``next_poll``'s pace."""
        window = self.state.in_flight(hall, self.create_window_s)
        if not window or (ids is not None and not ids & set(window)):
            return servers
        recs = {r.id: (r.pool, r.plan_entry, r.slot) for r in self.state.instances(hall, states=("requested",))}
        want = {iid: recs[iid] for iid in window if iid in recs and (ids is None or iid in ids)}
        started = time.monotonic()
        got = [servers]

        def poll() -> tuple[int, int]:
            slots = {(tag_value(s, "pool"), tag_value(s, "entry"), slot_of(s)) for s in got[0]}
            now = time.monotonic() - started
            waiting = [i for i, slot in want.items() if slot not in slots and window[i] > now]
            if waiting:
                got[0] = hall_servers(self.cloud, self.meter, hall)
                slots = {(tag_value(s, "pool"), tag_value(s, "entry"), slot_of(s)) for s in got[0]}
                waiting = [i for i in waiting if want[i] not in slots]
            return len(want) - len(waiting), len(want)

        wait_until(poll, started=started, timeout_s=max(window.values()), sleep=self.sleep, cap=2.0)
        return got[0]

    def _settle_builds(self, hall: str, out: Reconciliation) -> None:
        """Records still ``launching`` (their server building) are waited for, so the plan that follows counts
        settled instances and nothing is left for a later run: polled when they should be ready."""
        started = time.monotonic()

        def poll() -> tuple[int, int]:
            waiting = {i.server_id: i for i in self.state.instances(hall, states=SETTLING) if i.server_id}
            if not waiting:
                return 1, 1
            servers = hall_servers(self.cloud, self.meter, hall)
            r = self.apply(hall, servers, self.state.instances(hall, states=(*LIVE, LOST)))
            out.settled += r.settled
            out.lost += r.lost
            out.surplus += r.surplus
            out.warnings += r.warnings
            left = sum(1 for i in self.state.instances(hall, states=SETTLING) if i.server_id)
            return len(waiting) - left, len(waiting)

        if any(i.server_id for i in self.state.instances(hall, states=SETTLING)):
            self.sleep(0.5)
            if not wait_until(poll, started=started, timeout_s=self.settle_timeout_s, sleep=self.sleep):
                out.warnings.append(
                    f"servers still building after {self.settle_timeout_s:.0f} s: the next run settles them"
                )

    def apply(self, hall: str, servers: list[Any], records: list[Instance], *, check: bool = False) -> Reconciliation:
        """Compare ``servers`` (one list call's answer) with ``records`` (the same scope's live and lost records)."""
        st = self.state
        out = Reconciliation(hall, listed=len(servers), check=check)
        by_sid = {r.server_id: r for r in records if r.server_id}
        listed = {s.id for s in servers}
        pools: dict[str, bool] = {}
        # slot -> the record holding it (live, not lost): who owns a slot when a second server turns up in it
        holder = {(r.pool, r.plan_entry, r.slot): r for r in records if r.state in LIVE}
        delete: dict[str, dict[str, Any]] = {}
        in_flight = st.in_flight(hall, self.create_window_s) if any(
            r.state == "requested" and r.server_id is None for r in records
        ) else {}  # fmt: skip

        for s in sorted(servers, key=lambda s: (s.created_at or "", s.id)):
            rec = by_sid.get(s.id)
            pool, entry, slot = tag_value(s, "pool"), tag_value(s, "entry"), slot_of(s)
            if rec is None:
                old = st.by_server(s.id)
                if old is not None:  # deleted or failed in the fleet state, still in Nova: finish the delete
                    delete[s.id] = {"name": s.name, "server_id": s.id, "why": f"its record is {old.state}"}
                    continue
                if pool is None or entry is None or slot is None:
                    out.foreign.append({"name": s.name, "server_id": s.id, "why": "no sco-pool/entry/slot tags"})
                    continue
                if pool not in pools:
                    pools[pool] = st.pool(hall, pool) is not None
                if not pools[pool]:
                    out.foreign.append(
                        {"name": s.name, "server_id": s.id, "why": f"pool {pool} is not in the fleet state"}
                    )
                    continue
                if s.status == "ERROR":
                    delete[s.id] = {"name": s.name, "server_id": s.id, "why": f"a launch in ERROR: {_fault(s)[:300]}"}
                    continue
                held = holder.get((pool, entry, slot))
                if held is not None and held.server_id and held.server_id != s.id:
                    delete[s.id] = {"name": s.name, "server_id": s.id, "why": f"slot {slot} is {held.name}'s"}
                    continue
                new_state = "active" if s.status == "ACTIVE" else "launching"
                out.adopted.append(
                    {"name": s.name, "server_id": s.id, "status": s.status, "pool": pool, "entry": entry, "slot": slot}
                )
                if not check:
                    row = st.adopt(hall, pool, entry, slot, s.name, s.id, new_state, status=s.status)
                    if row is not None:
                        holder[(pool, entry, slot)] = row
                continue
            if rec.state == LOST:  # listed again (a partial list earlier, a cell back): it holds capacity again
                held = holder.get((rec.pool, rec.plan_entry, rec.slot))
                if held is not None:
                    delete[s.id] = {"name": s.name, "server_id": s.id, "why": f"lost, and slot {rec.slot} is taken"}
                    continue
                to = "active" if s.status == "ACTIVE" else "launching"
                out.settled.append({"name": rec.name, "server_id": s.id, "from": LOST, "to": to})
                if not check:
                    st.transition(rec.id, to, "instance.found", only_from=(LOST,), status=s.status)
                continue
            if s.status == "ERROR" and rec.state in (*SETTLING, "active"):
                fault = _fault(s)[:500]
                out.settled.append({"name": rec.name, "server_id": s.id, "from": rec.state, "to": "failed"})
                delete[s.id] = {"name": s.name, "server_id": s.id, "why": f"in ERROR: {fault[:300]}"}
                if not check:
                    st.transition(rec.id, "failed", "launch.failed", error=fault, status="ERROR", by="reconcile")
                continue
            if rec.state in SETTLING and s.status == "ACTIVE":
                out.settled.append({"name": rec.name, "server_id": s.id, "from": rec.state, "to": "active"})
                if not check:
                    st.transition(rec.id, "active", "instance.active", only_from=SETTLING, by="reconcile")
            elif rec.state == "requested":  # the create was answered, the answer never recorded
                out.settled.append({"name": rec.name, "server_id": s.id, "from": "requested", "to": "launching"})
                if not check:
                    st.transition(rec.id, "launching", "launch.requested", only_from=("requested",), by="reconcile")

        for r in records:
            if r.state == LOST or (r.server_id and r.server_id in listed):
                continue
            if r.server_id is None:
                if r.id in in_flight:
                    out.warnings.append(
                        f"{r.name}: its create may still be inside Nova ({in_flight[r.id]:.0f} s of its window"
                        " left): it keeps its slot, and a later run settles it"
                    )
                elif r.state == "requested" and not any(
                    a["pool"] == r.pool and a["entry"] == r.plan_entry and a["slot"] == r.slot for a in out.adopted
                ):
                    out.never_launched.append({"name": r.name, "slot": r.slot})
                    if not check:
                        st.transition(
                            r.id, "failed", "launch.failed", only_from=("requested",),
                            error="the launch never reached Nova (its run stopped before the create was answered)",
                        )  # fmt: skip
                continue
            if r.state in ("requested", "launching", "active"):
                # not in the tagged list: gone, or its tags were removed (it would run on unseen for ever while a
                # replacement launched). One GET tells them apart; a server still there gets its tags back.
                srv = server_still_there(self.cloud, self.meter, r.server_id)
                if srv is not None:
                    tags = [TAG.format("hall", hall), TAG.format("pool", r.pool), TAG.format("entry", r.plan_entry),
                            TAG.format("slot", r.slot)]  # fmt: skip
                    out.retagged.append({"name": r.name, "server_id": r.server_id, "tags": tags})
                    if not check:
                        restore_tags(self.cloud, self.meter, srv, tags)
                        st.event(hall, "server.retagged", instance_id=r.id, pool=r.pool, server_id=r.server_id)
                        listed.add(r.server_id)
                    continue
                why = (
                    f"server {r.server_id} is no longer in Nova (last listed {_iso(r.last_seen) or 'never'}): deleted"
                    " outside the product, e.g. by an operator or by a Blazar lease's preemption"
                )
                out.lost.append({"name": r.name, "server_id": r.server_id, "why": why, "last_seen": r.last_seen})
                if not check:
                    st.lose(r.id, why, server_id=r.server_id)
            elif r.state in (*RECLAIMING, "deleting"):
                out.under_reclaim_gone.append(r.name)

        out.surplus = list(delete.values())
        if not check:
            st.seen(sorted(listed))
            if delete:
                t0 = time.monotonic()
                accepted, refused = delete_all(self.cloud, self.meter, list(delete), concurrency=self.concurrency)
                for sid, msg in refused.items():
                    out.warnings.append(f"deleting surplus server {delete[sid]['name']} ({sid}): {msg}")
                left = wait_gone(
                    lambda: hall_servers(self.cloud, self.meter, hall), accepted, started=t0,
                    timeout_s=self.delete_timeout_s, sleep=self.sleep,
                )  # fmt: skip
                for sid in left:
                    out.warnings.append(f"surplus server {delete[sid]['name']} ({sid}) still listed after the timeout")
                for sid in accepted:
                    st.event(hall, "server.deleted", **delete[sid], by="reconcile")
        return out
