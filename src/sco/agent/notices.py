"""Reclaim notices: parsing, refusal with a reason, and the NoticeBook every source hands its notices to.

Two shapes arrive (the sources in ``sco.agent.notice_sources`` read them):
- over NATS on ``sco.notice.<hall>.<node>``: ``{"id", "hall", "node", "terminateAt", "issuedAt"?, "signatures"}``
  (times in epoch seconds, numbers or RFC 3339 strings), signed by a notice key the bundle's hall policy
  names (``sco.contract.notice``);
- in the OpenStack instance metadata (``meta_data.json``): the instance ``name`` and, in its ``meta`` map,
  ``sco_reclaim_id`` and ``sco_reclaim_at`` (Nova metadata values are strings).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

FUTURE_SKEW_S = 30.0  # an issue time further ahead than this is a broken clock, not a notice
MAX_EPOCH_S = 1e11  # year ~5138: anything later is not a time a notice can mean
MIN_DEADLINE_STEP_S = 1.0  # an earlier deadline moves the drain only if it is at least this much earlier
MAX_NOTICES = 256  # ids the book remembers (the current drain's notice is always kept)


class NoticeRefused(Exception):
    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind  # "malformed" | "foreign" | "absurd"
        self.reason = reason


# A JetStream publish acknowledgement ({"stream", "seq"} and optional fields; "error" when the publish failed).
_PUBACK_KEYS = frozenset({"stream", "seq", "duplicate", "domain", "error", "batch", "count", "val"})


def foreign_traffic(data: bytes, reply: str, headers: Mapping[str, str] | None) -> str | None:
    """What JetStream traffic routed onto a notice subject is ("jetstream-puback" | "jetstream-delivery"), or None.

    A client that may not publish to another node's notice subject can still have the server send there: a
    publish to the events stream with that subject as its reply gets the PubAck, and a push consumer with it as
    deliver_subject gets the stream's messages (reply ``$JS.ACK.``, flow control ``$JS.FC.``, heartbeats with a
    Status header). None of these is a notice; they are counted, not refused one record each.
    """
    if reply.startswith(("$JS.ACK.", "$JS.FC.")) or (headers and headers.get("Status")):
        return "jetstream-delivery"
    if data[:1] != b"{" or b'"stream"' not in data or len(data) > 4096:
        return None
    try:
        doc = json.loads(data)
    except ValueError:
        return None
    if (
        isinstance(doc, dict)
        and doc.keys() <= _PUBACK_KEYS
        and isinstance(doc.get("stream"), str)
        and type(doc.get("seq")) is int
    ):
        return "jetstream-puback"
    return None


@dataclass(frozen=True)
class Notice:
    id: str
    hall: str
    node: str
    terminate_at: float  # wall clock, epoch seconds: the instance is gone then
    issued_at: float
    source: str  # "nats" | "metadata" | "spool"
    received_at: float

    def as_event(self) -> dict[str, Any]:
        return {
            "notice": self.id,
            "terminate_at": self.terminate_at,
            "issued_at": self.issued_at,
            "source": self.source,
            "received_at": self.received_at,
        }


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:80]}... ({len(text)} characters)"


def _time(value: Any, what: str) -> float:
    t = _raw_time(value, what)
    # NaN compares false with everything, so it would pass every later check; infinity and 1e300 overflow.
    if not math.isfinite(t) or not 0 < t < MAX_EPOCH_S:
        raise NoticeRefused("absurd", f"{what}: {_short(value)} is not a time in range (0 to {MAX_EPOCH_S:.0e} s)")
    return t


def _raw_time(value: Any, what: str) -> float:
    if isinstance(value, bool):
        raise NoticeRefused("malformed", f"{what}: expected epoch seconds or RFC 3339, got {value!r}")
    try:
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, str):
            if len(value) > 64:
                raise NoticeRefused("malformed", f"{what}: {_short(value)} is not a time")
            try:
                return float(value)
            except ValueError:
                pass
            try:
                dt = datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                raise NoticeRefused("malformed", f"{what}: {value!r} is not a time") from None
            if dt.tzinfo is None:
                raise NoticeRefused("malformed", f"{what}: {value!r} has no time zone")
            return dt.timestamp()
    except OverflowError:
        raise NoticeRefused("absurd", f"{what}: {_short(value)} is out of range") from None
    raise NoticeRefused("malformed", f"{what}: expected a time, got {type(value).__name__}")


def _check_times(terminate_at: float, issued_at: float, now: float, window: float) -> None:
    if issued_at > now + FUTURE_SKEW_S:
        raise NoticeRefused("absurd", f"issuedAt is {issued_at - now:.0f} s in the future")
    if terminate_at < issued_at:
        raise NoticeRefused("absurd", "terminateAt is before issuedAt")
    if terminate_at > now + 2 * window:
        raise NoticeRefused("absurd", f"terminateAt is {terminate_at - now:.0f} s away, beyond twice the window")
    if terminate_at < now - window:
        raise NoticeRefused("absurd", f"terminateAt passed {now - terminate_at:.0f} s ago (stale notice)")


def _id(value: Any) -> str:
    if not isinstance(value, str) or not value or len(value) > 128 or not value.isprintable():
        raise NoticeRefused("malformed", f"id: expected a printable string of 1-128 characters, got {_short(value)}")
    return value


def parse_nats(raw: bytes, *, hall: str, node: str, now: float, window: float) -> Notice:
    """An unsigned notice's fields (the NATS source checks the signature first, then reads the object)."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: absurd nesting
        raise NoticeRefused("malformed", f"not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise NoticeRefused("malformed", "expected a JSON object")
    return notice_from_nats(doc, hall=hall, node=node, now=now, window=window)


def notice_from_nats(doc: dict[str, Any], *, hall: str, node: str, now: float, window: float) -> Notice:
    nid = _id(doc.get("id"))
    if doc.get("node") != node:
        raise NoticeRefused("foreign", f"notice {nid} is for node {_short(doc.get('node'))}, this is {node!r}")
    if doc.get("hall", hall) != hall:
        raise NoticeRefused("foreign", f"notice {nid} is for hall {_short(doc.get('hall'))}, this is {hall!r}")
    if "terminateAt" not in doc:
        raise NoticeRefused("malformed", f"notice {nid}: terminateAt: missing")
    terminate_at = _time(doc["terminateAt"], "terminateAt")
    issued_at = _time(doc.get("issuedAt", now), "issuedAt")
    _check_times(terminate_at, issued_at, now, window)
    return Notice(nid, hall, node, terminate_at, issued_at, "nats", now)


def parse_metadata(raw: bytes, *, hall: str, node: str, now: float, window: float) -> Notice | None:
    """The notice in ``meta_data.json``, or None when the instance carries no reclaim."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: absurd nesting
        raise NoticeRefused("malformed", f"metadata: not JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("meta", {}), dict):
        raise NoticeRefused("malformed", "metadata: expected an object with a meta map")
    meta = doc.get("meta", {})
    if "sco_reclaim_id" not in meta and "sco_reclaim_at" not in meta:
        return None
    nid = _id(meta.get("sco_reclaim_id"))
    if doc.get("name") not in (None, node):
        raise NoticeRefused("foreign", f"metadata names instance {_short(doc.get('name'))}, this node is {node!r}")
    if "sco_reclaim_at" not in meta:
        raise NoticeRefused("malformed", f"notice {nid}: meta.sco_reclaim_at: missing")
    terminate_at = _time(meta["sco_reclaim_at"], "meta.sco_reclaim_at")
    issued_at = _time(meta.get("sco_reclaim_issued_at", now), "meta.sco_reclaim_issued_at")
    _check_times(terminate_at, issued_at, now, window)
    return Notice(nid, hall, node, terminate_at, issued_at, "metadata", now)


Verdict = Literal["start", "earlier", "duplicate", "absorbed"]


@dataclass
class NoticeBook:
    """Every notice from every source, by id; the one place that decides what a notice means.

    - The first notice starts the drain ("start"); its id and every later one are remembered, so the same
      notice from the other channel, or again, is a "duplicate".
    - The drain's deadline is the earliest termination time of any notice since; a notice that moves it
      earlier by at least ``MIN_DEADLINE_STEP_S`` is "earlier" (a flood of 1 ms steps costs nothing).
    - Any other notice is "absorbed": counted, never a second drain. This holds after the drain finished
      too, until ``rearm()`` (the node was untainted / resumed) or the agent starts on a new instance.
    - At most ``MAX_NOTICES`` ids are kept (the oldest go; the current drain's notice stays).
    """

    seen: dict[str, Notice] = field(default_factory=dict)
    current: Notice | None = None
    deadline: float | None = None
    duplicates: int = 0
    absorbed: int = 0
    max_notices: int = MAX_NOTICES

    def offer(self, n: Notice) -> Verdict:
        old = self.seen.get(n.id)
        if old is not None and n.terminate_at > old.terminate_at - MIN_DEADLINE_STEP_S:
            self.duplicates += 1
            return "duplicate"
        if old is None or n.terminate_at < old.terminate_at:
            self.seen[n.id] = n
            self._prune()
        if self.current is None:
            self.current, self.deadline = n, n.terminate_at
            return "start"
        assert self.deadline is not None
        if n.terminate_at <= self.deadline - MIN_DEADLINE_STEP_S:
            self.deadline = n.terminate_at
            return "earlier"
        self.absorbed += 1
        return "absorbed"

    def restore(self, n: Notice, deadline: float) -> None:
        """The drain the spool says this instance already started (after a restart)."""
        self.seen[n.id] = n
        self.current, self.deadline = n, deadline

    def rearm(self) -> None:
        """The node is back in service: the next notice starts a drain again."""
        self.current, self.deadline = None, None
        self.seen.clear()

    def _prune(self) -> None:
        if len(self.seen) <= self.max_notices:
            return
        keep = self.current.id if self.current else None
        for nid in sorted(self.seen, key=lambda k: self.seen[k].received_at):
            if len(self.seen) <= self.max_notices:
                break
            if nid != keep:
                del self.seen[nid]
