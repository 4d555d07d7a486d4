"""Opt-in (conftest.py: SCO_LIFECYCLE_BOOTS=N): launch -> agent connected to the relay under its own identity, for N
instances the hall launches itself (issue 28, "Measured"), on test_lifecycle.py's real chain.

After test_lifecycle.py, with its fixtures again (a fresh devkit cloud, Kubernetes stand-in and the hall's services
restarted): N pending pods of contract ci-runners, each too large to share an instance with another (600m of a 1-vCPU
instance); the control loop's unit, run as its timer runs it, plans and launches N servers (the pool's cap is N in
this run: inventory group_vars); each server boots as test_lifecycle's does (``_boot``: the baked image on the hall's
network at an address of its own, the metadata proxy, Debian's cloud-init's four stages, the agent from the image's
unit), SLOTS at a time, each as soon as Nova has it ACTIVE (the loop still running). The image is the lower layer of
an overlay (copy-on-write, as a cloud boots a disk over its base image): N copies of its 1 GB tree do not fit this
machine's disk.

Per instance, on the machine's one clock:

- launch: the fleet state's ``instance.requested`` (the acquirer records it just before its create call; Nova's
  created_at has whole seconds only, printed beside it);
- ACTIVE: ``instance.active`` (the acquirer saw the server ACTIVE: its polls are seconds apart, and this test's
  once a second, so a boot may begin a few seconds before it: "queued" below zero);
- connected: the relay's time of the node's first heartbeat (JetStream's timestamp of its message on
  ``sco.heartbeat.<hall>.<node>``). That is the relay's own record of a connection authenticated as that node and
  allowed on that node's subjects (no other identity may publish there), and the agent beats within a second of
  connecting (sco.agent.heartbeat). The ``instance.enrolled`` event is the credential issued, not a connection; the
  agent's "subscribed to" line is the agent's own word, with no time on it (the text log format): checked, not timed.

The split: Nova (launch -> ACTIVE), queued (ACTIVE -> its boot began: waiting for one of the SLOTS, this harness's,
not a cloud's, whose hypervisors start every server at once), host (the host made: overlay, network, metadata proxy),
cloud-init (its four stages), enrolment (agent started -> ``instance.enrolled``), connect (enrolled -> first beat).
p50 and p99 are nearest-rank over the N instances, of launch -> connected as measured and without the queue. Written
to /var/tmp/sco-molecule/hall-lifecycle/lifecycle/boots.txt. Then every server is deleted and every host removed."""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime
from typing import Any

import test_lifecycle as lc

N = int(os.environ["SCO_LIFECYCLE_BOOTS"])  # conftest.py checked it before collecting this module
SLOTS = 4  # instances booting at once: 2 cores, shared
BOOT_S = 600  # one instance, ACTIVE -> its first heartbeat, its slot's wait included
# the same services, cloud and stand-in as test_lifecycle.py's, made again for this module
cloud, kube, hall = lc.cloud, lc.kube, lc.hall


def _rank(values: list[float], q: float) -> float:
    """Nearest-rank percentile (of 20, p99 is the largest), of the values there are (an event missing is NaN)."""
    s = sorted(v for v in values if not math.isnan(v))
    return s[max(math.ceil(q * len(s)), 1) - 1] if s else math.nan


def _events(kind: str, server_ids: list[str]) -> dict[str, float]:
    """The first ``kind`` event of each instance of these servers, by node name, in Unix seconds."""
    rows = lc._fleet(
        "SELECT i.name, extract(epoch FROM min(e.at)) FROM lifecycle_event e JOIN instance i ON i.id = e.instance_id"
        " WHERE e.hall = %s AND e.kind = %s AND i.server_id = ANY(%s) GROUP BY i.name",
        lc.HALL,
        kind,
        server_ids,
    )
    return {name: float(at) for name, at in rows}


def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def test_instances_launched_by_the_hall_connect_to_the_relay(cloud: Any, kube: Any, hall: lc.Host) -> None:
    conn = cloud.connect()
    admin_project = conn.identity.find_project("admin").id
    assert not list(conn.compute.servers(all_projects=True)), "servers in the cloud before the launch"
    first_beat: dict[str, float] = {}
    stamps: dict[str, dict[str, float]] = {}
    booted: list[str] = []
    proxies: list[Any] = []
    lock = threading.Lock()
    stop = threading.Event()
    loads = [f"start {_load()}"]

    def watch_beats() -> None:
        # the relay's time of each node's first beat: read every second (an agent beats every 30 s: the first read
        # after its first beat still holds that one)
        while not stop.is_set():
            try:
                beats = lc._beats()
            except Exception as e:  # the relay unreachable for a moment: the next read
                print(f"boots: heartbeats unread: {e}")
                beats = {}
            for node, (at, _) in beats.items():
                if at.timestamp() >= t0:  # not an earlier run's node's last beat, still in the stream
                    first_beat.setdefault(node, at.timestamp())
            stop.wait(1)

    def launch() -> tuple[int, str]:
        # the loop as its timer runs it, again if a run launched fewer than N (at most three runs)
        rc, out = 0, ""
        own = cloud.connect()  # this thread's (the main one polls the servers meanwhile)
        try:
            for i in range(3):
                rc, out = lc._loop(hall, f"plan and launch {N} (run {i + 1})")
                if rc != 0 or len(list(own.compute.servers(all_projects=True))) >= N:
                    break
        finally:
            own.close()
        return rc, out

    t0 = time.time()

    def boot(server: Any) -> None:
        t = stamps[server.name]
        t["boot"] = time.time()
        h, proxy = lc._boot(cloud, server, server.project_id or admin_project, address=None, overlay=True, stamps=t)
        with lock:
            proxies.append(proxy)
        env = h.run("cat /etc/sco/agent.env")
        assert f"SCO_AGENT_NODE={server.name}" in env and "SCO_AGENT_ENROL_TOKEN=" in env, env
        kube.cluster.add_node(server.name)  # kubelet registers the node
        t["agent"] = time.time()
        h.start("sco-agent.service", "sco-agent")
        lc._wait(lambda: server.name in first_beat, BOOT_S, f"{server.name}'s first heartbeat on the relay", 0.5)
        assert "subscribed to" in h.log("sco-agent"), h.log("sco-agent")[-3000:]

    for i in range(N):
        kube.cluster.create_pod("ci", {
            "metadata": {"name": f"boots-{i}", "labels": {"role": "runner"}},
            "spec": {"tolerations": lc.TOLERATE, "containers": [
                {"name": "c", "image": "ci-runner", "resources": {"requests": {"cpu": "600m", "memory": "256Mi"}}}]},
        })  # fmt: skip
    watcher = threading.Thread(target=watch_beats, name="beats", daemon=True)
    watcher.start()
    pool = ThreadPoolExecutor(SLOTS, thread_name_prefix="boot")
    started: dict[str, Future[None]] = {}
    server_ids: list[str] = []
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="loop") as one:
            looping = one.submit(launch)
            # each server booted once Nova has it ACTIVE, while the loop runs on (it waits for all of them)
            end = time.monotonic() + 900
            while len(started) < N:
                assert time.monotonic() < end, f"{len(started)} of {N} servers ACTIVE after 900 s"
                if looping.done() and looping.result()[0] != 0:
                    raise AssertionError(looping.result()[1][-4000:])
                for s in conn.compute.servers(all_projects=True):
                    if s.status == "ACTIVE" and s.name not in started:
                        stamps[s.name] = {"nova_created": datetime.fromisoformat(s.created_at).timestamp()}
                        started[s.name] = pool.submit(boot, s)
                        booted.append(s.name)
                        server_ids.append(s.id)
                if looping.done() and len(started) < N and len(list(conn.compute.servers(all_projects=True))) < N:
                    raise AssertionError(f"the loop launched {len(started)} of {N}:\n{looping.result()[1][-3000:]}")
                time.sleep(1)
            rc, out = looping.result()
            assert rc == 0, out[-4000:]
        loads.append(f"all launched {_load()}")
        failed = []
        for name, f in started.items():
            try:
                f.result(timeout=BOOT_S * (N // SLOTS + 2))
            except Exception as e:  # every instance's failure said, not only the first
                failed.append(f"{name}: {str(e)[-1500:]}")
        assert not failed, "\n".join(failed)
        loads.append(f"all connected {_load()}")
        took = time.time() - t0

        requested, active, enrolled = (
            _events(k, server_ids) for k in ("instance.requested", "instance.active", "instance.enrolled")
        )
        rows, table = [], []
        head = ["launch", "Nova", "queued", "host", "cloud-init", "enrol", "connect", "total", "no-queue", "created"]
        first = min(requested.values())
        for name in sorted(started, key=lambda n: requested[n]):
            t = stamps[name]
            launched, connected = requested[name], first_beat[name]
            # an event the fleet state lacks is NaN in its columns, said in the table, not a lost measurement
            up, done = active.get(name, math.nan), enrolled.get(name, math.nan)
            queued = t["boot"] - up
            parts = [
                launched - first,
                up - launched,
                queued,
                t["host"] - t["boot"],
                t["cloud-init"] - t["host"],
                done - t["agent"],
                connected - done,
                connected - launched,
                connected - launched - (max(queued, 0.0) if not math.isnan(queued) else 0.0),
                t["nova_created"] - launched,
            ]
            table.append(parts)
            rows.append(f"{name:<28}" + "".join(f"{v:>11.1f}" for v in parts))
        split = {h: [r[i] for r in table] for i, h in enumerate(head)}
        total, net = split["total"], split["no-queue"]
        summary = [
            f"hall-lifecycle boots: {N} instances launched by one control-loop run, booted {SLOTS} at a time,"
            f" all connected {took:.0f} s after the launch",
            f"launch -> connected (first heartbeat on the relay): p50 {_rank(total, 0.5):.1f} s,"
            f" p99 {_rank(total, 0.99):.1f} s (as measured, {SLOTS} boot slots)",
            f"launch -> connected without the wait for a boot slot: p50 {_rank(net, 0.5):.1f} s,"
            f" p99 {_rank(net, 0.99):.1f} s",
            "split, p50 / p99 s: "
            + ", ".join(f"{h} {_rank(split[h], 0.5):.1f} / {_rank(split[h], 0.99):.1f}" for h in head[1:7]),
            "load average (1, 5, 15 min): " + "; ".join(loads),
            "columns: launch (s after the first launch), Nova (launch -> ACTIVE), queued (ACTIVE -> boot began),"
            " host, cloud-init, enrol (agent started -> enrolled), connect (enrolled -> first heartbeat), total"
            " (launch -> connected), no-queue (total - queued), created (Nova's created_at - launch, whole seconds)",
            f"{'instance':<28}" + "".join(f"{h:>11}" for h in head),
            *rows,
        ]
        text = "\n".join(summary)
        (lc.LOGS / "boots.txt").write_text(text + "\n")
        print("\n" + text)
        assert len(first_beat.keys() & set(started)) == N
    finally:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        for name in booted:
            with contextlib.suppress(Exception):
                log = lc.Host(name).log("sco-agent")
                (lc.LOGS / f"boots-agent-{name}.log").write_text(log)
        for p in proxies:
            with contextlib.suppress(Exception):
                p.close()
        # the instances cleaned up: every server deleted, every host removed
        for s in conn.compute.servers(all_projects=True):
            with contextlib.suppress(Exception):
                conn.compute.delete_server(s, ignore_missing=True)
        try:
            lc._wait(lambda: not list(conn.compute.servers(all_projects=True)), 180, "the servers deleted", 2)
        except AssertionError as e:
            print(f"boots: {e}")
        lc.hosts.remove(lc.HALL, booted)  # molecule/shared/hosts.py
        conn.close()
