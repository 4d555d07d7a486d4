"""A cluster of relays in operator mode. Role notice_relay applied to three relay hosts of one inventory
(this machine three times, each host's paths under the test's directory), each nats-server started as the unit the
role installed says: its ExecStartPre (the catch-up from its peers), its ExecStart. The three route to each other
over TLS, each showing a certificate the hall's CA signed (no route password), and keep the streams in three copies;
every relay has a full resolver.

A node enrolled through one relay connects to another and hears a notice the reclaimer sent through the third; its
revocation, pushed once to one relay, closes its connection wherever it is connected (the time is measured: goal
< 1 s); a relay restarted later still refuses it (its resolver's directory), and a relay that was down when the
revocation was pushed refuses it from its start (the unit's catch-up: nats-server's own resolver sync never brought
it, see sco-relay-catchup.py)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import nats
import yaml

from sco.provider import relay_identity as ri
from tests.harness import BIN, free_port, wait_for
from tests.relays import HALL, REPO, Deployed, ca_for, event_acked, relay_refusal, tls_for

NAMES = ("r1", "r2", "r3")
RELAYS = """
- name: The notice relays of hall local, operator mode, three on this machine
  hosts: sco_relay
  gather_facts: false
  pre_tasks:
    - name: Each host's own paths for the role, under the test's directory
      ansible.builtin.set_fact:
        "{{ item.key }}": "{{ item.value }}"
      loop: "{{ own | dict2items }}"
  roles: [sco.orchestrator.notice_relay]
"""


class ClusterRelay(Deployed):
    """One relay host of the three; the controller's credentials directory shared (one controller)."""

    def __init__(self, root: Path, creds: Path) -> None:
        super().__init__(root)
        self.creds = creds
        self.cluster = free_port()
        self.caught_up: dict[str, Any] = {}

    def host_vars(self, nodes: list[str]) -> dict[str, Any]:
        """The host's settings; the role's own paths (role vars, above inventory variables) apart, in ``own``, which
        the play sets as facts (above role vars)."""
        every = {**self.vars(nodes), "ansible_host": "127.0.0.1", "ansible_connection": "local",
                 "notice_relay_cluster_port": self.cluster}  # fmt: skip
        own = {k: every.pop(k) for k in list(every) if k.startswith("_notice_relay_")}
        return {**every, "own": own}

    @property
    def ca(self) -> Path:
        """The hall's CA: one controller, its state directory the test's (run_playbook's sco_state_dir)."""
        return self.root.parent / "tls" / "ca.crt"

    def run(self, key: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.unit(key), capture_output=True, text=True, timeout=60)

    def start(self) -> None:
        pre = self.run("ExecStartPre")
        assert pre.returncode == 0, pre.stderr
        self.caught_up = json.loads(pre.stdout.splitlines()[-1])
        super().start()

    def closed_connections(self, account: str) -> list[dict[str, Any]]:
        """The relay's closed connections of ``account`` (monitoring's /connz), each with its reason."""
        url = f"http://127.0.0.1:{self.monitor}/connz?state=closed&acc={account}&limit=1000"
        with urllib.request.urlopen(url, timeout=3) as r:
            return list(json.loads(r.read()).get("connections") or [])

    def jsz(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor}/jsz", timeout=3) as r:
            return dict(json.loads(r.read()))


def apply(tmp: Path, relays: list[ClusterRelay], nodes: list[str]) -> subprocess.CompletedProcess[str]:
    """The role on the three relay hosts in one run, as site.yml's relay play runs it."""
    inventory = tmp / "inventory.yml"
    hosts = {name: r.host_vars(nodes) for name, r in zip(NAMES, relays, strict=True)}
    inventory.write_text(yaml.safe_dump({"sco_relay": {"hosts": hosts}}))
    play = tmp / "relays.yml"
    play.write_text(RELAYS)
    env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(REPO / "collections"), "PATH": f"{BIN}:{os.environ['PATH']}"}
    extravars = {"ansible_python_interpreter": sys.executable, "sco_state_dir": str(tmp)}
    out = subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", str(inventory), str(play), "-e", json.dumps(extravars)],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    return out


def enrol(relay: ClusterRelay, node: str) -> tuple[ri.NodeIdentity, Path]:
    """As the enrolment service does for a node it launched, through ``relay`` only."""
    keys = ri.HallKeys.ensure(relay.creds / "operator", HALL)
    key = ri.NKey.generate("user")

    async def issue() -> ri.NodeIdentity:
        admin = await ri.RelayAdmin.connect(relay.url, keys, tls_ca_file=ca_for(relay.url))
        try:
            return await ri.issue(admin, keys, node, key.public)
        finally:
            await admin.close()

    identity = asyncio.run(issue())
    path = relay.root / f"node-{node}.creds"
    path.write_text(ri.creds(identity.user_jwt, key.seed))
    return identity, path


def revoke(relay: ClusterRelay, identity: ri.NodeIdentity) -> None:
    keys = ri.HallKeys.ensure(relay.creds / "operator", HALL)

    async def run() -> None:
        admin = await ri.RelayAdmin.connect(relay.url, keys, tls_ca_file=ca_for(relay.url))
        try:
            await ri.revoke(admin, keys, identity)
        finally:
            await admin.close()

    asyncio.run(run())


async def notice_across(node_url: str, creds: Path, node: str, reclaimer_url: str, reclaimer: Path) -> list[bytes]:
    got: list[bytes] = []
    nc = await nats.connect(
        node_url, user_credentials=str(creds), inbox_prefix=ri.node_inbox(HALL, node), **tls_for(node_url)
    )
    rc = await nats.connect(reclaimer_url, user_credentials=str(reclaimer), **tls_for(reclaimer_url))
    try:

        async def take(msg: Any) -> None:
            got.append(msg.data)

        await nc.subscribe(f"sco.notice.{HALL}.{node}", cb=take)
        await nc.flush(timeout=5)
        # the subscription's interest reaches the reclaimer's relay over the route: publish until it is heard
        for _ in range(50):
            await rc.publish(f"sco.notice.{HALL}.{node}", f"notice for {node}".encode())
            await rc.flush(timeout=5)
            await asyncio.sleep(0.1)
            if got:
                break
        return got
    finally:
        await nc.close()
        await rc.close()


async def revoked_while_connected(url: str, creds: Path, node: str, push: Any) -> tuple[float, list[str]]:
    """Node ``node`` connected to ``url``; ``push`` (the revocation, elsewhere) run: seconds from the push's start
    to the relay closing the node's connection, and what the node was told."""
    closed = asyncio.Event()
    errors: list[str] = []

    async def on_closed() -> None:
        closed.set()

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    nc = await nats.connect(
        url, user_credentials=str(creds), inbox_prefix=ri.node_inbox(HALL, node), allow_reconnect=False,
        max_reconnect_attempts=0, disconnected_cb=on_closed, closed_cb=on_closed, error_cb=on_error, **tls_for(url),
    )  # fmt: skip
    await nc.flush(timeout=5)
    t0 = time.monotonic()
    await asyncio.to_thread(push)
    await asyncio.wait_for(closed.wait(), 10)
    took = time.monotonic() - t0
    errors.append(str(nc.last_error))  # the server's -ERR, which nats-py keeps rather than calling error_cb
    await nc.close()
    return took, errors


def test_a_cluster_in_operator_mode_enrols_anywhere_and_revokes_everywhere(tmp_path: Path) -> None:
    creds = tmp_path / "controller" / "nats"
    relays = [ClusterRelay(tmp_path / name, creds) for name in NAMES]
    apply(tmp_path, relays, ["a"])

    # each relay: the cluster block with every route (TLS, a certificate the hall's CA signed required: no route
    # password anywhere), the full resolver, no seed; the catch-up's creds (relay-sync: it may only ask for the
    # account JWTs) root-only beside the stream tool's
    assert not (creds / "route.password").exists()
    for r in relays:
        text = (r.etc / "nats-server.conf").read_text()
        assert "resolver {\n  type: full" in text and 'name: "local"' in text, text[:2000]
        routes = re.findall(r'"nats-route://127\.0\.0\.1:(\d+)"', text)
        assert sorted(routes) == sorted(str(x.cluster) for x in relays), routes
        cluster = text.split("cluster {")[1]
        assert "verify: true" in cluster and "password" not in text and "authorization" not in cluster
        assert not re.search(r"\bS[OAU][A-Z2-7]{50,}", text), "a seed in the relay's configuration"
        assert (r.etc / "nats-server.conf").stat().st_mode & 0o777 == 0o640
        assert (r.etc / "sync.creds").read_text() == (creds / "relay-sync.creds").read_text()
        assert (r.etc / "sync.creds").stat().st_mode & 0o777 == 0o600
        pre = r.unit("ExecStartPre")
        others = sorted(f"--peer=nats://127.0.0.1:{x.port}" for x in relays if x is not r)
        assert sorted(a for a in pre if a.startswith("--peer=")) == others, pre
        assert pre[pre.index("--ca-file") + 1] == str(r.root / "relay-tls" / "ca.crt"), pre

    r1, r2, r3 = relays
    try:
        for r in relays:
            r.start()
        # the first relay found no peer yet (the cluster's first start): it starts with what it has
        assert r1.caught_up["peer"] == "", r1.caught_up
        wait_for(lambda: all(r.jsz().get("meta_cluster", {}).get("cluster_size") == 3 for r in relays), 30,
                 "the three relays' JetStream cluster")  # fmt: skip
        post = r1.unit("ExecStartPost")
        stream = subprocess.run([*post, "--wait", "60"], capture_output=True, text=True, timeout=90)
        assert stream.returncode == 0, stream.stderr
        assert {json.loads(x)["stream"] for x in stream.stdout.splitlines()} == {"SCO_EVENTS", "SCO_HEARTBEATS"}

        reclaimer = creds / "reclaimer.creds"
        # the inventory's node on its preloaded account, on any relay; the notice sent through another
        assert asyncio.run(notice_across(r3.url, creds / "node-a.creds", "a", r1.url, reclaimer)) == [b"notice for a"]

        # a node enrolled through r1 connects to r2, hears the reclaimer's notice sent through r3, and its event
        # lands in the three-copy stream
        _b, b_creds = enrol(r1, "b")
        assert asyncio.run(notice_across(r2.url, b_creds, "b", r3.url, reclaimer)) == [b"notice for b"]
        assert asyncio.run(event_acked(r2.url, b_creds, "b")) >= 1

        # revocation pushed once, to r1: the node's connection on r2 (and on r3, r1) is closed; timed
        times = {}
        for where in relays:
            node = f"c-{where.root.name}"
            ident, path = enrol(r1, node)
            took, told = asyncio.run(revoked_while_connected(where.url, path, node, lambda i=ident: revoke(r1, i)))
            # the revoked account's limit of 0 connections, or its revocation, whichever the relay applies first: as
            # the client heard it, or (over TLS the server's -ERR and its close can reach nats-py as a bare EOF) as
            # the relay recorded the closed connection
            told += [c.get("reason", "") for c in where.closed_connections(ident.account)]
            said = ("revoked", "maximum account active connections", "maximum account connections exceeded")
            assert any(w in e.lower() for e in told for w in said), told
            times[where.root.name] = took
            for other in relays:
                refused = asyncio.run(relay_refusal(other.url, user_credentials=str(path)))
                assert "authorization violation" in refused.lower(), (other.root.name, refused)
        print(f"revocation pushed to r1 -> connection closed: {json.dumps(times)}")
        assert max(times.values()) < 1.0, times

        # r3 is down when node d is revoked; r2 is up then and restarted after
        d, d_creds = enrol(r1, "d")
        assert asyncio.run(relay_refusal(r3.url, user_credentials=str(d_creds))) == "connected"
        r3.stop()
        revoke(r1, d)
        r2.stop()
        r2.start()
        assert "authorization violation" in asyncio.run(relay_refusal(r2.url, user_credentials=str(d_creds))).lower()
        # r3 comes back: its unit's catch-up takes the revocation from a peer before it serves
        r3.start()
        assert r3.caught_up["peer"] in (r1.url, r2.url) and r3.caught_up["written"] >= 1, r3.caught_up
        refused = asyncio.run(relay_refusal(r3.url, user_credentials=str(d_creds)))
        assert "authorization violation" in refused.lower(), refused
        # the node enrolled before is still served by the relay that came back
        assert asyncio.run(relay_refusal(r3.url, user_credentials=str(b_creds))) == "connected"
    finally:
        for r in relays:
            r.stop()
