"""Reclaim notices: parsing, refusal with a reason, de-duplication by id, earliest termination wins.

Two shapes arrive:
- over NATS on ``sco.notice.<hall>.<node>``: ``{"id", "hall", "node", "terminateAt", "issuedAt"?}``
  (times in epoch seconds, numbers or RFC 3339 strings);
- in the OpenStack instance metadata (``meta_data.json``): the instance ``name`` and, in its ``meta`` map,
  ``sco_reclaim_id`` and ``sco_reclaim_at`` (Nova metadata values are strings).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

FUTURE_SKEW_S = 30.0  # an issue time further ahead than this is a broken clock, not a notice


class NoticeRefused(Exception):
    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind  # "malformed" | "foreign" | "absurd"
        self.reason = reason


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


def _time(value: Any, what: str) -> float:
    if isinstance(value, bool):
        raise NoticeRefused("malformed", f"{what}: expected epoch seconds or RFC 3339, got {value!r}")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
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
        raise NoticeRefused("malformed", f"id: expected a printable string of 1-128 characters, got {value!r}")
    return value


def parse_nats(raw: bytes, *, hall: str, node: str, now: float, window: float) -> Notice:
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise NoticeRefused("malformed", f"not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise NoticeRefused("malformed", "expected a JSON object")
    nid = _id(doc.get("id"))
    if doc.get("node") != node:
        raise NoticeRefused("foreign", f"notice {nid} is for node {doc.get('node')!r}, this is {node!r}")
    if doc.get("hall", hall) != hall:
        raise NoticeRefused("foreign", f"notice {nid} is for hall {doc.get('hall')!r}, this is {hall!r}")
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
    except (ValueError, UnicodeDecodeError) as e:
        raise NoticeRefused("malformed", f"metadata: not JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("meta", {}), dict):
        raise NoticeRefused("malformed", "metadata: expected an object with a meta map")
    meta = doc.get("meta", {})
    if "sco_reclaim_id" not in meta and "sco_reclaim_at" not in meta:
        return None
    nid = _id(meta.get("sco_reclaim_id"))
    if doc.get("name") not in (None, node):
        raise NoticeRefused("foreign", f"metadata names instance {doc.get('name')!r}, this node is {node!r}")
    if "sco_reclaim_at" not in meta:
        raise NoticeRefused("malformed", f"notice {nid}: meta.sco_reclaim_at: missing")
    terminate_at = _time(meta["sco_reclaim_at"], "meta.sco_reclaim_at")
    issued_at = _time(meta.get("sco_reclaim_issued_at", now), "meta.sco_reclaim_issued_at")
    _check_times(terminate_at, issued_at, now, window)
    return Notice(nid, hall, node, terminate_at, issued_at, "metadata", now)


@dataclass
class NoticeBook:
    """Notices seen, by id. The drain's deadline is the earliest termination time of any accepted notice."""

    seen: dict[str, Notice] = field(default_factory=dict)
    duplicates: int = 0

    def offer(self, n: Notice) -> str:
        """ "new" (first notice of this id), "earlier" (same id, earlier time), or "duplicate"."""
        old = self.seen.get(n.id)
        if old is None:
            self.seen[n.id] = n
            return "new"
        if n.terminate_at < old.terminate_at:
            self.seen[n.id] = n
            return "earlier"
        self.duplicates += 1
        return "duplicate"
