"""The fault drill of hall HA (molecule scenario hall-ha): both nodes are reclaimed while the hall loses, one after
the other, the leader of its event stream, its PostgreSQL primary and its active control host; the hall must not
lose a drain, an event, a delete or a record.

Without systemd as PID 1 the relays, the distributor and the agents are not running after converge (the fleet
state's Patroni members are: the role starts them as daemons on hosts without systemd): the drill starts each with
its unit's own command line, and the project's Kubernetes API stand-in on ha-ctl1's address (what sco_kube_url
names). The cloud is the devkit's real OpenStack (Keystone, Nova with its fake driver, Placement, Glance) on the
machine's loopback, reached from inside both control hosts at the same 127.0.0.1 addresses through port forwards
(sco_devkit.netns_forward); the nodes' instances are Nova servers named after them, recorded in the fleet state as
the acquirer records a launch. Then:

1. ha-ctl1 runs `sco reclaim` for both nodes (window WINDOW): notices signed with the hall's notice key, sent as
   the relay's reclaimer user, T recorded in the fleet state;
2. kill -9 of the nats-server leading the SCO_EVENTS stream (R3) while the agents drain and publish; then, once
   the stream has a new leader, kill -9 of the PostgreSQL primary's Patroni and postgres processes; then, once a
   member took over, ha-ctl1 dies (its network link cut, its run killed -9: no FIN reaches anyone);
3. ha-ctl2's next run of the reclaim step (`sco reclaim --finish`, the control loop's first task) finishes the
   reclaims: each instance deleted in Nova at its recorded T (or as soon after as ha-ctl2 ran, which it says);
4. every node drained before T; every event each agent spooled is in the stream exactly once and in the agent's
   order; the fleet state has each instance deleted with one schedule, one notice and a delete at or after T; the
   three failover times are printed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "shared"))
import verify  # molecule/shared/verify.py

SC = verify.Scenario("hall-ha")
HALL = "hall-ha"
INFRA = ["ha-infra1", "ha-infra2", "ha-infra3"]
NODES = ["ha-node1", "ha-node2"]
ADDRESS = {h: v["ansible_host"] for h, v in yaml.safe_load(SC.inventory.read_text())["all"]["hosts"].items()}
RELAYS = ",".join(f"nats://{ADDRESS[h]}:4222" for h in INFRA)
CREDS = SC.work / "credentials" / "nats"
# the relay in operator mode (notice_relay made the hall's operator keys): its users present creds files (user JWT and
# seed), the relay refusing their bare nkey seeds; in static mode the nkey seeds
OPERATOR = (CREDS / "operator").is_dir()


def _identity(user: str) -> list[str]:
    """``sco`` CLI flags for relay user ``user``'s files on the controller, as notice_relay made them."""
    return ["--creds", str(CREDS / f"{user}.creds")] if OPERATOR else ["--nkey-seed", str(CREDS / f"{user}.nk")]


# the hall's CA, which role fleet_state made in the hall's state directory on the controller (sco_state_dir)
CA = SC.work / "tls" / "ca.crt"
# seconds from the notice to T: long enough for the three faults to land before it (stream failover ~6 s,
# Patroni's ttl 10 s: 00-hall-ha.yml) on a loaded 2-core machine
WINDOW = 45.0
LOGS = SC.work / "drill"


def _ns(host: str) -> str:
    return f"scom-{HALL}-{host}"


def _spawn(host: str, name: str, *argv: str) -> subprocess.Popen[bytes]:
    """A controller-side process (the checkout's venv) inside ``host``'s network namespace, its output logged."""
    LOGS.mkdir(parents=True, exist_ok=True)
    with open(LOGS / f"{name}.log", "ab") as log:
        return subprocess.Popen(
            ["ip", "netns", "exec", _ns(host), *argv], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def _pids(host: str, comm: str) -> list[int]:
    """Processes named ``comm`` in the host's namespace (test hosts share the machine's process table: never kill
    by name machine-wide)."""
    out = subprocess.run(["ip", "netns", "pids", _ns(host)], capture_output=True, text=True, check=False).stdout
    found = []
    for pid in out.split():
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == comm:
                found.append(int(pid))
        except OSError:
            continue
    return found


def _kill(host: str, comm: str, sig: int = signal.SIGKILL) -> list[int]:
    pids = _pids(host, comm)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    return pids


# What the drill asks the relay cluster, as the relays' stream tool (relay-admin: JetStream's API only), from inside
# ha-ctl1: the stream's leader and replicas, or every message of a node's subject in stream order.
_JS = """
import asyncio, json, ssl, sys
import nats, nats.js.errors
servers, identity, what, ca = sys.argv[1].split(","), sys.argv[2], sys.argv[3], sys.argv[4]
# a creds file (operator mode) or an nkey seed file (static mode); the relays serve TLS only (the hall's CA)
auth = {"user_credentials": identity} if identity.endswith(".creds") else {"nkeys_seed": identity}
if ca:
    auth["tls"] = ssl.create_default_context(cafile=ca)

async def main():
    nc = await nats.connect(servers=servers, connect_timeout=2, max_reconnect_attempts=3, allow_reconnect=True, **auth)
    js = nc.jetstream(timeout=5)
    if what == "info":
        si = await js.stream_info("SCO_EVENTS")
        c = si.cluster
        replicas = [{"name": r.name, "current": r.current} for r in (c.replicas or [])] if c else []
        print(json.dumps({"leader": c.leader if c else None, "messages": si.state.messages, "replicas": replicas}))
    else:  # every message of the subject, by stream sequence (the tool's identity may only use JetStream's API)
        si = await js.stream_info("SCO_EVENTS")
        out = []
        for seq in range(si.state.first_seq, si.state.last_seq + 1):
            try:
                m = await js.get_msg("SCO_EVENTS", seq)
            except nats.js.errors.NotFoundError:
                continue
            if m.subject == what:
                out.append({"seq": seq, "id": (m.headers or {}).get("Nats-Msg-Id"), "event": json.loads(m.data)})
        print(json.dumps(out))
    await nc.close()

asyncio.run(main())
"""


def _js(what: str, timeout: float = 30) -> Any:
    ca = str(verify.relay_ca(SC) or "")
    admin = _identity("relay-admin")[1]
    out = SC.in_netns("ha-ctl1", sys.executable, "-c", _JS, RELAYS, admin, what, ca, timeout=timeout)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def _stream_info() -> dict[str, Any] | None:
    try:
        got = _js("info", timeout=15)
        return got if isinstance(got, dict) else None
    except (AssertionError, subprocess.TimeoutExpired, ValueError):
        return None


def _wait(pred: Any, timeout: float, what: str, every: float = 0.3) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(every)
    raise AssertionError(f"drill: timed out after {timeout:g} s waiting for {what}")


@pytest.fixture(scope="module")
def relays() -> Iterator[None]:
    """The three relays as their unit runs them (user sco-nats, the cluster's config), then the unit's
    ExecStartPost (the streams, R3) once every relay runs, as the role does after starting a cluster."""
    for h in INFRA:
        started = SC.host(h).run(
            "setsid runuser -u sco-nats -- /usr/local/bin/nats-server -c /etc/sco-nats/nats-server.conf "
            "> /var/log/sco-nats.log 2>&1 < /dev/null &"
        )
        assert started.rc == 0, started.stderr
    try:
        post = verify.exec_line(SC.host(INFRA[0]), "sco-nats.service", "ExecStartPost")
        made = SC.host(INFRA[0]).run(f"{post} --wait 60")
        assert made.rc == 0, made.stdout + made.stderr
        info = _wait(lambda: (i := _stream_info()) and i["leader"] and len(i["replicas"]) == 2 and i, 60,
                     "SCO_EVENTS with a leader and two replicas")  # fmt: skip
        print(f"drill: SCO_EVENTS led by {info['leader']}, replicas {[r['name'] for r in info['replicas']]}")
        yield
    finally:
        for h in INFRA:
            _kill(h, "nats-server", signal.SIGTERM)


@pytest.fixture(scope="module")
def kube() -> Iterator[None]:
    """The Kubernetes API stand-in where sco_kube_url points (ha-ctl1:6443), with both nodes and two pods each of
    the ci-runners contract (20 s budget), which take 3 and 6 s to stop."""
    p = _spawn("ha-ctl1", "kube-standin", sys.executable, "-m", "sco_devkit.standins.kube_apiserver",
               "--listen", f"{ADDRESS['ha-ctl1']}:6443", *(a for n in NODES for a in ("--node", n)))  # fmt: skip
    try:
        for node in NODES:
            for i in (1, 2):
                pod = {
                    "apiVersion": "v1", "kind": "Pod",
                    # each takes 3 or 6 s to exit after TERM: the drains publish while the stream's leader is gone
                    "metadata": {"name": f"runner-{node}-{i}", "namespace": "ci", "labels": {"role": "runner"},
                                 "annotations": {"standin.sco.dev/shutdown-seconds": str(3 * i)}},
                    "spec": {"nodeName": node, "containers": [{"name": "runner", "image": "ci-runner"}]},
                }  # fmt: skip
                _wait(lambda pod=pod: _post_pod(pod), 15, f"the stand-in to take pod {pod['metadata']['name']}")
        yield
    finally:
        p.terminate()
        p.wait(10)


_POST = """
import json, sys, urllib.request
req = urllib.request.Request(sys.argv[1], data=sys.argv[2].encode(), method="POST",
                             headers={"Content-Type": "application/json"})
print(urllib.request.urlopen(req, timeout=3).status)
"""


def _post_pod(pod: dict[str, Any]) -> bool:
    url = f"http://{ADDRESS['ha-ctl1']}:6443/api/v1/namespaces/ci/pods"
    out = SC.in_netns("ha-ctl1", sys.executable, "-c", _POST, url, json.dumps(pod), timeout=10)
    return out.returncode == 0 and out.stdout.strip() == "201"


@pytest.fixture(scope="module")
def agents(relays: None, kube: None) -> Iterator[None]:
    """The distributor on ha-ctl1 and each node's agent, as their units run them; ready once each agent has its
    bundle and has subscribed to its notices."""
    ctl = SC.host("ha-ctl1")
    serve = verify.exec_line(ctl, "sco-distributor.service", "ExecStart")
    ctl.run(f"setsid {serve} > /var/log/sco-distributor.log 2>&1 < /dev/null &")
    url = f"https://{ADDRESS['ha-ctl1']}:8470/v1/halls/{HALL}/bundle.json"
    # over TLS, checked against the distributor's CA as role node_agent gave it to the node
    ca = str(SC.root("ha-node1") / "etc/sco/distributor-ca.crt")
    fetch = (
        "import ssl, sys, urllib.request; "
        "urllib.request.urlopen(sys.argv[1], timeout=2, context=ssl.create_default_context(cafile=sys.argv[2]))"
    )
    _wait(lambda: SC.in_netns("ha-node1", sys.executable, "-c", fetch, url, ca).returncode == 0, 30,
          "the distributor on ha-ctl1 to serve the bundle")  # fmt: skip
    for node in NODES:
        h = SC.host(node)
        # a fresh spool (a new spool id): the drill's events are told from an earlier run's by it
        h.run("rm -rf /var/log/sco-agent.log /var/lib/sco/spool")
        run = _agent_exec_start(h)
        assert h.run(f"setsid {run} > /var/log/sco-agent.log 2>&1 < /dev/null &").rc == 0
    try:
        for node in NODES:
            h = SC.host(node)
            _wait(lambda h=h: "NATS connected; subscribed to" in h.run("cat /var/log/sco-agent.log").stdout, 60,
                  f"{node}'s agent to subscribe to its notices")  # fmt: skip
            # the bundle names the notice keys: a notice before it is refused
            _wait(lambda h=h: h.run(_BUNDLE_STATUS).rc == 0, 90, f"{node}'s agent to fetch the bundle")
        yield
    finally:
        for node in NODES:
            _kill(node, "sco-agent", signal.SIGTERM)
        _kill("ha-ctl1", "sco", signal.SIGTERM)


_BUNDLE_STATUS = "/opt/sco/bin/sco node bundle-status --cache-dir /var/lib/sco/bundle --trust-dir /etc/sco/trusted"


def _agent_exec_start(h: Any) -> str:
    """The agent's command line as systemd runs it: the role's drop-in resets the unit's ExecStart and sets its own."""
    dropin = h.file("/etc/systemd/system/sco-agent.service.d/10-ansible.conf").content_string.splitlines()
    return [ln.removeprefix("ExecStart=") for ln in dropin if ln.startswith("ExecStart=") and ln != "ExecStart="][-1]


def _spool(node: str) -> list[dict[str, Any]]:
    out = SC.host(node).run("/opt/sco/bin/sco-agent events --state-dir /var/lib/sco")
    assert out.rc == 0, out.stderr
    return [json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith("{")]


def _outcome(node: str, after: int) -> dict[str, Any] | None:
    return next((e for e in _spool(node)[after:] if str(e.get("type")).startswith("drain.")), None)


# --- the cloud, as the control hosts see it -------------------------------------------------------------------------

CTL = ["ha-ctl1", "ha-ctl2"]
POOL = "drill"  # not the hall's ha-spot (its flavor and image are a real hall's, not the devkit cloud's)


@pytest.fixture(scope="module")
def cloud() -> Iterator[Any]:
    """The devkit OpenStack on the machine's loopback ($SCO_TEST_OPENSTACK: a running one's describe()), its ports
    forwarded into both control hosts, and a clouds.yaml entry `drill` for their runs."""
    from sco_devkit.devcluster.openstack import OpenStackCloud

    if os.environ.get("SCO_TEST_OPENSTACK"):
        c = OpenStackCloud.attach(json.loads(Path(os.environ["SCO_TEST_OPENSTACK"]).read_text()))
    else:
        c = OpenStackCloud(SC.work / "drill-cloud")
        c.start()
    ports = [*c.ports.values(), *([c.network.port] if c.network else [])]
    # started in the machine's own namespace: it opens its listeners inside the control hosts'
    LOGS.mkdir(parents=True, exist_ok=True)
    with open(LOGS / "netns-forward.log", "ab") as log:
        fwd = subprocess.Popen(
            [sys.executable, "-m", "sco_devkit.netns_forward", *(a for h in CTL for a in ("--netns", _ns(h))),
             *(a for p in ports for a in ("--port", str(p)))],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    (LOGS / "clouds.yaml").write_text(yaml.safe_dump({"clouds": {"drill": c.cloud_config}}))
    try:
        _wait(lambda: "ready" in (LOGS / "netns-forward.log").read_text() or fwd.poll() is not None, 30,
              "the port forwards into the control hosts")  # fmt: skip
        assert fwd.poll() is None, (LOGS / "netns-forward.log").read_text()[-2000:]
        yield c
    finally:
        fwd.kill()
        fwd.wait(10)
        if not c.attached:
            c.stop()


def _dsn() -> str:
    """The fleet state's DSN as fleet_state wrote it on ha-ctl1, its member names as addresses and its CA the
    controller's copy (a process of the controller's inside a host's namespace reads the controller's files, not
    the host's)."""
    env = SC.host("ha-ctl1").file("/etc/sco/fleet-state.env").content_string
    dsn = next(ln.split("=", 1)[1] for ln in env.splitlines() if ln.startswith("SCO_DB_DSN="))
    dsn = re.sub(r"\bsslrootcert=\S+", f"sslrootcert={CA}", dsn.strip().strip("'\""))
    assert "sslmode=verify-full" in dsn, dsn  # TLS on by default, the server checked against the hall's CA
    return re.sub(r"\bha-infra[0-9]\b", lambda m: ADDRESS[m.group(0)], dsn)


# What the drill asks the fleet state, from inside a control host: record the nodes' instances as the acquirer
# records a launch; wait for a writable primary other than a given one; an instance's account.
_FLEET = """
import json, sys, time
from sco.state.db import connect
from sco.state.fleet import FleetState, Pool
dsn, what, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
if what == "record":
    with FleetState(dsn) as st:
        st.ensure_pool(Pool(args["hall"], args["pool"], flavor=args["flavor"], image=args["image"]))
        for slot, (name, sid) in enumerate(sorted(args["servers"].items())):
            i = st.request(args["hall"], args["pool"], "drill", slot, name)
            st.transition(i.id, "launching", "instance.launching", server_id=sid)
            st.transition(i.id, "active", "instance.active", only_from=("launching",))
elif what == "primary":
    end, last = time.time() + args["timeout"], ""
    while time.time() < end:
        try:
            with connect(dsn) as c:
                addr = c.execute("SELECT host(inet_server_addr())").fetchone()[0]
            if addr != args["not"]:
                print(json.dumps({"at": time.time(), "addr": addr}))
                sys.exit(0)
        except Exception as e:
            last = str(e)
        time.sleep(0.2)
    sys.exit(f"no writable primary but {args['not']} after {args['timeout']} s: {last}")
else:
    with FleetState(dsn) as st:
        out = {}
        for i in st.instances(args["hall"], states=None, names=args["names"]):  # deleted ones too
            out[i.name] = {"state": i.state, "terminate_at": i.terminate_at, "server_id": i.server_id,
                           "events": [{"kind": e["kind"], "at": e["at"]} for e in st.events(instance_id=i.id)]}
        print(json.dumps(out, default=str))
"""


def _fleet(what: str, args: dict[str, Any], timeout: float = 60, host: str = "ha-ctl2") -> Any:
    out = SC.in_netns(host, sys.executable, "-c", _FLEET, _dsn(), what, json.dumps(args), timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return json.loads(out.stdout) if out.stdout.strip() else None


def _patroni_primary() -> str:
    """The infra host whose Patroni says it leads (GET /primary: 200 on the leader only)."""
    # Patroni's REST API is https only, its certificate the hall's CA's
    probe = (
        "import ssl, sys, urllib.request;"
        " urllib.request.urlopen(sys.argv[1], timeout=2, context=ssl.create_default_context(cafile=sys.argv[2]))"
    )
    for h in INFRA:
        url = f"https://{ADDRESS[h]}:8008/primary"
        if SC.in_netns("ha-ctl2", sys.executable, "-c", probe, url, str(CA)).returncode == 0:
            return h
    raise AssertionError("no Patroni member says it is the primary")


def _reclaim_env(cloud: Any) -> dict[str, str]:
    return {**os.environ, "SCO_DB_DSN": _dsn(), "OS_CLIENT_CONFIG_FILE": str(LOGS / "clouds.yaml")}


def _warnings() -> list[str]:
    """The control hosts' runs' warnings and errors (their logs go with the scenario's destroy)."""
    return [
        f"{log.name}: {line}"
        for log in sorted(LOGS.glob("reclaim-*.log"))
        for line in log.read_text(errors="replace").splitlines()
        if line.startswith(("WARNING", "ERROR", "sco: error"))
    ]


# --- the drill ----------------------------------------------------------------------------------------------------


def test_reclaim_while_the_stream_leader_the_primary_and_the_control_host_die(agents: None, cloud: Any) -> None:
    nova = cloud.connect()
    servers = {}
    for node in NODES:
        s = nova.compute.create_server(name=node, flavor_id=cloud.flavors["sco.small"], image_id=cloud.image_id,
                                       networks="none")  # fmt: skip
        servers[node] = s.id
    for sid in servers.values():
        nova.compute.wait_for_server(nova.compute.get_server(sid), status="ACTIVE", wait=180)
    _fleet("record", {"hall": HALL, "pool": POOL, "flavor": cloud.flavors["sco.small"], "image": cloud.image_id,
                      "servers": servers})  # fmt: skip

    before = {n: len(_spool(n)) for n in NODES}
    leader = _stream_info()
    assert leader and leader["leader"], leader
    primary = _patroni_primary()
    env = _reclaim_env(cloud)
    ca = verify.relay_ca(SC)
    reclaim = [sys.executable, "-m", "sco.cli", "reclaim", "--hall", HALL, "--os-cloud", "drill", "--nats", RELAYS,
               *_identity("reclaimer"), *(["--nats-ca-file", str(ca)] if ca else [])]  # fmt: skip
    t0 = time.time()
    with open(LOGS / "reclaim-ha-ctl1.log", "wb") as log:
        ctl1 = subprocess.Popen(
            ["ip", "netns", "exec", _ns("ha-ctl1"), *reclaim, "--window", str(WINDOW),
             "--notice-key", str(SC.work / "keys" / "notice.key"), *NODES],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        told = _wait(lambda: (f := _fleet("account", {"hall": HALL, "names": NODES}))
                     and all(any(e["kind"] == "notice.published" for e in f[n]["events"]) for n in NODES) and f,
                     30, "ha-ctl1's notices to both nodes")  # fmt: skip
        assert ctl1.poll() is None, (LOGS / "reclaim-ha-ctl1.log").read_text()
        terminate_at = {n: float(told[n]["terminate_at"]) for n in NODES}
        print(
            f"drill: ha-ctl1 noticed both nodes {time.time() - t0:.2f} s after it started; T in "
            f"{min(terminate_at.values()) - time.time():.1f} s"
        )

        # 1. the stream's leader dies while the agents taint, evict and publish
        dead_relay = next(h for h in INFRA if leader["leader"].endswith(h))
        killed_at = time.time()
        assert _kill(dead_relay, "nats-server"), f"no nats-server in {dead_relay}"
        new = _wait(lambda: (i := _stream_info()) and i["leader"] and i["leader"] != leader["leader"] and i, 60,
                    "a new SCO_EVENTS leader")  # fmt: skip
        print(
            f"drill: stream leader {leader['leader']} killed -9; {new['leader']} leads after "
            f"{time.time() - killed_at:.2f} s"
        )

        # 2. the PostgreSQL primary dies: Patroni and every postgres process of its member
        killed_at = time.time()
        assert _kill(primary, "patroni") and _kill(primary, "postgres"), f"no Patroni member running on {primary}"
        took = _fleet("primary", {"not": ADDRESS[primary], "timeout": 90}, timeout=120)
        print(
            f"drill: PostgreSQL primary {primary} killed -9; {took['addr']} takes writes after "
            f"{took['at'] - killed_at:.2f} s"
        )

        # ha-ctl1's run lost its session (and the hall's lock) with the primary: it connects again and takes the
        # lock back on the new primary, still waiting for T
        _wait(lambda: "connected again, lock taken" in (LOGS / "reclaim-ha-ctl1.log").read_text() or ctl1.poll()
              is not None, 60, "ha-ctl1's run to take the hall's lock back")  # fmt: skip
        print(f"drill: ha-ctl1's run holds the hall again {time.time() - killed_at:.2f} s after the primary's kill")

        # 3. the active control host dies before T: its link cut first, so nothing it held is let go by a FIN
        assert ctl1.poll() is None, (
            "ha-ctl1's run ended before it was killed: " + (LOGS / "reclaim-ha-ctl1.log").read_text()[-3000:]
        )
        assert time.time() < min(terminate_at.values()), "T passed before ha-ctl1 was killed (machine too loaded)"
        subprocess.run(["ip", "netns", "exec", _ns("ha-ctl1"), "ip", "link", "set", "eth0", "down"], check=True)
        died_at = time.time()
        os.killpg(ctl1.pid, signal.SIGKILL)
        ctl1.wait(10)
        print(f"drill: ha-ctl1 killed {min(terminate_at.values()) - died_at:.1f} s before T")
    finally:
        if ctl1.poll() is None:
            os.killpg(ctl1.pid, signal.SIGKILL)
        subprocess.run(["ip", "netns", "exec", _ns("ha-ctl1"), "ip", "link", "set", "eth0", "up"], check=False)

    # ha-ctl2's next run: the hall's lock is free once PostgreSQL finds ha-ctl1's session dead (its keepalives)
    fin = subprocess.run(["ip", "netns", "exec", _ns("ha-ctl2"), *reclaim, "--finish", "--lock-wait", "120"],
                         env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    done_at = time.time()
    (LOGS / "reclaim-ha-ctl2.log").write_text(fin.stdout + fin.stderr)
    assert fin.returncode == 0, fin.stdout + fin.stderr
    print(f"drill: ha-ctl2 finished {done_at - died_at:.2f} s after ha-ctl1 died:")
    for line in fin.stdout.splitlines():
        print(f"drill:   {line}")
    for node in NODES:
        assert re.search(rf"^{node}: \w+, finished \(deleted (at its T|[0-9.]+ s after its T)", fin.stdout, re.M), (
            node, fin.stdout)  # fmt: skip

    # every node drained before T (the agents' own account, spooled)
    for node in NODES:
        ev = _wait(lambda node=node: _outcome(node, before[node]), 60, f"{node}'s drain outcome")
        assert ev["type"] == "drain.drained", (node, ev)
        assert ev["at"] < terminate_at[node], (node, ev["at"], terminate_at[node])
        print(
            f"drill: {node} drained {ev['at'] - t0:.2f} s after the reclaim began, "
            f"{terminate_at[node] - ev['at']:.2f} s before T"
        )

    # every instance gone from Nova, and the fleet state says so: one schedule, one notice, the delete at or after T
    for node, sid in servers.items():
        _wait(lambda sid=sid: nova.compute.find_server(sid, ignore_missing=True) is None, 120,
              f"Nova to delete {node}'s server")  # fmt: skip
    account = _fleet("account", {"hall": HALL, "names": NODES})
    for node in NODES:
        a = account[node]
        kinds = [e["kind"] for e in a["events"]]
        assert a["state"] == "deleted", (node, a)
        assert kinds.count("reclaim.scheduled") == 1 and kinds.count("notice.published") == 1, (node, kinds)
        assert "instance.delete_requested" in kinds, (node, kinds)
        # what the agent said reached the fleet state (the reclaimers follow SCO_EVENTS on their durable consumer)
        assert "agent.drain.drained" in kinds, (node, kinds, _warnings())
        assert float(a["terminate_at"]) == terminate_at[node], (node, a["terminate_at"], terminate_at[node])
        print(f"drill: {node}: fleet state {a['state']}, events {kinds}")

    # every spooled event in the stream exactly once, in the agent's order, once the agents have replayed
    for node in NODES:
        h = SC.host(node)
        _wait(lambda h=h: '"unpublished": 0' in h.run("/opt/sco/bin/sco-agent status --state-dir /var/lib/sco").stdout,
              60, f"{node}'s agent to publish its backlog")  # fmt: skip
        spooled = _spool(node)
        spool_id = h.run("cat /var/lib/sco/spool/spool.id").stdout.strip()
        assert len(spool_id) == 32, spool_id
        got = [m for m in _js(f"sco.events.{HALL}.{node}", timeout=60) if str(m["id"]).startswith(f"{spool_id}.")]
        assert [m["id"] for m in got] == [f"{spool_id}.{m['event']['seq']}" for m in got]
        seqs = [m["event"].get("seq") for m in got]
        assert len(seqs) == len(set(seqs)), f"{node}: an event twice in the stream: {seqs}"
        assert seqs == sorted(seqs), f"{node}: out of order: {seqs}"
        assert [m["event"] for m in got] == spooled, node
        print(f"drill: {node}: {len(got)} events in SCO_EVENTS, each once, in order")
