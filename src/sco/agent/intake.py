"""Notice intake: what every source hands over is decided by the NoticeBook and accounted for here.

A notice starts a drain, moves a running drain's deadline earlier, or is absorbed (counted, never a second
drain); a refused one and JetStream traffic another client routed onto the notice subject are counted. Floods
cost counters, not disk: at most 20 refusal/absorbed records a second, one foreign-traffic summary a minute.
The drain itself is the :class:`Drains` owner's (``sco.agent.drains``); intake only tells it.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Callable
from typing import Protocol

from sco.agent.drain import Drain
from sco.agent.metrics import AgentMetrics
from sco.agent.notices import MIN_DEADLINE_STEP_S, Notice, NoticeBook, NoticeRefused
from sco.agent.spool import CRITICAL, ROUTINE, Spool
from sco.contract.bundle import Bundle
from sco.contract.notice import notice_keyring
from sco.contract.signing import Keyring

log = logging.getLogger("sco.agent")

FOREIGN_SAY_EVERY_S = 60.0
RECORDS_PER_SECOND = 20  # refusal and absorbed records written a second at most
REFUSED_DIGESTS = 1000  # refused messages remembered (a repeat is counted, not recorded again)


class Drains(Protocol):
    """What intake needs of whoever runs the drain."""

    @property
    def current(self) -> Drain | None: ...

    def start(self, notice: Notice) -> None: ...

    def move_deadline(self, terminate_at: float) -> None: ...


class NoticeIntake:
    def __init__(
        self,
        *,
        spool: Spool,
        metrics: AgentMetrics,
        clock: Callable[[], float],
        bundle: Callable[[], Bundle | None],
        drains: Drains,
        book: NoticeBook | None = None,
    ) -> None:
        self.spool, self.metrics, self.clock, self.bundle, self.drains = spool, metrics, clock, bundle, drains
        self.book = book or NoticeBook()
        self.refused: Counter[str] = Counter()
        self.absorbed = 0
        self.foreign_traffic: Counter[str] = Counter()
        self._refused_seen: set[str] = set()
        self._record_budget = (0, 0)  # (second, records) for refusal / absorbed records
        self._keys: tuple[str | None, Keyring] = (None, Keyring())
        self._foreign_said = -FOREIGN_SAY_EVERY_S  # clock time of the last warning and summary record
        self._foreign_recorded: dict[str, int] = {}

    def notice_keys(self) -> Keyring:
        """The notice keys the cached bundle's hall policy names (rebuilt when the bundle changes)."""
        b = self.bundle()
        digest = b.content_digest if b else None
        if self._keys[0] != digest:
            self._keys = (digest, notice_keyring(b.policy) if b else Keyring())
        return self._keys[1]

    def _may_record(self) -> bool:
        sec = int(self.clock())
        at, n = self._record_budget
        if at != sec:
            at, n = sec, 0
        self._record_budget = (at, n + 1)
        return n < RECORDS_PER_SECOND

    def refuse(self, source: str, e: NoticeRefused, raw: bytes) -> None:
        self.refused[e.kind] += 1
        self.metrics.notice(source, "refused")
        self.metrics.refusals.inc(e.kind)
        digest = hashlib.sha256(raw).hexdigest()
        if digest in self._refused_seen:
            return
        if len(self._refused_seen) > REFUSED_DIGESTS:
            self._refused_seen.clear()
        self._refused_seen.add(digest)
        if self._may_record():
            self.spool.append(
                "notice.refused",
                ROUTINE,
                source=source,
                kind=e.kind,
                reason=e.reason,
                bytes=len(raw),
                sha256=digest,  # which message: a sender can tell its own notice from someone else's
                refused_total=dict(self.refused),
            )
            log.warning("refused %s notice (%s): %s", source, e.kind, e.reason[:300])

    def foreign(self, kind: str) -> None:
        """JetStream acks or deliveries another client routed onto the notice subject: one warning and one
        summary record a minute at most."""
        self.foreign_traffic[kind] += 1
        now = self.clock()
        if now - self._foreign_said >= FOREIGN_SAY_EVERY_S:
            self._foreign_said = now
            log.warning(
                "foreign traffic on the notice subject, ignored (%s so far): another client routes JetStream "
                "replies or deliveries here (check the relay's permissions)",
                dict(self.foreign_traffic),
            )
            self.record_foreign()

    def record_foreign(self) -> None:
        """The foreign-traffic summary record, when the counts changed since the last."""
        if dict(self.foreign_traffic) != self._foreign_recorded:
            self._foreign_recorded = dict(self.foreign_traffic)
            self.spool.append("notice.foreign_traffic", ROUTINE, foreign_traffic_total=self._foreign_recorded)

    def catch_up(self) -> None:
        """Called on the housekeeping tick: the summary catches up after a flood ends."""
        if self.clock() - self._foreign_said >= FOREIGN_SAY_EVERY_S:
            self.record_foreign()

    def accept(self, n: Notice) -> None:
        verdict = self.book.offer(n)
        if verdict == "duplicate":
            self.metrics.notice(n.source, "duplicate")
            return
        drain = self.drains.current
        if verdict == "start" and drain is None:
            self.metrics.notice(n.source, "accepted")
            self.spool.append("notice.accepted", CRITICAL, **n.as_event())
            self.drains.start(n)
            return
        if drain is not None and n.terminate_at <= drain.deadline.terminate_at - MIN_DEADLINE_STEP_S:
            self.spool.append(
                "notice.deadline",
                CRITICAL,
                notice=drain.notice.id,
                terminate_at=n.terminate_at,
                from_notice=n.id,
                source=n.source,
            )
            self.drains.move_deadline(n.terminate_at)
            self.metrics.notice(n.source, "deadline")
            return
        # Another notice while the node drains or after it drained: counted, never a second drain.
        self.absorbed += 1
        self.metrics.notice(n.source, "absorbed")
        if self._may_record():
            self.spool.append(
                "notice.absorbed",
                ROUTINE,
                notice=n.id,
                source=n.source,
                terminate_at=n.terminate_at,
                draining=drain is not None,
                of=self.book.current.id if self.book.current else None,
                absorbed_total=self.absorbed,
            )
