"""The reconciler's and the acquirer's decisions, called with literals: a view in (the fleet state's records and
Nova's list, as ``FleetIO.observe`` reads them), the changes out, no cloud and no database. The real-cloud tests
(tests/test_reconcile.py, tests/test_acquire_calls.py, tests/test_provider_openstack.py) check that ``apply``
writes them."""

from __future__ import annotations

from typing import Any

from sco.control.acquirer import PlanEntry, capacity_reason, decide_entry, free_slots, victims
from sco.control.reconcile import (
    NEVER_REACHED,
    SETTLING,
    Adopt,
    Decisions,
    Delete,
    Lose,
    Move,
    Reconciliation,
    Retag,
    Server,
    View,
    decide,
    decide_builds,
    project,
    resolved,
)
from sco.state.fleet import Instance

HALL = "h"


def rec(iid: int, slot: int, state: str, server: str | None = None, **kw: Any) -> Instance:
    pool, entry = kw.pop("pool", "spot"), kw.pop("entry", "e1")
    return Instance(iid, HALL, pool, entry, slot, f"h-{pool}-{entry}-{slot}", server, state, None, None, **kw)


def srv(sid: str, slot: int | None, status: str = "ACTIVE", **kw: Any) -> Server:
    pool, entry = kw.pop("pool", "spot"), kw.pop("entry", "e1")
    return Server(sid, kw.pop("name", f"h-{pool}-{entry}-{slot}"), status, pool, entry, slot, **kw)


def view(servers: list[Server], records: list[Instance], **kw: Any) -> View:
    return View(HALL, tuple(servers), tuple(records), pools=kw.pop("pools", frozenset({"spot"})), **kw)


def kinds(d: Decisions) -> list[tuple[str, str]]:
    """Each change as (its kind, the server or record it is about)."""
    out = []
    for c in d.changes:
        if isinstance(c, Adopt):
            out.append(("adopt", c.server.id))
        elif isinstance(c, Move):
            out.append((f"{c.kind}:{c.record.state}->{c.to}", c.record.name))
        elif isinstance(c, Lose):
            out.append(("lose", c.record.name))
        elif isinstance(c, Retag):
            out.append(("retag", c.record.name))
        else:
            out.append(("delete", c.server_id))
    return out


# --- the hall's reconciliation ------------------------------------------------------------------------------------


def test_agreement_changes_nothing() -> None:
    d = decide(view([srv("s0", 0)], [rec(1, 0, "active", "s0")]))
    assert d == Decisions()


def test_a_server_without_a_record_is_adopted_into_its_slot() -> None:
    d = decide(view([srv("s0", 0), srv("s1", 1, "BUILD")], []))
    assert d.changes == (Adopt(srv("s0", 0), "active"), Adopt(srv("s1", 1, "BUILD"), "launching"))
    # the slot's requested record that never got its server takes it: not failed as never launched
    d = decide(view([srv("s0", 0)], [rec(1, 0, "requested")]))
    assert kinds(d) == [("adopt", "s0")]
    live = project([rec(1, 0, "requested")], d.changes)
    assert [(i.id, i.state, i.server_id) for i in live] == [(1, "active", "s0")]


def test_surplus_servers_are_deleted_with_why() -> None:
    servers = [
        srv("old", 3, created_at="1"),  # its record is deleted in the fleet state
        srv("err", 4, "ERROR", fault="No valid host", created_at="2"),  # an unrecorded launch in ERROR
        srv("dup", 0, created_at="3"),  # a second server in a held slot
    ]
    d = decide(view(servers, [rec(1, 0, "active", "s0")], past={"old": "deleted"}))
    assert d.changes == (
        Delete("old", "h-spot-e1-3", "its record is deleted"),
        Delete("err", "h-spot-e1-4", "a launch in ERROR: No valid host"),
        Delete("dup", "h-spot-e1-0", "slot 0 is h-spot-e1-0's"),
        Lose(rec(1, 0, "active", "s0"), d.changes[3].why),  # type: ignore[union-attr]
    )
    # two unrecorded servers in one slot: the first (by creation) adopted, the second deleted
    d = decide(view([srv("b", 0, created_at="2"), srv("a", 0, created_at="1")], []))
    assert kinds(d) == [("adopt", "a"), ("delete", "b")]


def test_servers_that_are_not_the_products_are_left_alone_and_reported() -> None:
    d = decide(view([Server("x", "x", "ACTIVE"), srv("y", 0, pool="gpu")], []))
    assert d.changes == ()
    assert [(f["server_id"], f["why"]) for f in d.foreign] == [
        ("x", "no sco-pool/entry/slot tags"),
        ("y", "pool gpu is not in the fleet state"),
    ]


def test_records_stuck_settling_are_settled_to_what_nova_says() -> None:
    records = [rec(1, 0, "launching", "s0"), rec(2, 1, "requested", "s1"), rec(3, 2, "launching", "s2"),
               rec(4, 3, "active", "s3")]  # fmt: skip
    servers = [srv("s0", 0, created_at="1"), srv("s1", 1, "BUILD", created_at="2"),
               srv("s2", 2, "ERROR", fault="Build aborted", created_at="3"),
               srv("s3", 3, "ERROR", created_at="4")]  # fmt: skip
    d = decide(view(servers, records))
    assert kinds(d) == [
        ("settle:launching->active", "h-spot-e1-0"),
        ("settle:requested->launching", "h-spot-e1-1"),
        ("fail:launching->failed", "h-spot-e1-2"),
        ("delete", "s2"),
        ("fail:active->failed", "h-spot-e1-3"),
        ("delete", "s3"),
    ]
    active, launching, failed = d.changes[0], d.changes[1], d.changes[2]
    assert isinstance(active, Move) and active.only_from == SETTLING and active.detail == {"by": "reconcile"}
    assert isinstance(launching, Move) and launching.only_from == ("requested",)
    assert isinstance(failed, Move)
    assert failed.detail == {"error": "Build aborted", "status": "ERROR", "by": "reconcile"}
    assert failed.only_from is None and failed.event == "launch.failed"


def test_a_lost_record_listed_again_is_found_unless_its_slot_is_taken() -> None:
    lost = rec(1, 0, "lost", "s0")
    d = decide(view([srv("s0", 0, "BUILD")], [lost]))
    (found,) = d.changes
    assert isinstance(found, Move) and (found.to, found.event, found.only_from) == ("launching", "instance.found",
                                                                                     ("lost",))  # fmt: skip
    assert [i.state for i in project([lost], d.changes)] == ["launching"]
    d = decide(view([srv("s0", 0)], [lost, rec(2, 0, "active", "s9")], still_there={"s9": srv("s9", 0)}))
    assert kinds(d)[0] == ("delete", "s0") and d.changes[0].why == "lost, and slot 0 is taken"  # type: ignore[union-attr]


def test_an_unlisted_server_is_lost_or_retagged_by_what_its_lookup_said() -> None:
    records = [rec(1, 0, "active", "gone", last_seen=0.0), rec(2, 1, "launching", "untagged")]
    untagged = Server("untagged", "h-spot-e1-1", "ACTIVE")  # the GET's answer: no tags
    d = decide(view([], records, still_there={"gone": None, "untagged": untagged}))
    lose, retag = d.changes
    assert isinstance(lose, Lose) and lose.why.startswith("server gone is no longer in Nova (last listed 1970-01-01")
    assert isinstance(retag, Retag) and retag.server == untagged
    assert retag.tags == ("sco-hall=h", "sco-pool=spot", "sco-entry=e1", "sco-slot=1")
    assert project(records, d.changes) == [records[1]]  # lost holds no slot; retagged keeps its own


def test_a_requested_record_without_a_server_waits_for_its_window_then_never_launched() -> None:
    waiting = rec(1, 0, "requested")
    d = decide(view([], [waiting], in_flight={1: 42.0}))
    assert d.changes == () and d.warnings == (
        "h-spot-e1-0: its create may still be inside Nova (42 s of its window left): it keeps its slot, and a later"
        " run settles it",
    )
    d = decide(view([], [waiting]))
    assert d.changes == (Move("never_launched", waiting, "failed", "launch.failed", ("requested",),
                              {"error": NEVER_REACHED}),)  # fmt: skip
    assert project([waiting], d.changes) == []


def test_instances_under_reclaim_are_the_reclaimers() -> None:
    d = decide(view([], [rec(1, 0, "draining", "s0"), rec(2, 1, "deleting", "s1")]))
    assert d.changes == () and d.under_reclaim_gone == ("h-spot-e1-0", "h-spot-e1-1")


def test_the_report_says_each_change_as_before() -> None:
    records = [rec(1, 0, "launching", "s0"), rec(2, 1, "active", "gone", last_seen=None), rec(3, 2, "requested")]
    d = decide(view([srv("s0", 0), srv("new", 5, "BUILD")], records, still_there={"gone": None}))
    r = Reconciliation(HALL, listed=2, check=True)
    r.add(d)
    assert r.adopted == [{"name": "h-spot-e1-5", "server_id": "new", "status": "BUILD", "pool": "spot",
                          "entry": "e1", "slot": 5}]  # fmt: skip
    assert r.settled == [{"name": "h-spot-e1-0", "server_id": "s0", "from": "launching", "to": "active"}]
    assert [x["name"] for x in r.lost] == ["h-spot-e1-1"] and r.lost[0]["last_seen"] is None
    assert r.never_launched == [{"name": "h-spot-e1-2", "slot": 2}]
    assert r.drift == 4 and r.explain()[0] == "hall h: Nova lists 2 servers; drift 4"


# --- builds -------------------------------------------------------------------------------------------------------


def test_builds_settle_with_novas_build_time_fail_or_vanish() -> None:
    records = [rec(1, 0, "launching", "a"), rec(2, 1, "launching", "b"), rec(3, 2, "launching", "c"),
               rec(4, 3, "launching", "d"), rec(5, 4, "active", "e")]  # fmt: skip
    servers = [srv("a", 0, build_s=3.5), srv("b", 1, "BUILD"), srv("c", 2, "ERROR", fault="No valid host found"),
               srv("e", 4)]  # fmt: skip
    d = decide_builds(view(servers, records), by=None)
    assert kinds(d) == [
        ("settle:launching->active", "h-spot-e1-0"),
        ("fail:launching->failed", "h-spot-e1-2"),
        ("delete", "c"),
        ("lose", "h-spot-e1-3"),
    ]
    assert d.changes[0].detail == {"build_s": 3.5}  # type: ignore[union-attr]
    assert d.changes[1].detail == {"error": "No valid host found", "status": "ERROR"}  # type: ignore[union-attr]
    assert d.changes[3] == Lose(records[3], "server d vanished while launching")
    assert resolved(d) == 3  # b still building
    # looked up by id (the hall's reconciliation): the vanished one is retagged, or lost for good
    d = decide_builds(view([], records[3:4], still_there={"d": Server("d", "x", "BUILD")}), by="reconcile")
    assert kinds(d) == [("retag", "h-spot-e1-3")] and resolved(d) == 0
    d = decide_builds(view([], records[3:4], still_there={"d": None}), by="reconcile")
    assert isinstance(d.changes[0], Lose) and "is no longer in Nova" in d.changes[0].why


def test_a_build_stopped_before_it_settled_fails_and_goes_and_a_transient_status_waits() -> None:
    """Nova's power sync stops an instance whose host reports it off ("Instance shutdown by itself. Calling the stop
    API"): seen once in CI on Ironic's fake hardware, a launch then waited its whole 600 s for an ACTIVE that could
    not come. Stopped, paused, suspended or shelved while settling is a failed launch, its server taken back at
    once; a reboot, a migration or an UNKNOWN status (its compute away) is waited for."""
    stopped = ["SHUTOFF", "PAUSED", "SUSPENDED", "SHELVED", "SHELVED_OFFLOADED", "SOFT_DELETED"]
    waits = ["BUILD", "REBOOT", "HARD_REBOOT", "MIGRATING", "UNKNOWN"]
    statuses = stopped + waits
    records = [rec(i + 1, i, "launching", f"s{i}") for i in range(len(statuses))]
    servers = [srv(f"s{i}", i, st) for i, st in enumerate(statuses)]
    servers[0] = srv("s0", 0, "SHUTOFF", fault="stopped by its host")
    for by, said in ((None, {}), ("reconcile", {"by": "reconcile"})):
        d = decide_builds(view(servers, records), by=by)
        expected = [[("fail:launching->failed", f"h-spot-e1-{i}"), ("delete", f"s{i}")] for i in range(len(stopped))]
        assert kinds(d) == [k for pair in expected for k in pair]
        fail, delete = d.changes[0], d.changes[1]
        assert isinstance(fail, Move) and isinstance(delete, Delete)
        why = "SHUTOFF before it was ever settled ACTIVE: stopped by its host"
        assert fail.detail == {"error": why, "status": "SHUTOFF", **said} and delete.why == why
        assert resolved(d) == len(stopped)
    # the hall's reconciliation (decide) settles the same way
    d = decide(view(servers[:1], records[:1]))
    assert kinds(d)[:2] == [("fail:launching->failed", "h-spot-e1-0"), ("delete", "s0")]
    # an active instance stopped later is not a launch: nothing here (the reclaim and the plan see it)
    assert decide_builds(view([srv("x", 0, "SHUTOFF")], [rec(1, 0, "active", "x")]), by=None).changes == ()


def test_a_build_the_tagged_list_missed_but_nova_still_has_with_its_tags_is_not_lost() -> None:
    """The acquirer looks up a build its tagged list does not show (under load Nova listed 29 of 30 fresh creates
    once: the 30th was lost while it built, and the run ended with 29 active and nothing pending). Found by id with
    the record's tags, it is what Nova says: still building, or settled; only a server that is gone is lost."""
    r = rec(4, 3, "launching", "d")
    d = decide_builds(view([], [r], still_there={"d": srv("d", 3, "BUILD")}), by=None)
    assert d.changes == () and resolved(d) == 0
    d = decide_builds(view([], [r], still_there={"d": srv("d", 3, build_s=7.0)}), by=None)
    assert kinds(d) == [("settle:launching->active", "h-spot-e1-3")] and resolved(d) == 1
    # its tags gone (another slot's, or none): retagged, as before
    d = decide_builds(view([], [r], still_there={"d": Server("d", "x", "BUILD")}), by=None)
    assert kinds(d) == [("retag", "h-spot-e1-3")]


def test_capacity_faults_mark_the_pool_unavailable() -> None:
    assert capacity_reason("No valid host was found. ") == "NoValidHost: No valid host was found. "
    assert capacity_reason("Exhausted all hosts available for retrying build failures") is not None
    assert capacity_reason("Quota exceeded for instances") == "quota: Quota exceeded for instances"
    assert capacity_reason("Build of instance x aborted: disk") is None


# --- the acquirer's entry -----------------------------------------------------------------------------------------


def test_an_entry_short_of_its_count_launches_into_the_lowest_free_slots() -> None:
    records = [rec(1, 1, "active", "s1"), rec(2, 3, "active", "s3")]
    d = decide_entry(PlanEntry(HALL, "spot", "e1", 5), view([srv("s1", 1), srv("s3", 3)], records))
    assert d.reconcile == Decisions() and d.launch == (0, 2, 4) and d.retire == ()
    assert free_slots([], 2) == [0, 1]


def test_a_shrunk_entry_retires_the_named_first_then_idle_from_the_highest_slot() -> None:
    live = [rec(1, 0, "active", "a"), rec(2, 1, "active", "b"), rec(3, 2, "draining", "c"), rec(4, 3, "active", "d")]
    e = PlanEntry(HALL, "spot", "e1", 1, delete=("h-spot-e1-0",))
    assert [i.slot for i in victims(e, live, 3)] == [0, 3, 1]  # never the one under reclaim
    d = decide_entry(e, view([srv(x.server_id or "", x.slot) for x in live], live))
    assert [i.slot for i in d.retire] == [0, 3, 1] and d.launch == ()


def test_an_entry_counts_what_its_reconciliation_adopts_and_loses() -> None:
    # a crashed run left slot 1's server unrecorded and slot 0's record lost its server: 2 wanted, so slot 0 again
    records = [rec(1, 0, "active", "gone")]
    v = view([srv("s1", 1)], records, still_there={"gone": None})
    d = decide_entry(PlanEntry(HALL, "spot", "e1", 2), v)
    assert kinds(d.reconcile) == [("adopt", "s1"), ("lose", "h-spot-e1-0")] and d.launch == (0,)
    # the plan wants none: the adopted server (no record id yet) is retired, found by its slot when applied
    d = decide_entry(PlanEntry(HALL, "spot", "e1", 0), v)
    assert [(i.id, i.slot, i.server_id) for i in d.retire] == [(0, 1, "s1")]
