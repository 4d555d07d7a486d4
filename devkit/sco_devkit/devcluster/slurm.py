"""A real Slurm cluster on one machine: one slurmctld and N slurmd on loopback (Debian's slurm-wlm 22.05).

Settings follow ``shared/recipes``: no cgroups or systemd (proctrack/linuxproc, task/none), root as
SlurmUser, every node a distinct port on 127.0.0.1, ``auth/none`` + ``cred/none`` (no munged to run),
``sched_interval=1`` so requeued jobs start again within a second or two. ``job_submit/lua`` and
``cli_filter/lua`` are enabled when their scripts are given. Every client command needs ``SLURM_CONF``:
``env()`` gives it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from sco_devkit.ports import free_port


class SlurmError(RuntimeError):
    pass


class SlurmCluster:
    def __init__(
        self,
        root: Path,
        nodes: tuple[str, ...] = ("n1", "n2", "n3"),
        partition: str = "spot",
        job_submit_lua: Path | None = None,
        cli_filter_lua: Path | None = None,
        extra_conf: str = "",
        cpus: int = 2,
        slurm_user: str = "root",
    ) -> None:
        self.root = Path(root)
        self.nodes = nodes
        self.partition = partition
        self.job_submit_lua = job_submit_lua
        self.cli_filter_lua = cli_filter_lua
        self.extra_conf = extra_conf
        self.cpus = cpus
        # SlurmUser: Slurm's privileged user besides root (DRAIN, signal and requeue any job). Another user than root
        # for a node agent that runs as its own user and is that (without slurmdbd there is no operator grant).
        self.slurm_user = slurm_user
        self.ctld_port = free_port()
        # Job ids of their own (FirstJobId, from the port: clusters alive at once have different ports): a node agent
        # without ptrace access tells stepds apart by job id and start time, and two test clusters on this host each
        # starting at job 1 at once had one cluster's agent signal the other's job.
        self.node_ports = {n: free_port() for n in nodes}
        self.conf = self.root / "slurm.conf"
        # slurmstepd's sockets are <SlurmdSpoolDir>/<node>_<job id>.<step id>, and a Unix socket's path has 108 bytes:
        # under pytest's temporary directories (pytest-113/popen-gw0/<test name>/slurm/spool/n1/...) one had 109 and
        # every batch job failed to launch. A short directory of its own (named by the root: the same across
        # restarts), linked from <root>/spool.
        self.spool = Path("/tmp") / f"sco-slurm-{hashlib.sha256(str(self.root.resolve()).encode()).hexdigest()[:12]}"
        self.ctld: subprocess.Popen[bytes] | None = None
        self.slurmds: dict[str, subprocess.Popen[bytes]] = {}
        self._fds: list[int] = []

    def _log(self, name: str) -> int:
        fd = os.open(self.root / "log" / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._fds.append(fd)
        return fd

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def write_conf(self) -> None:
        r = self.root
        for d in ("state", "log", "jobs"):
            (r / d).mkdir(parents=True, exist_ok=True)
        self.spool.mkdir(mode=0o755, exist_ok=True)
        if not (r / "spool").is_symlink():
            (r / "spool").symlink_to(self.spool)
        if self.slurm_user != "root":  # slurmctld runs as SlurmUser: its state, logs and pid file are that user's
            import pwd

            pw = pwd.getpwnam(self.slurm_user)
            for owned in (r / "state", r / "log"):
                os.chown(owned, pw.pw_uid, pw.pw_gid)
            for up in [r, *r.parents]:  # its way to them
                if up != Path("/") and not up.stat().st_mode & 0o001:
                    up.chmod((up.stat().st_mode & 0o7777) | 0o001)
            r.chmod(0o1777)
        plugins = ""
        if self.job_submit_lua:
            shutil.copy(self.job_submit_lua, r / "job_submit.lua")
            plugins += "JobSubmitPlugins=lua\n"
        if self.cli_filter_lua:
            shutil.copy(self.cli_filter_lua, r / "cli_filter.lua")
            plugins += "CliFilterPlugins=lua\n"
        nodes = "".join(
            f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p} CPUs={self.cpus} RealMemory=1000"
            " State=UNKNOWN\n"
            for n, p in self.node_ports.items()
        )
        partition = f"PartitionName={self.partition} Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP"
        self.conf.write_text(
            f"""# written by sco_devkit.devcluster.slurm
ClusterName=sco
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={self.ctld_port}
AuthType=auth/none
CredType=cred/none
AuthInfo=cred_expire=5
SlurmUser={self.slurm_user}
SlurmdUser=root
StateSaveLocation={r}/state
SlurmdSpoolDir={self.spool}/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdParameters=config_overrides
SchedulerParameters=sched_interval=1
MpiDefault=none
JobRequeue=1
FirstJobId={self.ctld_port * 1000}
KillWait=5
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
{plugins}{self.extra_conf}{nodes}{partition}
"""
        )

    def start(self, timeout: float = 30) -> SlurmCluster:
        self.write_conf()
        self.start_ctld()
        for n in self.nodes:
            self.start_slurmd(n)
        self.wait_idle(timeout)
        return self

    def start_ctld(self) -> None:
        self.ctld = subprocess.Popen(
            ["slurmctld", "-D", "-i", "-f", str(self.conf)],
            env=self.env(),
            stdout=subprocess.DEVNULL,
            stderr=self._log("ctld.err"),
        )

    def freeze_ctld(self) -> None:
        """slurmctld stops answering (SIGSTOP): clients time out, its state is kept."""
        assert self.ctld is not None
        self.ctld.send_signal(signal.SIGSTOP)

    def thaw_ctld(self) -> None:
        assert self.ctld is not None
        self.ctld.send_signal(signal.SIGCONT)

    def stop_ctld(self) -> None:
        if self.ctld and self.ctld.poll() is None:
            self.ctld.send_signal(signal.SIGKILL)  # an unreachable scheduler, not a graceful one
            self.ctld.wait(10)
        self.ctld = None

    def restart_ctld(self) -> None:
        self.stop_ctld()
        self.ctld = subprocess.Popen(
            ["slurmctld", "-D", "-f", str(self.conf)],
            env=self.env(),
            stdout=subprocess.DEVNULL,
            stderr=self._log("ctld.err"),
        )

    def start_slurmd(self, node: str) -> None:
        (self.spool / node).mkdir(parents=True, exist_ok=True)
        self.slurmds[node] = subprocess.Popen(
            ["slurmd", "-D", "-f", str(self.conf), "-N", node],
            env=self.env(),
            stdout=subprocess.DEVNULL,
            stderr=self._log(f"slurmd.{node}.err"),
        )

    def run(self, *argv: str, timeout: float = 10, check: bool = True) -> str:
        p = subprocess.run(list(argv), env=self.env(), capture_output=True, text=True, timeout=timeout)
        if check and p.returncode != 0:
            raise SlurmError(f"{' '.join(argv)}: {p.stderr.strip() or p.stdout.strip()}")
        return p.stdout

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False)
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def wait_idle(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                states = self.node_states()
            except subprocess.TimeoutExpired:
                states = {}
            if states and all(states.get(n) == "idle" for n in self.nodes):
                return
            time.sleep(0.2)
        raise SlurmError(f"nodes not idle after {timeout} s: {self.node_states()}")

    def sbatch(self, script: Path, *args: str) -> int:
        out = self.run("sbatch", "--parsable", *args, str(script))
        return int(out.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        out = self.run("scontrol", "-o", "show", "job", str(job_id), check=False)
        fields: dict[str, str] = {}
        for tok in out.split():
            k, _, v = tok.partition("=")
            if k and k not in fields:
                fields[k] = v
        return fields

    def stop(self) -> None:
        for p in [*self.slurmds.values(), self.ctld]:
            if p is not None and p.poll() is None:
                p.terminate()
        for p in [*self.slurmds.values(), self.ctld]:
            if p is not None:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
        # slurmstepd and the job processes outlive their slurmd: end this cluster's (and only its) too
        from sco.agent.slurm.jobprocs import from_stepd_tree, stepd_pids

        for n in self.nodes:
            spool = self.spool / n
            doomed = stepd_pids(spool, n) | {p for ps in from_stepd_tree(n, spool).values() for p in ps}
            for pid in doomed:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
