"""The checkpoint socket on the Slurm path, on the real cluster (slurmctld and slurmd on loopback): a job that
keeps running after USR1 but says "done" on the socket is requeued at once, not at the end of its budget. The
job is found from the client's process (its cgroup or SLURM_JOB_ID), not from anything the client claims."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from sco_devkit.devcluster.slurm import SlurmCluster
from tests.harness import NatsServer, reachable, wait_for
from tests.slurm_hall import WINDOW, agent_for

ROOT = Path(__file__).resolve().parents[1]

# USR1 is ignored: the application checkpoints through the socket instead, and would run on until killed.
JOB = """#!/bin/bash
#SBATCH --output={jobs}/ck-out.%j
trap '' USR1
cd {root}
{python} -m tests.checkpoint_workload {sock} job-$SLURM_JOB_ID done:0.5 genomics-ckpt > {jobs}/ck-client.$SLURM_JOB_ID &
sleep 300 & wait $!
"""


def test_done_on_the_socket_requeues_before_the_budget(
    tmp_path: Path,
    nats_server: NatsServer,
    clean: SlurmCluster,
) -> None:
    c = clean
    with tempfile.TemporaryDirectory(prefix="sco-ck-") as d:
        sock = Path(d) / "ck.sock"
        reachable(Path(d))  # /run/sco: the agent's own (the unit's RuntimeDirectory=)
        script = c.root / "jobs" / "ck-job.sh"
        script.write_text(JOB.format(jobs=c.root / "jobs", root=ROOT, python=sys.executable, sock=sock))
        env = agent_for(tmp_path, nats_server, c, "n1")
        env.config.write_text(env.config.read_text().replace('checkpoint_socket = ""', f'checkpoint_socket = "{sock}"'))
        try:
            env.start().wait_subscribed()
            jid = c.sbatch(script, "--account=genomics", "--comment=sco-contract=genomics-ckpt", "-w", "n1")
            registered = wait_for(lambda: env.of("checkpoint.registered"), 30, "the job's client")[0]
            assert registered["job"] == jid  # attributed by the kernel's view of the process, not the client
            t0 = env.send(env.notice("ck-slurm-1", WINDOW))
            out = env.outcome(WINDOW)
            assert out["type"] == "drain.drained" and out["at"] < t0 + WINDOW
            checkpointed = env.of("job.checkpointed")[0]
            requeued = env.of("job.requeued")[0]
            assert checkpointed["job"] == jid and requeued["jobs"] == [jid]
            # the genomics-ckpt budget is 6 s: requeued once the job said done (~0.5 s), not at 6 s
            assert requeued["after_s"] < 6.0 and not requeued["left_before_requeue"]
            assert env.of("checkpoint.done")[0]["workload"] == f"job-{jid}"
        finally:
            env.stop()


# A job of the climate-sims contract (4 s budget) whose process names genomics-ckpt (6 s), then registers as
# itself; the replies are the job's output.
FORGER = """#!/bin/bash
#SBATCH --output={jobs}/forger-out.%j
register="/usr/bin/python3 -S {root}/tests/checkpoint_register.py {sock} job-$SLURM_JOB_ID"
$register genomics-ckpt > {jobs}/forged.$SLURM_JOB_ID
$register > {jobs}/own.$SLURM_JOB_ID
"""


def test_a_job_cannot_register_as_another_contract(
    tmp_path: Path,
    nats_server: NatsServer,
    clean: SlurmCluster,
) -> None:
    """The job is found from the process (the root-owned slurmstepd it descends from here, proctrack/linuxproc; its
    job_<id> cgroup with proctrack/cgroup) and its contract from slurmctld's record of it: a job of climate-sims
    naming genomics-ckpt is refused with one line (before: registered with genomics-ckpt's budget); unnamed, it is
    under its own contract; a process in no job is refused."""
    import json
    import subprocess

    c = clean
    with tempfile.TemporaryDirectory(prefix="sco-ck-") as d:
        sock = Path(d) / "ck.sock"
        reachable(Path(d))
        jobs = c.root / "jobs"
        script = jobs / "forger.sh"
        script.write_text(FORGER.format(jobs=jobs, root=ROOT, sock=sock))
        env = agent_for(tmp_path, nats_server, c, "n1")
        env.config.write_text(env.config.read_text().replace('checkpoint_socket = ""', f'checkpoint_socket = "{sock}"'))
        try:
            env.start().wait_subscribed()
            jid = c.sbatch(script, "--account=climate", "--comment=sco-contract=climate-sims", "-w", "n1")
            own_out = jobs / f"own.{jid}"
            wait_for(lambda: own_out.exists() and own_out.read_text().strip(), 30, "the job's second registration")
            forged = json.loads((jobs / f"forged.{jid}").read_text())
            own = json.loads(own_out.read_text())
            assert forged["op"] == "error"
            assert forged["error"] == (
                f"register: refused: contract 'genomics-ckpt' is not this process's: job {jid} is under contract "
                "'climate-sims'"
            )
            assert own["op"] == "registered" and own["contract"] == "climate-sims" and own["budget_s"] == 4.0
            outside = subprocess.run(
                [
                    "/usr/bin/python3",
                    "-S",
                    str(ROOT / "tests" / "checkpoint_register.py"),
                    str(sock),
                    "x",
                    "climate-sims",
                ],
                capture_output=True,
                text=True,
                timeout=30,
            )
            err = json.loads(outside.stdout)["error"]
            assert err.startswith("register: refused: pid ") and "is in no Slurm job" in err, err
            registered = env.of("checkpoint.registered")
            assert [(r["contract"], r["job"]) for r in registered] == [("climate-sims", jid)]
        finally:
            env.stop()
