"""Issue 20 defect 7: notices on an account of their own in the relay. A real nats-server configured by the
notice_relay role's own template, a real agent holding only its node's credentials, and the two ways other
clients landed messages on a node's notice subject: a control-plane reader's JetStream request whose reply subject
is that subject, and another node routing the acks of its own events there. Neither reaches the agent (it counts
whatever odd traffic still arrives: here only the reclaimer's own junk), and the reclaimer's real notice still
drains the node end to end."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path
from typing import Any

import nats

from sco.contract.signing import write_keypair
from sco_devkit.standins.kube_apiserver import KubeApiStandIn
from tests.harness import AgentEnv, add_pod, wait_for
from tests.test_drill import BIN, REPO, run_playbook, start_relay

ATTACKS = 200  # of each kind (17,300 in 10 s reached one agent before)


def status(agent: AgentEnv) -> dict[str, Any]:
    out = subprocess.run(
        [str(BIN / "sco-agent"), "status", "--state-dir", str(agent.state)], capture_output=True, timeout=30
    )
    return dict(json.loads(out.stdout))


def test_readers_and_other_nodes_cannot_land_anything_on_a_nodes_notice_subject(
    tmp_path: Path, kube: KubeApiStandIn
) -> None:
    srv, creds = start_relay(tmp_path, ["a", "b"])
    pw = {u: (creds / u).read_text().strip() for u in ("node-a", "node-b", "control", "reclaimer")}
    agent = AgentEnv(tmp_path / "agent", kube, srv, node="a", nats_user="node-a", nats_password=pw["node-a"])
    add_pod(kube, "web", "web-0", agent.node, grace=30, prestop=0.2)
    write_keypair(agent.notice_key, tmp_path / "notice.key", tmp_path / "notice.pub")  # the hall trusts it
    (tmp_path / "nats").symlink_to(creds)  # the drill reads <sco_credentials_dir>/nats/<user>

    async def attack() -> None:
        reader = await nats.connect(srv.url, user="control", password=pw["control"])
        other = await nats.connect(srv.url, user="node-b", password=pw["node-b"], inbox_prefix="_INBOX.local.b")
        reclaimer = await nats.connect(srv.url, user="reclaimer", password=pw["reclaimer"])
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
