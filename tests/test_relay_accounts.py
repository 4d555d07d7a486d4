"""Notices on an account of their own in the relay. A real nats-server configured by the
notice_relay role's own template, a real agent holding only its node's credentials, and the two ways other
clients landed messages on a node's notice subject: a control-plane reader's JetStream request whose reply subject
is that subject, and another node routing the acks of its own events there. Neither reaches the agent (it counts
whatever odd traffic still arrives: here only the reclaimer's own junk), and the reclaimer's real notice still
drains the node end to end."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import nats
import pytest

from sco.contract.signing import write_keypair
from sco.errors import ConfigError
from sco.provider import heartbeats
from sco_devkit.standins.kube_apiserver import KubeApiStandIn
from tests.harness import AgentEnv, add_pod, wait_for
from tests.relays import ATTACKS, REPO, agent_identity, as_user, run_playbook, start_relay, status, tls_for


def test_readers_and_other_nodes_cannot_land_anything_on_a_nodes_notice_subject(
    tmp_path: Path, kube: KubeApiStandIn
) -> None:
    srv, creds = start_relay(tmp_path, ["a", "b"])
    agent = AgentEnv(tmp_path / "agent", kube, srv, node="a", **agent_identity(creds, "a"))
    add_pod(kube, "web", "web-0", agent.node, grace=30, prestop=0.2)
    write_keypair(agent.notice_key, tmp_path / "notice.key", tmp_path / "notice.pub")  # the hall trusts it
    (tmp_path / "nats").symlink_to(creds)  # the drill reads <sco_credentials_dir>/nats/<user>

    async def attack() -> None:
        reader = await nats.connect(srv.url, **as_user(creds, "control"))
        other = await nats.connect(srv.url, **as_user(creds, "node-b"), inbox_prefix="_INBOX.local.b")
        reclaimer = await nats.connect(srv.url, **as_user(creds, "reclaimer"))
        try:
            for i in range(ATTACKS):
                # the reader may ask JetStream about the stream; the answer goes to the reply subject it names
                await reader.publish("$JS.API.STREAM.INFO.SCO_EVENTS", b"", reply="sco.notice.local.a")
                # node b may publish its own events; the stream's ack goes to the reply subject it names
                await other.publish("sco.events.local.b", json.dumps({"i": i}).encode(), reply="sco.notice.local.a")
            # each sender's traffic is answered in order: once its next answer is back, all of the above were too
            await reader.jetstream(timeout=5).stream_info("SCO_EVENTS")
            await other.jetstream(timeout=5).publish("sco.events.local.b", b"{}")
            # what the agent does count: junk on its subject from the one account that may publish there
            await reclaimer.publish("sco.notice.local.a", b'{"junk": "marker"}')
            await reclaimer.flush(timeout=5)
        finally:
            for c in (reader, other, reclaimer):
                await c.close()

    agent.start().wait_subscribed()
    try:
        asyncio.run(attack())
        wait_for(lambda: agent.of("notice.refused"), 15, "the reclaimer's junk refused")
        # the reclaimer's notice still reaches the agent, which drains its node
        out = run_playbook(
            tmp_path, REPO / "playbooks/drill.yml",
            {"drill_notice_keys": [str(tmp_path / "notice.key")], "sco_hall": "local", "sco_relay_url": srv.url,
             "sco_credentials_dir": str(tmp_path), "drill_nodes": ["a"], "drill_notice_seconds": 15,
             "drill_grace_seconds": 5},
        )  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
        assert "a: drained" in out.stdout and len(agent.of("drain.drained")) == 1
    finally:
        agent.stop()  # the agent records its foreign-traffic total as of the stop
        srv.stop()
    notices = status(agent)["notices"]
    # nothing routed by a reader or another node arrived: no foreign traffic, one refusal (the marker)
    assert notices["foreign_traffic_total"] == {}, notices
    assert sum(notices["refused_total"].values()) == 1, notices
    (refused,) = agent.of("notice.refused")
    assert refused["bytes"] == len(b'{"junk": "marker"}'), refused


def test_the_relays_config_holds_no_secret_and_renders_the_same_twice(tmp_path: Path) -> None:
    """Relay users are nkeys. The config has each user's public key, never a seed or a password;
    a second render (the role's next run) changes nothing; each user's seed on the controller gets it in."""
    import nkeys

    from tests.relays import RENDER, ROLE

    srv, creds = start_relay(tmp_path, ["a"])
    try:
        conf = (tmp_path / "nats.conf").read_text()
        seeds = sorted(creds.glob("*.nk"))
        assert [s.stem for s in seeds] == ["control", "node-a", "reclaimer", "relay-admin"]
        for s in seeds:
            assert s.stat().st_mode & 0o777 == 0o600, s
            seed = s.read_bytes().strip()
            assert seed.decode() not in conf
            assert f'nkey: "{nkeys.from_seed(bytearray(seed)).public_key.decode()}"' in conf, s.stem
        assert "password" not in conf and not re.search(r"\bS[A-Z][A-Z2-7]{50,}", conf)  # no seed of any kind
        again = tmp_path / "again.conf"
        r = run_playbook(
            tmp_path, RENDER,
            {"role": str(ROLE), "out": str(again), "notice_relay_hall": "local", "notice_relay_nodes": ["a"],
             "notice_relay_credentials_dir": str(creds), "notice_relay_listen": "127.0.0.1",
             "notice_relay_port": srv.port, "notice_relay_monitor_port": int(conf.split('http: "127.0.0.1:')[1][:5]),
             "notice_relay_store_dir": str(tmp_path / "js"),
             "notice_relay_tls_member_dir": str(tmp_path / "relay-tls")},
        )  # fmt: skip
        assert r.returncode == 0, r.stdout + r.stderr
        assert again.read_text() == conf  # the same seeds: the role's template task reports no change

        async def connect(**auth: Any) -> str:
            errors: list[str] = []

            async def on_error(e: Exception) -> None:
                errors.append(str(e))

            try:
                nc = await nats.connect(
                    srv.url, connect_timeout=3, max_reconnect_attempts=0, allow_reconnect=False, error_cb=on_error,
                    **auth,
                )  # fmt: skip
            except Exception as e:
                return errors[-1] if errors else str(e) or type(e).__name__
            await nc.close()
            return "connected"

        assert asyncio.run(connect(**as_user(creds, "node-a"))) == "connected"
        foreign = tmp_path / "foreign.nk"
        foreign.write_bytes(nkeys.encode_seed(b"\x01" * 32, nkeys.PREFIX_BYTE_USER))
        for auth in ({"nkeys_seed": str(foreign)}, {"user": "node-a", "password": "anything"}):
            assert "authorization violation" in asyncio.run(connect(**auth, **tls_for(srv.url))).lower(), auth
    finally:
        srv.stop()


def test_the_control_loops_heartbeat_reader_reads_the_role_relay_with_its_seed(tmp_path: Path) -> None:
    """sco-control-loop's unit names the reader's seed file ($SCO_NATS_NKEY_SEED, role control_loop); a node's
    beat reaches it through the node's account, and a seed file that is not there is one line naming it."""
    srv, creds = start_relay(tmp_path, ["a"])
    try:

        async def beat() -> None:
            nc = await nats.connect(srv.url, **as_user(creds, "node-a"))
            await nc.publish("sco.heartbeat.local.a", b'{"drain": "idle"}')
            await nc.flush(timeout=5)
            await nc.close()

        asyncio.run(beat())
        reader = heartbeats.reader_from_env(
            {"SCO_NATS_URL": srv.url, "SCO_NATS_NKEY_SEED": str(creds / "control.nk"),
             "SCO_NATS_CA_FILE": str(tmp_path / "tls" / "ca.crt")}
        )  # fmt: skip
        assert reader is not None
        beats = asyncio.run(heartbeats.read(reader, "local"))
        assert set(beats) == {"a"} and beats["a"][1] == {"drain": "idle"}, beats
        missing = tmp_path / "control.nk"
        with pytest.raises(ConfigError, match=f"SCO_NATS_NKEY_SEED {missing}: no readable nkey seed file"):
            heartbeats.reader_from_env({"SCO_NATS_URL": srv.url, "SCO_NATS_NKEY_SEED": str(missing)})
    finally:
        srv.stop()
