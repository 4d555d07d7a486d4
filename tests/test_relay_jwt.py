"""Node identities issued at run time (sco.provider.relay_identity) on a real nats-server in
operator mode with a full resolver. A node enrolled while the relay runs (no reload) connects with its creds under
its own account, hears only its own notices and puts only its own events into the stream; the two routes of
tests/test_relay_accounts.py (a reader's JetStream request and another node's event naming a node's notice
subject as their reply) land nothing there, with a real agent holding a creds file; another node's creds, name or
a self-made JWT are refused; a revocation closes the connected client on the running relay."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest

from sco.provider import heartbeats
from sco.provider import relay_identity as ri
from sco_devkit.standins.kube_apiserver import KubeApiStandIn
from tests.harness import AgentEnv, add_pod, wait_for
from tests.relays import (
    ATTACKS,
    HALL,
    JwtRelay,
    ca_for,
    publish_until,
    relay_refusal,
    start_jwt_relay,
    status,
    stream_subjects,
    tls_for,
)


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[JwtRelay]:
    r = start_jwt_relay(tmp_path)
    yield r
    r.srv.stop()


async def _connect(url: str, creds: Path, node: str = "", **more: Any) -> Any:
    extra = {"inbox_prefix": ri.node_inbox(HALL, node)} if node else {}
    return await nats.connect(url, user_credentials=str(creds), connect_timeout=3, **extra, **tls_for(url), **more)


def test_the_config_is_operator_mode_and_holds_no_secret(relay: JwtRelay) -> None:
    conf = relay.conf.read_text()
    assert "operator: " in conf and "type: full" in conf and "allow_delete: true" in conf
    assert "password" not in conf and not re.search(r"\bS[OAU][A-Z2-7]{50,}", conf)  # no seed of any kind
    for seed in relay.keys.__dict__.values():
        if isinstance(seed, ri.NKey):
            assert seed.seed.decode() not in conf


def test_a_node_enrolled_at_run_time_hears_only_its_notices_and_publishes_only_its_events(relay: JwtRelay) -> None:
    a, a_creds = relay.enrol("a")  # the relay runs already: no restart, no reload
    b, b_creds = relay.enrol("b")
    assert a.account != b.account and ri.decode_jwt(a.user_jwt)["nats"] == {
        "type": "user", "version": 2, "issuer_account": a.account
    }  # fmt: skip

    async def scenario() -> tuple[list[tuple[str, bytes]], list[str], list[str], list[str]]:
        got: list[tuple[str, bytes]] = []
        errors: list[str] = []

        async def on_error(e: Exception) -> None:
            errors.append(str(e))

        async def on_msg(msg: Any) -> None:
            got.append((msg.subject, msg.data))

        node_a = await _connect(relay.url, a_creds, "a", error_cb=on_error)
        node_b = await _connect(relay.url, b_creds, "b")
        reclaimer = await _connect(relay.url, relay.users["reclaimer"])
        folded: list[str] = []

        async def fold(msg: Any) -> None:  # the reclaimer's durable push consumer, as sco.provider.reclaimer
            folded.append(msg.subject)
            await msg.ack()

        try:
            await node_a.subscribe(f"sco.notice.{HALL}.a", cb=on_msg)
            for forbidden in (f"sco.notice.{HALL}.b", f"sco.notice.{HALL}.>", ">", "_INBOX.>"):
                await node_a.subscribe(forbidden, cb=on_msg)
            await node_a.flush(timeout=5)
            await reclaimer.jetstream(timeout=5).subscribe(
                f"sco.events.{HALL}.>", stream=ri.STREAM, durable=f"sco-reclaimer-{HALL}", cb=fold, manual_ack=True
            )
            notices = [(f"sco.notice.{HALL}.{node}", f"notice for {node}".encode()) for node in ("a", "b")]
            await publish_until(reclaimer, notices, got)
            # node a: its own events and heartbeat in; another's events, a notice, an arbitrary subject refused
            ack = await node_a.jetstream(timeout=5).publish(f"sco.events.{HALL}.a", b'{"type": "agent.started"}')
            assert ack.stream == ri.STREAM
            await node_a.publish(f"sco.heartbeat.{HALL}.a", b'{"drain": "idle"}')
            for subject in (f"sco.events.{HALL}.b", f"sco.notice.{HALL}.a", f"sco.notice.{HALL}.b", "elsewhere"):
                await node_a.publish(subject, b"{}")
            await node_a.flush(timeout=5)
            await node_b.jetstream(timeout=5).publish(f"sco.events.{HALL}.b", b'{"type": "agent.started"}')
            await asyncio.sleep(0.5)
            reader = heartbeats.reader_from_env(
                {
                    "SCO_NATS_URL": relay.url,
                    "SCO_NATS_CREDS": str(relay.users["control"]),
                    "SCO_NATS_CA_FILE": str(ca_for(relay.url)),
                }
            )
            assert reader is not None
            beats = await heartbeats.read(reader, HALL)
            return got, errors, folded, sorted(beats)
        finally:
            for c in (node_a, node_b, reclaimer):
                await c.close()

    got, errors, folded, beats = asyncio.run(scenario())
    assert got and set(got) == {(f"sco.notice.{HALL}.a", b"notice for a")}, got
    violations = " ".join(errors).lower()
    for subject in (f"sco.notice.{HALL}.b", ">", f"sco.events.{HALL}.b", "elsewhere"):
        assert f'"{subject}"' in violations, (subject, errors)
    assert asyncio.run(stream_subjects(relay)) == [f"sco.events.{HALL}.a", f"sco.events.{HALL}.b"]
    assert folded == [f"sco.events.{HALL}.a", f"sco.events.{HALL}.b"]  # the reclaimer reads the accounts' events
    assert beats == ["a"]  # the control loop's reader hears node a's beat through a's account


def test_readers_and_other_nodes_cannot_land_anything_on_a_nodes_notice_subject(
    relay: JwtRelay, tmp_path: Path, kube: KubeApiStandIn
) -> None:
    """tests/test_relay_accounts.py's attacks against the operator-mode relay, a real agent on a creds file."""
    _, a_creds = relay.enrol("a")
    _, b_creds = relay.enrol("b")
    agent = AgentEnv(
        tmp_path / "agent", kube, relay.srv, node="a", nats_creds_file=str(a_creds), nats_ca_file=str(ca_for(relay.url))
    )
    add_pod(kube, "web", "web-0", agent.node, grace=30, prestop=0.2)

    async def attack() -> None:
        reader = await _connect(relay.url, relay.users["control"])
        other = await _connect(relay.url, b_creds, "b")
        reclaimer = await _connect(relay.url, relay.users["reclaimer"])
        try:
            for i in range(ATTACKS):
                # the reader may ask JetStream about the stream; the answer goes to the reply subject it names
                await reader.publish(f"$JS.API.STREAM.INFO.{ri.STREAM}", b"", reply=f"sco.notice.{HALL}.a")
                # node b may publish its own events; the stream's ack goes to the reply subject it names
                await other.publish(f"sco.events.{HALL}.b", json.dumps({"i": i}).encode(), reply=f"sco.notice.{HALL}.a")
            # each sender's traffic is answered in order: once its next answer is back, all of the above were too
            await reader.jetstream(timeout=5).stream_info(ri.STREAM)
            await other.jetstream(timeout=5).publish(f"sco.events.{HALL}.b", b"{}")
            # what the agent does count: junk on its subject from the one account that may publish there
            await reclaimer.publish(f"sco.notice.{HALL}.a", b'{"junk": "marker"}')
            await reclaimer.flush(timeout=5)
        finally:
            for c in (reader, other, reclaimer):
                await c.close()

    async def notify() -> None:  # the reclaimer's real notice, signed with the hall's notice key
        reclaimer = await _connect(relay.url, relay.users["reclaimer"])
        await reclaimer.publish(f"sco.notice.{HALL}.a", agent.notice("n-1", 15))
        await reclaimer.flush(timeout=5)
        await reclaimer.close()

    agent.start().wait_subscribed()
    try:
        asyncio.run(attack())
        wait_for(lambda: agent.of("notice.refused"), 15, "the reclaimer's junk refused")
        asyncio.run(notify())
        wait_for(lambda: agent.of("drain.drained"), 30, "node a drained")
        # the agent's account of its drain reached the stream through its own account
        wait_for(
            lambda: f"sco.events.{HALL}.a" in asyncio.run(stream_subjects(relay)), 15, "node a's events in the stream"
        )
    finally:
        agent.stop()
    notices = status(agent)["notices"]
    assert notices["foreign_traffic_total"] == {}, notices
    assert sum(notices["refused_total"].values()) == 1, notices
    (refused,) = agent.of("notice.refused")
    assert refused["bytes"] == len(b'{"junk": "marker"}'), refused
    assert len(agent.of("drain.drained")) == 1


def test_another_nodes_creds_name_or_a_self_made_identity_are_refused(relay: JwtRelay) -> None:
    a, a_creds = relay.enrol("a")
    b, _ = relay.enrol("b")
    a_seed = re.search(rb"\bSU[A-Z2-7]+", a_creds.read_bytes())
    assert a_seed is not None
    a_key = ri.NKey.from_seed(a_seed.group())
    stranger = ri.NKey.generate("account")
    forged = {
        # node a's seed under node b's user JWT: the signature of the server's nonce does not match
        "b's JWT, a's seed": relay.creds_file("x1", b.user_jwt, a_key),
        # a's key naming b's account, signed by a key b's account does not list
        "b's account, a stranger's signature": relay.creds_file(
            "x2", ri.encode_jwt(stranger, a_key.public, {"type": "user", "issuer_account": b.account}), a_key
        ),
        # a user of the node issuer that carries permissions of its own (all subjects): scoped users may not
        "scoped user with permissions": relay.creds_file(
            "x3",
            ri.encode_jwt(
                relay.keys.node_issuer,
                a_key.public,
                {"type": "user", "issuer_account": a.account, "pub": {"allow": [">"]}, "sub": {"allow": [">"]}},
            ),
            a_key,
        ),
        # an account the operator never signed (made up, never pushed)
        "unknown account": relay.creds_file(
            "x4",
            ri.encode_jwt(relay.keys.node_issuer, a_key.public, {"type": "user", "issuer_account": stranger.public}),
            a_key,
        ),
    }
    assert asyncio.run(relay_refusal(relay.url, user_credentials=str(a_creds))) == "connected"
    for what, path in forged.items():
        refused = asyncio.run(relay_refusal(relay.url, user_credentials=str(path)))
        assert "authorization violation" in refused.lower(), what
    # the listed configuration's ways in (a bare nkey, a password) do not exist here
    seed_file = relay.dir / "a.nk"
    seed_file.write_bytes(a_key.seed)
    for auth in ({"nkeys_seed": str(seed_file)}, {"user": "node-a", "password": "anything"}):
        assert "authorization violation" in asyncio.run(relay_refusal(relay.url, **auth)).lower(), auth


def test_a_revocation_closes_the_connected_node_and_refuses_it_after(relay: JwtRelay) -> None:
    a, a_creds = relay.enrol("a")
    _, b_creds = relay.enrol("b")

    async def scenario() -> tuple[float, str, str, list[bytes]]:
        closed = asyncio.Event()

        async def on_closed() -> None:
            closed.set()

        async def quiet(e: Exception) -> None:
            pass

        node_a = await _connect(relay.url, a_creds, "a", allow_reconnect=False, closed_cb=on_closed, error_cb=quiet)
        assert node_a.is_connected
        node_b = await _connect(relay.url, b_creds, "b")
        heard: list[bytes] = []

        async def on_b(msg: Any) -> None:
            heard.append(msg.data)

        await node_b.subscribe(f"sco.notice.{HALL}.b", cb=on_b)
        await node_b.flush(timeout=5)
        admin = await ri.RelayAdmin.connect(relay.url, relay.keys, tls_ca_file=ca_for(relay.url))
        try:
            started = time.monotonic()
            await ri.revoke(admin, relay.keys, a)
            await asyncio.wait_for(closed.wait(), 10)
            took = time.monotonic() - started
            again = await relay_refusal(relay.url, user_credentials=str(a_creds))
            # the account is then forgotten (allow_delete); the node stays refused
            await admin.forget(relay.keys, [a.account])
            after_delete = await relay_refusal(relay.url, user_credentials=str(a_creds))
            reclaimer = await _connect(relay.url, relay.users["reclaimer"])
            await reclaimer.publish(f"sco.notice.{HALL}.b", b"still here")
            await reclaimer.flush(timeout=5)
            await reclaimer.close()
            await asyncio.sleep(0.3)
            return took, again, after_delete, heard
        finally:
            await admin.close()
            await node_b.close()

    took, again, after_delete, heard = asyncio.run(scenario())
    print(f"revocation to the connected client closed: {took * 1000:.1f} ms")
    assert took < 10  # a bound, not the figure: bench relay_jwt_identities measures it
    assert "authorization violation" in again.lower() and "authorization violation" in after_delete.lower()
    assert heard == [b"still here"]  # node b, untouched by a's revocation
