"""A rolling upgrade under a reclaim: the local hall converged from release N (releases.py: an earlier commit of
this repository, built as it built) is upgraded to release N+1 (this checkout released as the next minor) by
sco.orchestrator.upgrade over real SSH while a reclaim is under way on its node. The tests run in file order, each
on what the one before left.

Without systemd as PID 1 (molecule/README.md) nothing runs the units: the tests start release N's relay,
distributor and agent with their units' command lines, and the project's Kubernetes API stand-in where the local
hall's sco_kube_url points (with pods of the sample contracts on the node). The agent is started as role node_agent
starts it where node_agent_run_without_systemd asks (start-stop-daemon, /run/sco-agent.pid), so N+1's role finds it
and restarts it (after its drain) as a unit restart would. The relay and the distributor keep running release N's
processes through the upgrade (nothing restarts them here): the agent's side of the roll is what is exercised.

The cloud is the devkit's OpenStack (Keystone, Nova with its fake driver, Placement, Glance) on the machine's
loopback, forwarded into the host's namespace (sco_devkit.netns_forward); the node is a Nova server named after it,
recorded in the fleet state as release N's acquirer records a launch. The control loop's timer is its unit run as the
timer runs it (ExecStart as its user, with its environment: verify.service_command).

1. release N runs: the agent (N's product) subscribed, the bundle cached, the fleet state at N's migrations, the
   node's instance in Nova;
2. the upgrade runs; when its node agents' batch begins installing, the reclaimer (N+1's `sco reclaim --no-wait`)
   notices the node with the hall's 120 s window, T recorded in the fleet state, and the control loop's timer runs
   (N+1's unit, the roll half done): the notice is not lost (accepted once), the drain ends (drained) before T,
   the agent is restarted only after its drain ended, as N+1, which reads N's spool (the same spool, status
   answers, its backlog published), every spooled event is in SCO_EVENTS exactly once, the fleet state's
   migrations ran forward once each, the cached bundle's serial did not go back; the loop's run started during
   the upgrade succeeds, writes its textfile and deletes the instance at T (its reclaim step, which finishes the
   reclaims under way): still in Nova when the upgrade ends before T, gone after, the fleet state's delete
   request at or after T; the timer's next run, after the upgrade, succeeds and writes its textfile too;
3. a second upgrade run changes nothing;
4. a drain that outlasts node_agent_drain_wait_s fails the host with one clear line and leaves its agent running
   as it was (not restarted); the roll stops (max_fail_percentage 0); once the drain has ended the same run passes.
   The drain is held open by stopping the agent (SIGSTOP) after it accepted the notice: a drain longer than the
   wait, without depending on how long the playbook takes to reach the agent's handler on a loaded machine.

Each step's time is printed (`upgrade:` lines)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "shared"))
import hosts  # molecule/shared/hosts.py
import verify  # molecule/shared/verify.py

SC = verify.Scenario("hall-upgrade")
HOST = "sco-local"
HALL = "local"
NS = f"scom-{SC.name}-{HOST}"
REPO = Path(__file__).resolve().parents[3]
BIN = Path(sys.executable).parent
N = (SC.work / "release-n").resolve()
N1 = (SC.work / "release-n1").resolve()
N1_VERSION = json.loads((SC.work / "releases.json").read_text())["n1"]["version"]
N_VERSION = json.loads((SC.work / "releases.json").read_text())["n"]["version"]
AGENT = "/opt/sco-agent/bin/sco-agent"  # node_agent_venv (inventory: the agent's venv of its own)
PIDFILE = "/run/sco-agent.pid"  # role node_agent's, where it runs the agent without systemd
CREDS = SC.work / "credentials" / "nats"
WINDOW = 120  # the local hall's noticeWindowSeconds
LOGS = SC.work / "upgrade"
KEPT = REPO / ".work" / "molecule" / "hall-upgrade-verify"  # LOGS, copied when verify ends
# the fleet state (the demo's embedded PostgreSQL, trust for postgres) as the controller's clients reach it in the
# host's namespace
DSN = "host=127.0.0.1 port=5433 user=postgres dbname=sco_fleet connect_timeout=10"
CLOUD = "hall-local"  # control_loop_cloud (inventory group_vars/sco_control.yml): the loop's clouds.yaml entry
# the node's instance's pool: not the hall's local-spot, which the loop plans (no demand: target 0)
POOL = "upgrade"
TEXTFILES = "/var/lib/prometheus/node-exporter"  # control_loop_metrics_textfile_dir (the role's default)
STATE: dict[str, Any] = {}


def _say(line: str) -> None:
    """A step's figure: printed, and kept in LOGS/steps.txt (pytest shows a passed test's output only with -s)."""
    print(f"upgrade: {line}")
    LOGS.mkdir(parents=True, exist_ok=True)
    with open(LOGS / "steps.txt", "a") as f:
        f.write(f"{time.strftime('%H:%M:%S')} {line}\n")


def _wait(pred: Any, timeout: float, what: str, every: float = 0.5) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(every)
    raise AssertionError(f"upgrade: timed out after {timeout:g} s waiting for {what}")


def _env(release: Path | None, **extra: str) -> dict[str, str]:
    """The controller's environment for one release: its collection and its product first (molecule's env points
    at release N's)."""
    env = {**os.environ, **extra}
    env["PATH"] = f"{BIN}:{env['PATH']}"
    env["PYTHONPATH"] = str(release / "site") if release else ""
    if release:
        env["ANSIBLE_COLLECTIONS_PATH"] = str(release / "collections")
    env.setdefault("ANSIBLE_HOST_KEY_CHECKING", "false")
    env.setdefault("MOLECULE_PROJECT_DIRECTORY", str(REPO))
    return env


def _in_ns(
    *argv: str, release: Path | None = None, timeout: float = 60, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", "netns", "exec", NS, *argv], capture_output=True, text=True, timeout=timeout,
                          env=_env(release, **(env or {})))  # fmt: skip


def _upgrade_argv(*extra: str) -> list[str]:
    """ansible-playbook sco.orchestrator.upgrade of release N+1, as docs/UPGRADE.md runs it."""
    return [
        str(BIN / "ansible-playbook"), "-i", str(SC.inventory.parent), "sco.orchestrator.upgrade",
        "-e", f"sco_version={N1_VERSION}", "-e", f"sco_wheelhouse={SC.work / 'wheelhouse-n1'}",
        "-e", "node_agent_run_without_systemd=true", "-e", "node_agent_drain_poll_s=2", *extra,
    ]  # fmt: skip


def _recap(out: str) -> dict[str, int]:
    recap = out.split("PLAY RECAP", 1)[1]
    m = re.search(rf"{HOST}\s*:\s*ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", recap)
    assert m, recap
    return {"ok": int(m[1]), "changed": int(m[2]), "unreachable": int(m[3]), "failed": int(m[4])}


def _agent_pid() -> int:
    """The agent's pid, from its pid file as the controller sees the host's files (no SSH round trip)."""
    pid = int((SC.root(HOST) / PIDFILE.lstrip("/")).read_text().strip())
    assert Path(f"/proc/{pid}").exists(), f"the agent ({pid}, {PIDFILE}) does not run"
    return pid


def _local_events() -> list[dict[str, Any]]:
    """The spool read from the controller (release N+1's reader on the host's files): seconds faster than over SSH
    on a loaded machine, where the moment a drain starts is what matters."""
    out = subprocess.run([str(N1 / "site" / "bin" / "sco-agent"), "events", "--state-dir",
                          str(SC.root(HOST) / "var" / "lib" / "sco")], capture_output=True, text=True, timeout=60,
                         env=_env(N1))  # fmt: skip
    assert out.returncode == 0, out.stderr
    return [json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith("{")]


def _started_at(pid: int) -> float:
    """A process's start, in epoch seconds (/proc/<pid>/stat's starttime after boot)."""
    ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    btime = next(int(ln.split()[1]) for ln in Path("/proc/stat").read_text().splitlines() if ln.startswith("btime"))
    return btime + ticks / os.sysconf("SC_CLK_TCK")


def _spool() -> list[dict[str, Any]]:
    """The agent's spool, read by release N+1's reader (/opt/sco is N+1's once the upgrade's first plays ran)."""
    out = SC.host(HOST).run("/opt/sco/bin/sco-agent events --state-dir /var/lib/sco")
    assert out.rc == 0, out.stderr
    return [json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith("{")]


def _status() -> dict[str, Any]:
    out = SC.host(HOST).run(f"{AGENT} status --state-dir /var/lib/sco")
    assert out.rc == 0, out.stderr
    return dict(json.loads(out.stdout))


def _of(notice: str, kind: str) -> list[dict[str, Any]]:
    return [e for e in _spool() if e.get("type") == kind and str(e.get("notice")) == notice]


def _outcome(notice: str) -> dict[str, Any] | None:
    return next((e for e in _spool() if str(e.get("type")).startswith("drain.") and e.get("type") != "drain.resumed"
                 and str(e.get("notice")) == notice), None)  # fmt: skip


def _bundle_serial() -> int:
    out = SC.host(HOST).run(
        "/opt/sco/bin/sco node bundle-status --cache-dir /var/lib/sco/bundle --trust-dir /etc/sco/trusted"
    )
    assert out.rc == 0, out.stdout + out.stderr
    return int(json.loads(out.stdout)["serial"])


def _version(venv: str) -> str:
    out = SC.host(HOST).run(
        f"{venv}/bin/python -c \"import importlib.metadata as m; print(m.version('spot-capacity-orchestrator'))\""
    )
    assert out.rc == 0, out.stderr
    return str(out.stdout.strip())


_MIGRATIONS = """
import json, psycopg
c = psycopg.connect("host=127.0.0.1 port=5433 user=postgres dbname=sco_fleet", connect_timeout=10)
print(json.dumps([[v, n] for v, n in c.execute("SELECT version, name FROM schema_migration ORDER BY version")]))
"""


def _migrations() -> list[list[Any]]:
    out = _in_ns(sys.executable, "-c", _MIGRATIONS)
    assert out.returncode == 0, out.stderr
    return list(json.loads(out.stdout))


# every message of a subject in SCO_EVENTS, by stream sequence, read as the relay's stream tool (relay-admin:
# JetStream's API only; the reclaimer may only follow its own durable consumer)
_JS = """
import asyncio, json, sys
import nats, nats.js.errors

async def main():
    nc = await nats.connect("nats://127.0.0.1:4222", nkeys_seed=sys.argv[1], connect_timeout=5,
                            max_reconnect_attempts=2)
    js = nc.jetstream(timeout=5)
    si = await js.stream_info("SCO_EVENTS")
    out = []
    for seq in range(si.state.first_seq, si.state.last_seq + 1):
        try:
            m = await js.get_msg("SCO_EVENTS", seq)
        except nats.js.errors.NotFoundError:
            continue
        if m.subject == sys.argv[2]:
            out.append({"seq": seq, "id": (m.headers or {}).get("Nats-Msg-Id"), "event": json.loads(m.data)})
    print(json.dumps(out))
    await nc.close()

asyncio.run(main())
"""


def _stream(subject: str) -> list[dict[str, Any]]:
    out = _in_ns(sys.executable, "-c", _JS, str(CREDS / "relay-admin.nk"), subject)
    assert out.returncode == 0, out.stderr[-2000:]
    return list(json.loads(out.stdout))


_SEND = """
import json, sys, urllib.request
req = urllib.request.Request(sys.argv[1], data=sys.argv[2].encode(), method=sys.argv[3],
                             headers={"Content-Type": sys.argv[4]})
print(urllib.request.urlopen(req, timeout=3).status)
"""


def _put_work(tag: str) -> None:
    """Pods of two sample contracts on the node: CI runners (20 s budget) stopping in 4 s, a model server (30 s)
    in 25 s, so a drain lasts about 25 s."""
    pods = [("ci", {"role": "runner"}, 4), ("inference", {"app.kubernetes.io/name": "model-server"}, 25)]
    for ns, labels, secs in pods:
        pod = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{ns}-{tag}", "namespace": ns, "labels": labels,
                         "annotations": {"standin.sco.dev/shutdown-seconds": str(secs)}},
            "spec": {"nodeName": HOST, "containers": [{"name": "main", "image": "work"}]},
        }  # fmt: skip
        url = f"http://127.0.0.1:6443/api/v1/namespaces/{ns}/pods"

        def taken(pod: dict[str, Any] = pod, url: str = url) -> bool:
            out = _in_ns(sys.executable, "-c", _SEND, url, json.dumps(pod), "POST", "application/json")
            return out.stdout.strip() == "201"

        _wait(taken, 20, f"the stand-in to take pod {pod['metadata']['name']}")


def _back_in_service() -> None:
    """The node put back after its drain (its cordon and SCO's taint lifted, as an operator does): the agent rearms,
    and the next notice drains it again."""
    body = json.dumps({"spec": {"unschedulable": None, "taints": None}})
    url = f"http://127.0.0.1:6443/api/v1/nodes/{HOST}"
    out = _in_ns(sys.executable, "-c", _SEND, url, body, "PATCH", "application/merge-patch+json")
    assert out.stdout.strip() == "200", out.stdout + out.stderr
    _wait(lambda: [e for e in _spool() if e.get("type") == "notice.rearmed"], 120, "the agent to rearm")


def _notice(notice_id: str) -> float:
    """The reclaimer's notice for the node (release N+1's `sco notice send`: the control host's release once the
    upgrade's control play ran), signed with the hall's notice key; returns T."""
    out = _in_ns(
        sys.executable, "-m", "sco.cli", "notice", "send", "--hall", HALL, "--node", HOST,
        "--signing-key", str(SC.work / "keys" / "notice.key"), "--in", str(WINDOW), "--id", notice_id,
        "--nats", "nats://127.0.0.1:4222", "--nkey-seed", str(CREDS / "reclaimer.nk"), release=N1,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return time.time() + WINDOW


# The node's instance as release N's acquirer recorded its launch (N's product on N's schema: the instance was there
# before the upgrade), and an instance's account afterwards.
_FLEET = """
import json, sys
from sco.state.fleet import FleetState, Pool
a = json.loads(sys.argv[2])
with FleetState(sys.argv[1]) as st:
    if sys.argv[3] == "record":
        st.ensure_pool(Pool(a["hall"], a["pool"], flavor=a["flavor"], image=a["image"]))
        i = st.request(a["hall"], a["pool"], "upgrade", 0, a["name"])
        st.transition(i.id, "launching", "instance.launching", server_id=a["server"])
        st.transition(i.id, "active", "instance.active", only_from=("launching",))
        print(json.dumps(i.id))
    else:
        state, t = st.conn.execute("SELECT state, extract(epoch FROM terminate_at) FROM instance WHERE id = %s",
                                   (a["id"],)).fetchone()
        events = st.conn.execute("SELECT kind, extract(epoch FROM at) FROM lifecycle_event WHERE instance_id = %s"
                                 " ORDER BY id", (a["id"],)).fetchall()
        print(json.dumps({"state": state, "terminate_at": float(t) if t is not None else None,
                          "events": [[k, float(at)] for k, at in events]}))
"""


def _fleet(what: str, args: dict[str, Any], release: Path) -> Any:
    out = _in_ns(sys.executable, "-c", _FLEET, DSN, json.dumps(args), what, release=release)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return json.loads(out.stdout)


def _reclaim() -> tuple[str, float]:
    """The reclaimer takes the node's instance back: release N+1's `sco reclaim` (the control host's release once
    the upgrade's control play ran) with the hall's window, signed with the hall's notice key, as the relay's
    reclaimer; T recorded in the fleet state. --no-wait: the delete at T is the control loop's reclaim step (a
    waiting run holds the hall's lock all window, which the loop's reconcile and acquire steps need). Returns the
    notice's id and T."""
    out = _in_ns(
        sys.executable, "-m", "sco.cli", "reclaim", "--hall", HALL, "--window", str(WINDOW), "--no-wait",
        "--nats", "nats://127.0.0.1:4222", "--nkey-seed", str(CREDS / "reclaimer.nk"),
        "--notice-key", str(SC.work / "keys" / "notice.key"), "--os-cloud", CLOUD, "--dsn", DSN,
        "--lock-wait", "60", HOST, release=N1, timeout=180, env={"OS_CLIENT_CONFIG_FILE": str(LOGS / "clouds.yaml")},
    )  # fmt: skip
    (LOGS / "reclaim.log").write_text(out.stdout + out.stderr)
    assert out.returncode == 0, out.stdout + out.stderr
    m = re.search(rf"^{HOST}: notice (\S+) published, deleted at ([0-9.]+)$", out.stdout, re.M)
    assert m, out.stdout + out.stderr
    return m[1], float(m[2])


def _loop(what: str) -> tuple[float, str]:
    """One run of the control loop's unit as its timer starts it (role control_loop's sco-control-loop.service:
    ExecStart as its user, with its environment), asserted to succeed and to write its textfile; returns when it
    started and what it printed. Called from a thread too: SSH alone (hosts.py), no testinfra."""
    th = hosts.test_host(SC.name, HOST)

    def run(cmd: str) -> str:
        return th.ssh("bash", "-c", shlex.quote(cmd), timeout=60).stdout

    line = verify.service_command(run, "sco-control-loop.service")
    t0 = time.time()
    out = th.ssh("bash", "-c", shlex.quote(line), check=False, timeout=900)
    took = time.time() - t0
    with open(LOGS / "control-loop.log", "a") as f:
        f.write(f"=== {what}: exit {out.returncode} in {took:.1f} s\n{out.stdout}{out.stderr}\n")
    assert out.returncode == 0, f"the control loop's run {what} failed:\n{out.stdout[-4000:]}{out.stderr[-3000:]}"
    assert f"for hall {HALL}: ok" in out.stdout, out.stdout[-3000:]
    # node_exporter's textfile (docs/METRICS.md): the loop's last ok run, this one
    prom = (SC.root(HOST) / TEXTFILES.lstrip("/") / "sco_control_loop.prom").read_text()
    last = re.search(r'^sco_control_last_run_timestamp_seconds\{step="loop",result="ok"\} (\S+)$', prom, re.M)
    assert last and t0 <= float(last[1]) <= time.time(), prom
    _say(f"control loop run {what}: ok in {took:.1f} s, sco_control_loop.prom written")
    return t0, out.stdout


def _netns_pids(needle: str) -> list[int]:
    """Processes in the host's network namespace whose command line has ``needle`` (test hosts share the machine's
    process table: never kill by name machine-wide)."""
    out = subprocess.run(["ip", "netns", "pids", NS], capture_output=True, text=True, check=False).stdout
    found = []
    for pid in out.split():
        try:
            if needle in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.fixture(scope="module")
def hall() -> Iterator[None]:
    """Release N's relay, distributor and agent as their units run them, and the Kubernetes API stand-in."""
    LOGS.mkdir(parents=True, exist_ok=True)
    h = SC.host(HOST)
    t0 = time.monotonic()
    assert h.run(verify.GIVE_PTYS).rc == 0  # for the control loop's runs
    started = h.run(
        "setsid runuser -u sco-nats -- /usr/local/bin/nats-server -c /etc/sco-nats/nats-server.conf "
        "> /var/log/sco-nats.log 2>&1 < /dev/null &"
    )
    assert started.rc == 0, started.stderr
    post = verify.exec_line(h, "sco-nats.service", "ExecStartPost")
    _wait(lambda: h.run(post).rc == 0, 60, "the relay's streams (its unit's ExecStartPost)")
    serve = verify.exec_line(h, "sco-distributor.service", "ExecStart")
    assert h.run(f"setsid {serve} > /var/log/sco-distributor.log 2>&1 < /dev/null &").rc == 0
    with open(LOGS / "kube-standin.log", "ab") as log:
        kube = subprocess.Popen(
            ["ip", "netns", "exec", NS, sys.executable, "-m", "sco_devkit.standins.kube_apiserver",
             "--listen", "127.0.0.1:6443", "--node", HOST],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=_env(None),
        )  # fmt: skip
    dropin = h.file("/etc/systemd/system/sco-agent.service.d/10-ansible.conf").content_string.splitlines()
    run = [ln.removeprefix("ExecStart=") for ln in dropin if ln.startswith("ExecStart=") and ln != "ExecStart="][-1]
    assert run.startswith(f"{AGENT} run "), run
    # as role node_agent starts it without systemd (node_agent_run_without_systemd): the upgrade finds it by its
    # pid file
    args = run.removeprefix(AGENT).strip()
    agent = h.run(
        f"PYTHONDONTWRITEBYTECODE=1 start-stop-daemon --start --background --make-pidfile --pidfile {PIDFILE} "
        f"--output /var/log/sco-agent.log --startas {AGENT} -- {args}"
    )
    assert agent.rc == 0, agent.stdout + agent.stderr
    try:
        _wait(lambda: "NATS connected; subscribed to" in h.run("cat /var/log/sco-agent.log").stdout, 90,
              "release N's agent to subscribe to its notices")  # fmt: skip
        _wait(lambda: h.run("ls /var/lib/sco/bundle").stdout.strip() != "", 90,
              "release N's agent to cache the bundle")  # fmt: skip
        _say(f"release N's hall running in {time.monotonic() - t0:.1f} s")
        yield
    finally:
        # what a failed run needs, kept past the scenario's destroy (which removes SC.work)
        with contextlib.suppress(Exception):
            (LOGS / "spool.jsonl").write_text("".join(json.dumps(e) + "\n" for e in _local_events()))
            for f in ("sco-agent.log", "sco-nats.log", "sco-distributor.log"):
                shutil.copy(SC.root(HOST) / "var" / "log" / f, LOGS / f)
        shutil.rmtree(KEPT, ignore_errors=True)
        shutil.copytree(LOGS, KEPT)
        h.run(f"start-stop-daemon --stop --oknodo --retry TERM/10/KILL/5 --pidfile {PIDFILE} --remove-pidfile")
        for needle in ("nats-server", "sco-distributor", "/opt/sco/bin/sco ", "sco-control-loop"):
            for pid in _netns_pids(needle):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        kube.terminate()
        kube.wait(10)


@pytest.fixture(scope="module")
def cloud() -> Iterator[Any]:
    """The devkit OpenStack (Keystone, Nova with its fake driver, Placement, Glance) on the machine's loopback, its
    ports forwarded into the host's namespace (sco_devkit.netns_forward: the same 127.0.0.1 addresses its catalog
    names); clouds.yaml entry CLOUD on the controller for `sco reclaim`, and on the host where the loop's unit finds
    it (openstacksdk's /etc/openstack, the unit's user's group), once the upgrade has made that user."""
    from sco_devkit.devcluster.openstack import OpenStackCloud

    shutil.rmtree(SC.work / "cloud", ignore_errors=True)
    c = OpenStackCloud(SC.work / "cloud")
    fwd = None
    try:
        t0 = time.monotonic()
        c.start()
        _say(f"the devkit OpenStack started in {time.monotonic() - t0:.0f} s")
        LOGS.mkdir(parents=True, exist_ok=True)
        with open(LOGS / "netns-forward.log", "ab") as log:
            fwd = subprocess.Popen(
                [sys.executable, "-m", "sco_devkit.netns_forward", "--netns", NS,
                 *(a for p in c.ports.values() for a in ("--port", str(p)))],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        _wait(lambda: "ready" in (LOGS / "netns-forward.log").read_text() or fwd.poll() is not None, 30, "forwards")
        assert fwd.poll() is None, (LOGS / "netns-forward.log").read_text()[-2000:]
        (LOGS / "clouds.yaml").write_text(yaml.safe_dump({"clouds": {CLOUD: c.cloud_config}}))
        yield c
    finally:
        if fwd is not None:
            fwd.kill()
            fwd.wait(10)
        c.stop()


def _give_the_loop_its_cloud() -> None:
    """clouds.yaml where the loop's unit finds CLOUD (openstacksdk reads /etc/openstack), readable by its user's
    group (made by N+1's role control_loop: N's loop ran as root)."""
    etc = SC.root(HOST) / "etc" / "openstack"
    etc.mkdir(exist_ok=True)
    shutil.copy(LOGS / "clouds.yaml", etc / "clouds.yaml")
    done = SC.host(HOST).run("chgrp sco-control /etc/openstack/clouds.yaml && chmod 0640 /etc/openstack/clouds.yaml")
    assert done.rc == 0, done.stderr


def test_release_n_runs_the_hall(hall: None, cloud: Any) -> None:
    # the node is an instance in Nova, which release N's loop launched and recorded
    nova = cloud.connect()
    server = nova.compute.create_server(name=HOST, flavor_id=cloud.flavors["sco.small"], image_id=cloud.image_id,
                                        networks="none")  # fmt: skip
    nova.compute.wait_for_server(server, status="ACTIVE", wait=180)
    STATE["server"] = server.id
    STATE["instance"] = _fleet("record", {"hall": HALL, "pool": POOL, "flavor": cloud.flavors["sco.small"],
                                          "image": cloud.image_id, "name": HOST, "server": server.id}, N)  # fmt: skip
    STATE["serial"] = _wait(lambda: _bundle_serial_or_none(), 90, "a cached bundle")
    STATE["migrations"] = _migrations()
    STATE["pid"] = _agent_pid()
    STATE["spool_id"] = SC.host(HOST).run("cat /var/lib/sco/spool/spool.id").stdout.strip()
    assert _version("/opt/sco-agent") == N_VERSION and _version("/opt/sco") == N_VERSION
    names = [n for _, n in STATE["migrations"]]
    assert names and len(names) == len(set(names)), STATE["migrations"]
    _say(f"release N ({N_VERSION}): bundle serial {STATE['serial']}, migrations {names}, instance {server.id}")
    _put_work("1")


def _bundle_serial_or_none() -> int | None:
    try:
        return _bundle_serial()
    except (AssertionError, KeyError, TypeError, ValueError):
        return None


def test_upgrade_while_a_reclaim_is_under_way(hall: None, cloud: Any) -> None:
    log_path = LOGS / "upgrade-1.log"
    t0 = time.monotonic()
    timer = ThreadPoolExecutor(1)  # the loop's timer firing while the upgrade runs
    with open(log_path, "w") as log:
        play = subprocess.Popen(_upgrade_argv(), cwd=REPO, env=_env(N1), stdout=log, stderr=subprocess.STDOUT)
    held: list[int] = []  # processes stopped here, continued in the finally at the latest
    try:
        # The notice lands when the node agents' batch begins, before it installs N+1 (N's agent still runs): the
        # role waits for the drain before it replaces the release in the agent's venv, and again before the restart.
        # The order is made, not raced: the playbook is stopped at its node play's banner until the agent accepted
        # the notice (the reclaim takes seconds to publish), and the agent is then stopped in its drain until the
        # wait before the install has seen the drain open (a drain is ~25 s, the play's steps before the install as
        # long under load). Both stops are a slow scheduler and a slow drain to the parts; the drain still ends by T.
        def agents_batch() -> bool:
            return "PLAY [Node agents, in batches]" in log_path.read_text(errors="replace") or play.poll() is not None

        _wait(agents_batch, 1200, "the upgrade to reach the agents' batch")
        assert play.poll() is None, log_path.read_text()[-6000:]
        os.kill(play.pid, signal.SIGSTOP)
        held.append(play.pid)
        noticed_at = time.monotonic()
        notice, terminate_at = _reclaim()
        _say(f"reclaim of {HOST} (notice {notice}) sent {noticed_at - t0:.1f} s into the upgrade, "
             f"T in {terminate_at - time.time():.1f} s")  # fmt: skip

        def accepted() -> bool:
            return any(e.get("type") == "notice.accepted" and e.get("notice") == notice for e in _local_events())

        _wait(accepted, 30, f"the agent to accept notice {notice}", every=0.1)
        agent = _agent_pid()
        os.kill(agent, signal.SIGSTOP)
        held.append(agent)
        os.kill(play.pid, signal.SIGCONT)
        held.remove(play.pid)
        # the timer's run while the roll is half done (the control hosts on N+1, the node's agent on N): its first
        # step finishes the reclaim, deleting the instance at T
        _give_the_loop_its_cloud()
        assert play.poll() is None, "the upgrade ended before the control loop's run could start during it"
        during = timer.submit(_loop, "during the upgrade")

        def install_waited() -> bool:
            text = log_path.read_text(errors="replace").split("PLAY [Node agents, in batches]", 1)[1]
            wait = text.split("Wait for the drain before pip replaces files under its agent", 1)
            return (len(wait) == 2 and "FAILED - RETRYING: [sco-local]: Wait for the agent's drain to end" in wait[1]) \
                or play.poll() is not None  # fmt: skip

        _wait(install_waited, 600, "the node play's wait before the install to see the drain open")
        os.kill(agent, signal.SIGCONT)
        held.remove(agent)
        _say(f"agent {agent} held in its drain until the wait before the install had seen it "
             f"({terminate_at - time.time():.1f} s before T)")  # fmt: skip
        rc = play.wait(900)
    finally:
        for pid in held:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if play.poll() is None:
            play.kill()
        timer.shutdown(wait=False)
    out = log_path.read_text(errors="replace")
    took = time.monotonic() - t0
    assert rc == 0, out[-8000:]
    recap = _recap(out)
    assert recap["failed"] == 0 and recap["changed"] > 0, recap
    waited = out.count("FAILED - RETRYING: [sco-local]: Wait for the agent's drain to end")
    _say(f"run 1 in {took:.1f} s, {recap}; the agent's restart waited {waited} polls for its drain")
    # not deleted before T: Nova still has the server when the upgrade is over, if that is before T
    nova = cloud.connect()
    if time.time() < terminate_at - 1:
        assert nova.compute.find_server(STATE["server"], ignore_missing=True) is not None, "deleted before T"
        _say(f"the instance still in Nova {terminate_at - time.time():.1f} s before T")

    # the notice was not lost: accepted once, drained before T
    assert len(_of(notice, "notice.accepted")) == 1, _spool()[-10:]
    outcome = _wait(lambda: _outcome(notice), WINDOW, "the drain's outcome")
    assert outcome["type"] == "drain.drained", outcome
    assert outcome["at"] < terminate_at, (outcome, terminate_at)
    _say(f"drained {terminate_at - outcome['at']:.1f} s before T")

    # the loop's run during the upgrade (started while it ran) deleted the instance at T, and the fleet state says so
    started, said = during.result(timeout=WINDOW + 900)
    assert started < terminate_at, (started, terminate_at)
    m = re.search(rf"^finished the reclaim of {HOST}: deleted (at its T|([0-9.]+) s after its T) \((\w+)\)$", said,
                  re.M)  # fmt: skip
    assert m, said[-3000:]
    _wait(lambda: nova.compute.find_server(STATE["server"], ignore_missing=True) is None, 120,
          "Nova to have deleted the instance")  # fmt: skip
    account = _fleet("account", {"id": STATE["instance"]}, N1)
    kinds = [k for k, _ in account["events"]]
    asked = [at for k, at in account["events"] if k == "instance.delete_requested"]
    assert account["state"] == "deleted", account
    assert account["terminate_at"] == pytest.approx(terminate_at, abs=0.01), (account, terminate_at)
    assert kinds.count("reclaim.scheduled") == 1 and kinds.count("notice.published") == 1, kinds
    # its delete asked of Nova at or after T, by the fleet state's clock (T as it recorded it, not as printed)
    assert len(asked) == 1 and asked[0] >= account["terminate_at"], (asked, account)
    _say(f"the instance deleted {asked[0] - terminate_at:.2f} s after T by the loop's run during the upgrade "
         f"(started {terminate_at - started:.1f} s before T); fleet state: {kinds}")  # fmt: skip

    # N+1 put into the agent's venv only after the drain ended (pip replaces the files under the running agent,
    # which imports some modules only when it drains): the wait before the install saw the drain open
    node_play = out.split("PLAY [Node agents, in batches]", 1)[1]
    before_install = node_play.split("TASK [sco.orchestrator.node_agent : Install or upgrade sco in it]", 1)[0]
    assert "FAILED - RETRYING: [sco-local]: Wait for the agent's drain to end" in before_install, (
        "the notice landed after the release check: " + node_play[:6000]
    )
    record = SC.host(HOST).run(
        f"stat -c %Y /opt/sco-agent/lib/python3*/site-packages/spot_capacity_orchestrator-{N1_VERSION}.dist-info/RECORD"
    )
    assert record.rc == 0, record.stderr
    assert int(record.stdout) >= outcome["at"] - 1, (record.stdout, outcome)
    _say(f"N+1 installed in the agent's venv {int(record.stdout) - outcome['at']:.1f} s after the drain ended")

    # restarted only after its drain ended, as N+1, on N's spool
    pid = _agent_pid()
    assert pid != STATE["pid"], "the agent was not restarted"
    assert _started_at(pid) >= outcome["at"] - 1, (_started_at(pid), outcome)  # /proc's clock ticks: 10 ms
    assert _version("/opt/sco-agent") == N1_VERSION and _version("/opt/sco") == N1_VERSION
    assert SC.host(HOST).run("cat /var/lib/sco/spool/spool.id").stdout.strip() == STATE["spool_id"]
    assert _status()["drain"] is None
    _wait(lambda: _status()["events"]["unpublished"] == 0, 90, "N+1's agent to publish the spool's backlog")

    # every spooled event in the stream exactly once, in the agent's order
    spooled = _spool()
    got = [m for m in _stream(f"sco.events.{HALL}.{HOST}") if str(m["id"]).startswith(f"{STATE['spool_id']}.")]
    seqs = [m["event"].get("seq") for m in got]
    assert len(seqs) == len(set(seqs)), f"an event twice in the stream: {seqs}"
    assert seqs == sorted(seqs), f"out of order: {seqs}"
    assert [m["event"] for m in got] == spooled

    # the fleet state's schema went forward, each migration once; the bundle's serial did not go back
    after = _migrations()
    names = [n for _, n in after]
    assert after[: len(STATE["migrations"])] == STATE["migrations"], (STATE["migrations"], after)
    files = sorted((N1 / "src" / "sco" / "state" / "migrations").glob("*.sql"))
    assert after == [[int(f.stem.split("_", 1)[0]), f.stem.split("_", 1)[1]] for f in files], after
    serial = _wait(lambda: _bundle_serial_or_none(), 60, "a cached bundle")
    assert serial >= STATE["serial"], (STATE["serial"], serial)
    _say(f"{len(got)} events in SCO_EVENTS, each once; migrations {names}; bundle serial "
          f"{STATE['serial']} -> {serial}")  # fmt: skip
    STATE["pid"] = pid

    # and the timer's next run, after the upgrade
    _loop("after the upgrade")


def test_a_second_upgrade_changes_nothing(hall: None) -> None:
    t0 = time.monotonic()
    out = subprocess.run(_upgrade_argv(), cwd=REPO, env=_env(N1), capture_output=True, text=True, timeout=1200)
    (LOGS / "upgrade-2.log").write_text(out.stdout + out.stderr)
    assert out.returncode == 0, out.stdout[-8000:] + out.stderr[-2000:]
    recap = _recap(out.stdout)
    _say(f"run 2 in {time.monotonic() - t0:.1f} s, {recap}")
    assert recap["failed"] == 0 and recap["changed"] == 0, re.findall(r"^changed: .*$", out.stdout, re.M)
    assert _agent_pid() == STATE["pid"]


def test_a_drain_past_the_wait_fails_the_host_and_leaves_its_agent(hall: None) -> None:
    h = SC.host(HOST)
    _back_in_service()
    _put_work("2")
    log_path = LOGS / "upgrade-3.log"
    t0 = time.monotonic()
    # a changed setting (the log level) restarts the agent: its handler waits for the drain first
    with open(log_path, "w") as log:
        play = subprocess.Popen(
            _upgrade_argv("-e", "node_agent_log_level=debug", "-e", "node_agent_drain_wait_s=6"),
            cwd=REPO, env=_env(N1), stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    pid = 0
    try:
        # the notice when the agents' batch begins (the hall's window is short of the whole run's time here)
        def agents_batch() -> bool:
            return "PLAY [Node agents, in batches]" in log_path.read_text(errors="replace") or play.poll() is not None

        _wait(agents_batch, 1200, "the upgrade to reach the agents' batch")
        assert play.poll() is None, log_path.read_text()[-6000:]
        terminate_at = _notice("upgrade-2")
        pid = _agent_pid()

        def accepted() -> bool:
            return any(e.get("type") == "notice.accepted" and e.get("notice") == "upgrade-2" for e in _local_events())

        _wait(accepted, 30, "the agent to accept notice upgrade-2", every=0.1)
        os.kill(pid, signal.SIGSTOP)  # the drain stays open (no outcome) until SIGCONT: longer than the wait
        stopped_with = [e["type"] for e in _local_events() if e.get("notice") == "upgrade-2"]
        _say(f"agent {pid} stopped in its drain of upgrade-2 after {stopped_with}")
        assert not [t for t in stopped_with if t.startswith("drain.")], stopped_with  # still open
        rc = play.wait(900)
    finally:
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if play.poll() is None:
            play.kill()
    out = subprocess.CompletedProcess(play.args, rc, log_path.read_text(errors="replace"), "")
    took = time.monotonic() - t0
    assert out.returncode == 2, out.stdout[-8000:]
    recap = _recap(out.stdout)
    assert recap["failed"] == 1, recap
    line = re.search(r"node_agent: the drain of notice upgrade-2 \(T [0-9.]+\) is still open on sco-local after 6 s "
                     r"\(node_agent_drain_wait_s\): the agent is left as it is", out.stdout)  # fmt: skip
    assert line, out.stdout[-6000:]
    # max_fail_percentage 0: the play stopped with this batch
    assert "NO MORE HOSTS LEFT" in out.stdout, out.stdout[-4000:]
    # the agent was neither stopped nor restarted; its new settings are written for the next restart
    assert _agent_pid() == pid
    assert "debug" in h.file("/etc/sco/agent.toml").content_string
    # the restart is owed to the next run (the handler's marker, left when the wait failed the host)
    assert h.run("test -f /var/lib/sco/restart-pending").rc == 0
    _say(f"run 3 (drain held open) failed as it should in {took:.1f} s: {line.group(0)}")

    outcome = _wait(lambda: _outcome("upgrade-2"), WINDOW, "the held drain's outcome")
    assert outcome["at"] < terminate_at, (outcome, terminate_at)
    _say(f"the held drain ended ({outcome['type']}) {terminate_at - outcome['at']:.1f} s before T")
    # once the drain has ended the same run passes and restarts the agent with its new settings
    t0 = time.monotonic()
    again = subprocess.run(_upgrade_argv("-e", "node_agent_log_level=debug"), cwd=REPO, env=_env(N1),
                           capture_output=True, text=True, timeout=1200)  # fmt: skip
    (LOGS / "upgrade-4.log").write_text(again.stdout + again.stderr)
    assert again.returncode == 0, again.stdout[-8000:]
    # nothing else changed since run 3: the marker alone makes this run restart the agent, then it goes
    assert _agent_pid() != pid
    assert h.run("test -e /var/lib/sco/restart-pending").rc != 0
    _say(f"run 4 (after the drain) in {time.monotonic() - t0:.1f} s, {_recap(again.stdout)}")
