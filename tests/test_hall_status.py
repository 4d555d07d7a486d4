"""`sco hall status` and `sco hall report` on a real PostgreSQL, with the rows written by the product's own
fleet-state code (FleetState, the control loop's PgFleetStore): what the on-call engineer reads."""

from __future__ import annotations

import json
import re
from decimal import Decimal

import pytest

from sco.cli import main
from sco.control.arbiter import Arbitration, Grant, Refusal
from sco.control.record import PgFleetStore
from sco.state.fleet import FleetState, Pool
from sco.state.hall import parse_duration, parse_since, percentile
from tests.cli_run import one_line_error, sco
from tests.harness import free_port

HALL = "h1"


def _launch(fs: FleetState, pool: str, slot: int, name: str) -> int:
    """An instance as the acquirer leaves it: requested, then active with its server."""
    inst = fs.request(HALL, pool, "s0000abcd", slot, name)
    fs.transition(inst.id, "launching", "instance.launching", server_id=f"srv-{name}")
    fs.transition(inst.id, "active", "instance.active")
    return inst.id


def _notify(fs: FleetState, iid: int, notice: str, t_in_s: float) -> None:
    """What the reclaimer records when it fixes T (sco.provider.reclaimer.Reclaimer._schedule)."""
    fs.transition(
        iid, "notified", "reclaim.scheduled", only_from=("active",), reclaim_id=notice,
        terminate_at=fs.now() + t_in_s, window_s=t_in_s,
    )  # fmt: skip


def _backdate(fs: FleetState, iid: int, kind: str, seconds: float) -> None:
    # Time passing without waiting for it: the record is moved back as if written `seconds` earlier.
    fs.conn.execute(
        "UPDATE lifecycle_event SET at = at - make_interval(secs => %s) WHERE instance_id = %s AND kind LIKE %s",
        (seconds, iid, kind),
    )


@pytest.fixture
def hall(fleet_dsn: str) -> dict[str, int]:
    """A hall with a reclaim under way, one drained and one overrun reclaim, a silent agent, an unavailable pool,
    two control runs and an arbitration."""
    ids: dict[str, int] = {}
    with FleetState(fleet_dsn) as fs:
        fs.ensure_pool(Pool(HALL, "gpu-a", "g1.large", "img-1"))
        fs.ensure_pool(Pool(HALL, "gpu-b", "g1.large", "img-1", availability_zone="az2"))
        fs.ensure_pool(Pool(HALL, "od", "m1.xlarge", "img-1", kind="on-demand"))
        for slot, name in enumerate(("gpu-a-0", "gpu-a-1", "gpu-a-2", "gpu-a-3", "gpu-a-4")):
            ids[name] = _launch(fs, "gpu-a", slot, name)
        ids["od-0"] = _launch(fs, "od", 0, "od-0")

        # gpu-a-0: under reclaim, T ten minutes away, its agent has set the node DRAIN
        _notify(fs, ids["gpu-a-0"], "reclaim-under-way", 600)
        fs.agent_event(
            HALL, {"type": "node.drain_set", "node": "gpu-a-0", "seq": 1, "notice": "reclaim-under-way"},
            "draining", ("notified",),
        )  # fmt: skip

        # gpu-a-1: drained 30 s after its notice
        _notify(fs, ids["gpu-a-1"], "reclaim-drained", 120)
        fs.agent_event(
            HALL, {"type": "drain.drained", "node": "gpu-a-1", "seq": 7, "notice": "reclaim-drained",
                   "path": "scheduler", "elapsed_s": 30.0},
            "drained", ("notified", "draining"),
        )  # fmt: skip
        _backdate(fs, ids["gpu-a-1"], "reclaim.scheduled", 30)

        # gpu-a-2: overrun, 100 s after its notice, a Slurm job still on the node
        _notify(fs, ids["gpu-a-2"], "reclaim-overrun", 120)
        fs.agent_event(
            HALL, {"type": "drain.overrun", "node": "gpu-a-2", "seq": 9, "notice": "reclaim-overrun",
                   "path": "scheduler", "remaining": [{"job": 4242, "why": "steps still on the node"}]},
            "overrun", ("notified", "draining"),
        )  # fmt: skip
        _backdate(fs, ids["gpu-a-2"], "reclaim.scheduled", 100)

        # gpu-a-3: active, nothing heard of it for an hour (its records moved back, the instance too)
        _backdate(fs, ids["gpu-a-3"], "%", 3600)
        fs.conn.execute(
            "UPDATE instance SET created_at = created_at - interval '1 hour' WHERE id = %s", (ids["gpu-a-3"],)
        )

        fs.mark_unavailable(HALL, "gpu-b", 300, "quota: cores exceeded in project spot")
    with PgFleetStore(fleet_dsn) as store:
        ok = store.begin_run(HALL)
        store.finish_run(ok, "ok", {"run_id": ok})
        bad = store.begin_run(HALL)
        store.finish_run(bad, "failed", {"run_id": bad, "rc": 2})
        store.record_arbitration(
            HALL, bad,
            Arbitration(
                grants=(Grant("etl", "od", 2, Decimal("3.50"), "within authority 5.00 and hall ceiling 20.00"),),
                refusals=(Refusal("render", 4000, "fallback.onDemand is false"),),
                hall_spend_per_hour=Decimal("3.50"), ceiling_per_hour=Decimal("20.00"),
            ),
        )  # fmt: skip
        ids["run_ok"], ids["run_failed"] = ok, bad
    return ids


def test_status_json_has_reclaim_overrun_runs_unavailable_and_silent_agent(
    fleet_dsn: str, hall: dict[str, int], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["hall", "status", "--json", "--dsn", fleet_dsn]) == 0  # the only hall: no --hall needed
    st = json.loads(capsys.readouterr().out)
    assert set(st) == {
        "hall", "now", "stale_after_s", "recent_s", "pools", "reclaims", "overruns", "runs", "unavailable_pools",
        "stale_agents",
    }  # fmt: skip
    pools = {p["name"]: p for p in st["pools"]}
    assert pools["gpu-a"]["instances"] == {"active": 2, "draining": 1, "drained": 1, "overrun": 1}
    assert pools["od"]["instances"] == {"active": 1} and pools["od"]["kind"] == "on-demand"
    assert pools["gpu-b"]["instances"] == {} and pools["gpu-b"]["available"] is False

    under = {r["instance"]: r for r in st["reclaims"]}
    assert set(under) == {"gpu-a-0", "gpu-a-1", "gpu-a-2"}
    r0 = under["gpu-a-0"]
    assert r0["state"] == "draining" and r0["notice"] == "reclaim-under-way"
    assert 480 < r0["seconds_to_t"] <= 600 and r0["terminate_at"].endswith("Z")  # (a slow machine: not 600)

    assert [(o["instance"], o["notice"]) for o in st["overruns"]] == [("gpu-a-2", "reclaim-overrun")]
    assert st["overruns"][0]["reasons"] == ["job 4242: steps still on the node"]

    assert [(r["id"], r["status"]) for r in st["runs"]] == [(hall["run_failed"], "failed"), (hall["run_ok"], "ok")]
    assert all(r["duration_s"] >= 0 and r["finished_at"] for r in st["runs"])

    assert [(u["pool"], u["reason"]) for u in st["unavailable_pools"]] == [
        ("gpu-b", "quota: cores exceeded in project spot")
    ]
    assert 0 < st["unavailable_pools"][0]["seconds_left"] <= 300

    # gpu-a-3 only: gpu-a-4 and od-0 were heard of just now, the others have said their last word (or drain)
    assert [a["instance"] for a in st["stale_agents"]] == ["gpu-a-3"]
    assert st["stale_agents"][0]["silent_s"] >= 3600 and st["stale_agents"][0]["last_event"] == "instance.active"


def test_status_text_shows_time_to_t_overrun_reason_and_silent_agent(
    fleet_dsn: str, hall: dict[str, int], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["hall", "status", "--dsn", fleet_dsn, "--hall", HALL]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "gpu-a-0" in x)
    assert "reclaim-under-way" in line and re.search(r"\bin (8|9|10)m$", line), line
    assert "job 4242: steps still on the node" in out and "reclaim-overrun" in out
    silent = out.split("instances silent for 15m or more: 1", 1)[1]
    assert "gpu-a-3" in silent and "gpu-a-4" not in silent
    assert "gpu-b: quota: cores exceeded" in out and "gpu-b (UNAVAILABLE)" in out


def test_stale_threshold_is_the_operators(
    fleet_dsn: str, hall: dict[str, int], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["hall", "status", "--json", "--dsn", fleet_dsn, "--stale", "2h"]) == 0
    assert json.loads(capsys.readouterr().out)["stale_agents"] == []


def test_report_counts_outcomes_and_drain_percentiles(
    fleet_dsn: str, hall: dict[str, int], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["hall", "report", "--since", "7d", "--json", "--dsn", fleet_dsn]) == 0
    rp = json.loads(capsys.readouterr().out)
    assert set(rp) == {"hall", "since", "until", "reclaims", "total", "instance_hours", "on_demand"}
    a = rp["reclaims"]["gpu-a"]
    # gpu-a-0 is still draining: a reclaim without an outcome yet
    assert (a["reclaims"], a["drained"], a["overrun"], a["error"], a["no_outcome"]) == (3, 1, 1, 0, 1)
    assert a["drain_s"]["n"] == 2
    assert 30 <= a["drain_s"]["p50"] < 35 and 100 <= a["drain_s"]["p99"] < 105
    assert rp["total"]["reclaims"] == 3 and set(rp["reclaims"]) == {"gpu-a"}
    hours = {h["pool"]: h for h in rp["instance_hours"]}
    assert hours["gpu-a"]["instances"] == 5 and hours["gpu-a"]["flavor"] == "g1.large"
    assert 1.0 <= hours["gpu-a"]["instance_hours"] < 1.1  # gpu-a-3's hour; the others are seconds old
    assert hours["od"]["kind"] == "on-demand" and "gpu-b" not in hours
    assert rp["on_demand"]["grants"] == [
        {"contract": "etl", "pool": "od", "grants": 1, "instances": 2, "cost_per_hour_granted": "3.50"}
    ]
    assert rp["on_demand"]["refusals"] == {"render": 1} and rp["on_demand"]["spend_against_authority"] is None


def test_report_since_after_the_reclaims_counts_none(
    fleet_dsn: str, hall: dict[str, int], capsys: pytest.CaptureFixture[str]
) -> None:
    with FleetState(fleet_dsn) as fs:
        now = fs.now()
    from datetime import UTC, datetime

    since = datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f+00:00")
    assert main(["hall", "report", "--since", since, "--dsn", fleet_dsn]) == 0
    out = capsys.readouterr().out
    total = next(x for x in out.splitlines() if x.strip().startswith("(all)"))
    assert total.split() == ["(all)", "0", "0", "0", "0", "0", "-", "-"] and "not recorded" in out


def test_bad_since_is_one_line_naming_it(fleet_dsn: str, hall: dict[str, int]) -> None:
    p = sco("hall", "report", "--since", "last tuesday", "--dsn", fleet_dsn)
    one_line_error(p, 5, "--since", "'last tuesday'")
    p = sco("hall", "report", "--since", "2999-01-01T00:00:00Z", "--dsn", fleet_dsn)
    one_line_error(p, 5, "--since", "in the future")


def test_no_such_hall_and_unreachable_db_are_one_line_without_the_password(fleet_dsn: str, hall: object) -> None:
    p = sco("hall", "status", "--hall", "nope", "--dsn", fleet_dsn)
    one_line_error(p, 5, "hall 'nope'", "no such hall", "halls: h1")
    dsn = f"host=127.0.0.1 port={free_port()} user=x password=hunter2 dbname=y connect_timeout=2"
    for argv in (["hall", "status"], ["hall", "report", "--since", "1d"]):
        p = sco(*argv, "--dsn", dsn)
        one_line_error(p, 11, "fleet state", "cannot connect")
        assert "hunter2" not in p.stderr + p.stdout
    p = sco("hall", "status", "--dsn", "host=x password=hunter2 garbage")
    one_line_error(p, 5, "--dsn")
    assert "hunter2" not in p.stderr


def test_durations_and_percentiles() -> None:
    assert parse_duration("--stale", "15m") == 900 and parse_duration("--stale", "7d") == 7 * 86400
    with pytest.raises(Exception, match="--stale: expected a duration"):
        parse_duration("--stale", "15 minutes")
    with pytest.raises(Exception, match="--stale"):
        parse_duration("--stale", "0s")
    from datetime import UTC, datetime

    now = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    assert parse_since("1d", now) == datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    assert parse_since("2026-11-01T00:00:00", now) == datetime(2026, 11, 1, tzinfo=UTC)  # no zone: UTC
    assert percentile([], 50) is None
    assert percentile([5.0, 1.0, 3.0], 50) == 3.0 and percentile(list(map(float, range(1, 101))), 99) == 99.0
