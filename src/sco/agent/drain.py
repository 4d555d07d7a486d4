"""The one interface both drain paths (Kubernetes, Slurm) offer, so the daemon only wires tasks and never
asks which scheduler it runs beside (kubectl's drain ``Helper`` holds every setting; kopf's daemon wires).

A :class:`DrainPath` is how this node drains: built once at start with its scheduler client and settings,
it answers a preflight and makes one :class:`Drain` per notice, fresh or resumed from the spool's record.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, Protocol

from sco.agent.deadline import Deadline
from sco.agent.notices import Notice
from sco.agent.resume import DrainRecord
from sco.agent.spool import Spool


class Drain(Protocol):
    """One drain, for one notice, against one live :class:`Deadline`."""

    notice: Notice
    deadline: Deadline

    async def run(self) -> dict[str, Any]:
        """Drain and verify; spool and return the outcome (drained or overrun) by the overrun time."""
        ...

    def update_deadline(self, terminate_at: float) -> bool:
        """A later notice with an earlier termination: every loop sees it at once. True if it moved."""
        ...

    def summary(self) -> dict[str, Any]:
        """What had already been done when this drain was resumed (for ``drain.resumed``)."""
        ...


class DrainPath(Protocol):
    """How this node drains; the daemon holds one."""

    def record(self, spool: Spool, notice_id: str) -> DrainRecord:
        """What the spool says was already done for ``notice_id``."""
        ...

    def drain(self, notice: Notice, deadline: Deadline, record: DrainRecord | None) -> Drain: ...

    async def preflight(self) -> list[str]:
        """Problems that would stop a drain (unknown node, refused credential), said at start-up."""
        ...

    def follow_ups(self, stop: asyncio.Event) -> list[tuple[str, Coroutine[Any, Any, None]]]:
        """Named tasks the path still owes (e.g. telling slurmctld, once it answers, what was done around
        it); called at start and after each drain, each owed task is returned once."""
        ...

    async def close(self) -> None: ...
