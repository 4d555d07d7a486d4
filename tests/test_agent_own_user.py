"""The agent as its own user, as role node_agent's unit runs it: not root, no capability on a
Kubernetes node, CAP_KILL only on a Slurm node. Each drain path still lands inside its deadline; the Slurm path
around a silent slurmctld finds the jobs' processes without reading another user's /proc/<pid>/fd and signals them
with CAP_KILL, and without CAP_KILL it cannot (what the capability is for). The whole of the agent's tests run
this way with SCO_TEST_AGENT_USER=nobody (tests/harness.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sco.contract.bundle import Bundle
from sco.contract.signing import Keyring, generate
from sco.schedulers.slurm_admission import render_lua, write
from sco_devkit.devcluster.slurm import SlurmCluster
from sco_devkit.standins.kube_apiserver import KubeApiStandIn
from tests.harness import AgentEnv, NatsServer, add_pod, hall_bundle, outside_pytest_tmp, wait_for
from tests.slurm_hall import JOB, ROOT, WINDOW, running_on

USER = "nobody"  # a named user: slurm.conf's SlurmUser takes a name


def _proc_status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def _as_its_user(env: AgentEnv, agent_bin: Path) -> AgentEnv:
    env.agent_bin = agent_bin
    return env


def test_kube_drain_as_its_own_user_without_capabilities(
    tmp_path: Path, kube: KubeApiStandIn, nats_server: NatsServer, own_user_agent_bin: Path
) -> None:
    env = _as_its_user(AgentEnv(tmp_path / "agent", kube, nats_server, user=USER), own_user_agent_bin)
    for i in range(20):
        add_pod(kube, "web", f"w-{i:02d}", "node-1", prestop=0.3)
    try:
        env.start().wait_subscribed()
        assert env.proc is not None
        st = _proc_status(env.proc.pid)
        assert st["Uid"].split()[0] == "65534" and st["CapEff"] == st["CapBnd"] == "0000000000000000", st
        t0 = env.send(env.notice("own-user-kube", WINDOW))
        out = env.outcome(WINDOW)
        assert out["type"] == "drain.drained" and out["at"] < t0 + WINDOW - 2  # inside the deadline, margin kept
        assert len(env.of("pod.gone")) == 20, [e["type"] for e in env.events()]
    finally:
        env.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """Slurm with the agent's user as SlurmUser: Slurm decides by uid who may DRAIN, signal and requeue, and a hall
    without slurmdbd (no operator grant) gives the agent that (role node_agent's README)."""
    root = outside_pytest_tmp(tmp_path_factory.mktemp("own-user") / "slurm", USER)
    key = generate()
    bundle = Bundle.from_bytes(hall_bundle(root, key), Keyring([key.public]))
    c = SlurmCluster(root, nodes=("n1", "n2"), job_submit_lua=ROOT / "slurm_plugins" / "job_submit.lua",
                     slurm_user=USER)  # fmt: skip
    c.write_conf()
    write(root, render_lua(bundle.hall, bundle.serial, bundle.contracts, ["spot"]), bundle.serial)
    c.start()
    (root / "jobs").mkdir(exist_ok=True)
    (root / "jobs" / "job.sh").write_text(JOB.format(jobs=root / "jobs"))
    yield c
    c.stop()


def _around(tmp_path: Path, nats: NatsServer, c: SlurmCluster, agent_bin: Path, caps: tuple[str, ...]) -> None:
    """A root job on a node whose agent runs as USER with ``caps``; slurmctld frozen at the notice."""
    jid = c.sbatch(c.root / "jobs" / "job.sh", "--account=climate", "--comment=sco-contract=climate-sims")
    node = running_on(c, jid)
    # the job's script running under its slurmstepd, not only R in squeue: under CI's load the stepd came up after
    # the notice once, and the agent, finding no job process on the node, called it drained
    wait_for(lambda: (c.root / "jobs" / f"marker.{jid}.start").exists(), 30, "the job's script started", 0.2)
    env = AgentEnv(tmp_path / f"agent-{node}", None, nats, node=node, user=USER, slurm_conf=str(c.conf),
                   slurmd_spool_dir=str(c.spool / "%n"))  # fmt: skip
    env.agent_bin, env.caps = agent_bin, caps
    try:
        env.start().wait_subscribed()
        assert env.proc is not None
        assert _proc_status(env.proc.pid)["CapEff"] == ("0000000000000020" if caps else "0000000000000000")
        c.freeze_ctld()
        t0 = env.send(env.notice(f"own-user-{jid}", WINDOW))
        out = env.outcome(WINDOW)
        sig = env.of("job.signalled")
        marker = c.root / "jobs" / f"marker.{jid}.usr1"
        if caps:
            # found without the stepd's file descriptors (another user's), signalled at once, drained in time
            assert out["type"] == "drain.drained" and out["path"] == "around" and out["at"] < t0 + WINDOW
            assert out["method"] == "stepd-tree" and sig and sig[0]["job"] == jid and sig[0]["pids"]
            assert float(wait_for(lambda: marker.exists() and marker.read_text().split(), 5, "USR1")[0]) - t0 < 4
            c.thaw_ctld()  # and slurmctld, which takes the agent's user as privileged, learns late
            told = wait_for(lambda: env.of("scheduler.told"), 30, "slurmctld told", 0.2)
            assert told[0]["requeued"] == [jid]
        else:
            # without CAP_KILL it may not signal another user's job: nothing was sent, the job ran to the deadline
            seen = (out, [(e["type"], e.get("pids"), e.get("method")) for e in env.events()], env.logtext()[-3000:])
            assert out["type"] == "drain.overrun" and sig and sig[0]["pids"] == [] and not marker.exists(), seen
            assert "signalling another user's job needs CAP_KILL" in env.logtext()
    finally:
        c.thaw_ctld()
        env.stop()
        c.run("scancel", "--user=root", check=False)
        wait_for(lambda: not c.run("squeue", "-h", check=False).strip(), 30, "no jobs left", 0.2)
        for n in c.nodes:
            c.run("scontrol", "update", f"nodename={n}", "state=RESUME", check=False)
        time.sleep(0.5)


def test_slurm_around_as_its_own_user_with_cap_kill(
    tmp_path: Path, nats_server: NatsServer, cluster: SlurmCluster, own_user_agent_bin: Path
) -> None:
    _around(tmp_path, nats_server, cluster, own_user_agent_bin, ("kill",))


def test_slurm_around_without_cap_kill_cannot_signal(
    tmp_path: Path, nats_server: NatsServer, cluster: SlurmCluster, own_user_agent_bin: Path
) -> None:
    _around(tmp_path, nats_server, cluster, own_user_agent_bin, ())


def _role_resolves(slurm_conf: Path, tmp: Path) -> str:
    """The user role node_agent runs a Slurm node's agent as, node_agent_user unset: its own tasks (user.yml) on
    this machine, reading ``slurm_conf``."""
    play = tmp / "resolve.yml"
    play.write_text(
        "- hosts: localhost\n  gather_facts: false\n  tasks:\n"
        "    - {ansible.builtin.include_role: {name: sco.orchestrator.node_agent, tasks_from: user.yml}}\n"
        "    - {ansible.builtin.copy: {content: '{{ _node_agent_user }}', dest: " + str(tmp / "user") + "}}\n"
    )
    env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(ROOT / "collections"), "ANSIBLE_LOCALHOST_WARNING": "False"}
    argv = [str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,", "-c", "local", str(play),
            "-e", f"ansible_python_interpreter={sys.executable}", "-e",
            f"node_agent_scheduler=slurm node_agent_slurm_conf={slurm_conf} node_agent_state=present"]  # fmt: skip
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return (tmp / "user").read_text()


def _through_slurmctld(tmp_path: Path, nats: NatsServer, c: SlurmCluster, agent_bin: Path, user: str) -> AgentEnv:
    """A root job on a node whose agent runs as ``user`` (CAP_KILL, as on a Slurm node); slurmctld answers."""
    jid = c.sbatch(c.root / "jobs" / "job.sh", "--account=climate", "--comment=sco-contract=climate-sims")
    node = running_on(c, jid)
    env = AgentEnv(tmp_path / f"agent-{user}-{node}", None, nats, node=node, user=user, slurm_conf=str(c.conf),
                   slurmd_spool_dir=str(c.spool / "%n"))  # fmt: skip
    env.agent_bin = agent_bin
    env.start().wait_subscribed()
    env.send(env.notice(f"through-{user}-{jid}", WINDOW))
    return env


def _clean(c: SlurmCluster, env: AgentEnv) -> None:
    env.stop()
    c.run("scancel", "--user=root", check=False)
    wait_for(lambda: not c.run("squeue", "-h", check=False).strip(), 30, "no jobs left", 0.2)
    for n in c.nodes:
        c.run("scontrol", "update", f"nodename={n}", "state=RESUME", check=False)
    time.sleep(0.5)


def test_slurm_drain_through_slurmctld_as_the_user_the_role_resolves(
    tmp_path: Path, nats_server: NatsServer, cluster: SlurmCluster, own_user_agent_bin: Path
) -> None:
    """Slurm decides by uid who may DRAIN: the user role node_agent picks for a Slurm node without slurmdbd (the
    cluster's SlurmUser) drains through slurmctld; a user that is neither SlurmUser nor an operator (sco-agent
    without `sacctmgr ... adminlevel=Operator`; here daemon, which every Debian has) gets 'Invalid user id'."""
    user = _role_resolves(cluster.conf, tmp_path)
    assert user == USER  # the devkit cluster's SlurmUser
    env = _through_slurmctld(tmp_path, nats_server, cluster, own_user_agent_bin, user)
    try:
        out = env.outcome(WINDOW + 10)
        assert out["type"] == "drain.drained" and out["path"] == "scheduler", out
        assert env.of("node.drain_set") and env.of("job.requeued"), [e["type"] for e in env.events()]
        state = cluster.run("sinfo", "-h", "-n", env.node, "-o", "%T").strip()
        assert state.startswith("drain"), state
    finally:
        _clean(cluster, env)

    env = _through_slurmctld(tmp_path, nats_server, cluster, own_user_agent_bin, "daemon")
    try:
        wait_for(lambda: "Invalid user id" in env.logtext(), WINDOW, "slurmctld refusing the drain", 0.2)
        assert not env.of("node.drain_set")
        state = cluster.run("sinfo", "-h", "-n", env.node, "-o", "%T").strip()
        assert not state.startswith("drain"), state
    finally:
        _clean(cluster, env)
