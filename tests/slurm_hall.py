"""The Slurm side of the node-agent tests: the drain window, the job script the cluster fixture (conftest) installs, and
a node agent for one of its nodes. The cluster itself is the `cluster` fixture in conftest.py, `clean` between tests."""

from __future__ import annotations

from pathlib import Path

from sco_devkit.devcluster.slurm import SlurmCluster
from tests.harness import AgentEnv, NatsServer, wait_for

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 20.0


JOB = """#!/bin/bash
#SBATCH --output={jobs}/out.%j
env | grep ^SLURM_JOB > {jobs}/env.$SLURM_JOB_ID
marker={jobs}/marker.$SLURM_JOB_ID
trap 'echo "$(date +%s.%N) $SLURMD_NODENAME" >> $marker.usr1; exit 0' USR1
if [ -f $marker.usr1 ]; then echo "$SLURMD_NODENAME" >> $marker.resumed; exit 0; fi
echo "$SLURMD_NODENAME" >> $marker.start
sleep 300 & wait $!
"""


def agent_for(tmp_path: Path, nats: NatsServer, c: SlurmCluster, node: str) -> AgentEnv:
    return AgentEnv(
        tmp_path / f"agent-{node}",
        None,
        nats,
        node=node,
        slurm_conf=str(c.conf),
        slurmd_spool_dir=str(c.spool / "%n"),
    )


def running_on(c: SlurmCluster, jid: int) -> str:
    """The node job ``jid`` runs on, once its script has started there."""

    def node() -> str | None:
        j = c.job(jid)
        return (
            j.get("NodeList")
            if j.get("JobState") == "RUNNING" and (c.root / "jobs" / f"marker.{jid}.start").exists()
            else None
        )

    return str(wait_for(node, 30, f"job {jid} running", 0.1))
