"""What the spool says a drain already did: the base of each drain path's resume record."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Self

from sco.agent.spool import Spool


@dataclass
class DrainRecord:
    received_at: float | None = None  # when the notice was accepted: budgets run from here

    @classmethod
    def from_spool(cls, spool: Spool, notice_id: str) -> Self:
        r = cls()
        for ev in spool.events():
            if ev.get("notice") != notice_id:
                continue
            if ev["type"] == "notice.accepted" and r.received_at is None:
                r.received_at = float(ev["received_at"])
            else:
                r.apply(ev["type"], ev)
        return r

    def apply(self, type_: str, ev: dict[str, Any]) -> None:
        """Take one of this notice's events into account."""
        raise NotImplementedError

    def summary(self) -> dict[str, Any]:
        """What was already done, for the ``drain.resumed`` event."""
        raise NotImplementedError
