"""The devkit's real Slurm cluster (slurmctld and slurmd from Debian) where the tests put it."""

from __future__ import annotations

from pathlib import Path

from sco_devkit.devcluster.slurm import SlurmCluster
from tests.harness import wait_for


def test_a_batch_job_runs_under_a_deep_root(tmp_path: Path) -> None:
    """slurmstepd's socket is made in SlurmdSpoolDir, and a Unix socket's path has 108 bytes: a cluster under
    pytest's temporary directory of a machine that has run pytest 100 times (pytest-113/popen-gw0/<test name>)
    launched no batch job at all ("Unix socket path ... is too long (109 > 108)"). Here the root is deeper still."""
    c = SlurmCluster(tmp_path / ("deep" * 20) / "slurm", nodes=("n1",))
    assert len(str(c.root / "spool" / "n1" / "n1_99999999.4294967291")) > 108
    c.start()
    try:
        (c.root / "job.sh").write_text(f"#!/bin/bash\ntouch {c.root}/started.$SLURM_JOB_ID\nsleep 300 & wait $!\n")
        job = c.sbatch(c.root / "job.sh", "-c", "1")
        wait_for(lambda: (c.root / f"started.{job}").exists(), 60, "the job's script running")
    finally:
        c.run("scancel", "--user=root", check=False)
        c.stop()
