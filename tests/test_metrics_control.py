"""The control loop's textfile metrics (node_exporter textfile format, written atomically at each step's end)
from a real fleet state, read by a real node_exporter, and the distributor's /metrics; both pass
`promtool check metrics`."""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from sco.control import metrics, steps
from sco.control.record import PgFleetStore
from sco.errors import ConfigError
from sco.state.db import connect as connect_db
from tests.prom import NodeExporter, promtool_check, samples, scrape


def seed_fleet(dsn: str) -> None:
    from sco.state.db import connect

    with connect(dsn) as c:
        c.execute("INSERT INTO hall (name) VALUES ('h1')")
        for name, until in (("spot-a", None), ("spot-b", "clock_timestamp() + interval '1 hour'")):
            c.execute(
                "INSERT INTO pool (hall, name, flavor, kind, image, unavailable_until, unavailable_reason)"
                f" VALUES ('h1', %s, 'm1', 'reclaimable', 'img', {until or 'NULL'}, %s)",
                (name, "quota" if until else None),
            )
        rows = [
            ("spot-a", "active", None),
            ("spot-a", "active", None),
            ("spot-a", "draining", "clock_timestamp() + interval '1 minute'"),
            ("spot-a", "deleting", "clock_timestamp() - interval '1 minute'"),  # past T, still not deleted
            ("spot-b", "deleted", None),
        ]
        for slot, (pool, state, t) in enumerate(rows):
            c.execute(
                "INSERT INTO instance (hall, pool, plan_entry, slot, name, state, terminate_at)"
                f" VALUES ('h1', %s, 'e', %s, %s, %s, {t or 'NULL'})",
                (pool, slot, f"n{slot}", state),
            )


@pytest.fixture
def textdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "textfile"
    d.mkdir()
    monkeypatch.setenv(metrics.ENV, str(d))
    return d


def test_a_step_run_writes_its_textfile_with_the_fleet_gauges(fleet_dsn: str, textdir: Path) -> None:
    seed_fleet(fleet_dsn)
    params: dict[str, Any] = {"hall": "h1", "state_dsn": fleet_dsn, "nodes": []}
    steps.run("reclaim", params, check=False)
    text = (textdir / "sco_control_reclaim.prom").read_text()
    promtool_check(text)
    s = samples(text)
    ok_at = s['sco_control_last_run_timestamp_seconds{step="reclaim",result="ok"}']
    assert 'sco_control_last_run_timestamp_seconds{step="reclaim",result="failed"}' not in s
    assert s['sco_control_run_duration_seconds{step="reclaim"}'] >= 0
    # the hall-wide gauges are in their own file, the newest read of the fleet state
    text = (textdir / metrics.FLEET_FILE).read_text()
    promtool_check(text)
    s = samples(text)
    assert s['sco_fleet_instances{pool="spot-a",state="active"}'] == 2
    assert s['sco_fleet_instances{pool="spot-a",state="draining"}'] == 1
    assert not any("deleted" in k for k in s)  # gone instances are not the fleet
    assert s["sco_reclaims_in_progress"] == 1
    assert s["sco_reclaim_deletes_pending"] == 1 and s["sco_reclaim_deletes_past_deadline"] == 1
    assert s['sco_pool_available{pool="spot-a"}'] == 1 and s['sco_pool_available{pool="spot-b"}'] == 0
    # a failing run keeps the last ok time beside its own: the alert compares the two
    with pytest.raises(ConfigError):
        steps.run("reclaim", {**params, "nodes": ["no-such-node"]}, check=False)
    s = samples((textdir / "sco_control_reclaim.prom").read_text())
    assert s['sco_control_last_run_timestamp_seconds{step="reclaim",result="ok"}'] == ok_at
    assert s['sco_control_last_run_timestamp_seconds{step="reclaim",result="failed"}'] >= ok_at
    assert sorted(p.name for p in textdir.iterdir()) == [metrics.FLEET_FILE, "sco_control_reclaim.prom"]  # no temp file
    # check mode ran nothing for real: it leaves the file alone
    before = (textdir / "sco_control_reclaim.prom").read_bytes()
    steps.run("reclaim", params, check=True)
    assert (textdir / "sco_control_reclaim.prom").read_bytes() == before


def test_no_series_is_in_two_files_whatever_steps_ran(fleet_dsn: str, textdir: Path, tmp_path: Path) -> None:
    """node_exporter's textfile collector drops a series a second file repeats, keeping the first file's by name
    (logged: "was collected before with the same name and label values"): the fleet gauges every step reads are
    one file's, the newest, and the real node_exporter serves that one."""
    seed_fleet(fleet_dsn)
    params: dict[str, Any] = {"hall": "h1", "state_dsn": fleet_dsn, "nodes": []}
    steps.run("reclaim", params, check=False)
    with connect_db(fleet_dsn) as c:
        c.execute("UPDATE instance SET state = 'active' WHERE state = 'draining'")
    with PgFleetStore(fleet_dsn) as store:  # the loop's own file (sco-control-loop), after the reclaim step's
        metrics.write_step("loop", "ok", 0.0, 1.0, metrics.fleet_gauges(store, "h1"))
    seen: dict[str, str] = {}
    for f in sorted(textdir.glob("*.prom")):
        for series in samples(f.read_text()):
            assert series not in seen, f"{series} in {seen.get(series)} and {f.name}"
            seen[series] = f.name
    s = samples((textdir / metrics.FLEET_FILE).read_text())
    assert s['sco_fleet_instances{pool="spot-a",state="active"}'] == 3  # the newest read
    assert 'sco_fleet_instances{pool="spot-a",state="draining"}' not in s
    ne = NodeExporter(textdir, tmp_path / "node_exporter")
    try:
        scrape(ne.url)
        s = samples(scrape(ne.url))  # the second: a gathering error of the first would be counted by now
        log = ne.logtext()
    finally:
        ne.stop()
    assert s['promhttp_metric_handler_errors_total{cause="gathering"}'] == 0, log
    assert s['sco_fleet_instances{pool="spot-a",state="active"}'] == 3
    assert 'sco_fleet_instances{pool="spot-a",state="draining"}' not in s


def test_an_unwritable_directory_does_not_fail_the_step(
    fleet_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(metrics.ENV, str(tmp_path / "missing" / "dir"))
    assert steps.run("reclaim", {"hall": "h1", "state_dsn": fleet_dsn, "nodes": []}, check=False)["changed"] is False


def test_a_torn_previous_file_is_replaced_not_trusted(textdir: Path) -> None:
    (textdir / "sco_control_plan.prom").write_text(
        'sco_control_last_run_timestamp_seconds{step="plan",result="ok"} x\n'
    )
    path = metrics.write_step("plan", "failed", 10.0, 12.5)
    assert path is not None
    s = samples(path.read_text())
    assert s == {
        'sco_control_last_run_timestamp_seconds{step="plan",result="failed"}': 12.5,
        'sco_control_run_duration_seconds{step="plan"}': 2.5,
    }
    spend = metrics.render(metrics.spend_gauges({1: (4.5, 20.0), 2: (0.0, 0.0)}))
    promtool_check(spend)
    assert samples(spend)['sco_on_demand_authority_per_hour{tier="1"}'] == 20


def test_the_distributor_serves_metrics_by_code_and_hall(tmp_path: Path) -> None:
    import threading

    from sco.contract.distributor import DistributorServer, bundle_path

    p = bundle_path(tmp_path, "hall-a")
    p.parent.mkdir(parents=True)
    p.write_bytes(b'SCO-BUNDLE v1\n{"serial": 7, "hall": "hall-a"}\n')
    srv = DistributorServer(tmp_path, ("127.0.0.1", 0))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        urllib.request.urlopen(srv.url + "/v1/halls/hall-a/bundle.json", timeout=5).read()
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(srv.url + "/v1/halls/nope/bundle.json", timeout=5)
        text = urllib.request.urlopen(srv.url + "/metrics", timeout=5).read().decode()
    finally:
        srv.shutdown()
        srv.server_close()
    promtool_check(text)
    s = samples(text)
    assert s['sco_distributor_requests_total{code="200"}'] == 1
    assert s['sco_distributor_requests_total{code="404"}'] == 1
    assert s['sco_distributor_bundle_serial{hall="hall-a"}'] == 7
    assert "127.0.0.1" not in text and os.sep + "hall-a" not in text


def test_on_demand_spend_and_authority_by_tier_from_the_arbiters_view() -> None:
    from decimal import Decimal

    from sco.control.model import ContractInfo, Instance, Pool

    pools = (
        Pool("od", "on-demand", 4000, 10, price_per_hour=Decimal("2.50")),
        Pool("spot", "reclaimable", 4000, 10, price_per_hour=Decimal("0.50")),
    )
    infos = {
        "web": ContractInfo("web", 1, on_demand=True, spend_cap_per_hour=Decimal("10")),
        "etl": ContractInfo("etl", 2, on_demand=True, spend_cap_per_hour=Decimal("4")),
        "batch": ContractInfo("batch", 2),  # no on-demand: no authority
    }
    fleet = (
        Instance("1", "n1", "od", ("web",)),
        Instance("2", "n2", "od", ("web", "etl")),  # shared: half each
        Instance("3", "n3", "od", ("etl",), state="deleting"),  # being deleted: no longer paid
        Instance("4", "n4", "spot", ("batch",)),  # reclaimable: not on-demand spend
        Instance("5", "n5", "od", ("retired",)),  # a contract no longer in the bundle: tier 0, no authority
    )
    from sco.control.arbiter import arbitrate

    result = arbitrate({}, infos, pools, fleet, Decimal("100"))
    assert steps.spend_by_tier(result) == {0: (2.5, 0.0), 1: (3.75, 10.0), 2: (1.25, 4.0)}


def test_a_step_file_an_earlier_version_left_loses_its_fleet_gauges(fleet_dsn: str, textdir: Path) -> None:
    """A step that seldom runs (a drill's reclaim) would otherwise keep old copies beside the hall-wide file."""
    old = (
        "# HELP sco_control_last_run_timestamp_seconds When.\n# TYPE sco_control_last_run_timestamp_seconds gauge\n"
        'sco_control_last_run_timestamp_seconds{step="reclaim",result="ok"} 5\n'
        "# HELP sco_fleet_instances Instances.\n# TYPE sco_fleet_instances gauge\n"
        'sco_fleet_instances{pool="spot-a",state="active"} 9\n'
        "# HELP sco_reclaims_in_progress R.\n# TYPE sco_reclaims_in_progress gauge\nsco_reclaims_in_progress 4\n"
    )
    (textdir / "sco_control_reclaim.prom").write_text(old)
    seed_fleet(fleet_dsn)
    with PgFleetStore(fleet_dsn) as store:
        metrics.write_step("loop", "ok", 0.0, 1.0, metrics.fleet_gauges(store, "h1"))
    left = (textdir / "sco_control_reclaim.prom").read_text()
    promtool_check(left)
    assert samples(left) == {'sco_control_last_run_timestamp_seconds{step="reclaim",result="ok"}': 5}
    assert samples((textdir / metrics.FLEET_FILE).read_text())["sco_reclaims_in_progress"] == 1


def test_the_loops_heartbeat_read_never_fails_the_run(fleet_dsn: str) -> None:
    from sco.provider.heartbeats import collect_for_loop
    from sco.state.db import connect as connect_db

    conn = connect_db(fleet_dsn)
    conn.close()  # the fleet state gone mid-run: said in the journal, the run's own outcome stands
    assert collect_for_loop(conn, "h1", {"SCO_NATS_URL": "nats://127.0.0.1:1"}) is None
