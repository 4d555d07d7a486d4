"""The preflight: what would stop a drain (an unknown node, a refused credential), asked of the drain path at
start, every ``preflight_seconds`` and at once when the credential file changes (a rotated or renewed token is
checked before a notice needs it, not at the next start).

Its answer is spooled when it changes (problems found, other problems, all well again), never every run, and
written with the credential's state to ``scheduler.json`` beside the spool for ``sco-agent status`` (which
reads the state directory only).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sco._fs import atomic_write
from sco.agent.scheduler import NodeScheduler
from sco.agent.spool import CRITICAL, ROUTINE, Spool

log = logging.getLogger("sco.agent")

STATE_FILE = "scheduler.json"


class Preflight:
    def __init__(
        self, scheduler: NodeScheduler, spool: Spool, state_dir: Path, every: float, clock: Callable[[], float]
    ) -> None:
        self.scheduler, self.spool, self.every, self.clock = scheduler, spool, every, clock
        self.state_file = state_dir / STATE_FILE
        self.last: dict[str, Any] | None = None  # {"at", "ok", "problems"}
        self.waiting: Callable[[], bool] = lambda: False
        """True while first-boot enrolment has not written the credential yet: a refused credential is awaited."""

    async def once(self) -> None:
        problems = await self.scheduler.path.preflight()
        prev = self.last
        self.last = {"at": round(self.clock(), 3), "ok": not problems, "problems": problems}
        if prev is None or prev["problems"] != problems:
            if problems and self.waiting():
                # the normal first boot: the credential comes with enrolment; checked again as soon as it is written
                log.info("preflight: waiting for enrolment to write the credential (%s)", "; ".join(problems))
                self.spool.append("scheduler.preflight_waiting", ROUTINE, problems=problems)
                self.write_state()
                return
            for p in problems:
                log.error("preflight: %s", p)
            if problems:
                self.spool.append("scheduler.preflight", CRITICAL, problems=problems)
            elif prev is not None:
                log.info("preflight: all well again")
                self.spool.append("scheduler.preflight_ok", ROUTINE)
        self.write_state()

    async def run(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            sig = self.scheduler.signature()
            try:
                await self.once()
            except Exception as e:  # a bug here must not end the repeats (nor the agent)
                log.error("preflight: %s", e)
            until = loop.time() + self.every
            while not stop.is_set() and loop.time() < until:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), min(1.0, max(0.0, until - loop.time())))
                if self.scheduler.signature() != sig:
                    break  # the credential file changed: check the new credential now

    def write_state(self) -> None:
        """The last preflight and the credential's state; a failure to write is logged, never a reason to stop."""
        out: dict[str, Any] = {"preflight": self.last}
        credential = self.scheduler.credential_state()
        if credential is not None:
            out["credential"] = credential
        try:
            atomic_write(self.state_file, json.dumps(out, sort_keys=True).encode())
        except OSError as e:
            log.warning("%s: %s", self.state_file, e)
