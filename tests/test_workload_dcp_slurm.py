"""The DCP training job end to end on Slurm: real slurmctld/slurmd (loopback), the real agent on the job's node, the
real Ceph RGW as the checkpoint store.

With a notice: admitted requeueable by the contract's job_submit.lua, USR1 (and the checkpoint socket's notice)
-> the step in progress finished, a checkpoint saved, ``done`` with its save time -> requeued at once -> resumed
on another node from that checkpoint, no step redone -> final parameters bitwise equal to an uninterrupted run;
the drain outcome carries the lost-work figures.

Without a notice (the node dies: frozen, marked DOWN, its processes killed): resumed from the last periodic
checkpoint, the steps redone counted (at most ``--every``), final parameters still bitwise equal.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sco.control.drill import fold
from sco_devkit.devcluster.ceph import CephCluster
from sco_devkit.devcluster.slurm import SlurmCluster
from tests.dcp_runs import SMALL, assert_bitwise, lines, provision, reference
from tests.harness import NatsServer, wait_for
from tests.slurm_hall import WINDOW, agent_for

ROOT = Path(__file__).resolve().parents[1]
STEPS, EVERY = 24, 8

# exec: the training process is the batch step itself, so USR1 (scancel --full) and a node's death reach it.
JOB = """#!/bin/bash
#SBATCH --output={jobs}/dcp-out.%j
#SBATCH --open-mode=append
export AWS_ACCESS_KEY_ID={ak} AWS_SECRET_ACCESS_KEY={sk} AWS_ENDPOINT_URL={endpoint}
export SCO_CHECKPOINT_SOCKET={sockdir}/$SLURMD_NODENAME.sock
echo $$ > {jobs}/dcp-pid.$SLURM_JOB_ID
cd {root}
exec {python} -m sco_workloads.dcp_train --run job-$SLURM_JOB_ID --store s3://{bucket}/runs/ --steps {steps} \\
  --every {every} --step-seconds 0.1 --contract genomics-ckpt {small} --out {jobs}/dcp-final.$SLURM_JOB_ID.pt
"""


def _job(c: SlurmCluster, ceph: CephCluster, creds: dict[str, Any], sockdir: str) -> Path:
    script = c.root / "jobs" / "dcp-job.sh"
    script.write_text(
        JOB.format(
            jobs=c.root / "jobs",
            ak=creds["access_key"],
            sk=creds["secret_key"],
            endpoint=ceph.endpoint,
            sockdir=sockdir,
            root=ROOT,
            python=sys.executable,
            bucket=creds["bucket"],
            steps=STEPS,
            every=EVERY,
            small=" ".join(SMALL),
        )
    )
    return script


def _out(c: SlurmCluster, jid: int) -> list[dict[str, Any]]:
    p = c.root / "jobs" / f"dcp-out.{jid}"
    return lines(p.read_text()) if p.exists() else []


def _kinds(c: SlurmCluster, jid: int, kind: str) -> list[dict[str, Any]]:
    return [m for m in _out(c, jid) if m["kind"] == kind]


def _finished(c: SlurmCluster, jid: int) -> bool:
    return bool(_kinds(c, jid, "finished")) and c.job(jid).get("JobState") == "COMPLETED"


def test_notice_saves_requeues_and_resumes_bitwise_elsewhere(
    tmp_path: Path,
    nats_server: NatsServer,
    clean: SlurmCluster,
    ceph: CephCluster,
) -> None:
    c = clean
    creds = provision(ceph, "genomics-ckpt")
    ref = reference(STEPS, *SMALL)
    with tempfile.TemporaryDirectory(prefix="sco-ck-") as sockdir:
        env = agent_for(tmp_path, nats_server, c, "n1")
        sock = f"{sockdir}/n1.sock"
        env.config.write_text(env.config.read_text().replace('checkpoint_socket = ""', f'checkpoint_socket = "{sock}"'))
        try:
            env.start().wait_subscribed()
            script = _job(c, ceph, creds, sockdir)
            # land it on n1 (the agent's node) without pinning it there: a requeued job must be free to move
            c.run("scontrol", "update", "nodename=n2,n3", "state=drain", "reason=test: land on n1")
            jid = c.sbatch(script, "--account=genomics", "--comment=sco-contract=genomics-ckpt")
            assert c.job(jid)["Requeue"] == "1"  # the contract's admission made it requeueable
            wait_for(lambda: c.job(jid).get("JobState") == "RUNNING", 30, "the job running on n1", 0.1)
            c.run("scontrol", "update", "nodename=n2,n3", "state=resume")
            wait_for(lambda: env.of("checkpoint.registered"), 90, "the job's client on the socket")
            wait_for(lambda: _kinds(c, jid, "checkpoint"), 90, "its first periodic checkpoint")
            time.sleep(0.35)  # a few steps past it: the notice comes with a step in progress
            t0 = env.send(env.notice("dcp-slurm-1", WINDOW))
            out = env.outcome(WINDOW)
            assert out["type"] == "drain.drained" and out["at"] < t0 + WINDOW
            noticed = wait_for(lambda: _kinds(c, jid, "noticed"), 10, "the save on notice")[0]
            # the socket tells at once; the contract's USR1 may race it (named as Python names it, as SIGTERM is)
            assert noticed["via"] in ("SIGUSR1", "socket") and noticed["checkpointed"] is True
            done = env.of("checkpoint.done")[0]
            assert done["report"]["step"] == noticed["step"] and done["report"]["save_s"] == noticed["save_s"]
            requeued = env.of("job.requeued")[0]
            assert requeued["jobs"] == [jid] and requeued["after_s"] < 6.0  # at its done, not its 6 s budget
            (lost,) = out["workloads"]
            assert lost["checkpointed"] is True and lost["save_within_budget"] is True
            assert lost["save_s"] == noticed["save_s"] and lost["step"] == noticed["step"]
            assert fold("n1", env.events(), notice="dcp-slurm-1").workloads == [lost]  # the drill report's figures
            wait_for(lambda: _finished(c, jid), 90, "the requeued job to finish", 0.2)
            resumed = _kinds(c, jid, "resumed")[0]
            assert resumed["from_step"] == noticed["step"] and resumed["steps_redone"] == 0
            assert c.job(jid)["NodeList"] != "n1" and int(c.job(jid).get("Restarts", "0")) >= 1
            assert_bitwise(c.root / "jobs" / f"dcp-final.{jid}.pt", ref)
        finally:
            env.stop()


def test_node_killed_without_notice_resumes_from_the_last_periodic_checkpoint(
    clean: SlurmCluster,
    ceph: CephCluster,
) -> None:
    c = clean
    creds = provision(ceph, "genomics-ckpt")
    ref = reference(STEPS, *SMALL)
    with tempfile.TemporaryDirectory(prefix="sco-ck-") as sockdir:
        script = _job(c, ceph, creds, sockdir)
        jid = c.sbatch(script, "--account=genomics", "--comment=sco-contract=genomics-ckpt")
        wait_for(lambda: _kinds(c, jid, "checkpoint"), 90, "its first periodic checkpoint")
        node = c.job(jid)["NodeList"]
        time.sleep(0.45)  # some steps past it, then the node dies
        pid = int((c.root / "jobs" / f"dcp-pid.{jid}").read_text())
        stepd = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])  # its slurmstepd
        # The node dies: its processes freeze (no TERM is ever handled), slurmctld is told the node is DOWN
        # and requeues the job, the training process is gone for good.
        slurmd = c.slurmds[node].pid  # frozen too: a dead node does not come back (ReturnToService=2)
        for p in (slurmd, stepd, pid):
            os.kill(p, signal.SIGSTOP)
        try:
            c.run("scontrol", "update", f"nodename={node}", "state=down", "reason=killed")
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: c.job(jid).get("JobState") in ("PENDING", "RUNNING") and int(c.job(jid).get(
                "Restarts", "0")) >= 1, 30, "the job requeued", 0.1)  # fmt: skip
            wait_for(lambda: _finished(c, jid), 90, "the requeued job to finish", 0.2)
        finally:
            for p in (stepd, slurmd):  # the node comes back: its step finds the process gone
                os.kill(p, signal.SIGCONT)
        out = _out(c, jid)
        at = next(i for i, m in enumerate(out) if m["kind"] == "resumed")
        resumed, first_attempt = out[at], out[:at]
        assert not [m for m in out if m["kind"] == "noticed"]  # no notice: nothing saved at the end
        periodic = [m["step"] for m in first_attempt if m["kind"] == "checkpoint"]
        assert periodic and all(s % EVERY == 0 for s in periodic)
        assert resumed["from_step"] == periodic[-1]  # the last periodic checkpoint of the attempt that died
        assert 0 < resumed["steps_redone"] <= EVERY  # the steps it had done past it, redone
        assert c.job(jid)["NodeList"] != node
        assert_bitwise(c.root / "jobs" / f"dcp-final.{jid}.pt", ref)
        print(json.dumps({"steps_redone_without_notice": resumed["steps_redone"]}))
