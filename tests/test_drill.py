"""playbooks/drill.yml end to end: a real nats-server configured by the notice_relay role's own template (per-node
users, reclaimer, reader) and its stream tool, a real node agent holding only its node's credentials, and the
Kubernetes API stand-in; the drill sends the notice as the reclaimer and reports what the agent did."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sco.contract.signing import generate, write_keypair
from sco.standins.kube_apiserver import KubeApiStandIn
from tests.harness import AgentEnv, NatsServer, add_pod, free_port, wait_for

REPO = Path(__file__).resolve().parents[1]
ROLE = REPO / "collections/ansible_collections/sco/orchestrator/roles/notice_relay"
BIN = Path(sys.executable).parent

RENDER = """
- name: Render the relay's configuration with the role's template
  hosts: localhost
  gather_facts: false
  vars_files: ["{{ role }}/defaults/main.yml", "{{ role }}/vars/main.yml"]
  tasks:
    - name: Render
      ansible.builtin.template:
        src: "{{ role }}/templates/nats-server.conf.j2"
        dest: "{{ out }}"
        mode: "0600"
"""


def run_playbook(tmp: Path, play: str | Path, extravars: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """Run a playbook file, or a playbook text written to a file first."""
    if isinstance(play, str):
        text, play = play, tmp / f"play-{len(list(tmp.glob('play-*')))}.yml"
        play.write_text(text)
    extravars = {"ansible_python_interpreter": sys.executable, **extravars}
    env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(REPO / "collections"), "PATH": f"{BIN}:{os.environ['PATH']}"}
    return subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", "localhost,", "-c", "local", str(play), "-e", json.dumps(extravars)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


class RoleRelay(NatsServer):
    """nats-server started with the configuration the notice_relay role renders."""

    def __init__(self, workdir: Path, conf: Path, port: int) -> None:
        super().__init__(workdir, port)
        self.conf = conf

    def start(self) -> RoleRelay:
        self.proc = subprocess.Popen(
            [str(BIN / "nats-server"), "-c", str(self.conf)],
            stdout=subprocess.DEVNULL,
            stderr=open(self.dir / "nats.log", "ab"),  # noqa: SIM115
        )

        def up() -> bool:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return True
            except OSError:
                return False

        wait_for(up, 10, "nats-server")
        return self


def start_relay(tmp_path: Path, nodes: list[str]) -> tuple[RoleRelay, Path]:
    """A relay for hall `local` with the role's users for `nodes`, the reclaimer and the control reader."""
    creds = tmp_path / "credentials"
    port = free_port()
    conf = tmp_path / "nats.conf"
    r = run_playbook(
        tmp_path, RENDER,
        {"role": str(ROLE), "out": str(conf), "notice_relay_hall": "local", "notice_relay_nodes": nodes,
         "notice_relay_credentials_dir": str(creds), "notice_relay_listen": "127.0.0.1", "notice_relay_port": port,
         "notice_relay_monitor_port": free_port(), "notice_relay_store_dir": str(tmp_path / "js")},
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    srv = RoleRelay(tmp_path, conf, port).start()
    stream = subprocess.run(
        [sys.executable, str(ROLE / "files/sco-nats-stream.py"), "--server", srv.url,
         "--password-file", str(creds / "relay-admin"), "--hall", "local"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert json.loads(stream.stdout) == {"stream": "SCO_EVENTS", "action": "created"}, stream.stderr
    return srv, creds


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[tuple[RoleRelay, Path]]:
    srv, creds = start_relay(tmp_path, ["node-1"])
    yield srv, creds
    srv.stop()


def test_drill_reclaims_the_chosen_node_and_reports_drained(tmp_path: Path, relay: Any, kube: KubeApiStandIn) -> None:
    srv, creds = relay
    password = (creds / "node-node-1").read_text().strip()
    # the node's own relay identity, as the node_agent role writes it
    agent = AgentEnv(tmp_path / "agent", kube, srv, nats_user="node-node-1", nats_password=password)
    add_pod(kube, "web", "web-0", agent.node, grace=30, prestop=0.5)
    write_keypair(agent.notice_key, tmp_path / "notice.key", tmp_path / "notice.pub")  # the hall trusts it
    agent.start().wait_subscribed()
    try:
        ev = {
            "drill_notice_keys": [str(tmp_path / "notice.key")],
            "sco_hall": "local",
            "sco_relay_url": srv.url,
            "sco_credentials_dir": str(tmp_path),
            "drill_nodes": ["node-1"],
            "drill_notice_seconds": 20,
            "drill_grace_seconds": 5,
        }
        (tmp_path / "nats").symlink_to(creds)  # the drill reads <sco_credentials_dir>/nats/<user>
        out = run_playbook(tmp_path, REPO / "playbooks/drill.yml", ev)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "node-1: drained" in out.stdout
        drained = agent.of("drain.drained")
        assert len(drained) == 1 and drained[0]["notice"].startswith("drill-")
        # the agent's events reached the hall's stream under its own credentials
        assert agent.of("notice.accepted")
    finally:
        agent.stop()


def test_drill_says_which_nodes_did_not_drain(tmp_path: Path, relay: Any) -> None:
    srv, creds = relay
    (tmp_path / "nats").symlink_to(creds)
    write_keypair(generate(), tmp_path / "notice.key", tmp_path / "notice.pub")
    ev = {"sco_hall": "local", "sco_relay_url": srv.url, "sco_credentials_dir": str(tmp_path),
          "drill_nodes": ["node-1"], "drill_notice_seconds": 2, "drill_grace_seconds": 1,
          "drill_notice_keys": [str(tmp_path / "notice.key")]}  # fmt: skip
    out = run_playbook(tmp_path, REPO / "playbooks/drill.yml", ev)
    assert out.returncode != 0  # no agent listens: the job fails and names the node
    assert "node-1: no answer" in out.stdout and "not drained: node-1" in out.stdout


@pytest.mark.slow
def test_drill_with_cloud_credentials_deletes_the_instances_after_the_drain(  # type: ignore[no-untyped-def]
    tmp_path: Path, openstack_cloud, fleet_dsn, kube: KubeApiStandIn
) -> None:
    """With the hall's cloud and fleet state, the drill is a real reclaim: the provider's reclaimer (the collection's
    reclaim module) notices the instance as the relay's reclaimer user, the agent drains, the server is deleted at T,
    and the report gives both the agent's account and the instance's end."""
    from sco.control.acquirer import Acquirer, PlanEntry
    from sco.state.fleet import FleetState, Pool

    hall = "local"  # the agent's hall (harness bundle)
    conn = openstack_cloud.connect()
    try:
        with FleetState(fleet_dsn) as st:
            st.ensure_pool(
                Pool(hall, "spot", flavor=openstack_cloud.flavors["sco.small"], image=openstack_cloud.image_id)
            )
            Acquirer(conn, st, lambda n: "#cloud-config\n").apply(PlanEntry(hall, "spot", "drill", 1))
            (inst,) = st.instances(hall, pool="spot")
        srv, creds = start_relay(tmp_path, [inst.name])
        password = (creds / f"node-{inst.name}").read_text().strip()
        agent = AgentEnv(
            tmp_path / "agent", kube, srv, node=inst.name, nats_user=f"node-{inst.name}", nats_password=password
        )
        add_pod(kube, "web", "web-0", agent.node, grace=30, prestop=0.5)
        write_keypair(agent.notice_key, tmp_path / "notice.key", tmp_path / "notice.pub")
        (tmp_path / "nats").symlink_to(creds)
        clouds = openstack_cloud.write_clouds_yaml(tmp_path / "clouds.yaml")
        agent.start().wait_subscribed()
        try:
            ev = {
                "drill_notice_keys": [str(tmp_path / "notice.key")],
                "sco_hall": hall,
                "sco_relay_url": srv.url,
                "sco_credentials_dir": str(tmp_path),
                "sco_cloud": "sco-loopback",
                "sco_state_dsn": fleet_dsn,
                "drill_nodes": [inst.name],
                "drill_notice_seconds": 15,
                "drill_grace_seconds": 5,
            }
            os.environ["OS_CLIENT_CONFIG_FILE"] = str(clouds)
            try:
                out = run_playbook(tmp_path, REPO / "playbooks/drill.yml", ev)
            finally:
                del os.environ["OS_CLIENT_CONFIG_FILE"]
            with FleetState(fleet_dsn) as st:
                kinds = [e["kind"] for e in st.events(instance_id=inst.id)]
            why = (
                f"{out.stdout}{out.stderr}\nagent: {[e['type'] for e in agent.events()]}\nfleet: {kinds}\nrelay: "
                + ((tmp_path / "nats.log").read_text()[-3000:])
            )
            assert out.returncode == 0, why
            assert f"{inst.name}: drained, deleted" in out.stdout, why
            (drained,) = agent.of("drain.drained")
            with FleetState(fleet_dsn) as st:
                after = st.instance(inst.id)
            # the agent's account reached the fleet state (the reclaimer read the hall's events as the relay's
            # reclaimer user) before the delete, and the delete came at T, not before
            assert after.state == "deleted"
            assert kinds.index("agent.drain.drained") < kinds.index("instance.delete_requested")
            assert drained["notice"].startswith("reclaim-") and drained["at"] < after.terminate_at
            assert conn.compute.find_server(inst.server_id, ignore_missing=True) is None
        finally:
            agent.stop()
            srv.stop()
    finally:
        for s in conn.compute.servers(tags=f"sco-hall={hall}"):
            conn.compute.delete_server(s.id, ignore_missing=True)
        conn.close()


def test_a_nodes_relay_identity_cannot_read_other_inboxes(tmp_path: Path, kube: KubeApiStandIn) -> None:
    """The relay's control users read every node's events through JetStream push consumers, which deliver on
    _INBOX subjects: a node's credentials must not subscribe there (only to its own inbox), while its own agent still
    gets the acks of what it publishes."""
    import asyncio

    import nats

    srv, creds = start_relay(tmp_path, ["node-1", "node-2"])
    pw = {u: (creds / u).read_text().strip() for u in ("node-node-1", "node-node-2", "control")}
    agent = AgentEnv(tmp_path / "agent", kube, srv, nats_user="node-node-1", nats_password=pw["node-node-1"])
    add_pod(kube, "web", "web-0", agent.node, grace=30, prestop=0.2)
    write_keypair(agent.notice_key, tmp_path / "notice.key", tmp_path / "notice.pub")
    (tmp_path / "nats").symlink_to(creds)

    async def snoop() -> tuple[list[str], list[str]]:
        errors: list[str] = []

        async def on_error(e: Exception) -> None:
            errors.append(str(e))

        # the control loop's reader follows the hall's events on a durable push consumer (delivered on _INBOX)
        reader = await nats.connect(srv.url, user="control", password=pw["control"])
        seen: list[str] = []
        spy = await nats.connect(srv.url, user="node-node-2", password=pw["node-node-2"], error_cb=on_error)

        async def on_spied(msg: Any) -> None:
            seen.append(msg.subject)

        for subject in ("_INBOX.>", "_INBOX.local.node-1.>"):
            await spy.subscribe(subject, cb=on_spied)
        await spy.flush(timeout=3)

        async def on_event(msg: Any) -> None:
            await msg.ack()

        await reader.jetstream().subscribe(
            "sco.events.local.>", stream="SCO_EVENTS", durable="probe", cb=on_event, manual_ack=True
        )
        out = await asyncio.to_thread(
            run_playbook, tmp_path, REPO / "playbooks/drill.yml",
            {"drill_notice_keys": [str(tmp_path / "notice.key")], "sco_hall": "local", "sco_relay_url": srv.url,
             "sco_credentials_dir": str(tmp_path), "drill_nodes": ["node-1"], "drill_notice_seconds": 15,
             "drill_grace_seconds": 5},
        )  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
        await asyncio.sleep(1)
        await spy.close()
        await reader.close()
        return errors, seen

    agent.start().wait_subscribed()
    try:
        errors, seen = asyncio.run(snoop())
        assert seen == []  # not one of node-1's events (nor its acks) reached another node
        assert sum("permissions violation" in e.lower() for e in errors) == 2, errors

        def published() -> bool:
            out = subprocess.run(
                [str(BIN / "sco-agent"), "status", "--state-dir", str(agent.state)], capture_output=True, timeout=30
            )
            return bool(json.loads(out.stdout)["events"]["unpublished"] == 0)

        # the agent's own inbox still works: every event it published was acknowledged by the stream
        wait_for(published, 15, "the agent's events acknowledged")
    finally:
        agent.stop()
        srv.stop()
