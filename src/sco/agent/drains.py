"""The drain's lifecycle on this node: start one for an accepted notice, resume one the spool says is unfinished,
move its deadline, run what the drain path still owes afterwards, and rearm once the node is back in service.

One drain at a time; the drain itself (taint, evict, signal, verify) is the drain path's (``sco.agent.drain``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from sco.agent.checkpoint import CheckpointServer
from sco.agent.deadline import Deadline
from sco.agent.drain import Drain, DrainPath
from sco.agent.notices import Notice, NoticeBook
from sco.agent.resume import DrainRecord, latched_notice, unfinished_drain
from sco.agent.spool import CRITICAL, Spool
from sco.contract.bundle import Bundle

log = logging.getLogger("sco.agent")

Spawn = Callable[[Coroutine[Any, Any, None], str], None]


class DrainSupervisor:
    def __init__(
        self,
        *,
        spool: Spool,
        book: NoticeBook,
        bundle: Callable[[], Bundle | None],
        margin: Callable[[], float],
        clock: Callable[[], float],
        spawn: Spawn,
        wake: Callable[[], None],
        stop: asyncio.Event,
    ) -> None:
        """``spawn``: start a guarded root task; ``wake``: the publisher, when a drain starts or ends."""
        self.spool, self.book, self.bundle, self.margin, self.clock = spool, book, bundle, margin, clock
        self.spawn, self.wake, self.stop = spawn, wake, stop
        self.path: DrainPath | None = None
        self.checkpoint: CheckpointServer | None = None
        self.current: Drain | None = None
        self.task: asyncio.Task[None] | None = None
        self.outcomes: list[dict[str, Any]] = []

    def attach(self, path: DrainPath, checkpoint: CheckpointServer | None) -> None:
        """At start, once the scheduler's drain path and the checkpoint socket are there (before any notice)."""
        self.path, self.checkpoint = path, checkpoint

    def start(self, n: Notice, record: DrainRecord | None = None) -> None:
        assert self.path is not None, "a notice before the drain path was attached"
        if self.bundle() is None:
            self.spool.append(
                "bundle.missing",
                CRITICAL,
                notice=n.id,
                reason="no verified bundle cached: work keeps its own grace, capped by the deadline",
            )
        received = (record.received_at if record else None) or n.received_at
        deadline = Deadline.for_notice(n.terminate_at, self.margin(), received, self.clock)
        if deadline.late is not None:
            log.warning("notice %s is past its time (%s): draining best effort", n.id, deadline.late)
            self.spool.append("notice.late", CRITICAL, notice=n.id, **deadline.late)
        drain = self.path.drain(n, deadline, record)
        self.current = drain
        if self.checkpoint is not None:  # workloads on the checkpoint socket are told at once
            self.checkpoint.start_notice(n.id, deadline)
        self.task = asyncio.create_task(self._run(drain), name=f"drain:{n.id}")
        self.wake()

    def move_deadline(self, terminate_at: float) -> None:
        """A later notice with an earlier termination: the drain and its workloads see it at once."""
        if self.current is not None:
            self.current.update_deadline(terminate_at)
        if self.checkpoint is not None:  # workloads are told the shorter budget at once
            self.checkpoint.update_deadline()

    async def _run(self, drain: Drain) -> None:
        try:
            outcome = await drain.run()
            self.outcomes.append({"notice": drain.notice.id, **outcome})
            self.follow_ups()
        except Exception:
            log.exception("drain for notice %s failed", drain.notice.id)
            self.spool.append("drain.error", CRITICAL, notice=drain.notice.id)
        finally:
            if self.current is drain:
                self.current = None
            self.wake()

    def restore(self, hall: str, node: str, boot: str) -> None:
        """After a restart on the same instance, a drain this instance started still holds: no second one."""
        latched = latched_notice(self.spool.events(), hall, node, boot)
        if latched is not None:
            self.book.restore(*latched)

    def resume(self, hall: str, node: str) -> None:
        """Find a drain the spool says was started and never finished, and carry on with it."""
        seen, n = unfinished_drain(self.spool.events(), hall, node)
        self.book.seen.update(seen)
        if n is None:
            return
        assert self.path is not None
        record = self.path.record(self.spool, n.id)
        done = record.summary()
        self.spool.append(
            "drain.resumed", CRITICAL, notice=n.id, deadline_in_s=round(n.terminate_at - self.clock(), 3), **done
        )
        log.info("resuming drain for notice %s (%.1f s to the deadline)", n.id, n.terminate_at - self.clock())
        self.start(n, record)

    def follow_ups(self) -> None:
        """Start what the drain path still owes (e.g. telling slurmctld what was done around it)."""
        assert self.path is not None
        for name, coro in self.path.follow_ups(self.stop):
            self.spawn(coro, name)

    def state(self) -> str:
        """idle / draining n/m (pods or jobs gone of those seen) / drained / overrun: for systemctl status."""
        drain = self.current
        if drain is not None:
            progress = getattr(drain, "progress", None)
            done, total = progress() if progress is not None else (0, 0)
            return f"draining {done}/{total} for notice {drain.notice.id}"
        if self.outcomes:
            last = self.outcomes[-1]
            return f"{last.get('outcome', 'finished')} for notice {last.get('notice')}"
        return "idle"

    async def rearm_watch(self, every: float, back_in_service: Callable[[], Awaitable[bool]]) -> None:
        """After a drain the node stays drained: notices are absorbed until someone puts it back."""
        while not self.stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), every)
            if self.book.current is None or self.current is not None or self.stop.is_set():
                continue
            try:
                back = await back_in_service()
            except Exception as e:  # scheduler away: look again later
                log.debug("rearm check: %s", e)
                continue
            if back:
                prev = self.book.current.id
                self.book.rearm()
                self.spool.append("notice.rearmed", CRITICAL, after=prev, reason="node back in service")
                log.info("node back in service after notice %s: the next notice drains it again", prev)

    async def cancel(self, timeout: float) -> None:
        """At stop: the running drain is cancelled (resumable from the spool)."""
        if self.task is not None and not self.task.done():
            self.task.cancel()
            await asyncio.wait([self.task], timeout=timeout)
