"""The main job's chain in one test, on real parts, in the order a hall lives it.

A pending pod on the Kubernetes API stand-in -> the control loop's demand, plan, arbitrate and acquire (the
collection's modules through ansible-runner, as the timer runs them) launch one instance on the real Nova, its
agent.env naming the enrolment service -> the user-data Nova stores, read back through the metadata API as the
instance sees it, written out as cloud-init would -> the real ``sco-agent`` started on that agent.env enrols with
the real ``sco enrol serve`` over TLS, checked against the hall's CA the user-data carries (its one-time token for
its own relay identity and a node-bound Kubernetes token),
connects to the operator-mode relay under its own identity and heartbeats -> a pod of the contract lands on the
node -> the reclaimer notices the node over NATS, the agent drains (the pod evicted), the reclaimer deletes the
server at T, the fleet state records both -> the enrolment service's sweep revokes the node's identity: its
connection dropped, its creds refused. Real PostgreSQL throughout. ``pytest -s`` prints the timeline."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from sco.contract.signing import delegate, delegation_text, generate, write_keypair
from sco.control.acquirer import ENROL_TOKEN, ENROL_URL
from sco.provider import heartbeats
from sco.provider.reclaim_job import ReclaimSettings, reclaim
from sco.state.db import connect
from sco.state.fleet import FleetState
from sco_devkit.standins.kube_apiserver import ApiError, KubeApiStandIn
from tests.harness import add_pod, free_port, hall_bundle, make_tls, wait_for
from tests.relays import HALL, JwtRelay, ca_for, relay_refusal, start_jwt_relay

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENV = {"ANSIBLE_COLLECTIONS_PATH": str(ROOT / "collections"), "PATH": f"{BIN}:{os.environ['PATH']}"}
WINDOW_S = 15.0
TOLERATE = [{"key": "sco.dev/reclaim", "operator": "Equal", "value": "reclaimable", "effect": "NoSchedule"}]

PLAY = """
- name: Demand, plan, arbitrate and acquire as the control loop runs them
  hosts: localhost
  gather_facts: false
  module_defaults:
    group/sco.orchestrator.control:
      hall: "{{ hall }}"
      bundle: "{{ bundle }}"
      trust_dir: "{{ trust_dir }}"
      state_dsn: "{{ dsn }}"
      cloud: "{{ cloud }}"
  tasks:
    - name: Demand
      sco.orchestrator.demand:
        kubernetes: {url: "{{ kube_url }}", token_file: "{{ kube_token_file }}"}
      register: demand
    - name: Plan
      sco.orchestrator.plan:
        demand: "{{ demand }}"
        pools: "{{ pools }}"
      register: plan
    - name: Arbitrate
      sco.orchestrator.arbitrate:
        plan: "{{ plan }}"
        pools: "{{ pools }}"
        ceiling_per_hour: "0"
      register: arbitration
    - name: Acquire
      sco.orchestrator.acquire:
        plan: "{{ plan }}"
        arbitration: "{{ arbitration }}"
        pools: "{{ pools }}"
        signing_keys: ["{{ signing_key }}"]
        launch_delegation: "{{ launch_delegation }}"
        node_env: "{{ node_env }}"
        enrol_ca_file: "{{ enrol_ca_file }}"
      register: acquire
"""


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[JwtRelay]:
    (tmp_path / "relay").mkdir()
    r = start_jwt_relay(tmp_path / "relay")
    yield r
    r.srv.stop()


@pytest.fixture
def kube(tmp_path: Path) -> Iterator[tuple[KubeApiStandIn, Path, Path]]:
    """The stand-in with authentication on (as tests/test_enrolment.py): the enrolment service's credential, the
    control loop's (it reads pending pods), and the agent's service account, sco-system/sco-agent."""
    srv = KubeApiStandIn().start()
    enrol_token, _ = srv.issue_token("sco-system", "sco-enrol")
    control_token, _ = srv.issue_token("sco-system", "sco-control")
    srv.add_serviceaccount("sco-system", "sco-agent")
    enrol_file, control_file = tmp_path / "enrol-kube-token", tmp_path / "control-kube-token"
    enrol_file.write_text(enrol_token)
    control_file.write_text(control_token)
    yield srv, enrol_file, control_file
    srv.stop()


class Enrol:
    """``sco enrol serve`` as its unit runs it (a process of its own, TLS only with a certificate of the test's hall
    CA, as role control_loop gives it), sweeping for revocations every 0.5 s."""

    def __init__(self, tmp: Path, relay: JwtRelay, kube: KubeApiStandIn, token_file: Path, dsn: str) -> None:
        self.port = free_port()
        self.log = tmp / "enrol.log"
        self.ca, cert, key = make_tls(tmp / "enrol-tls")
        argv = [
            str(BIN / "sco"), "enrol", "serve", "--hall", HALL, "--dsn", dsn,
            "--relay-keys", str(relay.dir / "hall-keys"), "--nats-url", relay.url, "--listen", f"127.0.0.1:{self.port}",
            "--nats-ca-file", str(ca_for(relay.url)),
            "--kube-url", kube.url, "--kube-token-file", str(token_file), "--revoke-every", "0.5",
            "--tls-cert-file", str(cert), "--tls-key-file", str(key),
        ]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115
        wait_for(lambda: "enrolling hall" in self.text() or self.proc.poll() is not None, 30, "sco enrol serve")
        assert self.proc.poll() is None, self.text()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def metrics(self) -> dict[str, float]:
        ctx = ssl.create_default_context(cafile=str(self.ca))
        text = urllib.request.urlopen(f"{self.url}/metrics", timeout=5, context=ctx).read().decode()
        return {k: float(v) for k, v in re.findall(r"^(sco_enrol_\S+) (\S+)$", text, re.M)}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def enrol(tmp_path: Path, relay: JwtRelay, kube: tuple[KubeApiStandIn, Path, Path], fleet_dsn: str) -> Iterator[Enrol]:
    e = Enrol(tmp_path, relay, kube[0], kube[1], fleet_dsn)
    yield e
    e.stop()


def cloud_init(user_data: str, root: Path) -> dict[str, Path]:
    """What cloud-init's write_files does with the #cloud-config (under ``root`` instead of /): path -> file."""
    assert user_data.startswith("#cloud-config\n"), user_data[:80]
    written = {}
    for f in yaml.safe_load(user_data)["write_files"]:
        path = root / f["path"].lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        content = f["content"]
        path.write_bytes(base64.b64decode(content) if f.get("encoding") == "b64" else content.encode())
        path.chmod(int(f["permissions"], 8))
        written[f["path"]] = path
    return written


def agent_connections(relay: JwtRelay, node: str) -> list[dict[str, Any]]:
    """The relay's own view (its monitoring endpoint): the agent's open connections, by the name it connects with."""
    port = re.search(r'^http: "127\.0\.0\.1:(\d+)"', relay.conf.read_text(), re.M)
    assert port, relay.conf.read_text()
    connz = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port[1]}/connz?auth=1", timeout=5).read())
    return [c for c in connz.get("connections") or [] if c.get("name") == f"sco-agent {HALL}/{node}"]


def spool_events(state: Path) -> list[dict[str, Any]]:
    from sco.agent.spool import read_events

    return list(read_events(state / "spool"))


def test_a_hall_lives_the_chain_from_pending_pod_to_revoked_identity(  # type: ignore[no-untyped-def]
    openstack_cloud,
    fleet_dsn: str,
    relay: JwtRelay,
    kube: tuple[KubeApiStandIn, Path, Path],
    enrol: Enrol,
    tmp_path: Path,
) -> None:
    import ansible_runner
    import openstack

    api, _, control_kube_token = kube
    cfg = openstack_cloud.make_project(f"chain-{os.urandom(3).hex()}")
    project = cfg.pop("project_id")
    conn = openstack.connect(**cfg)
    # the hall's root key signs the bundle and, on the controller, the delegation for the control host's launch key
    key, notice_key, launch = generate(), generate(), generate()
    trust = tmp_path / "trusted"
    trust.mkdir()
    write_keypair(key, tmp_path / "signing.key", trust / "signing.pub")
    write_keypair(launch, tmp_path / "launch.key", tmp_path / "launch.pub")
    now = int(time.time())
    delegation = delegate(key, launch.public, HALL, issued_at=now - 60, expires_at=now + 14 * 86_400, serial=1)
    (tmp_path / "launch.delegation").write_text(delegation_text(delegation))
    bundle = tmp_path / "bundle.json"
    bundle.write_bytes(hall_bundle(tmp_path, key, notice_key))  # hall "local": contract web in namespace web
    agent: subprocess.Popen[bytes] | None = None
    proxy, out_file = None, None
    st = FleetState(fleet_dsn)
    try:
        # 1. a pending pod of contract web, tolerating reclaimable capacity
        res = {"requests": {"cpu": "500m", "memory": "256Mi"}}
        api.cluster.create_pod(
            "web", {"metadata": {"name": "web-0"}, "spec": {"tolerations": TOLERATE, "containers": [
                {"name": "c", "image": "web", "resources": res}]}}
        )  # fmt: skip

        # 2. the timer's steps: demand -> plan -> arbitrate -> acquire (node_env names the enrolment service)
        pools = [{"name": "spot", "kind": "reclaimable", "flavor": openstack_cloud.flavors["sco.small"],
                  "image": openstack_cloud.image_id, "vcpus": 1, "ramMiB": 512, "cap": 2,
                  "launch": {"networks": "none"}}]  # fmt: skip
        node_env = {ENROL_URL: enrol.url, "SCO_AGENT_NATS_URL": relay.url, "SCO_AGENT_KUBE_URL": api.url,
                    "SCO_AGENT_NATS_CA_FILE": str(ca_for(relay.url))}  # fmt: skip
        pdd = tmp_path / "runner"
        (pdd / "project").mkdir(parents=True)
        (pdd / "project" / "play.yml").write_text(PLAY)
        r = ansible_runner.run(
            private_data_dir=str(pdd), playbook="play.yml", envvars=ENV, quiet=True,
            extravars={
                "hall": HALL, "bundle": str(bundle), "trust_dir": str(trust), "dsn": fleet_dsn, "pools": pools,
                "cloud": cfg, "signing_key": str(tmp_path / "launch.key"), "node_env": node_env,
                "launch_delegation": str(tmp_path / "launch.delegation"), "enrol_ca_file": str(enrol.ca),
                "kube_url": api.url, "kube_token_file": str(control_kube_token),
                "ansible_python_interpreter": sys.executable,
            },
        )  # fmt: skip
        ok = {e["event_data"]["task"]: e["event_data"]["res"] for e in r.events if e.get("event") == "runner_on_ok"}
        assert r.rc == 0, r.stdout.read()
        assert ok["Demand"]["units"] == {"web": 0.5}, ok["Demand"]
        assert ok["Plan"]["plan"]["pools"][0]["launch"] == 1, yaml.safe_dump(ok["Plan"]["plan"]["pools"])
        assert ok["Acquire"]["launched"] == 1 and ok["Acquire"]["launch_failures"] == 0, ok["Acquire"]

        (inst,) = st.instances(HALL)
        node = inst.name
        assert inst.state == "active" and inst.server_id
        server = conn.compute.get_server(inst.server_id)
        assert server.status == "ACTIVE" and server.name == node

        # the instance's view of the metadata API (neutron-metadata-agent's proxy to nova-metadata)
        proxy = openstack_cloud.metadata_proxy(inst.server_id, project)
        base = proxy.url.rsplit("/", 1)[0]
        meta = json.loads(urllib.request.urlopen(proxy.url, timeout=10).read())
        assert meta["uuid"] == inst.server_id and meta["name"] == node
        user_data = urllib.request.urlopen(f"{base}/user_data", timeout=10).read().decode()
        disk = tmp_path / "instance"
        files = cloud_init(user_data, disk)
        env_file = files["/etc/sco/agent.env"]
        assert oct(env_file.stat().st_mode & 0o777) == "0o600"  # it holds a one-time token
        agent_env = dict(line.split("=", 1) for line in env_file.read_text().splitlines() if line)
        assert agent_env[ENROL_URL] == enrol.url and len(agent_env[ENROL_TOKEN]) >= 43
        assert agent_env["SCO_AGENT_HALL"] == HALL and agent_env["SCO_AGENT_NODE"] == node
        # the enrolment service's CA, as the user-data wrote it: the agent checks the service against it
        assert agent_env["SCO_AGENT_ENROL_CA_FILE"] == "/etc/sco/enrol-ca.crt"
        assert files["/etc/sco/enrol-ca.crt"].read_bytes() == enrol.ca.read_bytes()
        assert "/var/lib/sco/bundle/bundle.json" in files
        # the node trusts the hall's root only, never the control host's launch key
        assert [p for p in files if p.startswith("/etc/sco/trusted/")] == [f"/etc/sco/trusted/{key.keyid}.pub"]
        # only the token's hash is in the fleet state, bound to this instance
        (digest,) = st.conn.execute("SELECT token_sha256 FROM enrolment WHERE instance_id = %s", (inst.id,)).fetchone()
        assert agent_env[ENROL_TOKEN] not in digest

        # kubelet registers the node; the agent starts on the agent.env cloud-init wrote (paths under the
        # instance's directory, the metadata service through the proxy, no fixed ports)
        api.cluster.add_node(node)
        state = disk / "var/lib/sco"
        run_env = {k: v for k, v in os.environ.items() if not k.startswith("SCO_AGENT_")}
        run_env.update(agent_env)
        metrics_at = f"127.0.0.1:{free_port()}"
        run_env.update(
            SCO_AGENT_STATE_DIR=str(state), SCO_AGENT_TRUST_DIR=str(disk / "etc/sco/trusted"),
            SCO_AGENT_METADATA_URL=proxy.url, SCO_AGENT_METRICS_LISTEN=metrics_at,
            SCO_AGENT_CHECKPOINT_SOCKET="", SCO_AGENT_HEARTBEAT_SECONDS="1",
            SCO_AGENT_ENROL_CA_FILE=str(files["/etc/sco/enrol-ca.crt"]),
        )  # fmt: skip
        agent_log = tmp_path / "agent.log"
        out_file = open(agent_log, "ab")  # noqa: SIM115
        agent = subprocess.Popen(
            [str(BIN / "sco-agent"), "run"], env=run_env, stdout=out_file, stderr=subprocess.STDOUT
        )

        def log() -> str:
            return agent_log.read_text(errors="replace")

        def metrics() -> str:
            return str(urllib.request.urlopen(f"http://{metrics_at}/metrics", timeout=5).read().decode())

        def events(type_: str) -> list[dict[str, Any]]:
            return [e for e in spool_events(state) if e["type"] == type_]

        wait_for(lambda: events("enrol.done") or agent.poll() is not None, 60, "the agent's enrolment")
        assert agent.poll() is None, log()
        creds = state / "nats.creds"
        assert oct(creds.stat().st_mode & 0o777) == "0o600"
        kube_token = (state / "kube-token").read_text().strip()
        assert api.issued[kube_token]["node"] == node and api.issued[kube_token]["sa"] == ("sco-system", "sco-agent")
        wait_for(lambda: "subscribed to" in log(), 30, "the agent's NATS subscription")
        # its first bundle: the launch key's subset, taken under the root's delegation (its budgets drain it below)
        taken = json.loads((state / "bundle" / "state.json").read_text())
        assert taken["serial"] == 1 and taken["last_error"] is None and "is refused" not in log(), (taken, log())
        (conn_info,) = wait_for(lambda: agent_connections(relay, node), 10, "the agent's connection on the relay")
        (account,) = st.conn.execute("SELECT account FROM enrolment WHERE instance_id = %s", (inst.id,)).fetchone()
        assert conn_info["account"] == account  # its own account, minted at enrolment

        # heartbeats, read from the stream as the control loop does (reader: the hall's control user)
        reader = heartbeats.RelayReader(
            relay.url, {"user_credentials": str(relay.users["control"]), "tls_ca_file": str(ca_for(relay.url))}
        )
        beats = wait_for(lambda: asyncio.run(heartbeats.read(reader, HALL)), 30, "the agent's heartbeat", 0.2)
        assert set(beats) == {node} and beats[node][1]["drain"] == "idle"
        first_beat = beats[node][0].timestamp()  # the relay's time of the last beat at the first read (1 s apart)
        with connect(fleet_dsn) as c:
            assert heartbeats.collect(reader, c, HALL) == 1

        # 3. work lands: the stand-in has no Binding API, so the scheduler's bind is the pod made again bound
        api.cluster.delete_pod("web", "web-0", 0)
        add_pod(api, "web", "web-0", node, prestop=1)
        assert api.cluster.get_pod("web", "web-0")["status"]["phase"] == "Running"

        # 4. the reclaim: notice over NATS as the reclaimer (its own creds), drain, delete at T
        settings = ReclaimSettings(
            hall=HALL, nodes=(node,), window_s=WINDOW_S, nats_url=relay.url, signing_keys=[notice_key],
            dsn=fleet_dsn,
            nats_auth={"user_credentials": str(relay.users["reclaimer"]), "tls_ca_file": str(ca_for(relay.url))},
        )  # fmt: skip
        out = asyncio.run(reclaim(settings, conn))
        (noticed,) = [o for o in out if o.get("notice")]
        assert noticed["name"] == node and noticed["published"] is True and noticed["state"] == "deleted", out
        assert noticed["agent"] == "drained", out
        t_deadline = noticed["terminate_at"]

        (accepted,) = events("notice.accepted")
        assert accepted["source"] == "nats" and accepted["notice"] == noticed["notice"], accepted
        drained = events("drain.drained")
        assert drained and drained[0]["at"] < t_deadline, (drained, t_deadline)
        with pytest.raises(ApiError, match="not found"):
            api.cluster.get_pod("web", "web-0")  # evicted
        # the metadata poll saw the same notice (the reclaimer writes it too) and dropped it as a duplicate
        notices = dict(re.findall(r'^sco_agent_notices_total\{(channel="\w+",verdict="\w+")\} (\S+)$', metrics(), re.M))
        assert float(notices['channel="nats",verdict="accepted"']) == 1, notices
        assert float(notices.get('channel="metadata",verdict="duplicate"', 0)) >= 1, notices
        assert conn.compute.find_server(inst.server_id, ignore_missing=True) is None
        by_kind = {e["kind"]: e for e in st.events(instance_id=inst.id)}
        assert by_kind["agent.drain.drained"]["at"] <= t_deadline
        assert t_deadline <= by_kind["instance.delete_requested"]["at"] < t_deadline + 5
        assert by_kind["instance.delete_requested"]["detail"]["agent_state"] == "drained"
        assert st.instance(inst.id).state == "deleted"

        # 5. the sweep revokes the node's identity: its connection dropped, its creds refused
        wait_for(lambda: not agent_connections(relay, node), 15, "the agent's connection dropped")
        dropped = time.time()
        (revoked_at,) = st.conn.execute(
            "SELECT extract(epoch FROM revoked_at) FROM enrolment WHERE instance_id = %s", (inst.id,)
        ).fetchone()
        assert revoked_at is not None
        assert "authorization violation" in asyncio.run(relay_refusal(relay.url, user_credentials=str(creds))).lower()
        assert enrol.metrics()["sco_enrol_revoked_total"] == 1 and enrol.metrics()["sco_enrol_issued_total"] == 1
        # and its Node is gone with it (no cloud controller manager here), so its bound Kubernetes token is refused
        wait_for(lambda: node not in api.cluster.nodes, 10, "the deleted instance's Node removed")
        assert enrol.metrics()["sco_enrol_nodes_deleted_total"] == 1
        assert not api.issued_valid(api.issued[kube_token])
        wait_for(lambda: "NATS disconnected" in log(), 10, "the agent's disconnection said")

        ev = {e["kind"]: e["at"] for e in reversed(st.events(instance_id=inst.id))}  # the first of each kind
        (planned,) = st.conn.execute("SELECT extract(epoch FROM min(created_at)) FROM plan_record").fetchone()
        steps = [
            ("plan", float(planned)),
            ("launched (Nova ACTIVE)", ev["instance.active"]),
            ("enrolled", ev["instance.enrolled"]),
            ("first heartbeat", first_beat),
            ("notice (published)", ev["notice.published"]),
            ("drained", float(drained[0]["at"])),
            ("deleted (Nova: gone)", ev["instance.deleted"]),
            ("identity revoked", float(revoked_at)),
        ]
        assert [t for _, t in steps] == sorted(t for _, t in steps), steps
        lines = [f"{'step':<24}{'at +s':>8}{'since previous':>16}"]
        for i, (what, t) in enumerate(steps):
            lines.append(f"{what:<24}{t - steps[0][1]:>8.2f}{t - steps[i - 1][1] if i else 0:>16.2f}")
        lines.append(
            f"T = notice + {WINDOW_S:g} s; drained {t_deadline - steps[5][1]:.2f} s before T; delete sent"
            f" {by_kind['instance.delete_requested']['at'] - t_deadline:.2f} s after T; connection seen dropped"
            f" {dropped - float(revoked_at):.2f} s after the revocation"
        )
        print("\nhall chain timeline\n" + "\n".join(lines))
    finally:
        st.close()
        if agent is not None and agent.poll() is None:
            agent.terminate()
            agent.wait(10)
        if out_file is not None:
            out_file.close()
        if proxy is not None:
            proxy.close()
        for s in conn.compute.servers():
            conn.compute.delete_server(s.id, ignore_missing=True)
        conn.close()
