"""The node's event spool: an append-only file of framed records, bounded in size, crash-safe.

Record: ``>I length, >I crc32, B priority, >Q seq`` then ``payload`` (one JSON object); the CRC covers
priority, seq and payload.

Crash safety and fsync policy:
- Each record is written with a single ``write(2)`` of the whole frame on an ``O_APPEND`` descriptor. A
  kill -9 cannot undo a completed write (the data is in the page cache, which outlives the process), so a
  killed agent loses at most the record whose write was under way.
- Critical records (the drain's own state: notice accepted, tainted, eviction requested or forced,
  drained, overrun, drops) are followed by ``fdatasync`` before the agent acts on them; routine records
  are synced by the next critical record or at most ``sync_interval`` later. A power loss therefore loses
  at most ``sync_interval`` of routine events and no acted-on drain step.
- On open, the file is scanned: a record that is short or whose CRC does not match is a torn tail; it and
  anything after it are cut off (and counted), so the next append starts on a clean boundary.

Bound: when an append would pass ``max_bytes`` (64 MiB by default) the file is rewritten within half the
bound: routine records go before critical ones, already-published ones before unpublished ones, oldest
first; critical records go only if they alone overflow. A ``spool.dropped`` record says what was dropped.
Publication progress (the last seq acknowledged by JetStream) is kept in ``cursor.json``, written atomically.
"""

from __future__ import annotations

import json
import os
import struct
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sco._fs import atomic_write

_HEAD = struct.Struct(">IIBQ")  # length, crc32, priority, seq
_CRC_PART = struct.Struct(">BQ")
ROUTINE, CRITICAL = 0, 1
MAX_RECORD = 1 << 20
SPOOL_FILE = "events.spool"
CURSOR_FILE = "cursor.json"

Event = dict[str, Any]


@dataclass
class Recovery:
    records: int = 0
    torn_bytes: int = 0


def _frame(payload: bytes, priority: int, seq: int) -> bytes:
    crc = zlib.crc32(payload, zlib.crc32(_CRC_PART.pack(priority, seq)))
    return _HEAD.pack(len(payload), crc, priority, seq) + payload


@dataclass(frozen=True)
class _Rec:
    offset: int
    length: int  # of the whole frame
    priority: int
    seq: int


def _walk(path: Path, *, payloads: bool, start: int = 0) -> Iterator[tuple[_Rec, bytes | None]]:
    """Intact records of a spool file in order, streamed (never the whole file in memory).

    Stops at the first short or corrupt record: everything from there on is a torn tail.
    CRCs are always checked, so the payload is read either way; it is returned only if asked for.
    """
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed in finally; a generator holds it open
    except FileNotFoundError:
        return
    try:
        f.seek(start)
        pos = start
        while True:
            head = f.read(_HEAD.size)
            if len(head) < _HEAD.size:
                return
            length, crc, prio, seq = _HEAD.unpack(head)
            if length > MAX_RECORD:
                return
            payload = f.read(length)
            if len(payload) < length or zlib.crc32(payload, zlib.crc32(_CRC_PART.pack(prio, seq))) != crc:
                return
            yield _Rec(pos, _HEAD.size + length, prio, seq), (payload if payloads else None)
            pos += _HEAD.size + length
    finally:
        f.close()


class Spool:
    def __init__(
        self,
        directory: Path,
        *,
        max_bytes: int = 64 * 1024 * 1024,
        sync_interval: float = 1.0,
        clock: Callable[[], float] = time.time,
        base: dict[str, Any] | None = None,
    ) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / SPOOL_FILE
        self.max_bytes = max_bytes
        self.sync_interval = sync_interval
        self.clock = clock
        self.base = base or {}  # fields every event carries (hall, node)
        self.recovery = Recovery()
        self.published_seq = self._read_cursor()
        self.last_seq = 0
        self.dropped_total = 0
        self._recover()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        self.size = os.fstat(self._fd).st_size
        self._dirty_since: float | None = None
        self._pub_offset = 0  # file offset from which unpublished events are searched
        self._batch_end: dict[int, int] = {}

    def _read_cursor(self) -> int:
        try:
            return int(json.loads((self.dir / CURSOR_FILE).read_text())["published_seq"])
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return 0

    def _recover(self) -> None:
        if not self.path.exists():
            return
        end, count = 0, 0
        for rec, _ in _walk(self.path, payloads=False):
            end, count = rec.offset + rec.length, count + 1
            self.last_seq = rec.seq
        size = self.path.stat().st_size
        if end < size:
            self.recovery.torn_bytes = size - end
            with open(self.path, "r+b") as f:
                f.truncate(end)
                os.fsync(f.fileno())
        self.recovery.records = count

    def close(self) -> None:
        self.sync()
        os.close(self._fd)

    def sync(self) -> None:
        if self._dirty_since is not None:
            os.fdatasync(self._fd)
            self._dirty_since = None

    def maybe_sync(self) -> None:
        """Called periodically: bounds how long a routine record stays unsynced."""
        if self._dirty_since is not None and self.clock() - self._dirty_since >= self.sync_interval:
            self.sync()

    def _encode(self, type_: str, priority: int, fields: dict[str, Any]) -> tuple[Event, bytes]:
        event: Event = {"seq": self.last_seq + 1, "at": round(self.clock(), 6), "type": type_, **self.base, **fields}
        payload = json.dumps(event, separators=(",", ":"), sort_keys=True).encode()
        return event, _frame(payload, priority, event["seq"])

    def append(self, type_: str, priority: int = ROUTINE, **fields: Any) -> Event:
        event, frame = self._encode(type_, priority, fields)
        if self.size + len(frame) > self.max_bytes:
            self._compact(len(frame))
            event, frame = self._encode(type_, priority, fields)
        os.write(self._fd, frame)  # one write per record: a kill -9 cannot leave half of an earlier record
        self.size += len(frame)
        self.last_seq = event["seq"]
        if priority >= CRITICAL:
            os.fdatasync(self._fd)
            self._dirty_since = None
        elif self._dirty_since is None:
            self._dirty_since = self.clock()
        return event

    def _compact(self, incoming: int) -> None:
        """Rewrite the file within half the bound: critical records stay, routine ones go first."""
        self.sync()
        recs = [r for r, _ in _walk(self.path, payloads=False)]
        budget = self.max_bytes // 2 - incoming
        critical = [r for r in recs if r.priority >= CRITICAL]
        used = sum(r.length for r in critical)
        keep: set[int] = {r.seq for r in critical}
        dropped: list[_Rec] = []
        if used > budget:
            # Critical records alone overflow: the oldest already-published ones go first (they are in
            # JetStream), then, to keep the bound hard, the oldest unpublished ones (older drains: the newest
            # records are the current drain's state).
            for r in sorted(critical, key=lambda r: (r.seq > self.published_seq, r.seq)):
                if used <= budget:
                    break
                keep.discard(r.seq)
                dropped.append(r)
                used -= r.length
        # Routine: keep newest unpublished first, then newest published.
        routine = sorted(
            (r for r in recs if r.priority < CRITICAL), key=lambda r: (r.seq <= self.published_seq, -r.seq)
        )
        for r in routine:
            if used + r.length <= budget:
                keep.add(r.seq)
                used += r.length
            else:
                dropped.append(r)
        tmp = self.path.with_name(f".{self.path.name}.compact")
        with open(self.path, "rb") as src, open(tmp, "wb") as dst:
            for r in recs:
                if r.seq in keep:
                    src.seek(r.offset)
                    dst.write(src.read(r.length))
            self.last_seq = max([r.seq for r in recs] or [self.last_seq])
            event, frame = self._encode(
                "spool.dropped",
                CRITICAL,
                {
                    "routine": sum(1 for r in dropped if r.priority < CRITICAL),
                    "critical_published": sum(
                        1 for r in dropped if r.priority >= CRITICAL and r.seq <= self.published_seq
                    ),
                    "critical_unpublished": sum(
                        1 for r in dropped if r.priority >= CRITICAL and r.seq > self.published_seq
                    ),
                    "unpublished": sum(1 for r in dropped if r.seq > self.published_seq),
                    "bytes": sum(r.length for r in dropped),
                },
            )
            dst.write(frame)
            dst.flush()
            os.fsync(dst.fileno())
        os.close(self._fd)
        os.replace(tmp, self.path)
        dfd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self.size = os.fstat(self._fd).st_size
        self.last_seq = event["seq"]
        self.dropped_total += len(dropped)
        self._pub_offset, self._batch_end = 0, {}

    def events(self, after_seq: int = 0) -> Iterator[Event]:
        """Every intact event with seq > after_seq, oldest first, streamed from disk."""
        return read_events(self.dir, after_seq)

    def unpublished(self, limit: int = 1000) -> list[Event]:
        """The next events to publish, oldest first; starts from where the last batch ended."""
        out: list[Event] = []
        self._batch_end = {}
        for rec, payload in _walk(self.path, payloads=True, start=self._pub_offset):
            if rec.seq <= self.published_seq or payload is None:
                continue
            out.append(json.loads(payload))
            self._batch_end[rec.seq] = rec.offset + rec.length
            if len(out) >= limit:
                break
        return out

    def mark_published(self, seq: int) -> None:
        if seq > self.published_seq:
            self.published_seq = seq
            self._pub_offset = self._batch_end.get(seq, self._pub_offset)
            atomic_write(self.dir / CURSOR_FILE, json.dumps({"published_seq": seq}).encode())


def read_events(directory: Path, after_seq: int = 0) -> Iterator[Event]:
    """The events of the spool in ``directory``, read-only (no recovery, safe beside a running agent)."""
    for rec, payload in _walk(Path(directory) / SPOOL_FILE, payloads=True):
        if rec.seq > after_seq and payload is not None:
            yield json.loads(payload)
