"""The notice relay as a NATS cluster. Three real nats-servers, each configured by the notice_relay role's
own template for a three-relay hall, routed to each other over TLS, each showing a certificate the hall's CA signed
(no route password); the role's stream tool run
on every relay at once; an agent-like client given every relay's URL keeps publishing its events while the stream's
leader is killed with SIGKILL, and the stream holds each event exactly once, in order."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats

from tests.harness import free_port, wait_for
from tests.relays import ROLE, Pki, RoleRelay, as_user, deploy_tls, run_playbook

# Every relay's configuration from the role's template in one playbook run: the hall's settings as extra vars, each
# relay's own (name, ports, store, credentials) as the loop's task vars, which extra vars would override.
RENDER = """
- name: Render each relay's configuration with the role's template
  hosts: localhost
  gather_facts: false
  vars_files: ["{{ role }}/defaults/main.yml", "{{ role }}/vars/main.yml"]
  tasks:
    - name: Render
      ansible.builtin.template:
        src: "{{ role }}/templates/nats-server.conf.j2"
        dest: "{{ item.conf }}"
        mode: "0600"
      vars:
        notice_relay_server_name: "{{ item.name }}"
        notice_relay_port: "{{ item.port }}"
        notice_relay_monitor_port: "{{ item.monitor }}"
        notice_relay_cluster_port: "{{ item.cluster }}"
        notice_relay_store_dir: "{{ item.store }}"
        notice_relay_credentials_dir: "{{ item.creds }}"
        notice_relay_cluster_peers: "{{ item.peers }}"
        notice_relay_tls_member_dir: "{{ item.tls }}"
      loop: "{{ relays }}"
"""


@dataclass
class Relay:
    name: str
    dir: Path
    creds: Path
    port: int
    monitor: int
    cluster: int
    srv: RoleRelay | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def conf(self) -> Path:
        return self.dir / "nats.conf"

    def item(self, peers: list[str], conf: Path | None = None) -> dict[str, Any]:
        return {
            "name": self.name, "conf": str(conf or self.conf), "port": self.port, "monitor": self.monitor,
            "cluster": self.cluster, "store": str(self.dir / "js"), "creds": str(self.creds), "peers": peers,
            "tls": str(self.dir / "relay-tls"),
        }  # fmt: skip

    def start(self, conf: Path | None = None) -> Relay:
        self.srv = RoleRelay(self.dir, conf or self.conf, self.port).start()
        return self

    def kill(self) -> None:
        assert self.srv is not None and self.srv.proc is not None
        self.srv.proc.send_signal(signal.SIGKILL)
        self.srv.proc.wait(10)

    def stop(self) -> None:
        if self.srv is not None:
            self.srv.stop()

    def get(self, what: str) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor}/{what}", timeout=2) as r:
            return dict(json.loads(r.read()))

    def log(self) -> str:
        return (self.dir / "nats.log").read_text(errors="replace")


def relays(tmp: Path, n: int, creds: Path | None = None, prefix: str = "r", ca: Path | None = None) -> list[Relay]:
    """``n`` relays, each with its certificate signed by the CA in ``ca`` (default the hall's, ``tmp/tls``, where
    tests.relays.as_user finds it beside ``tmp/credentials``)."""
    creds = creds or tmp / "credentials"
    pki = Pki(ca or tmp / "tls")
    out = []
    for i in range(1, n + 1):
        d = tmp / f"{prefix}{i}"
        d.mkdir()
        deploy_tls(pki, d / "relay-tls", f"{prefix}{i}")
        out.append(Relay(f"local-{prefix}{i}", d, creds, free_port(), free_port(), free_port()))
    return out


def render(tmp: Path, items: list[dict[str, Any]], nodes: list[str]) -> None:
    r = run_playbook(
        tmp, RENDER,
        {"role": str(ROLE), "relays": items, "notice_relay_hall": "local", "notice_relay_nodes": nodes,
         "notice_relay_listen": "127.0.0.1"},
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr


def stream_tool(rs: list[Relay], replicas: int = 3) -> list[list[dict[str, str]]]:
    """The role's stream tool run on every relay at once, as each relay's unit does after its start."""
    procs = []
    for r in rs:
        argv = [sys.executable, str(ROLE / "files/sco-nats-stream.py"), "--server", r.url,
                "--nkey-seed", str(r.creds / "relay-admin.nk"), "--hall", "local", "--replicas", str(replicas),
                "--wait", "30", "--ca-file", str(r.dir / "relay-tls" / "ca.crt")]  # fmt: skip
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=60)
        assert p.returncode == 0, stderr
        out.append([json.loads(x) for x in stdout.splitlines()])
    return out


async def stream_info(r: Relay, creds: Path, stream: str = "SCO_EVENTS") -> dict[str, Any]:
    nc = await nats.connect(r.url, connect_timeout=2, max_reconnect_attempts=0, **as_user(creds, "relay-admin"))
    try:
        msg = await nc.request(f"$JS.API.STREAM.INFO.{stream}", b"", timeout=5)
        return dict(json.loads(msg.data))
    finally:
        await nc.close()


async def stream_messages(r: Relay, creds: Path) -> list[tuple[str, str]]:
    """(Nats-Msg-Id, subject) of every message of SCO_EVENTS, in stream order."""
    nc = await nats.connect(r.url, connect_timeout=2, max_reconnect_attempts=0, **as_user(creds, "relay-admin"))
    try:
        js = nc.jetstream(timeout=5)
        info = await js.stream_info("SCO_EVENTS")
        out = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            m = await js.get_msg("SCO_EVENTS", seq)
            out.append(((m.headers or {}).get("Nats-Msg-Id", ""), m.subject or ""))
        return out
    finally:
        await nc.close()


def leader_of(rs: list[Relay], creds: Path, stream: str) -> Relay:
    def found() -> Relay | None:
        for r in rs:
            try:
                info = asyncio.run(stream_info(r, creds, stream))
            except Exception:
                continue
            name = info.get("cluster", {}).get("leader")
            if name:
                return next(x for x in rs if x.name == name)
        return None

    return wait_for(found, 20, f"a leader of {stream}", interval=0.2)  # type: ignore[no-any-return]


def started(rs: list[Relay], conf: str | None = None) -> list[Relay]:
    for r in rs:
        r.start(r.dir / conf if conf else None)
    # every relay a member of one cluster: each one's JetStream meta group counts them all
    wait_for(lambda: all(r.get("jsz").get("meta_cluster", {}).get("cluster_size") == len(rs) for r in rs), 20,
             "the relays' cluster")  # fmt: skip
    return rs


def test_three_relays_one_stream_every_event_once_through_a_leader_kill(tmp_path: Path) -> None:
    rs = relays(tmp_path, 3)
    intruder = relays(tmp_path, 1, creds=tmp_path / "other-credentials", prefix="x", ca=tmp_path / "other-ca")[0]
    peers = [f"127.0.0.1:{r.cluster}" for r in rs]
    render(tmp_path, [r.item(peers) for r in rs] + [intruder.item([*peers, f"127.0.0.1:{intruder.cluster}"])],
           ["a", "b"])  # fmt: skip
    creds = rs[0].creds
    conf = rs[0].conf.read_text()
    assert "cluster {" in conf and conf.count("nats-route://") == 3 and "password" not in conf, conf
    try:
        started(rs)
        # every relay's unit runs the tool at once: each stream is created once, replicated on all three
        runs = stream_tool(rs)
        for stream in ("SCO_EVENTS", "SCO_HEARTBEATS"):
            actions = sorted(a["action"] for run in runs for a in run if a["stream"] == stream)
            assert actions == ["created", "unchanged", "unchanged"], runs
            info = asyncio.run(stream_info(rs[0], creds, stream))
            assert info["config"]["num_replicas"] == 3 and len(info["cluster"]["replicas"]) == 2, info
        assert stream_tool(rs[:1]) == [[{"stream": "SCO_EVENTS", "action": "unchanged"},
                                        {"stream": "SCO_HEARTBEATS", "action": "unchanged"}]]  # fmt: skip

        leader = leader_of(rs, creds, "SCO_EVENTS")
        others = [r for r in rs if r is not leader]

        spool = os.urandom(4).hex()
        total, kill_at = 60, 20
        gap = asyncio.run(publish_through_kill(rs, leader, creds, spool, total, kill_at))
        print(f"\nstream leader {leader.name} killed (SIGKILL): the next event acked after {gap * 1000:.0f} ms")
        new_leader = leader_of(others, creds, "SCO_EVENTS")
        assert new_leader is not leader
        got = asyncio.run(stream_messages(others[0], creds))
        assert got == [(f"{spool}-{i}", "sco.events.local.a") for i in range(total)], got
        # a notice from the reclaimer (the dead relay first in its list) reaches a node connected to another relay
        asyncio.run(notice_across(leader, others[0], others[1], creds))

        # a relay with another hall's CA and certificate is refused as a route, by every relay, both ways
        intruder.start()
        wait_for(lambda: "tls route handshake error" in intruder.log().lower(), 20, "the intruder's routes refused")
        assert intruder.get("routez")["num_routes"] == 0
        for r in others:
            assert intruder.name not in {x.get("remote_name") for x in r.get("routez")["routes"]}, r.get("routez")
    finally:
        for r in [*rs, intruder]:
            r.stop()


async def notice_across(dead: Relay, sender: Relay, receiver: Relay, creds: Path) -> None:
    """The provider's reclaimer, given the relays' URLs (a dead one first), sends a notice on ``sender``'s relay; the
    node it names is connected to ``receiver`` only."""
    from sco.contract.signing import generate
    from sco.provider.reclaimer import Reclaimer, notice_document, publish_notice

    got: asyncio.Queue[bytes] = asyncio.Queue()
    node = await nats.connect(receiver.url, **as_user(creds, "node-b"), inbox_prefix="_INBOX.local.b")
    key = generate()
    nothing: Any = None  # no cloud and no fleet state: only its connection to the relays is used here
    reclaimer = Reclaimer(nothing, nothing, f"{dead.url}, {sender.url}", signing_keys=[key],
                          nats_auth=as_user(creds, "reclaimer"))  # fmt: skip
    try:

        async def on(msg: Any) -> None:
            await got.put(msg.data)

        await node.subscribe("sco.notice.local.b", cb=on)
        await node.flush(timeout=5)
        nc = await reclaimer._connect()
        assert nc.connected_url.port == sender.port
        notice = notice_document("reclaim-across", "local", "b", time.time() + 120, time.time())
        end = time.monotonic() + 10
        # the subscription's interest crosses the route a moment after the flush: send until it arrives
        while got.empty() and time.monotonic() < end:
            await publish_notice(nc, notice, [key])
            await asyncio.sleep(0.1)
        assert not got.empty(), "the notice never reached the node on the other relay"
        assert b"reclaim-across" in await got.get()
    finally:
        await node.close()
        await reclaimer.close()


async def publish_through_kill(
    rs: list[Relay], leader: Relay, creds: Path, spool: str, total: int, kill_at: int
) -> float:
    """Publish ``total`` events as node a (every relay's URL, the leader's first), each until JetStream acks it, with
    the agent's de-duplication id; SIGKILL the stream's leader after ``kill_at``. Returns the time from the kill to
    the next ack."""
    urls = [leader.url] + [r.url for r in rs if r is not leader]

    async def quiet(e: Exception) -> None:  # the killed relay's EOF: expected (nats-py would print it)
        pass

    nc = await nats.connect(
        servers=urls, dont_randomize=True, max_reconnect_attempts=-1, reconnect_time_wait=0.2, connect_timeout=2,
        inbox_prefix="_INBOX.local.a", error_cb=quiet, **as_user(creds, "node-a"),
    )  # fmt: skip
    js = nc.jetstream(timeout=1)
    killed = gap = 0.0
    try:
        for i in range(total):
            if i == kill_at:
                leader.kill()
                killed = time.monotonic()
            while True:
                try:
                    await js.publish("sco.events.local.a", json.dumps({"i": i}).encode(),
                                     headers={"Nats-Msg-Id": f"{spool}-{i}"})  # fmt: skip
                    break
                except Exception:  # no leader yet, or the connection moving to another relay: the agent retries
                    await asyncio.sleep(0.05)
            if i == kill_at:
                gap = time.monotonic() - killed
    finally:
        await nc.close()
    return gap


def test_a_third_relay_scales_the_streams_to_three_copies_keeping_their_events(tmp_path: Path) -> None:
    """Going from two relays to three: the streams (two copies each, events in them) are scaled to three replicas by
    the stream tool once the third relay runs, and keep their events. (One relay to a cluster is not this path: the
    role refuses it, see test_role_units; nats-server drops a standalone server's streams as orphans on joining.)"""
    rs = relays(tmp_path, 3)
    two, three = [f"127.0.0.1:{r.cluster}" for r in rs[:2]], [f"127.0.0.1:{r.cluster}" for r in rs]
    # both the two relays' configuration and, for the role's run with a third relay in the group, all three's
    render(tmp_path, [r.item(two, r.dir / "two.conf") for r in rs[:2]] + [r.item(three) for r in rs], ["a"])
    creds = rs[0].creds
    try:
        started(rs[:2], "two.conf")
        assert sorted(a["action"] for run in stream_tool(rs[:2], replicas=2) for a in run) == [
            "created",
            "created",
            "unchanged",
            "unchanged",
        ]

        async def events() -> None:
            nc = await nats.connect(rs[0].url, inbox_prefix="_INBOX.local.a", **as_user(creds, "node-a"))
            js = nc.jetstream(timeout=5)
            for i in range(5):
                await js.publish("sco.events.local.a", b"{}", headers={"Nats-Msg-Id": f"before-{i}"})
            await nc.close()

        asyncio.run(events())
        # the role's run with the third relay in the group: every relay's new configuration, each restarted
        for r in rs[:2]:
            r.stop()
        started(rs)
        runs = stream_tool(rs, replicas=3)
        for stream in ("SCO_EVENTS", "SCO_HEARTBEATS"):
            actions = {a["action"] for run in runs for a in run if a["stream"] == stream}
            assert "updated" in actions and "created" not in actions, runs

        def replicated() -> bool:
            info = asyncio.run(stream_info(rs[2], creds))
            peers = info.get("cluster", {}).get("replicas", [])
            return info["config"]["num_replicas"] == 3 and len(peers) == 2 and all(p["current"] for p in peers)

        wait_for(replicated, 20, "SCO_EVENTS on three relays")
        assert [m for m, _ in asyncio.run(stream_messages(rs[2], creds))] == [f"before-{i}" for i in range(5)]
    finally:
        for r in rs:
            r.stop()


def validate_play(cases: dict[str, dict[str, Any]]) -> str:
    """One playbook running the role's checks once per case (task vars beat the role's vars/main.yml, so
    _notice_relay_conf can point at a test file), each saying "<case>: ok" or "<case>: refused: <message>"."""
    blocks = []
    for name, case in cases.items():
        blocks.append({
            "name": name,
            "block": [
                {"name": f"check {name}", "ansible.builtin.include_role": {"name": "sco.orchestrator.notice_relay",
                                                                          "tasks_from": "validate.yml"},
                 "vars": case},
                {"name": f"say {name}", "ansible.builtin.debug": {"msg": f"{name}: ok"}},
            ],
            "rescue": [{"name": f"say {name}", "ansible.builtin.debug": {
                "msg": f"{name}: refused: {{{{ ansible_failed_result.msg }}}}"}}],
        })  # fmt: skip
    return json.dumps([{"name": "The relay role's checks", "hosts": "localhost", "gather_facts": False,
                        "tasks": blocks}])  # fmt: skip


def test_a_single_relay_is_not_made_a_cluster_member_unless_told(tmp_path: Path) -> None:
    """nats-server drops a standalone server's streams as orphans ~30 s after it joins a cluster (seen in
    test_a_third_relay_scales...'s first version, nats-server issue 5467): the role refuses that change, naming the
    setting that allows it, and lets a relay already in the cluster (or a new one) through."""
    single, member = tmp_path / "single.conf", tmp_path / "member.conf"
    single.write_text('server_name: "local-r1"\njetstream {\n}\n')
    member.write_text('server_name: "local-r1"\ncluster {\n  name: "local"\n}\n')
    ev = {"sco_hall": "local", "notice_relay_nodes": ["a"], "notice_relay_credentials_dir": str(tmp_path / "creds"),
          "notice_relay_cluster_peers": ["r1.example:6222", "r2.example:6222", "r3.example:6222"]}  # fmt: skip
    cases: dict[str, dict[str, Any]] = {
        "single": {"_notice_relay_conf": str(single)},
        "single-told": {"_notice_relay_conf": str(single), "notice_relay_cluster_from_single": True},
        "member": {"_notice_relay_conf": str(member)},
        "new": {"_notice_relay_conf": str(tmp_path / "none.conf")},
        "four-copies": {"_notice_relay_conf": str(member), "notice_relay_stream_replicas": 4},
    }
    out = run_playbook(tmp_path, validate_play(cases), ev)
    assert out.returncode == 0, out.stdout + out.stderr
    msgs = [json.loads(f'"{m}"') for m in re.findall(r'"msg": "((?:[^"\\]|\\.)*)"', out.stdout)]
    said = dict(m.split(": ", 1) for m in msgs if m.split(": ", 1)[0] in cases)
    assert said.keys() == cases.keys(), out.stdout
    assert said["single"].startswith("refused: notice_relay: localhost runs as a single relay"), said
    assert "notice_relay_cluster_from_single=true" in said["single"], said
    assert said["four-copies"].startswith("refused: notice_relay: notice_relay_stream_replicas is 4;"), said
    rest = {k: v for k, v in said.items() if k not in ("single", "four-copies")}
    assert rest == {"single-told": "ok", "member": "ok", "new": "ok"}, said


SHOW = """
- name: What the agents and the control loop are given
  hosts: n1
  gather_facts: false
  roles: [sco.orchestrator.hall]
  tasks:
    - name: Show
      ansible.builtin.debug:
        msg: "{{ {'agent': node_agent_nats_url, 'control': control_loop_nats_url} | to_json }}"
"""


def test_agents_and_the_control_loop_are_given_every_relay(tmp_path: Path) -> None:
    """sco_relay_url defaults to every sco_relay host (its ansible_host, its own client port); an inventory without
    the group gets what it got before (the agent's local default, no control-loop relay)."""
    import yaml

    def given(groups: dict[str, Any], name: str) -> dict[str, str]:
        inv = tmp_path / name
        inv.mkdir()
        hosts = {"all": {"hosts": {"n1": {"ansible_connection": "local"}}, "children": groups}}
        (inv / "hosts.yml").write_text(yaml.safe_dump(hosts))
        out = run_playbook(tmp_path, SHOW, {"sco_hall": "local"}, "-i", str(inv))
        assert out.returncode == 0, out.stdout + out.stderr
        return dict(json.loads(json.loads(out.stdout.split('"msg": ', 1)[1].split("\n}", 1)[0])))

    relays3 = {
        "sco_relay": {"hosts": {"r1": {"ansible_host": "10.0.0.1"}, "r2": {"notice_relay_port": 4333}, "r3": {}}}
    }
    urls = "nats://10.0.0.1:4222,nats://r2:4333,nats://r3:4222"
    assert given(relays3, "three") == {"agent": urls, "control": urls}
    assert given({}, "none") == {"agent": "nats://127.0.0.1:4222", "control": ""}


def test_the_stream_tool_gives_up_at_its_wait_when_no_relay_listens(tmp_path: Path) -> None:
    """nats-py retries a refused first connection whatever its options say: the tool ran on (a traceback every 2 s)
    until something killed it. --wait now bounds it: one line, non-zero."""
    import nkeys

    seed = tmp_path / "relay-admin.nk"
    seed.write_bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER) + b"\n")
    argv = [sys.executable, str(ROLE / "files/sco-nats-stream.py"), "--server", f"nats://127.0.0.1:{free_port()}",
            "--nkey-seed", str(seed), "--hall", "local", "--wait", "2"]  # fmt: skip
    p = subprocess.run(argv, capture_output=True, text=True, timeout=60)  # a hang meets this timeout
    assert p.returncode != 0 and p.stdout == ""
    assert p.stderr.strip().startswith("sco-nats-stream: cannot reach nats://127.0.0.1:") and "in 2 s" in p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_the_reclaimer_reaches_a_live_relay_behind_several_silent_ones(tmp_path: Path) -> None:
    """Each relay that accepts and never answers (or drops packets) costs nats-py its 2 s connect_timeout, in an
    order of its own choosing: with a fixed 5 s bound on the first connect, three silent relays before the live one
    left the notices to the metadata alone (2 of 8). The bound now grows with the relay list."""
    import socket

    from sco.contract.signing import generate
    from sco.provider.reclaimer import Reclaimer
    from tests.harness import NatsServer

    silent = []
    for _ in range(4):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        silent.append(s)
    live = NatsServer(tmp_path / "nats").start()
    try:
        urls = ",".join([*(f"nats://127.0.0.1:{s.getsockname()[1]}" for s in silent), live.url])
        for _ in range(2):  # nats-py shuffles the list: twice, so the live one is rarely first both times

            async def connect() -> bool:
                r: Any = Reclaimer(None, None, urls, signing_keys=[generate()])  # type: ignore[arg-type]
                try:
                    return bool((await r._connect()).is_connected)
                finally:
                    await r.close()

            assert asyncio.run(connect())
    finally:
        live.stop()
        for s in silent:
            s.close()


def test_the_reclaimer_follows_the_agents_events_on_a_relay_cluster(tmp_path: Path) -> None:
    """The reclaimer's durable consumer on the R3 event stream is made within run()'s 10 s bound, and an agent's
    event reaches its fold, with the stream's leader as the first relay in its list and not."""
    from sco.contract.signing import generate
    from sco.provider.reclaimer import Reclaimer

    rs = relays(tmp_path, 3)
    peers = [f"127.0.0.1:{r.cluster}" for r in rs]
    render(tmp_path, [r.item(peers) for r in rs], ["a"])
    creds = rs[0].creds
    try:
        started(rs)
        stream_tool(rs)
        urls = ",".join(r.url for r in rs)

        async def follow() -> tuple[float, list[tuple[str, str]]]:
            folded: list[tuple[str, str]] = []
            r = Reclaimer(None, None, urls, signing_keys=[generate()], nats_auth=as_user(creds, "reclaimer"))
            r.fold = lambda hall, ev, subject: folded.append((subject, ev["type"]))  # type: ignore[method-assign]
            t0 = time.monotonic()
            sub = await asyncio.wait_for(r._follow_events("local"), 10)  # as run() bounds it
            took = time.monotonic() - t0
            nc = await nats.connect(rs[1].url, inbox_prefix="_INBOX.local.a", **as_user(creds, "node-a"))
            await nc.jetstream(timeout=5).publish("sco.events.local.a", json.dumps({"type": "drain.started"}).encode())
            await nc.close()
            end = time.monotonic() + 10
            while not folded and time.monotonic() < end:
                await asyncio.sleep(0.1)
            await sub.unsubscribe()
            await r.close()
            return took, folded

        took, folded = asyncio.run(follow())
        print(f"\nthe reclaimer's consumer on a 3-relay cluster made in {took:.2f} s")
        assert folded == [("sco.events.local.a", "drain.started")], folded
    finally:
        for r in rs:
            r.stop()


def test_a_reclaim_that_cannot_follow_the_events_at_first_keeps_trying(tmp_path: Path, fleet_dsn: str) -> None:
    """The relays are all down when the run starts (a stream failover under way is the same to it): the run goes on
    with its deletes and keeps trying to follow SCO_EVENTS, so an agent's account that comes once the relays are
    back still reaches the fleet state (it was lost for the whole run)."""
    from sco.contract.signing import generate
    from sco.provider.reclaimer import Reclaimer
    from sco.state.fleet import FleetState, Pool

    rs = relays(tmp_path, 3)
    peers = [f"127.0.0.1:{r.cluster}" for r in rs]
    render(tmp_path, [r.item(peers) for r in rs], ["a"])
    creds = rs[0].creds
    hall = "local"
    try:
        started(rs)
        stream_tool(rs)
        for r in rs:
            r.stop()
        with FleetState(fleet_dsn) as st:
            st.ensure_pool(Pool(hall, "spot", flavor="f", image="i"))
            inst = st.request(hall, "spot", "follow", 0, "a")
            st.transition(inst.id, "active", "instance.active", server_id="srv-a")
            st.transition(inst.id, "notified", "reclaim.scheduled", reclaim_id="reclaim-a", terminate_at=st.now() + 120)
            st.event(hall, "notice.published", instance_id=inst.id, notice="reclaim-a")

            async def scenario() -> None:
                stop = asyncio.Event()
                r = Reclaimer(None, st, ",".join(x.url for x in rs), signing_keys=[generate()],
                              nats_auth=as_user(creds, "reclaimer"))  # fmt: skip
                run = asyncio.create_task(r.run(hall, stop=stop))
                await asyncio.sleep(12)  # the first subscription has given up (its bound is 10 s)
                assert not run.done()
                for x in rs:
                    x.start()
                nc = await nats.connect(rs[2].url, inbox_prefix="_INBOX.local.a", **as_user(creds, "node-a"))
                ev = {"type": "drain.started", "node": "a", "notice": "reclaim-a", "at": time.time()}
                js, end = nc.jetstream(timeout=5), time.monotonic() + 60
                while True:  # as the agent does: until the restarted cluster's stream has a leader to ack it
                    try:
                        await js.publish("sco.events.local.a", json.dumps(ev).encode(), headers={"Nats-Msg-Id": "a-1"})
                        break
                    except Exception:
                        assert time.monotonic() < end, "the restarted relays' stream never acknowledged"
                        await asyncio.sleep(0.5)
                await nc.close()
                end = time.monotonic() + 40
                while time.monotonic() < end and "agent.drain.started" not in [
                    e["kind"] for e in st.events(instance_id=inst.id)
                ]:
                    await asyncio.sleep(0.3)
                stop.set()
                await asyncio.wait_for(run, 30)
                await r.close()

            asyncio.run(scenario())
            kinds = [e["kind"] for e in st.events(instance_id=inst.id)]
            assert "agent.drain.started" in kinds, kinds
    finally:
        for r in rs:
            r.stop()
