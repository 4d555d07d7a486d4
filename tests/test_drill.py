"""playbooks/drill.yml end to end: a real nats-server configured by the notice_relay role's own template (per-node
users, reclaimer, reader) and its stream tool, a real node agent holding only its node's credentials, and the
Kubernetes API stand-in; the drill sends the notice as the reclaimer and reports what the agent did."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nkeys
import pytest

from sco.contract.signing import generate, write_keypair
from sco_devkit.standins.kube_apiserver import KubeApiStandIn
from tests.harness import AgentEnv, add_pod, free_port, wait_for
from tests.relays import REPO, RoleRelay, agent_identity, as_user, run_playbook, start_relay

BIN = Path(sys.executable).parent


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[tuple[RoleRelay, Path]]:
    srv, creds = start_relay(tmp_path, ["node-1"])
    yield srv, creds
    srv.stop()


def test_drill_reclaims_the_chosen_node_and_reports_drained(tmp_path: Path, relay: Any, kube: KubeApiStandIn) -> None:
    srv, creds = relay
    # the node's own relay identity, as the node_agent role writes it
    agent = AgentEnv(tmp_path / "agent", kube, srv, **agent_identity(creds, "node-1"))
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
        ev["drill_report_dir"] = str(tmp_path / "reports")
        ev["drill_progress_seconds"] = 1
        out = run_playbook(tmp_path, REPO / "playbooks/drill.yml", ev)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "node-1: drained" in out.stdout
        drained = agent.of("drain.drained")
        assert len(drained) == 1 and drained[0]["notice"].startswith("drill-")
        # the agent's events reached the hall's stream under its own credentials
        assert agent.of("notice.accepted")
        # the job showed the node's progress while it drained, and ended with its time left at T
        assert "node-1: drained in" in out.stdout and "s left at T" in out.stdout, out.stdout
        (page,) = (tmp_path / "reports").glob("drill-*.html")
        report = json.loads(page.with_suffix(".json").read_text())
        assert f"report: {page}" in out.stdout
        assert report["nodes"]["node-1"]["outcome"] == "drained" and report["nodes"]["node-1"]["pods"] == 1
        assert report["nodes"]["node-1"]["notice"] == drained[0]["notice"]
        assert 'data-node="node-1"' in page.read_text()
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
        agent = AgentEnv(tmp_path / "agent", kube, srv, node=inst.name, **agent_identity(creds, inst.name))
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
                "drill_report_dir": str(tmp_path / "reports"),
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
            # the report followed the reclaimer's notice (the agent's own events) and adds the instance's end
            (page,) = (tmp_path / "reports").glob("drill-*.html")
            node = json.loads(page.with_suffix(".json").read_text())["nodes"][inst.name]
            assert node["notice"] == drained["notice"] and node["outcome"] == "drained", node
            assert node["instance"] == "deleted" and node["left_at_t_s"] > 0
            assert f"{inst.name}: drained in" in out.stdout  # the live progress, as without the cloud
        finally:
            agent.stop()
            srv.stop()
    finally:
        for s in conn.compute.servers(tags=f"sco-hall={hall}"):
            conn.compute.delete_server(s.id, ignore_missing=True)
        conn.close()


def test_a_nodes_relay_identity_cannot_read_other_inboxes(tmp_path: Path, kube: KubeApiStandIn) -> None:
    """The relay's control users read every node's events through JetStream push consumers, which deliver on
    _INBOX subjects: a node's credentials must not subscribe there (only to its own inbox, not even that of a node
    whose name extends its own: "a" and "a.b"), while its own agent still gets the acks of what it publishes. Junk
    on the drilled node's notice subject during the drill does not count as the drill's notice refused."""
    import asyncio

    import nats

    srv, creds = start_relay(tmp_path, ["a", "a.b"])
    agent = AgentEnv(tmp_path / "agent", kube, srv, node="a.b", **agent_identity(creds, "a.b"))
    add_pod(kube, "web", "web-0", agent.node, grace=30, prestop=0.2)
    write_keypair(agent.notice_key, tmp_path / "notice.key", tmp_path / "notice.pub")
    (tmp_path / "nats").symlink_to(creds)

    async def snoop() -> tuple[list[str], list[str]]:
        errors: list[str] = []

        async def on_error(e: Exception) -> None:
            errors.append(str(e))

        # the control loop's reader follows the hall's events on a durable push consumer (delivered on _INBOX)
        reader = await nats.connect(srv.url, **as_user(creds, "control"))
        seen: list[str] = []
        spy = await nats.connect(srv.url, **as_user(creds, "node-a"), error_cb=on_error)

        async def on_spied(msg: Any) -> None:
            seen.append(msg.subject)

        # refused: everyone's, a.b's; allowed but empty: a's own inbox space (a.b's replies come on _INBOX.local.a_b)
        for subject in ("_INBOX.>", "_INBOX.local.a_b.>", "_INBOX.local.a.b.>", "_INBOX.local.a.>"):
            await spy.subscribe(subject, cb=on_spied)
        await spy.flush(timeout=3)

        async def on_event(msg: Any) -> None:
            await msg.ack()

        await reader.jetstream().subscribe(
            "sco.events.local.>", stream="SCO_EVENTS", durable="control", cb=on_event, manual_ack=True
        )
        junk = await nats.connect(srv.url, **as_user(creds, "reclaimer"))

        async def inject() -> None:
            for i in range(30):
                await junk.publish("sco.notice.local.a.b", json.dumps({"junk": i}).encode())
                await asyncio.sleep(0.3)

        injecting = asyncio.create_task(inject())
        out = await asyncio.to_thread(
            run_playbook, tmp_path, REPO / "playbooks/drill.yml",
            {"drill_notice_keys": [str(tmp_path / "notice.key")], "sco_hall": "local", "sco_relay_url": srv.url,
             "sco_credentials_dir": str(tmp_path), "drill_nodes": ["a.b"], "drill_notice_seconds": 15,
             "drill_grace_seconds": 5},
        )  # fmt: skip
        await injecting
        assert out.returncode == 0, out.stdout + out.stderr
        assert "a.b: drained" in out.stdout
        await asyncio.sleep(1)
        for c in (spy, reader, junk):
            await c.close()
        return errors, seen

    agent.start().wait_subscribed()
    try:
        errors, seen = asyncio.run(snoop())
        assert seen == []  # not one of a.b's events (nor its acks) reached another node
        assert sum("permissions violation" in e.lower() for e in errors) == 2, errors
        assert agent.of("notice.refused")  # the junk was refused while the drill's notice drained the node

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


def _instances(st: Any, hall: str, names: list[str], *, window: float) -> list[Any]:
    """Fleet-state rows for instances under reclaim (notified, T = now + window), as the reclaimer leaves them."""
    from sco.state.fleet import Pool

    st.ensure_pool(Pool(hall, "spot", flavor="f", image="i"))
    out = []
    for slot, name in enumerate(names):
        inst = st.request(hall, "spot", "e", slot, name)
        st.transition(inst.id, "active", "instance.active", server_id=f"srv-{name}")
        st.transition(inst.id, "notified", "reclaim.scheduled", reclaim_id=f"r-{name}", terminate_at=st.now() + window)
        # its notice went out (a reclaim whose notice was never tried is told again first, not deleted at T)
        st.event(hall, "notice.published", instance_id=inst.id, pool="spot", notice=f"r-{name}")
        out.append(st.instance(inst.id))
    return out


def test_the_reclaimer_records_an_event_for_the_node_its_subject_names(tmp_path: Path, fleet_dsn: str) -> None:
    """A node may publish only on its own subject, but the body is its word: node a claiming to be node b's agent
    must not drain b's account in the fleet state, nor hide b's real events (de-duplicated by node and seq)."""
    import asyncio

    import nats

    from sco.provider.reclaimer import Reclaimer
    from sco.state.fleet import FleetState

    srv, creds = start_relay(tmp_path, ["a", "b"])
    try:
        with FleetState(fleet_dsn) as st:
            a, b = _instances(st, "local", ["a", "b"], window=60)

            async def scenario() -> None:
                r = Reclaimer(None, st, srv.url, signing_keys=[generate()], nats_auth=as_user(creds, "reclaimer"))
                sub = await r._follow_events("local")
                na = await nats.connect(srv.url, **as_user(creds, "node-a"), inbox_prefix="_INBOX.local.a")
                nb = await nats.connect(srv.url, **as_user(creds, "node-b"), inbox_prefix="_INBOX.local.b")
                forged = {"type": "drain.drained", "node": "b", "seq": 3, "at": 1.0, "notice": "r-b"}
                await na.jetstream().publish("sco.events.local.a", json.dumps(forged).encode())
                real = {"type": "drain.overrun", "node": "b", "seq": 3, "at": 2.0, "notice": "r-b"}
                await nb.jetstream().publish("sco.events.local.b", json.dumps(real).encode())
                wait = 0.0
                while st.instance(b.id).state == "notified" and wait < 10:
                    await asyncio.sleep(0.1)
                    wait += 0.1
                await sub.unsubscribe()
                for c in (na, nb):
                    await c.close()
                await r.close()

            asyncio.run(scenario())
            assert st.instance(b.id).state == "overrun"  # b's own account, not a's forgery
            assert st.instance(a.id).state == "notified"
            kinds_b = [e["kind"] for e in st.events(instance_id=b.id)]
            assert "agent.drain.overrun" in kinds_b and "agent.drain.drained" not in kinds_b
            refused = [e for e in st.events(hall="local") if e["kind"] == "agent.event_refused"]
            assert len(refused) == 1 and refused[0]["detail"]["subject"] == "sco.events.local.a"
    finally:
        srv.stop()


def test_a_delete_that_keeps_failing_ends_the_run_unconfirmed_and_the_next_run_tries_again(
    tmp_path: Path, fleet_dsn: str
) -> None:
    """OpenStack unreachable: the reclaim retries the delete with backoff for retry_for_s past T, then returns with
    the instance still under reclaim and named as not confirmed gone (exit 9 for sco reclaim), instead of running
    for ever holding the hall's lock; the next run, long past T, deletes again at once (nothing is abandoned)."""
    import asyncio

    import openstack

    from sco.provider.reclaimer import Reclaimer
    from sco.state.fleet import FleetState

    # a real openstacksdk connection to an endpoint nobody listens on
    cloud = openstack.connect(
        auth_url=f"http://127.0.0.1:{free_port()}/v3", username="u", password="p", project_name="p",
        user_domain_name="Default", project_domain_name="Default", api_timeout=2,
    )  # fmt: skip
    with FleetState(fleet_dsn) as st:
        (inst,) = _instances(st, "local", ["a"], window=3)

        def attempts() -> int:
            return [e["kind"] for e in st.events(instance_id=inst.id)].count("delete.failed")

        for _ in range(2):
            before = attempts()
            r = Reclaimer(cloud, st, "nats://127.0.0.1:1", signing_keys=[generate()], retry_for_s=2)

            async def go(r: Reclaimer = r) -> None:
                try:
                    await asyncio.wait_for(r.run("local", follow_events=False), 60)
                finally:
                    await r.close()

            asyncio.run(go())
            assert attempts() > before
            assert inst.id in r.unconfirmed
        after = st.instance(inst.id)
        kinds = [e["kind"] for e in st.events(instance_id=inst.id)]
    assert after.state == "notified"  # still under reclaim: the next run deletes it
    assert "delete.abandoned" not in kinds and kinds[-1] == "delete.pending"


@pytest.mark.parametrize("seconds", [0, -30, "nan", "1e12", "soon"])
def test_the_drill_refuses_a_notice_window_that_cannot_drain(tmp_path: Path, seconds: Any) -> None:
    """0 would delete with no drain at all (cloud mode) or announce a termination already past."""
    out = run_playbook(
        tmp_path, REPO / "playbooks/drill.yml",
        {"sco_hall": "local", "sco_relay_url": "nats://127.0.0.1:1", "sco_credentials_dir": str(tmp_path),
         "drill_nodes": ["node-1"], "drill_notice_seconds": seconds, "drill_notice_keys": ["/nonexistent"]},
    )  # fmt: skip
    assert out.returncode != 0
    assert "drill_notice_seconds must be a number from 1 to 3600" in out.stdout, out.stdout


def test_the_drill_in_check_mode_says_what_it_would_do_and_sends_nothing(tmp_path: Path, relay: Any) -> None:
    import asyncio

    import nats

    srv, creds = relay
    (tmp_path / "nats").symlink_to(creds)
    write_keypair(generate(), tmp_path / "notice.key", tmp_path / "notice.pub")
    got: list[bytes] = []

    async def listen_while(check: Any) -> Any:
        nc = await nats.connect(srv.url, **as_user(creds, "node-node-1"))

        async def on_msg(msg: Any) -> None:
            got.append(msg.data)

        await nc.subscribe("sco.notice.local.node-1", cb=on_msg)
        await nc.flush()
        out = await asyncio.to_thread(check)
        await asyncio.sleep(0.5)
        await nc.close()
        return out

    ev = {"sco_hall": "local", "sco_relay_url": srv.url, "sco_credentials_dir": str(tmp_path),
          "drill_nodes": ["node-1"], "drill_notice_seconds": 10,
          "drill_notice_keys": [str(tmp_path / "notice.key")]}  # fmt: skip
    out = asyncio.run(listen_while(lambda: run_playbook(tmp_path, REPO / "playbooks/drill.yml", {**ev}, "--check")))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "check mode: would send signed notices (T+10 s) to node-1" in out.stdout, out.stdout
    assert got == []


def test_readers_and_reclaimers_touch_only_their_own_consumer(tmp_path: Path, fleet_dsn: str) -> None:
    """The reclaimer follows the events on its durable consumer with the role's grants; the control reader has one
    of its own (named after it) and may not delete the reclaimer's (that would silence the agents' accounts
    mid-reclaim), create others, or delete or purge the stream."""
    import asyncio

    import nats

    from sco.provider.reclaimer import Reclaimer
    from sco.state.fleet import FleetState

    srv, creds = start_relay(tmp_path, ["a"])

    async def scenario(st: Any) -> dict[str, str]:
        r = Reclaimer(None, st, srv.url, signing_keys=[generate()], nats_auth=as_user(creds, "reclaimer"))
        sub = await r._follow_events("local")  # as in a real reclaim: creates sco-reclaimer-local
        out: dict[str, str] = {}
        nc = await nats.connect(srv.url, **as_user(creds, "control"))
        js = nc.jetstream(timeout=3)

        async def on_msg(msg: Any) -> None:
            await msg.ack()

        attempts = {
            "own durable": lambda: js.subscribe("sco.events.local.>", stream="SCO_EVENTS", durable="control",
                                                cb=on_msg, manual_ack=True),
            "another durable": lambda: js.subscribe("sco.events.local.>", stream="SCO_EVENTS", durable="other",
                                                    cb=on_msg, manual_ack=True),
            "delete the reclaimer's": lambda: js.delete_consumer("SCO_EVENTS", "sco-reclaimer-local"),
            "delete the stream": lambda: js.delete_stream("SCO_EVENTS"),
            "purge the stream": lambda: js.purge_stream("SCO_EVENTS"),
        }  # fmt: skip
        for what, attempt in attempts.items():
            try:
                await attempt()
                out[what] = "allowed"
            except Exception as e:
                out[what] = f"refused: {type(e).__name__}"
        info = await r.nc.jetstream().consumer_info("SCO_EVENTS", "sco-reclaimer-local")
        out["reclaimer's consumer"] = info.name
        await sub.unsubscribe()
        await nc.close()
        await r.close()
        return out

    try:
        with FleetState(fleet_dsn) as st:
            out = asyncio.run(scenario(st))
    finally:
        srv.stop()
    assert out["own durable"] == "allowed", out
    assert out["reclaimer's consumer"] == "sco-reclaimer-local", out
    for what in ("another durable", "delete the reclaimer's", "delete the stream", "purge the stream"):
        assert out[what].startswith("refused"), out


def _fatal_lines(out: subprocess.CompletedProcess[str]) -> list[str]:
    return [ln for ln in out.stdout.splitlines() if ln.startswith("fatal:")]


def _one_line(out: subprocess.CompletedProcess[str]) -> str:
    """The job failed with one message (not a traceback, not "from_json failed"): return it."""
    (fatal,) = _fatal_lines(out)
    assert "from_json" not in out.stdout and "Traceback" not in out.stdout, out.stdout
    msg = json.loads(fatal.split("=> ", 1)[1])["msg"]
    assert isinstance(msg, str) and "\n" not in msg, msg
    return msg


def test_a_missing_notice_key_stops_the_drill_with_one_line_and_sends_nothing(tmp_path: Path, relay: Any) -> None:
    """A crash: a missing key file raised in the script, whose exit 1 was read as "not drained" and
    whose empty output failed in from_json. Now: one line naming the file and what to do; no notice sent."""
    srv, creds = relay
    (tmp_path / "nats").symlink_to(creds)
    ev = {"sco_hall": "local", "sco_relay_url": srv.url, "sco_credentials_dir": str(tmp_path),
          "drill_nodes": ["node-1"], "drill_notice_seconds": 5, "drill_report_dir": str(tmp_path / "reports"),
          "drill_notice_keys": [str(tmp_path / "keys/notice.key")]}  # fmt: skip
    out = run_playbook(tmp_path, REPO / "playbooks/drill.yml", ev)
    assert out.returncode != 0
    msg = _one_line(out)
    assert msg.startswith(f"drill: notice key {tmp_path}/keys/notice.key: no such key file"), msg
    assert "--for notice" in msg and "spec.noticeKeys" in msg, msg
    assert not (tmp_path / "reports").exists()  # stopped before anything was sent
    # a file that is no key: the same, one line
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys/notice.key").write_text("")
    os.chmod(tmp_path / "keys/notice.key", 0o600)
    msg = _one_line(run_playbook(tmp_path, REPO / "playbooks/drill.yml", ev))
    assert msg.startswith(f"drill: notice key {tmp_path}/keys/notice.key: not a key file"), msg


def test_the_drill_makes_its_notice_key_and_says_the_hall_must_trust_it(tmp_path: Path) -> None:
    """With drill_make_notice_key the drill makes the missing key (0600), then checks the hall's published bundle:
    a key its policy does not list would have every notice refused, so the job stops with the entry to add; a key
    it lists passes."""
    import threading

    from sco.contract.distributor import DistributorServer, publish
    from sco.contract.signing import Keyring, load_private
    from tests.harness import hall_bundle

    hall_key, trusted_notice = generate(), generate()
    write_keypair(hall_key, tmp_path / "hall.key", tmp_path / "hall.pub")
    write_keypair(trusted_notice, tmp_path / "trusted-notice.key", tmp_path / "trusted-notice.pub")
    root = tmp_path / "distributor"
    publish(hall_bundle(tmp_path, hall_key, trusted_notice), root, Keyring([hall_key.public]))
    dist = DistributorServer(root, ("127.0.0.1", 0))
    threading.Thread(target=dist.serve_forever, daemon=True).start()
    try:
        ev = {"sco_hall": "local", "sco_relay_url": "nats://127.0.0.1:1", "sco_credentials_dir": str(tmp_path),
              "sco_distributor_url": dist.url, "sco_trusted_keys": [str(tmp_path / "hall.pub")],
              "drill_nodes": ["node-1"], "drill_make_notice_key": True,
              "drill_notice_keys": [str(tmp_path / "keys/notice.key")]}  # fmt: skip
        out = run_playbook(tmp_path, REPO / "playbooks/drill.yml", ev)
        made = load_private(tmp_path / "keys/notice.key")  # made, and private (load_private refuses 0644)
        msg = _one_line(out)
        assert f"notice key {tmp_path}/keys/notice.key (keyid {made.keyid}, just made) is not in the noticeKeys" in msg
        assert f"add {{keyid: '{made.keyid}', public: '" in msg and dist.url in msg, msg
        # the key the hall lists: past the key check (check mode: nothing sent)
        ok = {**ev, "drill_notice_keys": [str(tmp_path / "trusted-notice.key")]}
        out = run_playbook(tmp_path, REPO / "playbooks/drill.yml", ok, "--check")
        assert out.returncode == 0, out.stdout + out.stderr
        assert "check mode: would send signed notices" in out.stdout
    finally:
        dist.shutdown()
        dist.server_close()


def test_a_relay_that_refuses_the_drill_stops_it_with_one_line(tmp_path: Path, relay: Any) -> None:
    srv, _ = relay
    (tmp_path / "nats").mkdir()
    for user in ("control", "reclaimer"):  # seeds the relay does not know
        (tmp_path / "nats" / f"{user}.nk").write_bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
    write_keypair(generate(), tmp_path / "notice.key", tmp_path / "notice.pub")
    ev = {"sco_hall": "local", "sco_relay_url": srv.url, "sco_credentials_dir": str(tmp_path),
          "drill_nodes": ["node-1"], "drill_notice_seconds": 5, "drill_report_dir": str(tmp_path / "reports"),
          "drill_notice_keys": [str(tmp_path / "notice.key")]}  # fmt: skip
    out = run_playbook(tmp_path, REPO / "playbooks/drill.yml", ev)
    assert out.returncode != 0
    msg = _one_line(out)
    assert msg.startswith(f"drill: relay {srv.url} as control: ") and "authorization" in msg.lower(), msg
