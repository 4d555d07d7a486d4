"""Slurm client adapter: slurmctld through the Slurm commands (scontrol, scancel, squeue, sinfo).

Argument lists, never shell strings; output parsed from fixed ``-o`` formats. Every call has the scheduler-API
timeout (800 ms by default): past it the call is abandoned and ``SlurmUnreachable`` raised, so the agent can
drain around the scheduler.

pyslurm is not used: PyPI's pyslurm matches Slurm 25.11 only, while Debian 12 ships Slurm 22.05, so the
command path is the tested default. A pyslurm-backed class with the same methods could replace this one on
clusters whose Slurm matches a pyslurm release.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

# Messages the Slurm commands print when slurmctld cannot be reached (they then retry for many seconds).
_UNREACHABLE = (
    "Unable to contact slurm controller",
    "Socket timed out",
    "Connection refused",
    "Communication connection failure",
    "Slurm backup controller in standby mode",
)
_FIELD_SEP = "\x1f"  # squeue output fields: a separator no account, partition or comment contains


class SlurmUnreachable(Exception):
    """slurmctld did not answer within the timeout."""


class SlurmCommandError(Exception):
    """slurmctld answered with an error."""


@dataclass(frozen=True)
class Job:
    id: int
    account: str
    partition: str
    state: str
    user: str
    nodes: str
    comment: str


class SlurmClient:
    def __init__(self, *, slurm_conf: str = "", bin_dir: str = "", timeout: float = 0.8) -> None:
        self.env = dict(os.environ)
        if slurm_conf:
            self.env["SLURM_CONF"] = slurm_conf
        self.bin_dir = bin_dir
        self.timeout = timeout

    def _exe(self, name: str) -> str:
        return str(Path(self.bin_dir) / name) if self.bin_dir else name

    async def run(self, *argv: str, timeout: float | None = None) -> str:
        cmd = [self._exe(argv[0]), *argv[1:]]
        try:
            proc = await asyncio.create_subprocess_exec(
                *cmd, env=self.env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
            )
        except OSError as e:
            raise SlurmCommandError(f"{argv[0]}: {e.strerror}") from None
        try:
            async with asyncio.timeout(self.timeout if timeout is None else timeout):
                out, err = await proc.communicate()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            limit = self.timeout if timeout is None else timeout
            raise SlurmUnreachable(f"{' '.join(argv)}: no answer within {limit} s") from None
        text = err.decode(errors="replace").strip()
        if proc.returncode != 0:
            if any(m in text for m in _UNREACHABLE):
                raise SlurmUnreachable(f"{' '.join(argv)}: {text}")
            raise SlurmCommandError(f"{' '.join(argv)}: {text or out.decode(errors='replace').strip()}")
        return out.decode(errors="replace")

    async def drain(self, node: str, reason: str) -> None:
        await self.run("scontrol", "update", f"nodename={node}", "state=DRAIN", f"reason={reason}")

    async def resume_node(self, node: str) -> None:
        await self.run("scontrol", "update", f"nodename={node}", "state=RESUME")

    async def node_state(self, node: str) -> str:
        return (await self.run("sinfo", "-h", "-n", node, "-o", "%T")).strip()

    async def jobs_on_node(self, node: str) -> list[Job]:
        fmt = _FIELD_SEP.join(["%A", "%a", "%P", "%T", "%u", "%N", "%k"])
        out = await self.run("squeue", "-h", "-w", node, "-t", "RUNNING,COMPLETING,CONFIGURING,SUSPENDED", "-o", fmt)
        jobs = []
        for line in out.splitlines():
            parts = line.split(_FIELD_SEP)
            if len(parts) == 7 and parts[0].strip().isdigit():
                jid, acct, part, state, user, nodes, comment = (p.strip() for p in parts)
                jobs.append(Job(int(jid), acct, part, state, user, nodes, "" if comment == "(null)" else comment))
        return jobs

    async def job_state(self, job_id: int) -> tuple[str, str]:
        """(state, node list) of a job, ("", "") when slurmctld no longer knows it."""
        out = await self.run("squeue", "-h", "-j", str(job_id), "-o", f"%T{_FIELD_SEP}%N")
        for line in out.splitlines():
            state, _, nodes = line.partition(_FIELD_SEP)
            return state.strip(), nodes.strip()
        return "", ""

    async def steps_on_node(self, node: str) -> list[str]:
        out = await self.run("squeue", "-h", "-s", "-w", node, "-o", "%i")
        return [s.strip() for s in out.splitlines() if s.strip()]

    async def signal(self, job_id: int, sig: str) -> None:
        # --full: the batch shell and its children too, not only the steps
        await self.run("scancel", f"--signal={sig}", "--full", str(job_id))

    async def requeue(self, job_ids: list[int]) -> None:
        await self.run("scontrol", "requeue", ",".join(str(j) for j in job_ids))
