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
