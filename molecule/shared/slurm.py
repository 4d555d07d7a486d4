"""A real Slurm cluster (sco_devkit.devcluster: slurmctld and one slurmd on the controller's loopback, auth/none) whose
slurm.conf, job_submit.lua and contract table are the files in the slurmctld test host's /etc/slurm, the ones the
slurm_admission role wrote. slurmctld runs outside the host's namespace (the test hosts have no Slurm binaries);
it reads the host's files by their path on the controller.

    python slurm.py write-conf HOST_ETC_SLURM     # prepare: slurm.conf with JobSubmitPlugins=lua, before converge
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "src"), str(REPO / "devkit")]

from sco_devkit.devcluster.slurm import SlurmCluster  # noqa: E402

ROLE_FILES = REPO / "collections/ansible_collections/sco/orchestrator/roles/slurm_admission/files"


def cluster(etc_slurm: Path) -> SlurmCluster:
    return SlurmCluster(
        etc_slurm,
        nodes=("spot-s1",),
        partition="spot",
        job_submit_lua=ROLE_FILES / "job_submit.lua",
        cli_filter_lua=ROLE_FILES / "cli_filter.lua",
    )


if __name__ == "__main__" and sys.argv[1:2] == ["write-conf"]:
    etc = Path(sys.argv[2])
    etc.mkdir(parents=True, exist_ok=True)
    c = cluster(etc)
    c.write_conf()
    # write_conf copied the role's Lua files as the role will: remove them so converge installs its own
    for f in ("job_submit.lua", "cli_filter.lua"):
        (etc / f).unlink()
    print(c.conf)
