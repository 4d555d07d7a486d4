"""The fault drill of hall HA (molecule scenario hall-ha): both nodes are reclaimed with a short window while the
hall loses machines, and the hall must not lose a drain or an event.

Without systemd as PID 1 nothing converge installed runs yet: the drill starts every daemon with its unit's own
command line (the relays on the three infra hosts, the distributor on ha-ctl1, the agents on the nodes) and the
project's Kubernetes API stand-in on ha-ctl1's address (what sco_kube_url names), each in its host's network
namespace. Then:

1. the reclaimer's notices (signed with the hall's notice key, sent as the relay's reclaimer user) for both nodes,
   T = now + WINDOW;
2. kill -9 of the nats-server leading the SCO_EVENTS stream (R3) while the agents drain and publish;
3. every node drained before T; every event each agent spooled is in the stream exactly once and in the agent's
   order (after the agents' replay); the stream has a new leader, and how long that took is printed.

Not in this drill yet (molecule/README.md): the PostgreSQL primary's kill (Patroni) and the active control host's
run (`sco reclaim` on ha-ctl1, finished by ha-ctl2), the reclaimer's recorded deletes and the fleet state.
"""

from __future__ import annotations

import json
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
WINDOW = 20.0  # seconds from the notice to T
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
        try:
            import os

            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return pids


# What the drill asks the relay cluster, as the relays' stream tool (relay-admin: JetStream's API only), from inside
# ha-ctl1: the stream's leader and replicas, or every message of a node's subject in stream order.
_JS = """
import asyncio, json, sys
import nats, nats.js.errors
servers, seed, what = sys.argv[1].split(","), sys.argv[2], sys.argv[3]

async def main():
    nc = await nats.connect(servers=servers, nkeys_seed=seed, connect_timeout=2, max_reconnect_attempts=3,
                            allow_reconnect=True)
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
    out = SC.in_netns(
        "ha-ctl1", sys.executable, "-c", _JS, RELAYS, str(CREDS / "relay-admin.nk"), what, timeout=timeout
    )
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
    url = f"http://{ADDRESS['ha-ctl1']}:8470/v1/halls/{HALL}/bundle.json"
    fetch = "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)"
    _wait(lambda: SC.in_netns("ha-node1", sys.executable, "-c", fetch, url).returncode == 0, 30,
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


def test_reclaim_while_the_stream_leader_dies(agents: None) -> None:
    before = {n: len(_spool(n)) for n in NODES}
    leader = _stream_info()
    assert leader and leader["leader"], leader
    t0 = time.time()
    for node in NODES:
        sent = SC.in_netns(
            "ha-ctl1", sys.executable, "-m", "sco.cli", "notice", "send", "--hall", HALL, "--node", node,
            "--signing-key", str(SC.work / "keys" / "notice.key"), "--nats", RELAYS, "--in", str(WINDOW),
            "--nkey-seed", str(CREDS / "reclaimer.nk"), timeout=30,
        )  # fmt: skip
        assert sent.returncode == 0, sent.stderr
    terminate_at = t0 + WINDOW
    # the leader dies while the agents taint, evict and publish
    time.sleep(1.0)
    dead_host = next(h for h in INFRA if leader["leader"].endswith(h))
    killed_at = time.time()
    assert _kill(dead_host, "nats-server"), f"no nats-server in {dead_host}"
    new = _wait(lambda: (i := _stream_info()) and i["leader"] and i["leader"] != leader["leader"] and i, 60,
                "a new SCO_EVENTS leader")  # fmt: skip
    failover_s = time.time() - killed_at
    print(f"drill: stream leader {leader['leader']} killed -9; {new['leader']} leads after {failover_s:.2f} s")

    # every node drained before T (the agents' own account, spooled)
    finals = {}
    for node in NODES:
        finals[node] = _wait(lambda node=node: _outcome(node, before[node]), WINDOW + 30, f"{node}'s drain outcome")
    for node, ev in finals.items():
        assert ev["type"] == "drain.drained", (node, ev)
        assert ev["at"] < terminate_at, (node, ev["at"], terminate_at)
        print(f"drill: {node} drained {ev['at'] - t0:.2f} s after the notice, {terminate_at - ev['at']:.2f} s before T")

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
