"""The sweep at a run's start lets go of a dead run's test host mounts, never of a live run's."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.testhosts import sweep_dead_hosts


def _mounted(path: Path) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == str(path) for line in f)


def test_sweep_unmounts_a_dead_sessions_proc_and_spares_a_live_one(tmp_path: Path) -> None:
    base = tmp_path / "pytest-of-someone"
    dead, live = base / "pytest-1" / "gw0" / "host" / "proc", base / "pytest-2" / "gw0" / "host" / "proc"
    for p in (dead, live):
        p.mkdir(parents=True)
        subprocess.run(["mount", "-t", "proc", "proc", str(p)], check=True)
    # a process working in the live session (as a host's chrooted sshd is)
    holder = subprocess.Popen(["sleep", "60"], cwd=live.parent)
    try:
        done = sweep_dead_hosts(base)
        assert str(dead) in done
        assert not _mounted(dead)
        assert _mounted(live), "a live session's mount was taken"
        assert str(live) not in done
    finally:
        holder.kill()
        holder.wait()
        for p in (dead, live):
            subprocess.run(["umount", "-l", str(p)], capture_output=True, check=False)
