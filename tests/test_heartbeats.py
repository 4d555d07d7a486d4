"""Agent heartbeats: a real agent beats onto a relay started with the notice_relay role's own
configuration, the control loop's reader (role user `control`) reads the last beat per node into a real fleet
state, and `sco hall status` lists the agents not heard; the relay lets a node beat only for itself."""

from __future__ import annotations

import asyncio
import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from sco import _nats
from sco.cli import main
from sco.control import metrics
from sco.provider import heartbeats as relay_beats
from sco.provider.heartbeats import HeartbeatsUnreadable, RelayReader, collect, collect_for_loop
from sco.state import heartbeats
from sco.state.db import connect
from sco.state.fleet import FleetState, Pool
from sco_devkit.standins.kube_apiserver import KubeApiStandIn
from tests.harness import AgentEnv, NatsServer, free_port, wait_for
from tests.prom import promtool_check, samples
from tests.relays import agent_identity, as_user, start_relay

HALL = "local"


def _fleet(dsn: str, names: list[str], age_h: float = 1) -> None:
    """Active instances, launched ``age_h`` hours ago (so a never-heard agent is past any threshold)."""
    with FleetState(dsn) as fs:
        fs.ensure_pool(Pool(HALL, "spot", "m1", "img"))
        for slot, name in enumerate(names):
            inst = fs.request(HALL, "spot", "s0", slot, name)
            fs.transition(inst.id, "active", "instance.active", server_id=f"srv-{name}")
            fs.conn.execute(
                "UPDATE instance SET created_at = created_at - make_interval(secs => %s) WHERE id = %s",
                (age_h * 3600, inst.id),
            )


def _reader(srv: NatsServer, creds: Path, user: str = "control") -> RelayReader:
    # the relay's CA beside its credentials (start_relay's, as role hall keeps it)
    return RelayReader(
        srv.url, _nats.auth_options(nkey_seed_file=str(creds / f"{user}.nk"), ca_file=str(creds.parent / "tls/ca.crt")),
        timeout_s=10,
    )  # fmt: skip


def test_an_agent_beats_through_the_role_relay_and_the_silent_one_is_listed(
    tmp_path: Path, kube: KubeApiStandIn, fleet_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "relay").mkdir()
    srv, creds = start_relay(tmp_path / "relay", ["node-1", "node-2"])
    agent = AgentEnv(
        tmp_path / "agent", kube, srv, node="node-1", heartbeat_seconds=1,
        **agent_identity(creds, "node-1"),
    )  # fmt: skip
    try:
        _fleet(fleet_dsn, ["node-1", "node-2"])
        agent.start().wait_subscribed()
        reader = _reader(srv, creds)

        # node-1 may not beat for node-2: the relay refuses the publish, and node-2 stays unheard
        async def forge() -> list[str]:
            import nats

            errors: list[str] = []

            async def on_error(e: Exception) -> None:
                errors.append(str(e))

            nc = await nats.connect(srv.url, **as_user(creds, "node-node-1"), error_cb=on_error)
            await nc.publish("sco.heartbeat.local.node-2", b'{"drain":"idle"}')
            await nc.flush(timeout=2)
            await asyncio.sleep(0.3)  # the permissions violation comes back asynchronously
            await nc.close()
            return errors

        assert any("permissions violation" in e.lower() for e in asyncio.run(forge()))

        def heard() -> dict[str, Any]:
            return asyncio.run(relay_beats.read(reader, HALL))

        beats = wait_for(heard, 15, "node-1's heartbeat on the relay", interval=0.5)
        assert set(beats) == {"node-1"}
        at, detail = beats["node-1"]
        assert abs((datetime.now(UTC) - at).total_seconds()) < 30  # the relay's time of the message
        assert detail["drain"] == "idle" and detail["boot_id"] and detail["backlog"] >= 0 and "node" not in detail

        with connect(fleet_dsn) as conn:
            assert collect(reader, conn, HALL) == 1
        # what the on-call engineer runs, reading the relay itself as the same reader
        argv = ["hall", "status", "--json", "--dsn", fleet_dsn, "--nats", srv.url, "--user", "control"]
        ca = str(creds.parent / "tls/ca.crt")
        assert main([*argv, "--nkey-seed", str(creds / "control.nk"), "--nats-ca-file", ca]) == 0
        st = json.loads(capsys.readouterr().out)
        assert [(a["instance"], a["heard_at"]) for a in st["stale_agents"]] == [("node-2", None)]
        assert st["heartbeats"]["nodes"] == 1 and st["heartbeats"]["last_error"] is None
        # the agent stops: its last beat ages; past the threshold it is listed with when it was last heard
        agent.stop()
        with connect(fleet_dsn) as conn:
            conn.execute("UPDATE agent_heartbeat SET heard_at = heard_at - interval '20 minutes'")
        assert main(["hall", "status", "--dsn", fleet_dsn, "--stale", "15m"]) == 0
        out = capsys.readouterr().out
        silent = out.split("agents not heard for 15m or more: 2", 1)[1]
        assert re.search(r"node-1 +spot +active +\d{4}-\d\d-\d\dT[\d:]+Z +20m", silent), out
        assert re.search(r"node-2 +spot +active +never +60m", silent), out
    finally:
        agent.stop()
        srv.stop()


def test_the_control_loops_read_and_its_gauges(
    tmp_path: Path, nats_server: NatsServer, fleet_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop's read from its environment ($SCO_NATS_URL), then sco_agents_silent in the hall-wide file."""
    _fleet(fleet_dsn, ["a", "b", "c"])

    async def beat() -> None:
        import nats

        nc = await nats.connect(nats_server.url)
        assert await relay_beats.ensure_stream(nc, HALL) == "created"
        assert await relay_beats.ensure_stream(nc, HALL) == "unchanged"
        for node in ("a", "b", "a"):  # the stream keeps a's last beat only
            await nc.publish(f"sco.heartbeat.{HALL}.{node}", json.dumps({"drain": node}).encode())
        await nc.flush()
        await nc.close()

    asyncio.run(beat())
    textdir = tmp_path / "text"
    textdir.mkdir()
    with connect(fleet_dsn) as conn:
        # before any read: no gauge (every agent would count as silent)
        assert metrics.heartbeat_gauges(conn, HALL) == []
        assert collect_for_loop(conn, HALL, {}) is None  # not configured: nothing read, nothing recorded
        assert collect_for_loop(conn, HALL, {"SCO_NATS_URL": nats_server.url}) == 2
        assert {n: d["drain"] for n, (_, d) in _beats(conn).items()} == {"a": "a", "b": "b"}

        class Store:
            def __init__(self) -> None:
                self.conn = conn

            def fleet_metrics(self, hall: str) -> dict[str, Any]:
                return {"instances": {}, "pools": {}, "reclaiming": 0, "deleting": 0, "past_deadline": 0}

        monkeypatch.setenv(metrics.SILENT_ENV, "600")
        metrics.write_step("loop", "ok", 0.0, 1.0, metrics.fleet_gauges(Store(), HALL), str(textdir))
    text = (textdir / metrics.FLEET_FILE).read_text()
    promtool_check(text)
    s = samples(text)
    assert s["sco_agents_silent"] == 1  # c: launched an hour ago, never heard
    assert s["sco_agent_heartbeats_nodes"] == 2
    assert abs(s["sco_agent_heartbeats_read_timestamp_seconds"] - datetime.now(UTC).timestamp()) < 60


def _beats(conn: Any) -> dict[str, tuple[datetime, dict[str, Any]]]:
    return {n: (h, d) for n, h, d in conn.execute("SELECT node, heard_at, detail FROM agent_heartbeat")}


def test_heard_only_moves_forward_and_a_failed_read_is_said(fleet_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    _fleet(fleet_dsn, ["a"])
    now = datetime.now(UTC)
    with connect(fleet_dsn) as conn:
        heartbeats.record(conn, HALL, {"a": (now, {"drain": "idle"})})
        # an older message (a relay that lost its memory and a stale copy, or a slow reader) never moves it back
        heartbeats.record(conn, HALL, {"a": (now - timedelta(hours=1), {"drain": "old"})})
        assert _beats(conn)["a"][1] == {"drain": "idle"}
        assert abs((_beats(conn)["a"][0] - now).total_seconds()) < 0.001
        read_at = heartbeats.collection(conn, HALL)
    # a relay nobody answers on: the status says the read failed and shows what was last heard
    url = f"nats://127.0.0.1:{free_port()}"
    assert main(["hall", "status", "--json", "--dsn", fleet_dsn, "--nats", url]) == 0
    cap = capsys.readouterr()
    st = json.loads(cap.out)
    assert "sco hall status: warning: relay nats://127.0.0.1" in cap.err and "cannot connect" in cap.err
    assert st["heartbeats"]["last_error"].startswith(f"relay {url}: cannot connect")
    assert read_at is not None and st["heartbeats"]["read_at"] is not None and st["stale_agents"] == []


def test_bad_relay_settings_are_one_line_errors(fleet_dsn: str, tmp_path: Path) -> None:
    from tests.cli_run import one_line_error, sco

    _fleet(fleet_dsn, ["a"])
    p = sco("hall", "status", "--dsn", fleet_dsn, "--nats", "nats://host:notaport")
    one_line_error(p, 5, "--nats", "expected nats://HOST:PORT")
    with pytest.raises(HeartbeatsUnreadable, match="no heartbeat stream SCO_HEARTBEATS"):
        srv = NatsServer(tmp_path / "nats").start()
        try:
            asyncio.run(relay_beats.read(RelayReader(srv.url), HALL))
        finally:
            srv.stop()
    missing = tmp_path / "no-such-file"
    env = {"SCO_NATS_URL": "nats://127.0.0.1:4222", "SCO_NATS_USER": "control", "SCO_NATS_PASSWORD_FILE": str(missing)}
    with pytest.raises(Exception, match=f"SCO_NATS_PASSWORD_FILE {missing}"):
        relay_beats.reader_from_env(env)
    with connect(fleet_dsn) as conn:  # the loop's read says it and goes on
        assert collect_for_loop(conn, HALL, env) is None
