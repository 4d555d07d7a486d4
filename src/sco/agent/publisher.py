"""Spool to JetStream (``sco.events.<hall>.<node>``), in seq order; after an outage, replayed from the cursor.

A publish JetStream refuses (no stream, a timeout) is tried again after a backoff with jitter, not at every
wake-up (twice a second while a backlog waits: a hall's agents would all hammer a broken stream in step). A
refusal is said once a minute at most, with the backlog.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

from sco._retry import Backoff
from sco.agent.spool import Spool

log = logging.getLogger("sco.agent")

PUBLISH_WARN_EVERY_S = 60.0
PUBLISH_RETRY_S = (0.5, 10.0)  # first and longest wait after a refused publish (sco._retry.Backoff)
BATCH = 200  # records published before the next look at the connection
IDLE_WAKE_S = 1.0  # nothing woke the publisher: look again anyway
JETSTREAM_TIMEOUT_S = 2.0


class EventPublisher:
    def __init__(self, spool: Spool, subject: str, connection: Callable[[], Any], clock: Callable[[], float]) -> None:
        """``connection()``: the relay's nats-py client, or None before the first connection."""
        self.spool, self.subject, self.connection, self.clock = spool, subject, connection, clock
        self._wake = asyncio.Event()
        self._failing: tuple[float, str] | None = None

    def wake(self) -> None:
        """Something was spooled, the link came back, a drain started or ended: publish now."""
        self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        backoff = Backoff(PUBLISH_RETRY_S[0], PUBLISH_RETRY_S[1])
        while not stop.is_set():
            self._wake.clear()
            nc = self.connection()
            if nc is not None and nc.is_connected:
                js = nc.jetstream(timeout=JETSTREAM_TIMEOUT_S)
                batch = self.spool.unpublished(BATCH)
                done = 0
                try:
                    for ev in batch:
                        # JetStream de-duplicates replays by this id; the random spool id makes it unguessable.
                        msg_id = f"{self.spool.id}.{ev['seq']}"
                        await js.publish(self.subject, json.dumps(ev).encode(), headers={"Nats-Msg-Id": msg_id})
                        done = ev["seq"]
                    self._ok()
                    backoff.reset()
                except Exception as e:  # no stream, timeout, disconnect: retry later from the cursor
                    self._failed(e)
                    batch = []
                    if nc.is_connected:  # refused on a live connection; a dropped one is nats-py's to reconnect
                        if done:
                            self.spool.mark_published(done)
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(stop.wait(), backoff.next())
                        continue
                if done:
                    self.spool.mark_published(done)
                if len(batch) == BATCH:
                    continue
            else:
                backoff.reset()  # reconnected later: publish at once, the outage was not JetStream's refusal
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), IDLE_WAKE_S)

    def _failed(self, e: Exception) -> None:
        now = self.clock()
        reason = f"{type(e).__name__}: {e}".strip().rstrip(":")
        if "NoResponders" in reason or "NoStream" in reason or "no responders" in reason.lower():
            reason = f"no JetStream stream captures {self.subject} ({type(e).__name__})"
        prev = self._failing
        if prev is None or now - prev[0] >= PUBLISH_WARN_EVERY_S:
            backlog = self.spool.last_seq - self.spool.published_seq
            log.warning("events cannot be published: %s; %d event(s) wait in the spool", reason, backlog)
            self._failing = (now, reason)

    def _ok(self) -> None:
        if self._failing is not None:
            log.warning("events publishing again (was: %s)", self._failing[1])
            self._failing = None
