"""The main job of a hall, end to end, through the collection (issue 28, molecule scenario hall-lifecycle).

Converge deployed the hall with sco.orchestrator.site on lc-ctl (relay in operator mode, fleet state, distributor,
control loop, enrolment service, contracts publisher, monitoring) and baked the node agent into lc-image with
sco.orchestrator.bake_image. Without systemd as PID 1 nothing runs: this test starts each service with its unit's
own command line (User, EnvironmentFile, Environment, LoadCredential as systemd would give them), and runs the
control loop's unit (ExecStart: sco-control-loop, ansible-runner with control_loop.yml) several times, as its timer
would. The cloud is the devkit's OpenStack (Keystone, Nova with the fake driver, Placement, Glance, Blazar) on the
machine's loopback, forwarded into lc-ctl (sco_devkit.netns_forward; Keystone also at 127.0.0.1:5000, which the
inventory's sco_cloud names). Then:

1. a pending pod of contract ci-runners on the Kubernetes API stand-in (lc-ctl:6443); the loop plans and launches a
   server in Nova;
2. the server boots: a test host copied from lc-image's tree (hosts.py add: the baked image), on the hall's network,
   with Nova's SMBIOS product name and the metadata proxy at 169.254.169.254:80 in its namespace (what Neutron's
   metadata agent serves); Debian's real cloud-init runs its four stages (datasource OpenStack) and writes what the
   user-data says; kubelet's registration is the stand-in's Node; the agent starts from the image's unit;
3. the agent enrols (its one-time token for its own relay identity), connects, heartbeats; the loop's next run
   collects the beats and `sco hall status` lists the node; a pod of the contract is bound to it;
4. Nova made to fail (its policy refuses listing servers): the loop's runs fail, Prometheus fires
   ScoControlLoopFailed; Nova back: it clears;
5. a Blazar host lease on the compute host starting within the window: the loop's run notices the node over NATS,
   the agent drains (the pod evicted), the server is deleted at T, and the enrolment service revokes the node's
   identity (its creds refused by the relay);
6. Prometheus scraped node_exporter (the loop's textfiles), the distributor and the agent throughout.

The timeline plan -> launched -> enrolled -> first heartbeat -> notice -> drained -> deleted is printed and written
to /var/tmp/sco-molecule/hall-lifecycle/lifecycle/timeline.txt."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "shared"))
import hosts  # molecule/shared/hosts.py
import verify  # molecule/shared/verify.py

from sco_devkit.netns_forward import in_netns

SC = verify.Scenario("hall-lifecycle")
HALL = "hall-lifecycle"
CTL, IMAGE = "lc-ctl", "lc-image"
CTL_NS = f"scom-{HALL}-{CTL}"
CTL_ADDR = "10.231.114.11"
# the first instance's address: the inventory's extra scrape target for the launched agents
INSTANCE_ADDR = "10.231.114.21"
LOGS = SC.work / "lifecycle"
HALL_CA = SC.work / "tls" / "ca.crt"  # the relay serves TLS only (sco_relay_tls), its certificate from the hall's CA
WINDOW = 40  # control_loop_reclaim_window (00-hall-lifecycle.yml)
TOLERATE = [{"key": "sco.dev/reclaim", "operator": "Equal", "value": "reclaimable", "effect": "NoSchedule"}]
PROM = f"http://{CTL_ADDR}:9090"
# Nova refusing to list servers (the loop's before-leases reclaim lists them every run): "Nova made to fail"
NOVA_REFUSES = "\n".join(
    f'"{r}": "!"'
    for r in ("os_compute_api:servers:index", "os_compute_api:servers:detail",
              "os_compute_api:servers:index:get_all_tenants", "os_compute_api:servers:detail:get_all_tenants")
) + "\n"  # fmt: skip


def _wait(pred: Any, timeout: float, what: str, every: float = 0.5) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(every)
    raise AssertionError(f"lifecycle: timed out after {timeout:g} s waiting for {what}")


def _get(url: str, ns: str = CTL_NS, timeout: float = 10) -> Any:
    """GET from inside a namespace (the socket made there), JSON decoded."""
    with in_netns(ns), urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


# --- units run as systemd would run them ------------------------------------------------------------------------


class Host:
    """A host reached over SSH (the static ones through testinfra's inventory, an instance through hosts.py)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.th = hosts.test_host(HALL, name)

    def run(self, cmd: str, timeout: float = 120, check: bool = True) -> str:
        out = self.th.ssh("bash", "-c", shlex.quote(cmd), check=False, timeout=timeout)
        if check:
            assert out.returncode == 0, f"{self.name}: {cmd[:300]}\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
        return out.stdout

    def start(self, unit: str, log: str, user: str | None = None) -> None:
        """``unit`` started as systemd starts it: each ExecStartPre in order (one failing stops the start unless its
        line begins with "-"), then ExecStart in the background."""
        LOGS.mkdir(parents=True, exist_ok=True)
        for i, raw in enumerate(verify.unit_settings(self.run, unit).get("ExecStartPre", [])):
            line = verify.service_command(self.run, unit, "ExecStartPre", user=user, index=i)
            out = self.th.ssh("bash", "-c", shlex.quote(line), check=False, timeout=120)
            with open(LOGS / f"{log}-pre.log", "a") as f:
                f.write(f"=== ExecStartPre {raw}\nexit {out.returncode}\n{out.stdout}{out.stderr}\n")
            prefix = raw[: len(raw) - len(raw.lstrip("+-@:!"))]
            said = f"{self.name}: {unit}: ExecStartPre={raw}\n{out.stderr[-2000:]}"
            assert out.returncode == 0 or "-" in prefix, said
        line = verify.service_command(self.run, unit, user=user)
        self.run(f"setsid bash -c {shlex.quote(line)} > /var/log/{log}.log 2>&1 < /dev/null &")

    def log(self, name: str) -> str:
        return self.run(f"cat /var/log/{name}.log 2>/dev/null; true")


# --- fixtures ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cloud() -> Iterator[Any]:
    """The devkit OpenStack with Blazar on the machine's loopback, forwarded into lc-ctl."""
    from sco_devkit.devcluster.openstack import OpenStackCloud

    shutil.rmtree(SC.work / "cloud", ignore_errors=True)  # a fresh cloud (an earlier verify's socket files, data)
    c = OpenStackCloud(SC.work / "cloud", blazar=True)
    t0 = time.monotonic()
    c.start()
    c.start_blazar()
    print(f"lifecycle: the devkit OpenStack with Blazar started in {time.monotonic() - t0:.0f} s")
    LOGS.mkdir(parents=True, exist_ok=True)
    with open(LOGS / "netns-forward.log", "ab") as log:
        fwd = subprocess.Popen(
            [sys.executable, "-m", "sco_devkit.netns_forward", "--netns", CTL_NS,
             *(a for p in c.ports.values() for a in ("--port", str(p))), "--map", f"5000:{c.ports['keystone']}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        _wait(lambda: "ready" in (LOGS / "netns-forward.log").read_text() or fwd.poll() is not None, 30, "forwards")
        assert fwd.poll() is None, (LOGS / "netns-forward.log").read_text()[-2000:]
        yield c
    finally:
        fwd.kill()
        fwd.wait(10)
        c.stop()
        # blazar-manager outlived stop() (its workers): whatever still runs from this cloud's directory goes
        for pid in subprocess.run(["pgrep", "-f", str(c.root)], capture_output=True, text=True).stdout.split():
            with contextlib.suppress(OSError):
                os.kill(int(pid), 9)


@pytest.fixture(scope="module")
def kube() -> Iterator[Any]:
    """The Kubernetes API stand-in where sco_kube_url points (lc-ctl's address, port 6443), listening in lc-ctl's
    namespace, served by this process, with authentication: the tokens prepare wrote on lc-ctl, and the node-bound
    ones it issues the agents at enrolment."""
    from sco_devkit.standins.kube_apiserver import Identity, KubeApiStandIn

    # the tokens prepare.yml wrote on lc-ctl (the agents' come from TokenRequest at enrolment)
    tokens = {f"token-of-{n}": Identity(f"system:serviceaccount:sco-system:{n}") for n in
              ("enrol", "contract-publisher", "control-kube")}  # fmt: skip
    with in_netns(CTL_NS):
        srv = KubeApiStandIn((CTL_ADDR, 6443), tokens=tokens)
    srv.add_serviceaccount("sco-system", "sco-agent")
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def _stop_earlier_run() -> None:
    """What an earlier verify of this converge left: its services in lc-ctl's namespace (the hall's PostgreSQL and
    sshd stay) and its instances' hosts."""
    out = subprocess.run(["ip", "netns", "pids", CTL_NS], capture_output=True, text=True, check=False).stdout
    for pid in out.split():
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if any(k in cmd for k in ("nats-server", "/opt/sco/bin/", "/usr/bin/prometheus")):
                os.kill(int(pid), 9)
    d = hosts.scenario_dir(HALL)
    names = json.loads((d / "hosts.json").read_text())
    for name in [n for n in names if n not in (CTL, IMAGE)]:
        hosts.test_host(HALL, name).destroy()
    (d / "hosts.json").write_text(json.dumps([CTL, IMAGE]))
    members = d / "network.json"
    if members.exists():
        members.write_text(json.dumps({n: a for n, a in json.loads(members.read_text()).items() if n in (CTL, IMAGE)}))


@pytest.fixture(scope="module")
def hall() -> Host:
    """lc-ctl's services started with their units' command lines, in the order systemd would."""
    h = Host(CTL)
    _stop_earlier_run()
    h.run(verify.GIVE_PTYS)  # the control loop's ansible-runner needs them
    h.start("sco-nats.service", "sco-nats")
    _wait(lambda: "Server is ready" in h.log("sco-nats"), 30, "the relay")
    post = verify.service_command(h.run, "sco-nats.service", "ExecStartPost")
    h.run(f"bash -c {shlex.quote(post)}", timeout=90)
    h.start("sco-distributor.service", "sco-distributor")
    h.start("sco-enrol.service", "sco-enrol")
    h.start("prometheus-node-exporter.service", "node-exporter", user="prometheus")
    h.start("prometheus.service", "prometheus", user="prometheus")
    h.start("sco-contracts-configmap.service", "sco-contracts-configmap")
    _wait(lambda: "enrolling hall" in h.log("sco-enrol"), 60, "the enrolment service")
    # they run until molecule's destroy ends every process of the hosts' namespaces
    return h


def _loop(h: Host, what: str, timeout: float = 600) -> tuple[int, str]:
    """One run of the control loop's unit (ExecStart as its user, its environment), as the timer starts it."""
    line = verify.service_command(h.run, "sco-control-loop.service")
    t0 = time.time()
    out = h.th.ssh("bash", "-c", shlex.quote(line), check=False, timeout=timeout)
    print(f"lifecycle: loop run ({what}) exit {out.returncode} in {time.time() - t0:.1f} s")
    with open(LOGS / "control-loop.log", "a") as f:
        f.write(f"=== {what} exit {out.returncode}\n{out.stdout}{out.stderr}\n")
    return out.returncode, out.stdout + out.stderr


def _fleet(sql: str, *args: Any) -> list[tuple[Any, ...]]:
    from sco.state.db import connect

    with in_netns(CTL_NS):
        conn = connect("host=127.0.0.1 port=5433 dbname=sco_fleet user=postgres")
    with conn:
        return list(conn.execute(sql, args).fetchall())


def _beats() -> dict[str, Any]:
    """The heartbeats on the relay as the control loop reads them (the hall's reader, control.creds)."""
    import asyncio

    from sco.provider import heartbeats

    reader = heartbeats.RelayReader(
        f"nats://{CTL_ADDR}:4222",
        {"user_credentials": str(SC.work / "credentials" / "nats" / "control.creds"), "tls_ca_file": str(HALL_CA)},
    )
    with in_netns(CTL_NS):
        try:
            return asyncio.run(heartbeats.read(reader, HALL))
        except heartbeats.HeartbeatsUnreadable:
            return {}


def _alerts() -> list[dict[str, Any]]:
    return [
        a for a in _get(f"{PROM}/api/v1/alerts")["data"]["alerts"] if a["labels"]["alertname"] == "ScoControlLoopFailed"
    ]


def _boot(
    cloud: Any,
    server: Any,
    project_id: str,
    address: str | None = INSTANCE_ADDR,
    overlay: bool = False,
    stamps: dict[str, float] | None = None,
) -> tuple[Host, Any]:
    """The server boots: a copy of the baked image on the hall's network, SMBIOS saying OpenStack Nova, the metadata
    service at 169.254.169.254:80 in its namespace, then Debian's cloud-init, stage by stage. ``address``: on the
    hall's network (None: the next free one); ``overlay``: copy-on-write over the image (boots.py's many
    instances); ``stamps`` gets the times the host was made ("host") and cloud-init done ("cloud-init")."""
    add = [sys.executable, str(Path(hosts.__file__)), "add", HALL, server.name, "--image", IMAGE]
    add += ["--address", address] if address else []
    made = subprocess.run([*add, *(["--overlay"] if overlay else [])], capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]
    info = json.loads(made.stdout)
    root = Path(info["root"])
    dmi = root / "sys" / "class" / "dmi" / "id"
    dmi.mkdir(parents=True, exist_ok=True)
    (dmi / "product_name").write_text("OpenStack Nova\n")  # what Nova's libvirt driver gives a guest
    (dmi / "chassis_asset_tag").write_text("\n")
    subprocess.run(["ip", "-n", info["namespace"], "addr", "add", "169.254.169.254/32", "dev", "lo"], check=True)
    proxy = cloud.metadata_proxy(server.id, project_id, netns=info["namespace"], address=("169.254.169.254", 80))
    (root / "etc" / "cloud" / "cloud.cfg.d" / "90-sco-test.cfg").write_text(
        "datasource_list: [OpenStack]\n"
        "datasource:\n  OpenStack:\n    metadata_urls: ['http://169.254.169.254']\n    max_wait: 60\n    timeout: 10\n"
        # the test host's eth0 is configured already (no DHCP server on the hall's network)
        "network: {config: disabled}\n"
        # the test rootfs generates no en_US.UTF-8 (cc_locale's default): a module failing makes its stage exit 1
        "locale: C.UTF-8\n"
    )
    h = Host(server.name)
    if stamps is not None:
        stamps["host"] = time.time()
    for stage in ("init --local", "init", "modules --mode=config", "modules --mode=final"):
        h.run(f"cloud-init {stage} >> /var/log/cloud-init-stages.log 2>&1", timeout=180)
    if stamps is not None:
        stamps["cloud-init"] = time.time()
    return h, proxy


# --- the scenario -----------------------------------------------------------------------------------------------


def test_a_launched_instance_lives_its_whole_life_in_the_deployed_hall(cloud: Any, kube: Any, hall: Host) -> None:
    from tests.harness import add_pod

    from sco_devkit.standins.kube_apiserver import ApiError

    t_start = time.time()
    conn = cloud.connect()
    admin_project = conn.identity.find_project("admin").id
    stamps: dict[str, float] = {}
    instance: Host | None = None
    proxy = None
    try:
        # 1. pending work: a CI runner tolerating reclaimable capacity
        kube.cluster.create_pod("ci", {
            "metadata": {"name": "runner-0", "labels": {"role": "runner"}},
            "spec": {"tolerations": TOLERATE, "containers": [
                {"name": "c", "image": "ci-runner", "resources": {"requests": {"cpu": "500m", "memory": "256Mi"}}}]},
        })  # fmt: skip
        rc, out = _loop(hall, "plan and launch")
        assert rc == 0, out[-4000:]
        server = _wait(lambda: [s for s in conn.compute.servers(all_projects=True) if s.status == "ACTIVE"], 120,
                       "the launched server ACTIVE")[0]  # fmt: skip
        (inst,) = _fleet("SELECT id, name, server_id FROM instance WHERE server_id = %s", server.id)
        node = inst[1]
        assert server.name == node

        # 2. it boots the baked image through cloud-init against the metadata API
        t_boot = time.time()
        instance, proxy = _boot(cloud, server, server.project_id or admin_project)
        print(f"lifecycle: {node} booted (host made, cloud-init's four stages) in {time.time() - t_boot:.1f} s")
        env = instance.run("cat /etc/sco/agent.env")
        assert f"SCO_AGENT_NODE={node}" in env and "SCO_AGENT_ENROL_TOKEN=" in env, env
        assert instance.run("stat -c %a /etc/sco/agent.env").strip() == "600"
        assert instance.run("hostname -s 2>/dev/null; cat /etc/hostname").split()[-1] == node
        kube.cluster.add_node(node)  # kubelet registers the node
        instance.start("sco-agent.service", "sco-agent")

        # 3. enrols, connects under its own identity, heartbeats
        def events(kind: str) -> list[dict[str, Any]]:
            got = instance.run(
                "/opt/sco/bin/python -c 'import json,sys; from sco.agent.spool import read_events; "
                "[print(json.dumps(e)) for e in read_events(sys.argv[1])]' /var/lib/sco/spool", check=False
            )  # fmt: skip
            return [e for e in map(json.loads, got.splitlines()) if e.get("type") == kind]

        _wait(lambda: events("enrol.done"), 90, "the agent's enrolment", 1)
        assert instance.run("stat -c %a /var/lib/sco/nats.creds").strip() == "600"
        _wait(lambda: "subscribed to" in instance.log("sco-agent"), 60, "the agent's NATS subscription", 1)
        beats = _wait(lambda: _beats().get(node), 60, "the agent's heartbeat on the relay", 0.5)
        first_beat = beats[0].timestamp()  # the relay's time of the last beat at the first read
        rc, out = _loop(hall, "heartbeats collected")
        assert rc == 0, out[-4000:]
        status = hall.run(
            "export SCO_DB_DSN=\"$(sed -n 's/^SCO_DB_DSN=//p' /etc/sco/control-loop.env)\"; "
            "/opt/sco/bin/sco hall status --json "
            f"--hall {HALL} --nats nats://{CTL_ADDR}:4222 --creds /etc/sco/control-loop-nats.creds "
            "--nats-ca-file /etc/sco/relay-ca.crt "
            "2>/dev/null || true"
        )  # fmt: skip
        print(f"lifecycle: sco hall status: {status[:1500]}")
        # the status counts (names only the instances in trouble): the pool's one live instance, its agent heard
        st = json.loads(status)
        assert st["heartbeats"]["nodes"] == 1 and st["stale_agents"] == [], status
        assert [p["instances"] for p in st["pools"] if p["name"] == "lc-spot"] == [{"active": 1}], status
        # work lands (the stand-in has no Binding API: the scheduler's bind is the pod made again, bound)
        kube.cluster.delete_pod("ci", "runner-0", 0)
        add_pod(kube, "ci", "runner-0", node, prestop=1, labels={"role": "runner"})

        # 4. Nova made to fail: the loop fails, ScoControlLoopFailed fires; Nova back: it clears
        before = cloud.load_policy("nova", NOVA_REFUSES)
        try:
            rc, out = _loop(hall, "Nova refusing")
            assert rc != 0, out[-3000:]
            fired = _wait(_alerts, 60, "ScoControlLoopFailed firing", 2)
            print(f"lifecycle: ScoControlLoopFailed {[(a['state'], a['labels'].get('step')) for a in fired]}")
        finally:
            cloud.load_policy("nova", before)
        rc, out = _loop(hall, "Nova back")
        assert rc == 0, out[-3000:]
        _wait(lambda: not _alerts(), 60, "ScoControlLoopFailed cleared", 2)

        # 5. a Blazar host lease on the compute host, starting within the window at the loop's next runs
        ep = {"service_type": "reservation"}
        start = math.ceil((time.time() + WINDOW + 5) / 60) * 60  # Blazar's dates have minute resolution
        fmt = "%Y-%m-%d %H:%M"
        body = {"name": "lc-take-host", "start_date": datetime.fromtimestamp(start, UTC).strftime(fmt),
                "end_date": datetime.fromtimestamp(start + 3600, UTC).strftime(fmt),
                "reservations": [{"resource_type": "physical:host", "min": 1, "max": 1,
                                  "hypervisor_properties": "", "resource_properties": ""}], "events": []}  # fmt: skip
        resp = conn.session.post("/leases", json=body, endpoint_filter=ep, raise_exc=False)
        assert resp.status_code in (200, 201, 202), resp.text
        print(f"lifecycle: host lease starts at +{start - time.time():.0f} s")
        while time.time() < start + 30:
            rc, out = _loop(hall, "before the lease")
            if _fleet("SELECT 1 FROM lifecycle_event WHERE instance_id = %s AND kind = 'notice.published'", inst[0]):
                break
            time.sleep(5)
        assert rc == 0, out[-3000:]
        (accepted,) = _wait(lambda: events("notice.accepted"), 30, "the agent's notice", 0.5)
        assert accepted["source"] == "nats", accepted
        drained = _wait(lambda: events("drain.drained"), WINDOW, "the agent's drain", 0.5)
        with pytest.raises(ApiError, match="not found"):
            kube.cluster.get_pod("ci", "runner-0")  # evicted

        # the timer's next runs: the reclaim deletes the server at T and records it (then the enrolment service's
        # sweep revokes the node's identities)
        def gone() -> bool:
            if conn.compute.find_server(server.id, ignore_missing=True, all_projects=True) is not None:
                return False
            return bool(_fleet("SELECT 1 FROM instance WHERE id = %s AND state = 'deleted'", inst[0]))

        deadline = start + 120
        while not gone():
            assert time.time() < deadline, f"the server still there or not recorded deleted at T+{120 - WINDOW}"
            rc, out = _loop(hall, "at T")
            assert rc == 0, out[-3000:]
            time.sleep(5)
        t_gone = time.time()

        def node_deleted() -> bool:
            try:
                kube.cluster.get_node(node)
            except ApiError:
                return True
            return False

        # the enrolment service's sweep deletes the Node of an instance Nova no longer has (its uid the precondition)
        _wait(node_deleted, 60, "the Node deleted from Kubernetes", 1)
        print(f"lifecycle: Node {node} deleted {time.time() - t_gone:.1f} s after the server was gone")
        # its identity revoked: the creds it enrolled with refused by the relay
        probe = (
            "import asyncio, nats, ssl\n"
            "async def main():\n"
            "    try:\n"
            f"        nc = await nats.connect('nats://{CTL_ADDR}:4222', user_credentials='/var/lib/sco/nats.creds',"
            " connect_timeout=3, max_reconnect_attempts=0, allow_reconnect=False,"
            " tls=ssl.create_default_context(cafile='/etc/sco/relay-ca.crt'))\n"
            "        print('connected'); await nc.close()\n"
            "    except Exception as e:\n"
            "        print('refused', e)\n"
            "asyncio.run(main())\n"
        )
        refused = _wait(lambda: (o := instance.run(f"/opt/sco/bin/python -c {shlex.quote(probe)}", check=False))
                        .startswith("refused") and o, 60, "the node's creds refused", 2)  # fmt: skip
        assert "authorization" in refused.lower(), refused

        # 6. Prometheus scraped every part throughout
        q = urllib.parse.quote(f"count_over_time(up[{int(time.time() - t_start) + 60}s])")
        scraped = {
            r["metric"]["job"]: float(r["value"][1]) for r in _get(f"{PROM}/api/v1/query?query={q}")["data"]["result"]
        }
        print(f"lifecycle: Prometheus samples of up by job: {scraped}")
        # job sco-agent: role monitoring's file_sd of the enrolled agents (the enrolment service writes it), the only
        # way this hall knows the instance's address
        q = urllib.parse.quote(f'max(max_over_time(up{{job="sco-agent",instance="{INSTANCE_ADDR}:9469"}}[30m]))')
        agent_up = _get(f"{PROM}/api/v1/query?query={q}")["data"]["result"]
        assert agent_up and float(agent_up[0]["value"][1]) == 1, agent_up

        # the timeline, from the fleet state's events and the agent's
        ev = dict(_fleet("SELECT kind, extract(epoch FROM min(at)) FROM lifecycle_event WHERE instance_id = %s "
                         "GROUP BY kind", inst[0]))  # fmt: skip
        (planned,) = _fleet("SELECT extract(epoch FROM min(created_at)) FROM plan_record")[0]
        steps = [
            ("plan", float(planned)),
            ("launched (Nova ACTIVE)", float(ev["instance.active"])),
            ("enrolled", float(ev["instance.enrolled"])),
            ("first heartbeat", first_beat),
            ("notice (published)", float(ev["notice.published"])),
            ("drained", float(drained[0]["at"])),
            ("deleted (Nova: gone)", float(ev.get("instance.deleted", float("nan")))),
        ]
        lines = [f"{'step':<24}{'at +s':>8}{'since previous':>16}"]
        for i, (what, t) in enumerate(steps):
            lines.append(f"{what:<24}{t - steps[0][1]:>8.1f}{t - steps[i - 1][1] if i else 0:>16.1f}")
        stamps.update(dict(steps))
        text = "hall-lifecycle timeline\n" + "\n".join(lines)
        (LOGS / "timeline.txt").write_text(text + "\n")
        print("\n" + text)
    finally:
        if instance is not None:
            with contextlib.suppress(Exception):
                (LOGS / "agent.log").write_text(instance.log("sco-agent"))
                (LOGS / "cloud-init.log").write_text(
                    instance.run("cat /var/log/cloud-init.log /var/log/cloud-init-stages.log", check=False)
                )
        with contextlib.suppress(Exception):
            (LOGS / "enrol.log").write_text(hall.log("sco-enrol"))
        if proxy is not None:
            proxy.close()
        conn.close()
