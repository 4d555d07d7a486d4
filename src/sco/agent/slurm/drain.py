"""The Slurm drain path (seed view 19, third and fourth rows).

Through the scheduler: set the node DRAIN with a reason naming the notice; send each job its contract's signal
(USR1) with ``scancel --full`` (batch shell and steps) so the application checkpoints; wait, up to the job's
budget, for it to leave the node; requeue it so it resumes elsewhere; verify that no step of those jobs is left
on the node ("drained"), else "overrun" listing the jobs.

Around the scheduler: when slurmctld does not answer within the API timeout, stop asking. Find each job's
processes locally (``sco.agent.slurm.jobprocs``), signal them directly, wait up to the budget, then TERM and, at the
deadline less the margin, KILL what is left; spool the outcome; and tell slurmctld (DRAIN, requeue) once it
answers again: the scheduler learns late, which is acceptable because the node is going anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sco._retry import Backoff
from sco.agent.budget import SlurmBudgets
from sco.agent.checkpoint import CheckpointServer
from sco.agent.deadline import Deadline
from sco.agent.notices import Notice
from sco.agent.resume import DrainRecord
from sco.agent.slurm.jobprocs import alive, job_environment, job_processes
from sco.agent.spool import CRITICAL, ROUTINE, Spool
from sco.contract.bundle import Bundle
from sco.schedulers.slurm import Job, SlurmClient, SlurmCommandError, SlurmUnreachable

log = logging.getLogger("sco.agent.slurm")
POLL_S = 0.1
LEFT_STATES = {
    "",
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "PREEMPTED",
    "NODE_FAIL",
    "PENDING",
    "REQUEUED",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
}


# slurmctld keeps a node's reason whole (22.05 was checked with 5000 characters), but slurmdbd records every
# DRAIN in its event table's `reason` column, a MySQL TINYTEXT: 255 bytes. Kept within that, the accounting
# record names the same notice and T as `scontrol show node`.
SLURM_REASON_MAX_BYTES = 255
_TRUNCATED = "..."


def drain_reason(notice_id: str, terminate_at: float) -> str:
    """The DRAIN reason: the notice and T (ISO 8601 UTC, whole seconds, rounded down so never later than T).

    At most SLURM_REASON_MAX_BYTES of UTF-8: a notice id too long for it (ids may be 128 printable characters,
    not all ASCII) is cut, never T. It starts and ends with a letter or digit, so scontrol strips no quote."""
    gone = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(terminate_at))
    head, tail = "sco reclaim ", f": instance gone at {gone}"
    room = SLURM_REASON_MAX_BYTES - len(head.encode()) - len(tail.encode())
    raw = notice_id.encode()
    if len(raw) > room:
        notice_id = raw[: room - len(_TRUNCATED)].decode("utf-8", "ignore") + _TRUNCATED
    return f"{head}{notice_id}{tail}"


def _sig(name: str) -> signal.Signals:
    return signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]


@dataclass
class SlurmResume(DrainRecord):
    drain_set: bool = False
    signalled: set[int] = field(default_factory=set)
    requeued: set[int] = field(default_factory=set)
    around: bool = False

    def apply(self, type_: str, ev: dict[str, Any]) -> None:
        if type_ == "node.drain_set":
            self.drain_set = True
        elif type_ == "job.signalled":
            self.signalled.add(int(ev["job"]))
        elif type_ == "job.requeued":
            self.requeued.update(int(j) for j in ev["jobs"])
        elif type_ == "scheduler.unreachable":
            self.around = True

    def summary(self) -> dict[str, Any]:
        return {
            "drain_set": self.drain_set,
            "signalled": len(self.signalled),
            "requeued": len(self.requeued),
            "around": self.around,
        }


@dataclass
class JobState:
    job: Job
    drain_s: float
    final_s: float
    signal: str
    contract: str | None
    state: str = "running"  # running | signalled | left | requeued
    why: str = ""


class SlurmDrain:
    def __init__(
        self,
        *,
        slurm: SlurmClient,
        spool: Spool,
        budgets: SlurmBudgets,
        node: str,
        notice: Notice,
        deadline: Deadline,
        slurmd_spool_dir: Path,
        cgroup_root: Path = Path("/sys/fs/cgroup"),
        resume: SlurmResume | None = None,
        checkpoint: CheckpointServer | None = None,
    ) -> None:
        self.checkpoint = checkpoint  # a job whose workloads said "done" on the socket is requeued at once
        self.slurm, self.spool, self.budgets = slurm, spool, budgets
        self.node, self.notice = node, notice
        self.deadline = deadline
        self.slurmd_spool_dir, self.cgroup_root = slurmd_spool_dir, cgroup_root
        self.resume = resume or SlurmResume()
        self.clock = deadline.now
        self.started_at = deadline.started_at
        self.jobs: dict[int, JobState] = {}
        self.outcome: dict[str, Any] | None = None

    def _event(self, type_: str, priority: int = ROUTINE, **fields: Any) -> None:
        self.spool.append(type_, priority, notice=self.notice.id, **fields)

    def update_deadline(self, terminate_at: float) -> bool:
        return self.deadline.move_earlier(terminate_at)

    def summary(self) -> dict[str, Any]:
        return self.resume.summary()

    def progress(self) -> tuple[int, int]:
        """(jobs that left or were requeued, jobs seen): the "draining n/m" of the agent's sd_notify STATUS."""
        return sum(1 for j in self.jobs.values() if j.state in ("left", "requeued")), len(self.jobs)

    @property
    def reason(self) -> str:
        return drain_reason(self.notice.id, self.notice.terminate_at)

    def _budget_end(self, js: JobState) -> float:
        return self.deadline.budget_end(js.drain_s)

    def _track(self, job: Job) -> JobState:
        if job.id not in self.jobs:
            default = max(0.0, self.deadline.kill_at - self.started_at)
            b, drain_s, final_s, sig = self.budgets.for_job(job.account, job.partition, job.comment, default)
            self.jobs[job.id] = JobState(job, drain_s, final_s, sig, b.contract if b else None)
        return self.jobs[job.id]

    async def run(self) -> dict[str, Any]:
        try:
            if self.resume.around:
                raise SlurmUnreachable("slurmctld was unreachable before the restart")
            if not self.resume.drain_set:
                await self.slurm.drain(self.node, self.reason)
                self._event(
                    "node.drain_set",
                    CRITICAL,
                    reason=self.reason,
                    first_action_ms=round((self.clock() - self.started_at) * 1000, 1),
                )
            jobs = await self.slurm.jobs_on_node(self.node)
            for j in jobs:
                self._track(j)
            await asyncio.gather(*(self._through(js) for js in self.jobs.values()))
            return await self._verify()
        except SlurmUnreachable as e:
            return await self._around(str(e))

    async def _through(self, js: JobState) -> None:
        jid = js.job.id
        if jid in self.resume.requeued:
            js.state = "requeued"
            return
        if jid not in self.resume.signalled:
            try:
                await self.slurm.signal(jid, js.signal)
            except SlurmCommandError as e:  # e.g. finished meanwhile: nothing to signal, still requeue
                js.why = str(e)
            else:
                self._event(
                    "job.signalled",
                    CRITICAL,
                    job=jid,
                    signal=js.signal,
                    contract=js.contract,
                    budget_s=js.drain_s,
                    path="scheduler",
                )
        js.state = "signalled"
        end = self._budget_end(js)
        while self.clock() < end:
            state, nodes = await self.slurm.job_state(jid)
            if state in LEFT_STATES or self.node not in nodes.split(","):
                js.state = "left"
                break
            if self.checkpoint is not None and self.checkpoint.job_done(jid):
                self._event("job.checkpointed", CRITICAL, job=jid, after_s=round(self.clock() - self.started_at, 3))
                break  # its checkpoint is written: requeue now rather than at the budget's end
            await asyncio.sleep(POLL_S)
        try:
            await self.slurm.requeue([jid])
        except SlurmCommandError as e:
            js.why = f"requeue refused: {e}"
            self._event("job.requeue_failed", CRITICAL, job=jid, error=str(e))
            return
        left_first = js.state == "left"
        js.state = "requeued"
        self._event(
            "job.requeued",
            CRITICAL,
            jobs=[jid],
            after_s=round(self.clock() - self.started_at, 3),
            left_before_requeue=left_first,
        )

    async def _verify(self) -> dict[str, Any]:
        ours = {str(j) for j in self.jobs}
        while True:
            steps = await self.slurm.steps_on_node(self.node)
            left = sorted({s.split(".")[0] for s in steps} & ours)
            if not left:
                return self._finish("drained", path="scheduler")
            if self.deadline.overrun():
                return self._finish(
                    "overrun",
                    path="scheduler",
                    remaining=[
                        {"job": int(j), "why": self.jobs[int(j)].why or "steps still on the node"} for j in left
                    ],
                )
            await asyncio.sleep(POLL_S)

    # --- around the scheduler ----------------------------------------------------------------------

    async def _around(self, error: str) -> dict[str, Any]:
        if not self.resume.around:
            self._event("scheduler.unreachable", CRITICAL, error=error, scheduler="slurmctld")
        log.warning("slurmctld unreachable (%s): draining around it", error)
        method, procs = await asyncio.to_thread(job_processes, self.node, self.slurmd_spool_dir, self.cgroup_root)
        for jid, pids in procs.items():
            if jid not in self.jobs:
                # Without slurmctld, the job's own environment says its account and partition.
                env = job_environment(pids)
                self._track(
                    Job(
                        jid,
                        env.get("SLURM_JOB_ACCOUNT", ""),
                        env.get("SLURM_JOB_PARTITION", ""),
                        "RUNNING",
                        "",
                        self.node,
                        "",
                    )
                )
            self.jobs[jid].state = "signalled"
        for jid, pids in procs.items():
            js = self.jobs[jid]
            sig = _sig(js.signal)
            sent = self._kill(pids, sig)
            if jid not in self.resume.signalled:
                self._event(
                    "job.signalled",
                    CRITICAL,
                    job=jid,
                    signal=js.signal,
                    pids=sent,
                    method=method,
                    path="around",
                    contract=js.contract,
                    budget_s=js.drain_s,
                )
        self._event("scheduler.report_pending", CRITICAL, jobs=sorted(procs), reason=self.reason)
        termed: set[int] = set()
        while True:
            now = self.clock()
            remaining = {jid: alive(pids) for jid, pids in procs.items()}
            remaining = {j: p for j, p in remaining.items() if p}
            if not remaining:
                return self._finish("drained", path="around", method=method)
            for jid, pids in remaining.items():
                js = self.jobs[jid]
                if now >= self._budget_end(js) and jid not in termed:
                    termed.add(jid)
                    self._kill(pids, signal.SIGTERM)
                    self._event("job.terminated", CRITICAL, job=jid, pids=sorted(pids), path="around")
                if now >= self.deadline.kill_at:
                    self._kill(pids, signal.SIGKILL)
            if self.deadline.overrun():
                return self._finish(
                    "overrun",
                    path="around",
                    method=method,
                    remaining=[{"job": j, "why": f"{len(p)} processes still alive"} for j, p in remaining.items()],
                )
            await asyncio.sleep(POLL_S)

    @staticmethod
    def _kill(pids: set[int], sig: signal.Signals) -> list[int]:
        sent = []
        for p in sorted(pids):
            try:
                os.kill(p, sig)
                sent.append(p)
            except ProcessLookupError:
                continue
            except PermissionError:  # the agent's unit lacks CAP_KILL (role node_agent gives it on Slurm nodes)
                log.error("may not signal pid %d (%s): signalling another user's job needs CAP_KILL", p, sig.name)
        return sent

    def _finish(self, outcome: str, **fields: Any) -> dict[str, Any]:
        now = self.clock()
        body = {
            "elapsed_s": round(now - self.started_at, 3),
            "deadline_in_s": round(self.deadline.terminate_at - now, 3),
            "jobs": sorted(self.jobs),
            **fields,
        }
        if self.checkpoint is not None:  # lost work, per workload on the socket
            body["workloads"] = self.checkpoint.lost_work()
        if self.deadline.late is not None:
            body["late_notice"] = self.deadline.late  # drained best effort: the notice left no time
        self._event(f"drain.{outcome}", CRITICAL, **body)
        self.outcome = {"outcome": outcome, **body}
        log.log(
            logging.WARNING if outcome == "overrun" else logging.INFO,
            "drain %s for notice %s: %s",
            outcome,
            self.notice.id,
            body,
        )
        return self.outcome


class SlurmPath:
    """The Slurm drain path for this node (see :class:`sco.agent.drain.DrainPath`)."""

    def __init__(
        self,
        *,
        slurm: SlurmClient,
        spool: Spool,
        bundle: Callable[[], Bundle | None],
        node: str,
        slurmd_spool_dir: Path,
        cgroup_root: Path,
        checkpoint: CheckpointServer | None = None,
    ) -> None:
        self.checkpoint = checkpoint
        self.slurm, self.spool, self.bundle, self.node = slurm, spool, bundle, node
        self.slurmd_spool_dir, self.cgroup_root = slurmd_spool_dir, cgroup_root
        self._reporting: set[str] = set()

    def record(self, spool: Spool, notice_id: str) -> SlurmResume:
        return SlurmResume.from_spool(spool, notice_id)

    def drain(self, notice: Notice, deadline: Deadline, record: DrainRecord | None) -> SlurmDrain:
        return SlurmDrain(
            slurm=self.slurm,
            spool=self.spool,
            budgets=SlurmBudgets(self.bundle()),
            node=self.node,
            notice=notice,
            deadline=deadline,
            slurmd_spool_dir=self.slurmd_spool_dir,
            cgroup_root=self.cgroup_root,
            resume=record if isinstance(record, SlurmResume) else None,
            checkpoint=self.checkpoint,
        )

    async def preflight(self) -> list[str]:
        return []  # slurmctld may be away at boot: the path around it covers that

    def follow_ups(self, stop: asyncio.Event) -> list[tuple[str, Coroutine[Any, Any, None]]]:
        """A report to slurmctld for every drain done around it that the spool has not closed, each once."""
        pending: dict[str, dict[str, Any]] = {}
        for ev in self.spool.events():
            if ev["type"] == "scheduler.report_pending":
                pending[str(ev["notice"])] = ev
            elif ev["type"] == "scheduler.told":
                pending.pop(str(ev["notice"]), None)
        out: list[tuple[str, Coroutine[Any, Any, None]]] = []
        for nid, ev in pending.items():
            if nid not in self._reporting:
                self._reporting.add(nid)
                coro = report_late(self.slurm, self.spool, self.node, nid, list(ev["jobs"]), ev["reason"], stop)
                out.append((f"report:{nid}", coro))
        return out

    async def close(self) -> None:
        pass


async def report_late(
    slurm: SlurmClient, spool: Spool, node: str, notice_id: str, jobs: list[int], reason: str, stop: asyncio.Event
) -> None:
    """Tell slurmctld what happened around it, once it answers: DRAIN the node, requeue the jobs."""
    backoff = Backoff(0.5, 5.0)
    while not stop.is_set():
        try:
            await slurm.drain(node, reason)
            requeued, errors = [], {}
            for j in jobs:
                try:
                    await slurm.requeue([j])
                    requeued.append(j)
                except SlurmCommandError as e:
                    errors[str(j)] = str(e)
            spool.append("scheduler.told", CRITICAL, notice=notice_id, requeued=requeued, errors=errors)
            log.info("slurmctld answers again: node %s DRAIN, requeued %s", node, requeued)
            return
        except SlurmUnreachable:
            pass
        except SlurmCommandError as e:
            log.warning("telling slurmctld: %s", e)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), backoff.next())
