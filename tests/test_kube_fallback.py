"""The kubelet graceful-shutdown fallback around a silent Kubernetes API (seed view 19, fourth row).

A real dbus-daemon (Debian's ``dbus``) carries the logind **stand-in** (``sco_devkit.standins.logind``); a test-side
kubelet double takes its own delay lock and, on ``PrepareForShutdown``, terminates the node's pods by priority
(through the stand-in cluster directly, as kubelet acts locally) before letting go. The agent is its own process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sco.agent.inhibit import InhibitError, Logind
from sco_devkit.standins.kube_apiserver import KubeApiStandIn
from sco_devkit.standins.logind import LogindStandIn, PrivateBus
from tests.harness import AgentEnv, KubeletDouble, NatsServer, PodCgroups, add_pod, wait_for

WINDOW = 20.0


def _link(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


# --- the stand-in keeps logind's rules --------------------------------------------------------------


def test_the_lock_is_the_descriptor(bus: PrivateBus, logind: LogindStandIn) -> None:
    lg = Logind(bus.address)
    lock = lg.inhibit_sync("sco-agent", "final write")
    held = lg.inhibitors_sync()
    assert [(i["who"], i["mode"], i["what"], i["pid"]) for i in held] == [
        ("sco-agent", "delay", "shutdown", os.getpid())
    ]
    assert lg.delay_max_sync() == 8.0
    # the stand-in (a thread of this process) closed its own copy of the write end after replying: the pipe is
    # open twice here, our write end and its read end, not three times
    pipe = os.readlink(f"/proc/self/fd/{lock.fd}")
    assert pipe.startswith("pipe:")
    assert sum(1 for fd in os.listdir("/proc/self/fd") if _link(fd) == pipe) == 2
    lock.release()
    wait_for(lambda: not lg.inhibitors_sync(), 2, "the lock released")


def test_delay_lock_holds_shutdown_until_released(bus: PrivateBus, logind: LogindStandIn) -> None:
    lg = Logind(bus.address)
    lock = lg.inhibit_sync("sco-agent", "final write")
    lg.poweroff_sync()
    time.sleep(0.5)
    assert logind.shutdowns == [] and logind.preparing
    with pytest.raises(InhibitError, match="OperationInProgress"):
        lg.inhibit_sync("late", "too late")  # no new shutdown lock once the shutdown is under way
    t_release = time.time()
    lock.release()
    wait_for(lambda: logind.shutdowns, 2, "the shutdown to proceed")
    assert logind.shutdowns[0]["proceeded"] == "released" and logind.shutdowns[0]["at"] >= t_release


def test_delay_is_capped_and_block_refuses(bus: PrivateBus) -> None:
    s = LogindStandIn(bus.address, inhibit_delay_max_s=1).start()
    try:
        lg = Logind(bus.address)
        with pytest.raises(InhibitError, match="Delay inhibitors only supported for shutdown and sleep"):
            lg.inhibit_sync("x", "y", what="idle", mode="delay")
        with pytest.raises(InhibitError, match="Invalid mode"):
            lg.inhibit_sync("x", "y", mode="sometimes")
        block = lg.inhibit_sync("backup", "copying", mode="block")
        with pytest.raises(InhibitError, match="BlockedByInhibitorLock"):
            lg.poweroff_sync()
        block.release()
        wait_for(lambda: not lg.inhibitors_sync(), 2, "the block lock released")
        lock = lg.inhibit_sync("stuck", "never lets go")
        t0 = time.time()
        lg.poweroff_sync()
        wait_for(lambda: s.shutdowns, 5, "the shutdown after InhibitDelayMaxSec")
        assert s.shutdowns[0]["proceeded"] == "timeout" and s.shutdowns[0]["at"] - t0 >= 1.0
        lock.release()
    finally:
        s.stop()


def test_a_dead_holder_releases_its_lock(bus: PrivateBus, logind: LogindStandIn) -> None:
    code = (
        "import sys,time; from sco.agent.inhibit import Logind; "
        "Logind(sys.argv[1]).inhibit_sync('holder','x'); print('held', flush=True); time.sleep(60)"
    )
    p = subprocess.Popen([sys.executable, "-c", code, bus.address], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "held"
        assert [i.who for i in logind.held()] == ["holder"]
        os.kill(p.pid, signal.SIGKILL)
        wait_for(lambda: not logind.held(), 2, "the killed holder's lock released")
    finally:
        p.kill()
        p.wait()


def test_no_bus_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(InhibitError, match=r"D-Bus unix:path=.*/nobus.sock: cannot connect"):
        Logind(f"unix:path={tmp_path}/nobus.sock").inhibit_sync("x", "y")


# --- the switch -------------------------------------------------------------------------------------


@pytest.fixture
def agent_env(tmp_path: Path, kube: KubeApiStandIn, nats_server: NatsServer, bus: PrivateBus) -> Iterator[AgentEnv]:
    env = AgentEnv(tmp_path / "agent", kube, nats_server, logind_bus=bus.address)
    yield env
    env.stop()


def _audit_after(kube: KubeApiStandIn, t: float, *verbs: str) -> list[dict[str, Any]]:
    return [a for a in kube.cluster.audit if a["at"] > t and a["verb"] in verbs]


def test_api_silent_switches_to_kubelet_shutdown(
    agent_env: AgentEnv, kube: KubeApiStandIn, logind: LogindStandIn, bus: PrivateBus
) -> None:
    """The issue's case: the API goes silent 1 s after the notice while a PodDisruptionBudget holds a pod.
    Before: the agent retried until the deadline and reported an overrun with the pod still there. Now: within
    ~800 ms of silence it stops asking, holds a delay lock, powers off through logind so kubelet's graceful
    node shutdown terminates the pods, spools the outcome before letting the shutdown proceed, and taints the
    node once the API answers again."""
    env = agent_env
    add_pod(kube, "web", "web-0", env.node, prestop=0.3)
    add_pod(kube, "guarded", "g-0", env.node, labels={"app": "g"}, prestop=0.3)
    kube.cluster.create_pdb(
        "guarded", {"metadata": {"name": "g"}, "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "g"}}}}
    )
    kubelet = KubeletDouble(bus.address, kube, env.node)
    try:
        env.start().wait_subscribed()
        t0 = env.send(env.notice("silent-1", WINDOW))
        wait_for(lambda: env.of("eviction.blocked"), 5, "the PDB's first 429")
        t_silent = time.time()
        kube.go_silent(30)  # the API server stops answering (watches go quiet too)
        fb = wait_for(lambda: env.of("drain.fallback"), 5, "the switch to the fallback")[0]
        assert fb["at"] - t_silent >= 0.8  # it waited for the 800 ms timeout, no less
        taken = wait_for(lambda: env.of("inhibitor.taken"), 5, "the inhibitor")[0]
        assert wait_for(lambda: env.of("shutdown.requested"), 5, "the power-off request")[0]["at"] >= taken["at"]
        out = env.outcome(WINDOW)
        assert out["type"] == "drain.drained" and out["path"] == "around" and out["kubelet_shutdown"] is True
        assert "guarded/g-0" in out["terminated_by_kubelet"]
        assert out["at"] < t0 + WINDOW - 1
        # the PDB-held pod was terminated by kubelet (which ignores PDBs), not by the agent
        assert ("guarded", "g-0") not in kube.cluster.pods
        assert "guarded/g-0" in [n for n, _ in kubelet.terminated]
        # the agent stopped asking: nothing it sent reached the API after the switch
        after = _audit_after(kube, fb["at"], "evict", "evict-refused", "delete", "patch")
        assert [(a["verb"], a["name"]) for a in after] == [("delete", n.split("/")[1]) for n, _ in kubelet.terminated]
        # the shutdown waited for the agent's lock, which went only after the outcome was on disk
        wait_for(lambda: logind.shutdowns, 5, "the shutdown to proceed")
        released = env.of("inhibitor.released")[0]  # spooled just after the descriptor was closed
        assert taken["at"] < out["at"] <= logind.shutdowns[0]["at"] and out["at"] <= released["at"]
        assert logind.shutdowns[0]["proceeded"] == "released"
        assert env.of("scheduler.report_pending")
        assert not env.of("scheduler.told")
        kube.latency_s, kube.silent = 0, False  # the API answers again: the scheduler learns late
        told = wait_for(lambda: env.of("scheduler.told"), 15, "the late report")[0]
        assert told["notice"] == "silent-1" and told["tainted"]
        node = kube.cluster.nodes[env.node]
        assert any(t["key"] == "sco.dev/reclaim" for t in node["spec"]["taints"])
        assert node["metadata"]["annotations"]["sco.dev/reclaim-notice"] == "silent-1"
    finally:
        kube.latency_s, kube.silent = 0, False
        kubelet.close()


def test_fallback_without_kubelet_shutdown_says_so(
    agent_env: AgentEnv, kube: KubeApiStandIn, logind: LogindStandIn
) -> None:
    """No kubelet lock on the bus (graceful node shutdown not configured): the agent still holds its lock for its
    own final write, but reports an overrun naming the missing kubelet configuration."""
    env = agent_env
    add_pod(kube, "web", "web-0", env.node, prestop=0.3)
    kube.go_silent(30)  # silent from the start
    try:
        env.start().wait_subscribed()
        t0 = env.send(env.notice("silent-2", WINDOW))
        out = env.outcome(WINDOW)
        assert out["type"] == "drain.overrun" and out["path"] == "around"
        assert "graceful node shutdown is not configured" in out["reasons"][0]
        assert out["reasons"][1].startswith("the node's pods were never listed (API silent since")
        assert env.of("drain.fallback")[0]["at"] - t0 < 3
        assert out["at"] < t0 + WINDOW - 1
    finally:
        kube.latency_s, kube.silent = 0, False


def test_shutdown_waits_for_the_workloads_final_write(
    tmp_path: Path,
    kube: KubeApiStandIn,
    nats_server: NatsServer,
    bus: PrivateBus,
    logind: LogindStandIn,
    pod_cgroups: PodCgroups,
) -> None:
    """Around a silent API, the agent's lock holds the shutdown until the workload on the checkpoint socket has
    answered done (its final write), even after kubelet has let go."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory(prefix="sco-ck-") as d:
        sock = Path(d) / "ck.sock"
        env = AgentEnv(
            tmp_path / "agent",
            kube,
            nats_server,
            logind_bus=bus.address,
            checkpoint_socket=str(sock),
            kube_cgroup_root=pod_cgroups.root,
        )
        pod = add_pod(kube, "web", "web-0", env.node, prestop=0.3)
        kubelet = KubeletDouble(bus.address, kube, env.node)
        client = None
        try:
            env.start().wait_subscribed()
            # the pod's own process (its cgroup), under the pod's contract
            argv = [sys.executable, "-m", "tests.checkpoint_workload", str(sock), "trainer", "done:2.5", "web"]
            client = subprocess.Popen(pod_cgroups.argv(pod, argv), stdout=subprocess.PIPE, text=True)
            assert client.stdout is not None
            assert json.loads(client.stdout.readline())["kind"] == "registered"
            kube.go_silent(30)
            t0 = env.send(env.notice("ck-around-1", WINDOW))
            out = env.outcome(WINDOW)
            assert out["type"] == "drain.drained" and out["path"] == "around" and out["at"] < t0 + WINDOW
            assert out["checkpoint"] == {"done": 1}
            done = env.of("checkpoint.done")[0]
            kubelet_done = env.of("kubelet.shutdown_done")[0]
            assert kubelet_done["at"] < done["at"]  # kubelet let go first; the agent still held the shutdown
            wait_for(lambda: logind.shutdowns, 5, "the shutdown")
            assert done["at"] <= out["at"] <= logind.shutdowns[0]["at"]
        finally:
            kube.latency_s, kube.silent = 0, False
            if client is not None:
                client.kill()
                client.wait()
            kubelet.close()
            env.stop()


def test_preflight_says_when_logind_cannot_hold_a_shutdown(
    tmp_path: Path, kube: KubeApiStandIn, nats_server: NatsServer, bus: PrivateBus
) -> None:
    """At start-up: logind's InhibitDelayMaxSec left at its 5 s default is named (apart from the scheduler's
    preflight, which stays clean); so is a bus that cannot be reached."""
    short = LogindStandIn(bus.address, inhibit_delay_max_s=5).start()
    env = AgentEnv(tmp_path / "a", kube, nats_server, logind_bus=bus.address)
    gone = AgentEnv(tmp_path / "b", kube, nats_server, node="node-2", logind_bus=f"unix:path={tmp_path}/nobus")
    try:
        env.start()
        problems = wait_for(lambda: env.of("fallback.preflight"), 10, "the fallback preflight")[0]["problems"]
        assert problems == [
            "logind's InhibitDelayMaxSec is 5 s: around a silent API server kubelet's graceful node shutdown and"
            " the agent's final write would be cut short (role kubelet_graceful_shutdown sets it)"
        ]
        assert not env.of("scheduler.preflight")
        gone.start()
        problems = wait_for(lambda: gone.of("fallback.preflight"), 10, "the fallback preflight")[0]["problems"]
        assert "cannot connect" in problems[0] and "cannot take a shutdown inhibitor" in problems[0]
    finally:
        env.stop()
        gone.stop()
        short.stop()
