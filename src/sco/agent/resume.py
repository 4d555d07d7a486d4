"""What the spool says about drains after a restart: the notice a drain on this boot latched (no second drain),
the drain started and never finished (resumed), and what it already did (each drain path's resume record)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Self

from sco.agent.notices import Notice
from sco.agent.spool import Spool

OUTCOMES = ("drain.drained", "drain.overrun")


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


def latched_notice(events: Iterable[dict[str, Any]], hall: str, node: str, boot: str) -> tuple[Notice, float] | None:
    """The notice this boot's last drain was for and its (earliest) deadline, unless the node was rearmed since
    or the drain was another boot's (a new instance): the NoticeBook holds it, so no second drain starts."""
    last: dict[str, Any] | None = None
    deadline: float | None = None
    started_boot = None
    for ev in events:
        t = ev["type"]
        if t == "agent.started":
            started_boot = ev.get("boot_id")
        elif t == "notice.accepted":
            last, deadline = ev, float(ev["terminate_at"])
        elif t == "notice.deadline" and last is not None and ev.get("notice") == last["notice"]:
            deadline = min(deadline or float(ev["terminate_at"]), float(ev["terminate_at"]))
        elif t == "notice.rearmed":
            last, deadline = None, None
    if last is None or deadline is None or started_boot != boot:
        return None
    n = Notice(
        str(last["notice"]),
        hall,
        node,
        float(last["terminate_at"]),
        float(last["issued_at"]),
        str(last["source"]),
        float(last["received_at"]),
    )
    return n, deadline


def unfinished_drain(events: Iterable[dict[str, Any]], hall: str, node: str) -> tuple[dict[str, Notice], Notice | None]:
    """Every notice the spool says was accepted (by id), and the one whose drain started and never finished
    (with its earliest deadline, ``source`` "spool"), if any."""
    seen: dict[str, Notice] = {}
    open_notice: dict[str, Any] | None = None
    terminate_at: dict[str, float] = {}
    for ev in events:
        t, nid = ev["type"], str(ev.get("notice"))
        if t == "notice.accepted":
            open_notice = ev
            terminate_at[nid] = float(ev["terminate_at"])
            seen[nid] = Notice(
                nid,
                hall,
                node,
                float(ev["terminate_at"]),
                float(ev["issued_at"]),
                ev["source"],
                float(ev["received_at"]),
            )
        elif t == "notice.deadline" and nid in terminate_at:
            terminate_at[nid] = min(terminate_at[nid], float(ev["terminate_at"]))
        elif (t in OUTCOMES or t == "drain.error") and open_notice is not None and nid == open_notice["notice"]:
            open_notice = None
    if open_notice is None:
        return seen, None
    nid = open_notice["notice"]
    n = Notice(
        nid,
        hall,
        node,
        terminate_at[nid],
        float(open_notice["issued_at"]),
        "spool",
        float(open_notice["received_at"]),
    )
    return seen, n
