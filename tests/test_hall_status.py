"""`sco hall status` and `sco hall report` on a real PostgreSQL, with the rows written by the product's own
fleet-state code (FleetState, the control loop's PgFleetStore): what the on-call engineer reads."""

from __future__ import annotations

import json
import re
from decimal import Decimal

import pytest

from sco.cli import main
from sco.control.arbiter import arbitrate
from sco.control.model import ContractInfo, Instance
from sco.control.model import Pool as PlanPool
from sco.control.record import PgFleetStore
from sco.state import heartbeats
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

        # Heartbeats as the control loop reads them: gpu-a-3's agent was last heard two hours ago, od-0 (up for an
        # hour) never; gpu-a-4 and the draining gpu-a-0 were heard just now; gpu-a-1/2 have said their last word.
        for name in ("gpu-a-3", "od-0"):
            fs.conn.execute(
                "UPDATE instance SET created_at = created_at - interval '3 hours' WHERE id = %s", (ids[name],)
            )
        now = heartbeats_now(fs)
        heartbeats.record(
            fs.conn, HALL, {"gpu-a-3": (now, {}), "gpu-a-4": (now, {"drain": "idle"}), "gpu-a-0": (now, {})}
        )
        fs.conn.execute("UPDATE agent_heartbeat SET heard_at = heard_at - interval '2 hours' WHERE node = 'gpu-a-3'")
        fs.conn.execute(
            "UPDATE instance SET created_at = created_at + interval '2 hours' WHERE id = %s", (ids["od-0"],)
        )

        fs.mark_unavailable(HALL, "gpu-b", 300, "quota: cores exceeded in project spot")
    with PgFleetStore(fleet_dsn) as store:
        ok = store.begin_run(HALL)
        store.finish_run(ok, "ok", {"run_id": ok})
        bad = store.begin_run(HALL)
        store.finish_run(bad, "failed", {"run_id": bad, "rc": 2})
        # the arbiter's own decision: etl (tier 2, authority 5.00/h) runs od-0 at 1.75/h and is granted 2 more
        store.record_arbitration(HALL, bad, arbitration())
        ids["run_ok"], ids["run_failed"] = ok, bad
    return ids


def heartbeats_now(fs: FleetState) -> object:
    return fs.conn.execute("SELECT clock_timestamp()").fetchone()[0]


CONTRACTS = {
    "etl": ContractInfo("etl", 2, on_demand=True, spend_cap_per_hour=Decimal("5.00")),
    "render": ContractInfo("render", 1),
}


def arbitration(running: int = 1) -> object:
    pools = (PlanPool("od", "on-demand", 8000, 10, price_per_hour=Decimal("1.75")),)
    fleet = tuple(Instance(f"i{n}", f"od-{n}", "od", ("etl",)) for n in range(running))
    return arbitrate({"etl": 16000, "render": 4000}, CONTRACTS, pools, fleet, Decimal("20.00"))


def test_status_json_has_reclaim_overrun_runs_unavailable_and_silent_agent(
    fleet_dsn: str, hall: dict[str, int], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["hall", "status", "--json", "--dsn", fleet_dsn]) == 0  # the only hall: no --hall needed
    st = json.loads(capsys.readouterr().out)
    assert set(st) == {
        "hall", "now", "stale_after_s", "recent_s", "pools", "reclaims", "overruns", "runs", "unavailable_pools",
        "stale_agents", "heartbeats",
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

    # gpu-a-3 heard two hours ago, od-0 up for an hour and never heard; gpu-a-4 and gpu-a-0 heard now; gpu-a-1
    # (drained) and gpu-a-2 (overrun) beat no more
    silent = {a["instance"]: a for a in st["stale_agents"]}
    assert list(silent) == ["gpu-a-3", "od-0"]
    assert 7200 <= silent["gpu-a-3"]["silent_s"] < 7300 and silent["gpu-a-3"]["heard_at"].endswith("Z")
    assert 3600 <= silent["od-0"]["silent_s"] < 3700 and silent["od-0"]["heard_at"] is None
    assert st["heartbeats"]["nodes"] == 3 and st["heartbeats"]["last_error"] is None
    assert 0 <= st["heartbeats"]["read_age_s"] < 60


def test_status_text_shows_time_to_t_overrun_reason_and_silent_agent(
    fleet_dsn: str, hall: dict[str, int], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["hall", "status", "--dsn", fleet_dsn, "--hall", HALL]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "gpu-a-0" in x)
    assert "reclaim-under-way" in line and re.search(r"\bin (8|9|10)m$", line), line
    assert "job 4242: steps still on the node" in out and "reclaim-overrun" in out
    assert re.search(r"agent heartbeats: read \d+s ago, 3 node\(s\) on the relay", out), out
    silent = out.split("agents not heard for 15m or more: 2", 1)[1]
    assert "gpu-a-3" in silent and "gpu-a-4" not in silent
    assert re.search(r"od-0 +od +active +never +60m", silent), silent
    assert "gpu-b: quota: cores exceeded" in out and "gpu-b (UNAVAILABLE)" in out


def test_stale_threshold_is_the_operators(
    fleet_dsn: str, hall: dict[str, int], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["hall", "status", "--json", "--dsn", fleet_dsn, "--stale", "90m"]) == 0
    assert [a["instance"] for a in json.loads(capsys.readouterr().out)["stale_agents"]] == ["gpu-a-3"]
    assert main(["hall", "status", "--json", "--dsn", fleet_dsn, "--stale", "3h"]) == 0
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
    assert 3.0 <= hours["gpu-a"]["instance_hours"] < 3.1  # gpu-a-3's 3 hours; the others are seconds old
    assert hours["od"]["kind"] == "on-demand" and "gpu-b" not in hours
    assert 1.0 <= hours["od"]["instance_hours"] < 1.1
    assert rp["on_demand"]["grants"] == [
        {"contract": "etl", "pool": "od", "tier": 2, "authority_per_hour": "5.00", "grants": 1, "instances": 1,
         "cost_per_hour_granted": "1.75"}
    ]  # fmt: skip
    assert rp["on_demand"]["refusals"] == {"etl": 1, "render": 1}
    spend = {t["tier"]: t for t in rp["on_demand"]["spend_against_authority"]}
    assert set(spend) == {1, 2}
    assert spend[2]["spend_per_hour"] == "1.75" and spend[2]["authority_per_hour"] == "5.00"
    assert spend[2]["granted_per_hour"] == "1.75" and spend[1]["authority_per_hour"] == "0.00"


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
    assert total.split() == ["(all)", "0", "0", "0", "0", "0", "-", "-"]
    # the arbitrate run before the window still holds: its rates, for no time yet
    tier2 = next(x for x in out.splitlines() if x.strip().startswith("2 "))
    assert tier2.split()[:3] == ["2", "0.00", "0.00"] and tier2.split()[-2:] == ["1.75", "5.00"], out


def test_bad_since_is_one_line_naming_it(fleet_dsn: str, hall: dict[str, int]) -> None:
    p = sco("hall", "report", "--since", "last tuesday", "--dsn", fleet_dsn)
    one_line_error(p, 5, "--since", "'last tuesday'")
    p = sco("hall", "report", "--since", "2999-01-01T00:00:00Z", "--dsn", fleet_dsn)
    one_line_error(p, 5, "--since", "in the future")


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], *needles: str) -> None:
    """In process, so the old code's traceback (OverflowError, psycopg's DatetimeFieldOverflow) fails the test."""
    assert main(argv) == 5, argv
    cap = capsys.readouterr()
    lines = [x for x in cap.err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("sco: error: ") and cap.out == "", (argv, cap)
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_values_past_the_documented_bounds_are_one_line_naming_the_option(
    fleet_dsn: str, hall: dict[str, int], capsys: pytest.CaptureFixture[str]
) -> None:
    """Durations at most 10 years, --runs at most 10,000, --since times from 1970 up to 9000 (said in --help): past
    them Python's dates or PostgreSQL's intervals and integers overflowed into a traceback."""
    for opt in ("--stale", "--recent"):
        for value in ("999999999999d", "99999999999w", "3000000d", "3651d", "1" + "0" * 400 + "s"):
            _refused(capsys, ["hall", "status", "--dsn", fleet_dsn, opt, value], f"{opt}: at most 10 years")
        assert main(["hall", "status", "--json", "--dsn", fleet_dsn, opt, "3650d"]) == 0  # the bound itself
        capsys.readouterr()
    for runs in ("99999999999999999999", "9223372036854775808", "10001", "0"):
        _refused(capsys, ["hall", "status", "--dsn", fleet_dsn, "--runs", runs], "--runs: expected 1 to 10,000")
    assert main(["hall", "status", "--json", "--dsn", fleet_dsn, "--runs", "10000"]) == 0
    assert len(json.loads(capsys.readouterr().out)["runs"]) == 2
    for since in ("99999999999999999999d", "3000000d", "1000000d", "3651d"):
        _refused(capsys, ["hall", "report", "--dsn", fleet_dsn, "--since", since], "--since: at most 10 years")
    for since in ("9999-12-31T23:59:59-14:00", "0001-01-01T00:00:00+14:00", "0001-01-01", "1969-12-31T23:59:59Z"):
        _refused(capsys, ["hall", "report", "--dsn", fleet_dsn, "--since", since], "--since: expected a time from 1970")
    for since in ("3650d", "1970-01-01T00:00:00+14:00"):
        assert main(["hall", "report", "--json", "--dsn", fleet_dsn, "--since", since]) == 0
        assert json.loads(capsys.readouterr().out)["total"]["reclaims"] == 3


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


def test_spend_against_authority_is_the_arbiters_samples_over_the_window(
    fleet_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Three arbitrate runs two hours apart: etl (tier 2, authority 5.00/h) ran one od instance at 1.75/h, then
    # three (5.25/h: above its authority, as after a cap was lowered), then still three.
    with PgFleetStore(fleet_dsn) as store:
        for running in (1, 3, 3):
            store.conn.execute("UPDATE spend_record SET created_at = created_at - interval '2 hours'")
            store.record_arbitration(HALL, None, arbitration(running))
    assert main(["hall", "report", "--since", "3h", "--json", "--dsn", fleet_dsn]) == 0
    spend = {t["tier"]: t for t in json.loads(capsys.readouterr().out)["on_demand"]["spend_against_authority"]}
    t2 = spend[2]
    # the sample of 4 h ago holds for the window's first hour (1.75), the next one for two hours (2 x 5.25)
    assert abs(float(t2["spend"]) - 12.25) <= 0.02 and abs(float(t2["authority"]) - 15.00) <= 0.02
    assert abs(t2["spend_ratio"] - 12.25 / 15) < 0.01 and abs(t2["hours_covered"] - 3) < 0.01
    assert abs(t2["hours_over_authority"] - 2) < 0.01 and t2["peak_spend_per_hour"] == "5.25"
    assert t2["granted_per_hour"] == "0.00"  # the grant of 4 h ago is before the window; none since
    assert (t2["spend_per_hour"], t2["authority_per_hour"]) == ("5.25", "5.00")
    assert float(spend[1]["spend"]) == 0 and spend[1]["spend_ratio"] is None  # render: no authority, no spend
    assert main(["hall", "report", "--since", "3h", "--dsn", fleet_dsn]) == 0
    row = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("2 "))
    assert row.split()[3:6] == ["82%", "3.00", "2.00h"] and row.split()[-3:] == ["5.25", "5.25", "5.00"], row
