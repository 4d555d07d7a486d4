"""The node agent under hostile input and faults (defects 1-6, 8, 9 of the issue).

Real parts: nats-server (with accounts and permissions where identity matters), the agent as its own process,
tmpfs mounts for a full and a read-only state directory (the tests run as root, as the README says). The
Kubernetes API is the protocol-level stand-in (it cannot run here).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sco.agent.notices import NoticeBook, NoticeRefused, parse_metadata, parse_nats
from sco.agent.spool import MAX_RECORD, ROUTINE, Spool, read_events
from sco.contract.signing import Keyring, generate, write_keypair
from sco.errors import ConfigError
from sco_devkit.standins.kube_apiserver import KubeApiStandIn
from tests.harness import BIN, AgentEnv, MetadataServer, NatsServer, add_pod, free_port, stream_events, wait_for

WINDOW = 20.0
NOW = 1_800_000_000.0


@pytest.fixture
def agent(tmp_path: Path, kube: KubeApiStandIn, nats_server: NatsServer) -> Iterator[AgentEnv]:
    env = AgentEnv(tmp_path / "agent", kube, nats_server)
    yield env
    env.stop()


def audit(kube: KubeApiStandIn, verb: str, name: str | None = None) -> list[dict[str, Any]]:
    return [a for a in kube.cluster.audit if a["verb"] == verb and (name is None or a["name"] == name)]


def sign(doc: dict[str, Any], key: Any) -> bytes:
    from sco.contract.notice import sign_notice

    return sign_notice(doc, [key])


# --- 1. anyone on the relay can drain a node ---------------------------------------------------------------


def test_unsigned_forged_and_untrusted_notices_are_refused_and_counted(agent: AgentEnv, kube: KubeApiStandIn) -> None:
    add_pod(kube, "web", "w", agent.node, prestop=0.2)
    agent.start().wait_subscribed()
    agent.send(agent.unsigned_notice("bare-1", WINDOW))  # a bare PUB by anyone on the relay
    agent.send(sign(agent.notice_doc("other-key", WINDOW), generate()))  # signed, by a key the hall does not name
    forged = json.loads(agent.notice("forged", WINDOW))
    forged["terminateAt"] -= 15  # altered after signing
    agent.send(json.dumps(forged).encode())
    refused = wait_for(lambda: len(agent.of("notice.refused")) >= 3 and agent.of("notice.refused"), 10, "refusals")
    assert sorted(e["kind"] for e in refused) == ["forged", "unsigned", "untrusted"]
    assert refused[-1]["refused_total"] == {"forged": 1, "unsigned": 1, "untrusted": 1}
    assert not agent.of("notice.accepted") and not audit(kube, "patch", agent.node)
    # the reclaimer's notice, sent with the operator's command, drains
    from sco.contract.signing import write_keypair

    write_keypair(agent.notice_key, agent.root / "notice.key", agent.root / "notice.pub")
    send = ["notice", "send", "--hall", "local", "--node", agent.node, "--in", str(WINDOW), "--id", "good-1"]
    p = subprocess.run(
        [str(BIN / "sco"), *send, "--signing-key", str(agent.root / "notice.key"), "--nats", agent.nats.url],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.returncode == 0, p.stderr
    out = agent.outcome(WINDOW)
    assert out["type"] == "drain.drained" and out["notice"] == "good-1"


async def _route_jetstream_traffic_to(url: str, victim_subject: str, n: int) -> None:
    """What a node can do without publishing to another node's notice subject: publish its own events with that
    subject as the reply (JetStream sends the PubAck there), and create a push consumer delivering there."""
    import nats
    from nats.js.api import AckPolicy, ConsumerConfig

    nc = await nats.connect(url)
    try:
        for i in range(n):
            await nc.publish(f"sco.events.local.attacker.{i}", b"{}", reply=victim_subject)
        # the same message id twice: the second PubAck says "duplicate": true
        for _ in range(2):
            await nc.publish(
                "sco.events.local.attacker.dup", b"{}", reply=victim_subject, headers={"Nats-Msg-Id": "d1"}
            )
        await nc.flush()
        js = nc.jetstream()
        await js.add_consumer(
            "SCO_EVENTS",
            ConsumerConfig(
                durable_name="routed", deliver_subject=victim_subject, ack_policy=AckPolicy.EXPLICIT, ack_wait=30
            ),
        )
        await nc.flush()
    finally:
        await nc.close()


def test_jetstream_acks_and_deliveries_routed_to_a_notice_subject_are_foreign(tmp_path: Path, nats_server: Any) -> None:
    import asyncio

    from sco_devkit.standins.kube_apiserver import KubeApiStandIn
    from tests.harness import BIN, AgentEnv, wait_for

    kube = KubeApiStandIn().start()
    env = AgentEnv(tmp_path / "a", kube, nats_server)
    victim = f"sco.notice.local.{env.node}"
    try:
        env.start().wait_subscribed()
        asyncio.run(_route_jetstream_traffic_to(nats_server.url, victim, 60))
        # 62 PubAcks, then every stream message (62 and the agent's own) delivered with a $JS.ACK. reply
        wait_for(lambda: env.logtext().count("foreign traffic") >= 1, 15, "the foreign-traffic warning")
        env.send(env.notice("real-1", 30))  # the real channel still works beside the noise
        wait_for(lambda: env.of("notice.accepted"), 15, "the real notice")
        time.sleep(1)  # let the deliveries land: the assertion below is on what they left behind
    finally:
        env.stop()
        kube.stop()
    refused = env.of("notice.refused")
    assert not refused, refused[:3]
    foreign = env.of("notice.foreign_traffic")
    assert foreign, env.logtext()[-2000:]
    total = foreign[-1]["foreign_traffic_total"]  # brought up to date at stop
    assert total.get("jetstream-puback", 0) == 62, total
    assert total.get("jetstream-delivery", 0) >= 62, total
    assert len(foreign) <= 3, foreign  # a summary, not a record per message
    warnings = [x for x in env.logtext().splitlines() if "foreign traffic" in x]
    assert 1 <= len(warnings) <= 2, warnings
    p = subprocess.run(
        [str(BIN / "sco-agent"), "status", "--state-dir", str(env.state)], capture_output=True, text=True, timeout=30
    )
    assert p.returncode == 0, p.stderr
    notices = json.loads(p.stdout)["notices"]
    assert notices["foreign_traffic_total"] == total and notices["refused_total"] == {}, notices


def test_foreign_traffic_shapes() -> None:
    from sco.agent.notices import foreign_traffic

    assert foreign_traffic(b'{"stream":"SCO_EVENTS","seq":7}', "", None) == "jetstream-puback"
    assert foreign_traffic(b'{"stream":"S","seq":7,"duplicate":true,"domain":"d"}', "", None) == "jetstream-puback"
    ack = b'{"error":{"code":503,"description":"no responders"},"stream":"S","seq":0}'
    assert foreign_traffic(ack, "", None) == "jetstream-puback"
    assert foreign_traffic(b"x", "$JS.ACK.SCO_EVENTS.routed.1.2.3.4.5", None) == "jetstream-delivery"
    assert foreign_traffic(b"", "", {"Status": "100", "Description": "Idle Heartbeat"}) == "jetstream-delivery"
    # a notice, signed or not, or anything else, is for the notice path to judge
    assert foreign_traffic(b'{"stream":"S","seq":1,"terminateAt":5}', "", None) is None
    assert foreign_traffic(b'{"payload":{},"signatures":[]}', "", None) is None
    assert foreign_traffic(b"not json", "_INBOX.x", None) is None
    assert foreign_traffic(b'{"stream":"S","seq":"7"}', "", None) is None


def _auth_nats(root: Path, users: str) -> NatsServer:
    """nats-server with JetStream and a users block: no anonymous connections."""
    srv = NatsServer(root)
    root.mkdir(parents=True, exist_ok=True)
    conf = root / "nats.conf"
    conf.write_text(
        f"listen: 127.0.0.1:{srv.port}\njetstream {{ store_dir: {json.dumps(str(root / 'js'))} }}\n"
        f"authorization {{\n  users = [\n{users}\n  ]\n}}\n"
    )
    srv.proc = subprocess.Popen(
        [str(BIN / "nats-server"), "-c", str(conf)],
        stdout=subprocess.DEVNULL,
        stderr=open(root / "nats.log", "ab"),  # noqa: SIM115
    )

    def up() -> bool:
        try:
            socket.create_connection(("127.0.0.1", srv.port), 0.2).close()
            return True
        except OSError:
            return False

    wait_for(up, 10, "nats-server")
    return srv


_NODE_PERMS = (
    'permissions: {publish: {allow: ["sco.events.local.node-1", "$JS.API.>"]},'
    ' subscribe: {allow: ["sco.notice.local.node-1", "_INBOX.local.node-1.>"]}}'
)


@pytest.mark.parametrize("identity", ["password", "nkey"])
def test_agent_uses_its_own_nats_identity(tmp_path: Path, kube: KubeApiStandIn, identity: str) -> None:
    import nats
    import nkeys

    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    public = nkeys.from_seed(bytearray(seed)).public_key.decode()
    (tmp_path / "node.nk").write_bytes(seed + b"\n")
    (tmp_path / "node.nk").chmod(0o600)  # the role writes it so; group- or other-readable is refused
    node_user = (
        f'{{user: "node-1", password: "pw-node", {_NODE_PERMS}}}'
        if identity == "password"
        else f'{{nkey: "{public}", {_NODE_PERMS}}}'
    )
    srv = _auth_nats(
        tmp_path / "nats",
        f'    {node_user}\n    {{user: "reclaimer", password: "pw-rec", permissions: {{publish: ["sco.notice.>"]}}}}\n'
        f'    {{user: "admin", password: "pw-admin"}}',
    )
    settings: dict[str, Any] = (
        {"nats_user": "node-1", "nats_password": "pw-node"}
        if identity == "password"
        else {"nats_nkey_seed_file": str(tmp_path / "node.nk")}
    )
    env = AgentEnv(tmp_path / "a", kube, srv, **settings)
    try:
        admin = f"nats://admin:pw-admin@127.0.0.1:{srv.port}"

        async def setup() -> None:
            nc = await nats.connect(admin)
            await nc.jetstream().add_stream(name="SCO_EVENTS", subjects=["sco.events.>"])
            await nc.close()

        asyncio.run(setup())

        async def anonymous() -> None:  # a bare PUB without credentials: the relay refuses the connection
            await nats.connect(srv.url, max_reconnect_attempts=0, allow_reconnect=False, connect_timeout=2)

        with pytest.raises(Exception, match=r"(?i)authorization"):
            asyncio.run(anonymous())
        add_pod(kube, "web", "w", "node-1", prestop=0.2)
        env.start().wait_subscribed()

        async def reclaim() -> None:
            nc = await nats.connect(f"nats://reclaimer:pw-rec@127.0.0.1:{srv.port}")
            await nc.publish("sco.notice.local.node-1", env.notice("auth-1", WINDOW))
            await nc.flush()
            await nc.close()

        asyncio.run(reclaim())
        out = env.outcome(WINDOW)
        assert out["type"] == "drain.drained", (out, env.logtext()[-4000:])
        events = wait_for(
            lambda: (e := asyncio.run(stream_events(admin))) and e[-1]["seq"] >= out["seq"] and e, 15, "events"
        )
        assert {e["node"] for e in events} == {"node-1"}  # published under the node's own identity
    finally:
        env.stop()
        srv.stop()


def test_notice_signatures_round_trip_and_refusals() -> None:
    from sco.contract.notice import sign_notice, verify_notice
    from sco.contract.signing import Keyring
    from sco.errors import NoticeAuthError

    k, other = generate(), generate()
    doc = {"id": "n1", "hall": "h", "node": "a", "terminateAt": NOW + 120.25, "issuedAt": NOW}
    raw = sign_notice(doc, [k])
    assert verify_notice(raw, Keyring([k.public])) == doc
    cases = {
        json.dumps(doc).encode(): "unsigned",
        raw.replace(b'"node":"a"', b'"node":"b"'): "forged",
        sign_notice(doc, [other]): "untrusted",
        b"[]": "malformed",
        b" " * 70_000: "malformed",
    }
    for bad, kind in cases.items():
        with pytest.raises(NoticeAuthError) as e:
            verify_notice(bad, Keyring([k.public]))
        assert e.value.kind == kind, bad[:60]
    with pytest.raises(NoticeAuthError, match="no notice key is trusted"):
        verify_notice(raw, Keyring())


# --- 2. forged event ids -------------------------------------------------------------------------------------


def test_guessed_event_ids_do_not_make_jetstream_drop_real_events(agent: AgentEnv, kube: KubeApiStandIn) -> None:
    import nats

    async def forge() -> None:  # someone on the relay publishes first, with the ids the agent used to use
        nc = await nats.connect(agent.nats.url)
        js = nc.jetstream()
        for seq in range(1, 80):
            for msg_id in (f"local.{agent.node}.{seq}", str(seq)):
                await js.publish(f"sco.events.local.{agent.node}", b'{"forged": true}', headers={"Nats-Msg-Id": msg_id})
        await nc.close()

    asyncio.run(forge())
    add_pod(kube, "web", "w", agent.node, prestop=0.2)
    agent.start().wait_subscribed()
    agent.send(agent.notice("ids-1", WINDOW))
    out = agent.outcome(WINDOW)
    spooled = [e["seq"] for e in agent.events()]

    def published() -> list[int] | None:
        seqs = [e["seq"] for e in asyncio.run(stream_events(agent.nats.url)) if "seq" in e]
        return seqs if seqs and seqs[-1] >= out["seq"] else None

    assert wait_for(published, 15, "the agent's events in JetStream", 0.3)[: len(spooled)] == spooled


def test_events_and_notices_only_on_the_nodes_own_subject(tmp_path: Path) -> None:
    from sco.agent import config as agent_config

    (tmp_path / "k.pub").write_text("{}")
    base = {
        "SCO_AGENT_HALL": "h",
        "SCO_AGENT_NODE": "n",
        "SCO_AGENT_KUBE_URL": "http://127.0.0.1:1",
        "SCO_AGENT_TRUST_DIR": str(tmp_path),
        "SCO_AGENT_STATE_DIR": str(tmp_path / "state"),
    }
    for key, value in (("EVENTS_SUBJECT", "sco.events.>"), ("NOTICE_SUBJECT", "sco.notice.{hall}.*")):
        with pytest.raises(ConfigError) as e:
            agent_config.load(None, env={**base, f"SCO_AGENT_{key}": value})
        assert "must name this node" in "\n".join(e.value.lines())


# --- 3. a record the spool cannot read back hides all later ones ------------------------------------------------


def test_an_oversized_field_is_cut_and_later_records_stay_readable(tmp_path: Path) -> None:
    s = Spool(tmp_path)
    s.append("notice.refused", ROUTINE, kind="foreign", reason="n" * 2_250_000)
    for i in range(5):
        s.append("after", ROUTINE, i=i)
    s.close()
    assert (tmp_path / "events.spool").stat().st_size < 100_000
    events = list(read_events(tmp_path))
    assert [e["type"] for e in events] == ["notice.refused"] + ["after"] * 5
    assert events[0]["reason_len"] == 2_250_000
    s2 = Spool(tmp_path)  # a restart keeps all of them
    assert s2.recovery.torn_bytes == 0 and s2.last_seq == 6


def test_recovery_skips_an_unreadable_record_and_keeps_the_ones_after_it(tmp_path: Path) -> None:
    from sco.agent.spool import _frame

    s = Spool(tmp_path)
    for i in range(3):
        s.append("before", ROUTINE, i=i)
    s.close()
    with open(tmp_path / "events.spool", "ab") as f:  # what an old agent wrote: a record above the limit, then more
        f.write(_frame(json.dumps({"seq": 4, "type": "huge", "x": "y" * (MAX_RECORD + 10)}).encode(), 0, 4))
        f.write(_frame(json.dumps({"seq": 5, "type": "after"}, sort_keys=True).encode(), 0, 5))
    data = bytearray((tmp_path / "events.spool").read_bytes())
    data[30] ^= 0xFF  # and a flipped byte inside the first record
    (tmp_path / "events.spool").write_bytes(bytes(data))
    s = Spool(tmp_path)
    assert s.recovery.skipped == 2 and s.recovery.torn_bytes == 0
    s.append("after", ROUTINE, i=6)
    assert [e["type"] for e in s.events()] == ["before", "before", "after", "after"]
    s.close()


def test_a_huge_foreign_notice_hides_nothing(agent: AgentEnv, kube: KubeApiStandIn) -> None:
    add_pod(kube, "guarded", "g-0", agent.node, labels={"app": "g"}, prestop=0.2)
    kube.cluster.create_pdb(
        "guarded", {"metadata": {"name": "g"}, "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "g"}}}}
    )
    agent.start().wait_subscribed()
    # 800 KB on the wire (under NATS's 1 MB payload limit); its node name, quoted in a refusal reason and
    # escaped as JSON (\u00e9: 6 bytes a character), made a 2.4 MB record before the fix.
    doc = agent.notice_doc("big", WINDOW, node="\u00e9" * 400_000)
    agent.send(json.dumps(doc, ensure_ascii=False).encode())
    wait_for(lambda: agent.of("notice.refused"), 10, "the refusal")
    agent.send(agent.notice("real-1", WINDOW))
    out = agent.outcome(WINDOW)  # every record after the refusal is readable: the outcome, the forced delete
    assert out["type"] == "drain.drained" and out["forced"] == 1
    assert audit(kube, "delete", "g-0")
    agent.stop()
    agent.start()  # and a restart cuts nothing
    assert agent.of("agent.started")[-1]["spool_torn_bytes"] == 0
    assert agent.of("drain.drained")


# --- 4. no drain when the spool cannot be written ----------------------------------------------------------------


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Any]:
    mounted: list[Path] = []

    def mount(path: Path, size: str, ro: bool = False) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        opts = f"size={size}" + (",ro" if ro else "")
        subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], check=True)
        mounted.append(path)
        return path

    yield mount
    for p in reversed(mounted):
        subprocess.run(["umount", "-l", str(p)], check=False)


def _fill(path: Path) -> Path:
    filler = path / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    return filler


def test_full_disk_still_taints_and_evicts_and_says_so_later(
    tmp_path: Path, kube: KubeApiStandIn, nats_server: NatsServer, tmpfs: Any
) -> None:
    env = AgentEnv(tmp_path / "a", kube, nats_server, spool_max_bytes=65536)
    state = tmpfs(tmp_path / "a" / "state-fs", "1m")
    (state / "bundle").mkdir()
    (state / "bundle" / "bundle.json").write_bytes((env.state / "bundle" / "bundle.json").read_bytes())
    env.state = state
    env.config.write_text(env.config.read_text().replace(str(tmp_path / "a" / "state"), str(state)))
    for i in range(30):  # enough records to need new pages of the full filesystem
        add_pod(kube, "web", f"w-{i}", env.node, prestop=0.2)
    try:
        env.start().wait_subscribed()
        filler = _fill(state)
        env.send(env.notice("full-1", WINDOW))
        wait_for(lambda: len(audit(kube, "evict")) == 30, 10, "evictions despite the full disk")
        assert audit(kube, "patch", env.node)  # tainted
        wait_for(lambda: "ERROR" in env.logtext() and "cannot be written" in env.logtext(), 5, "an ERROR line")
        wait_for(lambda: not kube.cluster.list_pods(None, None, f"spec.nodeName={env.node}"), 10, "pods gone")
        assert env.proc is not None and env.proc.poll() is None
        filler.unlink()  # room again: the held records land, in order, and the outcome says what happened
        out = env.outcome(10)
        assert out["type"] == "drain.drained" and out["spool_unwritable"]["error"].startswith("ENOSPC")
        types = [e["type"] for e in env.events()]
        assert types.index("notice.accepted") < types.index("node.tainted") < types.index("drain.drained")
        assert "spool.unwritable" in types
        assert "Traceback" not in env.logtext()
        # the publisher lived through it: everything reaches JetStream, the outcome included
        wait_for(
            lambda: any(e.get("type") == "drain.drained" for e in asyncio.run(stream_events(nats_server.url))),
            15,
            "the outcome in JetStream",
        )
    finally:
        env.stop()


def test_check_config_and_run_refuse_an_unusable_state_dir(tmp_path: Path, tmpfs: Any) -> None:
    (tmp_path / "trusted").mkdir()
    (tmp_path / "trusted" / "k.pub").write_text("{}")
    ro = tmpfs(tmp_path / "ro", "1m", ro=True)
    small = tmpfs(tmp_path / "small", "256k")
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for state, needle in ((ro, "not writable"), (small, "less than the spool bound"), (a_file, "not a directory")):
        cfg = tmp_path / "agent.toml"
        cfg.write_text(
            f'[agent]\nhall = "h"\nnode = "n"\nkube_url = "http://127.0.0.1:1"\n'
            f'trust_dir = "{tmp_path / "trusted"}"\nstate_dir = "{state}"\n'
        )
        for cmd in ("check-config", "run"):
            p = subprocess.run(
                [str(BIN / "sco-agent"), cmd, "--config", str(cfg)], capture_output=True, text=True, timeout=30
            )
            assert p.returncode == 5 and "Traceback" not in p.stderr, (cmd, state, p.stderr)
            assert "agent.state_dir" in p.stderr and needle in p.stderr, p.stderr


# --- 5. non-finite times -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [math.nan, "nan", "NaN", math.inf, "-inf", "1e999", 10**400, 1e300, -5, 0])
def test_non_finite_and_out_of_range_times_are_refused(value: Any) -> None:
    doc = {"id": "t", "hall": "h", "node": "a", "terminateAt": value, "issuedAt": NOW}
    raw = json.dumps(doc).encode()  # Python writes NaN and Infinity; other senders might too
    with pytest.raises(NoticeRefused) as e:
        parse_nats(raw, hall="h", node="a", now=NOW, window=120)
    assert e.value.kind in ("absurd", "malformed")
    meta = {"name": "a", "meta": {"sco_reclaim_id": "m", "sco_reclaim_at": str(value)}}
    with pytest.raises(NoticeRefused):
        parse_metadata(json.dumps(meta).encode(), hall="h", node="a", now=NOW, window=120)


def test_a_nan_notice_leaves_a_refusal_record(agent: AgentEnv, kube: KubeApiStandIn) -> None:
    agent.start().wait_subscribed()
    agent.send(agent.notice("nan-1", WINDOW, terminateAt="nan"))
    agent.send(agent.notice("big-1", WINDOW, terminateAt=10**400))
    refused = wait_for(lambda: len(agent.of("notice.refused")) >= 2 and agent.of("notice.refused"), 10, "refusals")
    assert {e["kind"] for e in refused} == {"absurd"}
    assert not agent.of("notice.accepted") and not audit(kube, "patch", agent.node)
    assert agent.proc is not None and agent.proc.poll() is None


# --- 6. unbounded reads ------------------------------------------------------------------------------------------


class EvilServer:
    """Answers every request badly: an absurd Content-Length with a few MiB then a stall, or one byte at a time."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        try:
            conn.recv(65536)
            if self.mode == "huge":
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000000000\r\n\r\n")
                for _ in range(64):  # 4 MiB, then silence: the client must not wait for the rest
                    conn.sendall(b"{" * 65536)
            elif self.mode == "endless":
                conn.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
                for _ in range(64):
                    conn.sendall(b"{" * 65536)
            else:  # slow: one byte every 0.2 s
                for b in b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 100:
                    if self.stop.is_set():
                        break
                    conn.sendall(bytes([b]))
                    time.sleep(0.2)
            self.stop.wait(10)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


@pytest.mark.parametrize("mode", ["huge", "endless"])
def test_http_client_caps_the_body(mode: str) -> None:
    from sco._http import AsyncHttpClient, HttpTooLarge

    srv = EvilServer(mode)

    async def get() -> None:
        c = AsyncHttpClient(f"http://127.0.0.1:{srv.port}", timeout=10, max_body=1 << 20)
        try:
            await c.request("GET", "/openstack/latest/meta_data.json")
        finally:
            await c.close()

    try:
        with pytest.raises(HttpTooLarge, match="exceeds the 1048576 byte cap"):
            asyncio.run(get())
    finally:
        srv.close()


@pytest.mark.parametrize("mode", ["huge", "endless", "slow"])
def test_bundle_fetch_refuses_oversize_and_slow_answers_and_keeps_the_last_good_bundle(
    tmp_path: Path, mode: str
) -> None:
    from sco.agent.bundle_cache import BundleCache, BundleFetcher
    from sco.contract.signing import Keyring
    from tests.harness import hall_bundle

    key = generate()
    cache = BundleCache(tmp_path / "cache", Keyring([key.public]))
    assert cache.offer(hall_bundle(tmp_path, key)).outcome == "accepted"
    srv = EvilServer(mode)
    try:
        fetcher = BundleFetcher(cache, f"http://127.0.0.1:{srv.port}/b.json", max_bytes=1 << 20, deadline_s=2)
        offer = fetcher.refresh()
    finally:
        srv.close()
    assert offer.outcome == "error" and "refused response" in offer.reason
    assert ("deadline" if mode == "slow" else "byte cap") in offer.reason
    assert cache.bundle is not None and cache.bundle.serial == offer.serial == 1


def test_metadata_poll_refuses_an_endless_body(tmp_path: Path, kube: KubeApiStandIn, nats_server: NatsServer) -> None:
    srv = EvilServer("huge")
    env = AgentEnv(
        tmp_path / "a",
        kube,
        nats_server,
        metadata_url=f"http://127.0.0.1:{srv.port}/openstack/latest/meta_data.json",
        metadata_max_bytes=65536,
    )
    try:
        env.start()
        refused = wait_for(lambda: env.of("notice.refused"), 15, "the metadata refusal")
        assert refused[0]["source"] == "metadata" and "byte cap" in refused[0]["reason"]
        assert env.proc is not None and env.proc.poll() is None
    finally:
        env.stop()
        srv.close()


# --- 8. floods and odd configs -----------------------------------------------------------------------------------


def test_notices_after_a_drain_are_absorbed_until_the_node_is_back(agent: AgentEnv, kube: KubeApiStandIn) -> None:
    add_pod(kube, "web", "w", agent.node, prestop=0.2)
    agent.start().wait_subscribed()
    agent.send(agent.notice("first", WINDOW))
    agent.outcome(WINDOW)
    for i in range(60):  # new ids, ever earlier deadlines
        agent.send(agent.notice(f"flood-{i}", WINDOW - 1 - i * 0.01))
    time.sleep(1.2)
    agent.send(agent.notice("flood-last", WINDOW))
    wait_for(lambda: any(e["absorbed_total"] == 61 for e in agent.of("notice.absorbed")), 10, "the count")
    assert len(agent.of("notice.accepted")) == 1
    assert len(audit(kube, "patch", agent.node)) == 1  # tainted once, not 61 times
    absorbed = agent.of("notice.absorbed")
    assert len(absorbed) < 61  # counted, not one record (and fsync) each
    per_second: dict[int, int] = {}
    for e in absorbed:  # the bound is per clock second, so a flood that straddles a second gets two budgets
        per_second[int(e["at"])] = per_second.get(int(e["at"]), 0) + 1
    assert max(per_second.values()) <= 20, per_second
    # put back in service (untainted): the next notice drains again
    kube.cluster.nodes[agent.node]["spec"]["taints"] = []
    kube.cluster.nodes[agent.node]["spec"]["unschedulable"] = False
    wait_for(lambda: agent.of("notice.rearmed"), 15, "the rearm")
    add_pod(kube, "web", "w2", agent.node, prestop=0.2)
    agent.send(agent.notice("second", WINDOW))
    wait_for(lambda: len(agent.of("drain.drained")) == 2, WINDOW, "the second drain")


def test_restart_on_the_same_instance_keeps_the_node_drained(agent: AgentEnv, kube: KubeApiStandIn) -> None:
    agent.start().wait_subscribed()
    agent.send(agent.notice("once", WINDOW))
    agent.outcome(WINDOW)
    agent.stop()
    agent.start()
    wait_for(lambda: agent.logtext().count("subscribed to") == 2, 15, "the second subscription")
    agent.send(agent.notice("again", WINDOW))
    wait_for(lambda: agent.of("notice.absorbed"), 10, "the absorbed notice")
    assert len(agent.of("notice.accepted")) == 1


def test_notice_book_bounds_deadline_moves_and_memory() -> None:
    book = NoticeBook()
    first = parse_nats(
        json.dumps({"id": "n0", "node": "a", "terminateAt": NOW + 120, "issuedAt": NOW}).encode(),
        hall="h",
        node="a",
        now=NOW,
        window=120,
    )
    assert book.offer(first) == "start"
    verdicts = []
    for i in range(5000):  # new ids, each 1 ms earlier than the last
        raw = json.dumps({"id": f"n{i + 1}", "node": "a", "terminateAt": NOW + 120 - (i + 1) * 0.001}).encode()
        verdicts.append(book.offer(parse_nats(raw, hall="h", node="a", now=NOW + i * 1e-6, window=120)))
    assert verdicts.count("earlier") <= 5  # 5 s earlier in all: one move per second at most
    assert len(book.seen) <= 256 and "n0" in book.seen


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[agent]\nmetadata_poll_seconds = 0.001\n", "agent.metadata_poll_seconds"),
        ("[agent]\nbundle_refresh_seconds = -1\n", "agent.bundle_refresh_seconds"),
        ("[agent]\nmetadata_poll_seconds = nan\n", "agent.metadata_poll_seconds"),
        ("[agent]\nspool_sync_interval = inf\n", "agent.spool_sync_interval"),
        ("[agent]\nevict_concurrency = 2.5\n", "agent.evict_concurrency"),
        ("agent = 5\n", "agent: expected one [agent] table"),
        ('[[agent]]\nhall = "h"\n', "agent: expected one [agent] table"),
        (b'[agent]\nhall = "\xff\xfe"\n', "not UTF-8"),
        ('[agent]\nstate_dir = "{file}"\n', "is not a directory"),
    ],
)
def test_odd_configs_are_a_line_and_exit_5(tmp_path: Path, text: str | bytes, needle: str) -> None:
    (tmp_path / "trusted").mkdir()
    (tmp_path / "trusted" / "k.pub").write_text("{}")
    (tmp_path / "f").write_text("a file")
    cfg = tmp_path / "agent.toml"
    cfg.write_bytes(text if isinstance(text, bytes) else text.replace("{file}", str(tmp_path / "f")).encode())
    env = {
        **os.environ,
        "SCO_AGENT_HALL": "h",
        "SCO_AGENT_NODE": "n",
        "SCO_AGENT_KUBE_URL": "http://127.0.0.1:1",
        "SCO_AGENT_TRUST_DIR": str(tmp_path / "trusted"),
    }
    if "state_dir" not in str(text):
        env["SCO_AGENT_STATE_DIR"] = str(tmp_path / "state")
    for cmd in ("check-config", "run"):
        p = subprocess.run(
            [str(BIN / "sco-agent"), cmd, "--config", str(cfg)], capture_output=True, text=True, timeout=30, env=env
        )
        assert p.returncode == 5 and "Traceback" not in p.stderr, p.stderr
        assert needle in p.stderr, p.stderr


# --- 9. events that go nowhere, silently ----------------------------------------------------------------------


def test_no_stream_is_a_warning_and_a_visible_backlog(tmp_path: Path, kube: KubeApiStandIn) -> None:
    from tests.harness import ensure_stream

    srv = NatsServer(tmp_path / "nats").start()  # JetStream on, but no stream on sco.events.>
    env = AgentEnv(tmp_path / "a", kube, srv, log_level="info")
    try:
        add_pod(kube, "web", "w", env.node, prestop=0.2)
        env.start().wait_subscribed()
        env.send(env.notice("lost-1", WINDOW))
        env.outcome(WINDOW)
        wait_for(lambda: "WARNING" in env.logtext() and "cannot be published" in env.logtext(), 10, "a warning")
        p = subprocess.run(
            [str(BIN / "sco-agent"), "events", "--state-dir", str(env.state), "--unpublished"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        backlog = len(env.events())
        assert p.returncode == 0 and len(p.stdout.splitlines()) == backlog
        assert f"{backlog} not yet published" in p.stderr
        p = subprocess.run(
            [str(BIN / "sco-agent"), "status", "--state-dir", str(env.state)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert json.loads(p.stdout)["events"]["unpublished"] == backlog
        asyncio.run(ensure_stream(srv.url))  # the deployment creates the stream: the backlog drains
        wait_for(lambda: "publishing again" in env.logtext(), 15, "publishing again")

        def drained() -> bool:
            out = subprocess.run(
                [str(BIN / "sco-agent"), "status", "--state-dir", str(env.state)], capture_output=True, timeout=30
            )
            return bool(json.loads(out.stdout)["events"]["unpublished"] == 0)

        wait_for(drained, 15, "the backlog published")
    finally:
        env.stop()
        srv.stop()


def test_agent_module_imports_stay_lean() -> None:
    code = (
        "import sys, sco.agent.daemon, sco.agent.notice_sources, sco.contract.notice;"
        "print(any(m.startswith(('pydantic', 'aiohttp', 'yaml')) and sys.modules[m] is not None for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "False", out.stderr


def test_metadata_refusal_of_a_repeated_document_is_recorded_once(
    tmp_path: Path, kube: KubeApiStandIn, nats_server: NatsServer
) -> None:
    meta = MetadataServer("node-1")
    env = AgentEnv(tmp_path / "a", kube, nats_server, metadata=meta, nats_url=f"nats://127.0.0.1:{free_port()}")
    try:
        meta.doc["meta"] = {"sco_reclaim_id": "m", "sco_reclaim_at": "nan"}
        env.start()
        wait_for(lambda: env.of("notice.refused"), 10, "the refusal")
        time.sleep(2.5)  # two more polls of the same document
        assert len(env.of("notice.refused")) == 1
    finally:
        env.stop()
        meta.shutdown()


# --- found by review after the merge ------------------------------------------------------------------------------


def test_a_deeply_nested_notice_is_refused_not_a_traceback() -> None:
    """60 KB of nested brackets makes json.loads raise RecursionError: that is a malformed notice, refused."""
    raw = b"[" * 30000 + b"]" * 30000
    from sco.contract.notice import NoticeAuthError, verify_notice

    with pytest.raises(NoticeAuthError) as e:
        verify_notice(raw, Keyring([generate().public]))
    assert e.value.kind == "malformed"
    with pytest.raises(NoticeRefused) as r:
        parse_nats(raw, hall="h", node="a", now=NOW, window=120)
    assert r.value.kind == "malformed"
    meta = b'{"meta": {"x": ' + b"[" * 30000 + b"]" * 30000 + b"}}"
    with pytest.raises(NoticeRefused):
        parse_metadata(meta, hall="h", node="a", now=NOW, window=120)


@pytest.mark.parametrize("key", ["bad key!", "a/b/c", "-lead.example/x", "x" * 64, ""])
def test_check_config_refuses_a_taint_key_the_api_would_refuse(tmp_path: Path, key: str) -> None:
    """A taint key the API answers 422 to would leave the node schedulable during a drain: refuse it at start."""
    cfg = tmp_path / "agent.toml"
    cfg.write_text(
        f'[agent]\nhall = "local"\nnode = "n1"\nstate_dir = "{tmp_path / "st"}"\ntaint_key = {json.dumps(key)}\n'
    )
    p = subprocess.run(
        [str(BIN / "sco-agent"), "check-config", "--config", str(cfg)], capture_output=True, text=True, timeout=30
    )
    assert p.returncode == 5, p.stdout + p.stderr
    assert "agent.taint_key" in p.stdout + p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize(
    "args", [["--node", "x.>"], ["--node", "*"], ["--node", ""], ["--hall", "*"], ["--node", "a b"]]
)
def test_notice_send_refuses_names_no_node_could_receive(tmp_path: Path, args: list[str]) -> None:
    key_file = tmp_path / "notice.key"
    write_keypair(generate(), key_file, tmp_path / "notice.pub")
    base = {"--hall": "local", "--node": "node-1"}
    base.update(dict(zip(args[::2], args[1::2], strict=True)))
    argv = [str(BIN / "sco"), "notice", "send", "--in", "10", "--dry-run", "--nats", "nats://127.0.0.1:1"]
    for k, v in base.items():
        argv += [k, v]
    argv += ["--signing-key", str(key_file)]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert p.returncode != 0 and p.returncode != 1, p.stdout + p.stderr
    assert "Traceback" not in p.stderr
    assert "sent" not in p.stdout
