"""Finding a Slurm job's processes on this node without slurmctld (the path around the scheduler).

In order: the job's cgroup (v2: ``system.slice/[<node>_]slurmstepd.scope/job_<id>``; v1:
``<controller>/slurm[_<node>]/uid_<uid>/job_<id>``), where the cluster uses cgroups; otherwise slurmstepd's
process tree: the ``slurmstepd: [<job>.<step>]`` processes that hold a step socket (``<node>_<job>.<step>``)
in this node's slurmd spool directory, and their descendants.

The agent runs as its own user with CAP_KILL only: another user's ``/proc/<pid>/fd`` and ``environ`` are closed to
it (ptrace access). Then a slurmstepd is this node's when a listening step socket of its job in this node's spool
directory was made within STEPD_SOCKET_SKEW_S of the stepd's start (several slurmd, or clusters, may share a host
and reuse job ids; the same id made within seconds on both is what this cannot tell apart), and a job's account
and partition are unknown: it gets the budget the deadline leaves, never more.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections import defaultdict
from pathlib import Path

# slurmstepd binds its step socket right after it starts; seconds apart under load. /proc/stat's btime has 1 s steps.
STEPD_SOCKET_SKEW_S = 10.0
_SOCK = re.compile(r"^(?P<node>.+)_(?P<job>\d+)\.(?P<step>\d+)$")
_STEPD = re.compile(r"^slurmstepd: \[(?P<job>\d+)\.(?P<step>[^\]]+)\]")


def _procs_in(cgroup_dir: Path) -> set[int]:
    pids: set[int] = set()
    for f in cgroup_dir.rglob("cgroup.procs"):
        try:
            pids.update(int(x) for x in f.read_text().split())
        except (OSError, ValueError):
            continue
    return pids


def from_cgroups(node: str, root: Path = Path("/sys/fs/cgroup")) -> dict[int, set[int]]:
    jobs: dict[int, set[int]] = defaultdict(set)
    candidates = [
        *root.glob(f"system.slice/{node}_slurmstepd.scope/job_*"),
        *root.glob("system.slice/slurmstepd.scope/job_*"),
        *root.glob(f"*/slurm_{node}/uid_*/job_*"),
        *root.glob("*/slurm/uid_*/job_*"),
    ]
    for d in candidates:
        m = re.match(r"job_(\d+)$", d.name)
        if m and d.is_dir():
            jobs[int(m.group(1))] |= _procs_in(d)
    return {j: p for j, p in jobs.items() if p}


def _proc_table() -> tuple[dict[int, int], dict[int, str]]:
    parent: dict[int, int] = {}
    cmd: dict[int, str] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        parent[pid] = int(stat.rsplit(")", 1)[1].split()[1])
        cmd[pid] = cmdline
    return parent, cmd


def _step_sockets(spool_dir: Path, node: str) -> dict[int, tuple[int, str]]:
    """inode -> (job id, path) of the step sockets slurmstepd listens on in this node's spool directory."""
    prefix = str(spool_dir).rstrip("/") + "/"
    out: dict[int, tuple[int, str]] = {}
    try:
        with open("/proc/net/unix") as f:
            next(f)
            for line in f:
                parts = line.split()
                if len(parts) < 8 or not parts[7].startswith(prefix):
                    continue
                m = _SOCK.match(parts[7][len(prefix) :])
                if m and m.group("node") == node:
                    out[int(parts[6])] = (int(m.group("job")), parts[7])
    except OSError:
        return {}
    return out


def _socket_inodes(spool_dir: Path, node: str) -> dict[int, int]:
    """inode -> job id of the step sockets slurmstepd listens on in this node's spool directory."""
    return {inode: job for inode, (job, _) in _step_sockets(spool_dir, node).items()}


def _boot_time() -> float:
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("btime "):
                return float(line.split()[1])
    raise OSError("no btime in /proc/stat")


def _started_at(pid: int, boot: float) -> float | None:
    """When ``pid`` started (epoch seconds), from /proc/<pid>/stat, which any user may read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _job_by_socket_time(pid: int, job: int, sockets: dict[int, tuple[int, str]], boot: float | None) -> int | None:
    """Without ptrace access: ``job`` if one of its step sockets here was made when the stepd ``pid`` started."""
    started = _started_at(pid, boot) if boot is not None else None
    if started is None:
        return None
    for j, path in sockets.values():
        if j != job:
            continue
        try:
            made = os.stat(path).st_mtime
        except OSError:
            continue
        if abs(made - started) <= STEPD_SOCKET_SKEW_S:
            return job
    return None


class _NoAccess(Exception):
    """The stepd's file descriptors are closed to this user (another user's process, no ptrace access)."""


def _stepd_job(pid: int, inodes: dict[int, int]) -> int | None:
    """The job whose step socket (in this node's spool directory) the slurmstepd ``pid`` holds open."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except PermissionError:
        raise _NoAccess from None
    except OSError:
        return None
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except PermissionError:
            raise _NoAccess from None
        except OSError:
            continue
        if target.startswith("socket:["):
            job = inodes.get(int(target[8:-1]))
            if job is not None:
                return job
    return None


def from_stepd_tree(node: str, spool_dir: Path) -> dict[int, set[int]]:
    """Job processes under this node's slurmstepd processes. A stepd belongs to this node when it holds a
    step socket in the node's spool directory (several slurmd, or clusters, may share a host)."""
    sockets = _step_sockets(spool_dir, node)
    if not sockets:
        return {}
    inodes = {inode: job for inode, (job, _) in sockets.items()}
    try:
        boot: float | None = _boot_time()
    except OSError:
        boot = None
    parent, cmd = _proc_table()
    children: dict[int, list[int]] = defaultdict(list)
    for pid, ppid in parent.items():
        children[ppid].append(pid)
    jobs: dict[int, set[int]] = defaultdict(set)
    for pid, line in cmd.items():
        m = _STEPD.match(line)
        if not m:
            continue
        try:
            job = _stepd_job(pid, inodes)
        except _NoAccess:
            job = _job_by_socket_time(pid, int(m.group("job")), sockets, boot)
        if job is None or job != int(m.group("job")):
            continue
        stack = list(children.get(pid, []))
        while stack:
            p = stack.pop()
            if _STEPD.match(cmd.get(p, "")):
                continue
            jobs[job].add(p)
            stack.extend(children.get(p, []))
    return {j: p for j, p in jobs.items() if p}


def stepd_pids(spool_dir: Path, node: str) -> set[int]:
    """The slurmstepd processes serving ``node`` (for cleaning up a test cluster)."""
    inodes = _socket_inodes(spool_dir, node)
    _, cmd = _proc_table()
    out = set()
    for pid, line in cmd.items():
        if _STEPD.match(line):
            with contextlib.suppress(_NoAccess):
                if _stepd_job(pid, inodes) is not None:
                    out.add(pid)
    return out


def job_processes(
    node: str, spool_dir: Path, cgroup_root: Path = Path("/sys/fs/cgroup")
) -> tuple[str, dict[int, set[int]]]:
    """("cgroup" | "stepd-tree", {job id: pids}) for the jobs running on ``node``."""
    found = from_cgroups(node, cgroup_root)
    if found:
        return "cgroup", found
    return "stepd-tree", from_stepd_tree(node, spool_dir)


def alive(pids: set[int]) -> set[int]:
    out = set()
    for p in pids:
        try:
            with open(f"/proc/{p}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
            if state != b"Z":
                out.add(p)
        except OSError:
            continue
    return out


def job_environment(pids: set[int]) -> dict[str, str]:
    """The environment of the job's oldest process (its batch shell): SLURM_JOB_ACCOUNT and friends."""
    for pid in sorted(pids):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        env = {}
        for item in raw.split(b"\0"):
            k, sep, v = item.partition(b"=")
            if sep:
                env[k.decode(errors="replace")] = v.decode(errors="replace")
        if "SLURM_JOB_ID" in env:
            return env
    return {}
