"""The DCP training job on a Kubernetes node: the job is a real process attached to a pod of the API stand-in (it
gets TERM when the stand-in's kubelet starts terminating the pod's containers and KILL when they exit, at the end
of the grace), the real agent tells it of the notice through its checkpoint socket, and the real Ceph RGW keeps its
checkpoints. On the scheduler path (eviction with the contract's grace) and on the fallback path (API silent:
logind stand-in on a real dbus-daemon, kubelet's graceful node shutdown), it checkpoints before its grace ends and
a new pod on another node resumes from that checkpoint, bitwise equal to an uninterrupted run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from sco.control.drill import fold
from sco_devkit.devcluster.ceph import CephCluster
from sco_devkit.standins.kube_apiserver import KubeApiStandIn
from sco_devkit.standins.logind import LogindStandIn, PrivateBus
from tests.dcp_runs import SMALL, assert_bitwise, provision, reference, workload_env
from tests.harness import (
    AgentEnv,
    KubeletDouble,
    NatsServer,
    PodCgroups,
    add_pod,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 20.0
STEPS, EVERY = 24, 8


class PodProcess:
    """A workload process standing in for a pod's container: TERM when the stand-in's kubelet starts the pod's
    termination (after its preStop), KILL when the stand-in says the containers exited (the grace is over)."""

    def __init__(self, kube: KubeApiStandIn, pod: dict[str, Any], argv: list[str], env: dict[str, str]) -> None:
        self.kube, self.uid = kube, pod["metadata"]["uid"]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        self.lines: list[dict[str, Any]] = []
        self.termed_at: float | None = None
        self.killed_at: float | None = None
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=self._kubelet, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(json.loads(line))

    def _kubelet(self) -> None:
        c = self.kube.cluster
        while self.proc.poll() is None:
            with c.lock:
                cont = c.containers.get(self.uid)
                started = cont.term_started if cont else None
                prestop = cont.prestop if cont else 0.0
            if cont is None:  # the containers exited: whatever still runs is killed
                if self.proc.poll() is None:
                    self.killed_at = time.time()
                    self.proc.kill()
                return
            if started is not None and self.termed_at is None and time.monotonic() >= started + prestop:
                self.termed_at = time.time()
                self.proc.send_signal(signal.SIGTERM)
            time.sleep(0.01)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in self.lines if m["kind"] == kind]

    def wait(self, kind: str, timeout: float = 90) -> dict[str, Any]:
        what = f"{kind!r} from the workload (exit {self.proc.poll()}, killed at {self.killed_at}, saw {self.lines})"
        return dict(wait_for(lambda: self.of(kind), timeout, what)[0])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class KubeletShutdown(KubeletDouble):
    """kubelet's graceful node shutdown giving each pod the grace of its priority band (8 s here, as role
    kubelet_graceful_shutdown sets for the workloads' band), not the double's 1 s."""

    GRACE = 8

    def _run(self) -> None:
        msg = self._q.queue.get()
        assert msg.body == (True,)
        self.prepare_at = time.time()
        c = self.kube.cluster
        with c.lock:
            pods = [p for p in c.pods.values() if p["spec"].get("nodeName") == self.node]
        for p in sorted(pods, key=lambda p: p["spec"].get("priority", 0)):
            c.delete_pod(p["metadata"]["namespace"], p["metadata"]["name"], self.GRACE)
            self.terminated.append((f"{p['metadata']['namespace']}/{p['metadata']['name']}", time.time()))
        names = {n.split("/")[1] for n, _ in self.terminated}
        wait_for(lambda: not [k for k in c.pods if k[1] in names], self.GRACE + 5, "pods")
        self.lock.release()


def _argv(bucket: str, run: str, out: Path) -> list[str]:
    return [sys.executable, "-m", "sco_workloads.dcp_train", "--run", run, "--store", f"s3://{bucket}/runs/",
            "--steps", str(STEPS), "--every", str(EVERY), "--step-seconds", "0.1", "--contract", "batch",
            *SMALL, "--out", str(out)]  # fmt: skip


def _through_a_reclaim(
    tmp_path: Path, kube: KubeApiStandIn, env: AgentEnv, ceph: CephCluster, sock: Path, run: str, silent: bool,
    cgroups: PodCgroups, bus_address: str | None = None,
) -> None:  # fmt: skip
    creds = provision(ceph, "batch")
    wenv = {**workload_env(ceph, creds), "SCO_CHECKPOINT_SOCKET": str(sock)}
    # the batch contract: 12 s budget (the grace); the container may take up to 8 s after TERM, within it
    pod = add_pod(kube, "batch", f"{run}-0", env.node, grace=30, shutdown=8)
    kubelet = KubeletShutdown(bus_address, kube, env.node) if bus_address else None
    w = None
    try:
        env.start().wait_subscribed()
        # the pod's process in the pod's cgroup: the agent binds its registration to the pod (and its contract)
        w = PodProcess(kube, pod, cgroups.argv(pod, _argv(creds["bucket"], run, tmp_path / "unused.pt")), wenv)
        w.wait("registered")
        w.wait("checkpoint")  # its first periodic one
        time.sleep(0.35)  # a step in progress
        if silent:
            kube.go_silent(30)
        t0 = env.send(env.notice(f"dcp-{run}", WINDOW))
        out = env.outcome(WINDOW)
        assert out["type"] == "drain.drained" and out["at"] < t0 + WINDOW
        assert out.get("path", "scheduler") == ("around" if silent else "scheduler")
        noticed = w.wait("noticed")
        assert noticed["via"] in ("socket", "SIGTERM")  # the socket tells at once; TERM may race it
        assert noticed["checkpointed"] and w.wait("acked")
        assert w.proc.wait(10) == 75 and w.killed_at is None, noticed  # checkpointed, left before its grace ended
        done = env.of("checkpoint.done")[0]
        assert done["report"] == {"checkpointed": True, "save_s": noticed["save_s"], "step": noticed["step"]}
        (lost,) = out["workloads"]
        assert lost["checkpointed"] and lost["save_within_budget"] and lost["state"] == "done"
        assert lost["save_s"] < lost["budget_s"]
        assert fold(env.node, env.events(), notice=f"dcp-{run}").workloads == [lost]  # the drill report's figures
        # a new pod on another node (no agent there: no socket) resumes from that checkpoint
        if kubelet is not None:
            kubelet.close()
            kubelet = None
        kube.latency_s, kube.silent = 0, False
        kube.cluster.add_node("node-2")
        pod2 = add_pod(kube, "batch", f"{run}-1", "node-2", grace=30)
        final = tmp_path / f"{run}-final.pt"
        w2 = PodProcess(kube, pod2, _argv(creds["bucket"], run, final), {**wenv, "SCO_CHECKPOINT_SOCKET": ""})
        assert w2.proc.wait(90) == 0
        resumed = w2.of("resumed")[0]
        assert resumed["from_step"] == noticed["step"] and resumed["steps_redone"] == 0
        assert_bitwise(final, reference(STEPS, *SMALL))
    finally:
        kube.latency_s, kube.silent = 0, False
        if w is not None:
            w.stop()
        if kubelet is not None:
            kubelet.close()
        env.stop()


def test_checkpoints_on_the_socket_notice_on_the_scheduler_path(
    tmp_path: Path, kube: KubeApiStandIn, nats_server: NatsServer, ceph: CephCluster, pod_cgroups: PodCgroups
) -> None:
    with tempfile.TemporaryDirectory(prefix="sco-ck-") as d:
        sock = Path(d) / "ck.sock"
        env = AgentEnv(
            tmp_path / "agent", kube, nats_server, checkpoint_socket=str(sock), kube_cgroup_root=pod_cgroups.root
        )
        _through_a_reclaim(tmp_path, kube, env, ceph, sock, "kube-api", silent=False, cgroups=pod_cgroups)


def test_checkpoints_before_kubelet_shutdown_when_the_api_is_silent(
    tmp_path: Path,
    kube: KubeApiStandIn,
    nats_server: NatsServer,
    ceph: CephCluster,
    bus: PrivateBus,
    logind: LogindStandIn,
    pod_cgroups: PodCgroups,
) -> None:
    with tempfile.TemporaryDirectory(prefix="sco-ck-") as d:
        sock = Path(d) / "ck.sock"
        env = AgentEnv(
            tmp_path / "agent",
            kube,
            nats_server,
            checkpoint_socket=str(sock),
            logind_bus=bus.address,
            kube_cgroup_root=pod_cgroups.root,
        )
        _through_a_reclaim(
            tmp_path, kube, env, ceph, sock, "kube-around", silent=True, cgroups=pod_cgroups, bus_address=bus.address
        )
