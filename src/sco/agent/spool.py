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
- On open, the file is scanned. A record that cannot be read (short, CRC mismatch, larger than the record
  limit) is skipped and the scan resynchronises on the next intact frame (its CRC and a higher seq prove
  it), so one bad record never hides the ones after it. Only a tail with no intact frame after it is a torn
  tail: it is cut off (and counted), so the next append starts on a clean boundary.
- No record is ever written above the limit: strings longer than ``MAX_STRING`` are cut (``<field>_len``
  notes the original length) and a record still too large is replaced by a summary of itself.
- A write that fails (disk full, read-only, I/O error) never raises into the drain: the record stays in
  memory (in order, up to ``MAX_PENDING_BYTES``), the failure is logged at ERROR, and the next append
  retries; once the disk takes writes again a ``spool.unwritable`` record says what happened, and the
  drain's outcome carries ``spool_unwritable``.

Bound: when an append would pass ``max_bytes`` (64 MiB by default) the file is rewritten within half the
bound: routine records go before critical ones, already-published ones before unpublished ones, oldest
first; critical records go only if they alone overflow. A ``spool.dropped`` record says what was dropped.
Publication progress (the last seq acknowledged by JetStream) is kept in ``cursor.json``, written atomically.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
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
MAX_STRING = 4096  # longest string kept whole in a record (a 900 KB foreign node name is not)
MAX_PENDING_BYTES = 8 << 20  # records held in memory while the disk refuses writes
SPOOL_FILE = "events.spool"
CURSOR_FILE = "cursor.json"
ID_FILE = "spool.id"
OUTCOME_TYPES = frozenset({"drain.drained", "drain.overrun", "drain.error"})

log = logging.getLogger("sco.agent.spool")

Event = dict[str, Any]


@dataclass
class Recovery:
    records: int = 0
    torn_bytes: int = 0
    skipped: int = 0  # unreadable records passed over (their bytes stay until the next compaction)
    skipped_bytes: int = 0


def _frame(payload: bytes, priority: int, seq: int) -> bytes:
    crc = zlib.crc32(payload, zlib.crc32(_CRC_PART.pack(priority, seq)))
    return _HEAD.pack(len(payload), crc, priority, seq) + payload


@dataclass(frozen=True)
class _Rec:
    offset: int
    length: int  # of the whole frame
    priority: int
    seq: int


def _read_frame(f: Any, pos: int, after_seq: int) -> tuple[_Rec, bytes] | None:
    """The intact frame at ``pos`` with a seq above ``after_seq``, or None."""
    f.seek(pos)
    head = f.read(_HEAD.size)
    if len(head) < _HEAD.size:
        return None
    length, crc, prio, seq = _HEAD.unpack(head)
    if length > MAX_RECORD or prio not in (ROUTINE, CRITICAL) or seq <= after_seq:
        return None
    payload: bytes = f.read(length)
    if len(payload) < length or zlib.crc32(payload, zlib.crc32(_CRC_PART.pack(prio, seq))) != crc:
        return None
    return _Rec(pos, _HEAD.size + length, prio, seq), payload


def _resync(f: Any, pos: int, after_seq: int) -> tuple[_Rec, bytes] | None:
    """The next intact frame after an unreadable one at ``pos``. Every payload is a JSON object with sorted
    keys, so a frame starts ``_HEAD.size`` bytes before a ``{"``; the CRC and a rising seq confirm it."""
    window = 1 << 20
    at = pos + 1
    while True:
        f.seek(at + _HEAD.size)
        chunk = f.read(window)
        if not chunk:
            return None
        i = chunk.find(b'{"')
        while i >= 0:
            found = _read_frame(f, at + i, after_seq)
            if found is not None:
                return found
            i = chunk.find(b'{"', i + 1)
        at += max(1, len(chunk) - 1)


def _walk(
    path: Path, *, payloads: bool, start: int = 0, skipped: list[int] | None = None
) -> Iterator[tuple[_Rec, bytes | None]]:
    """Intact records of a spool file in order, streamed (never the whole file in memory).

    An unreadable record is skipped (its bytes added to ``skipped``) and reading resumes at the next
    intact frame; it ends where no intact frame follows (a torn tail).
    CRCs are always checked, so the payload is read either way; it is returned only if asked for.
    """
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed in finally; a generator holds it open
    except FileNotFoundError:
        return
    try:
        pos, last = start, 0
        while True:
            found = _read_frame(f, pos, last)
            if found is None:
                found = _resync(f, pos, last)
                if found is None:
                    return
                if skipped is not None:
                    skipped.append(found[0].offset - pos)
            rec, payload = found
            yield rec, (payload if payloads else None)
            pos, last = rec.offset + rec.length, rec.seq
    finally:
        f.close()


def _cap(value: Any, cut: dict[str, int], path: str) -> Any:
    """``value`` with every string longer than MAX_STRING cut; ``cut`` collects path -> original length."""
    if isinstance(value, str):
        if len(value) > MAX_STRING:
            cut[path] = len(value)
            return value[:MAX_STRING] + "..."
        return value
    if isinstance(value, dict):
        return {k: _cap(v, cut, f"{path}.{k}" if path else str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_cap(v, cut, f"{path}[{i}]") for i, v in enumerate(value)]
    return value


@dataclass
class WriteFailures:
    """Writes the disk refused since the spool last said so."""

    count: int = 0
    first_error: str = ""
    since: float = 0.0
    total: int = 0


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
        self.failures = WriteFailures()
        self._unreported: dict[str, Any] | None = None  # the last failure episode no outcome has mentioned yet
        self._pending: list[tuple[bytes, int]] = []  # frames the disk refused, oldest first
        self._pending_bytes = 0
        self._recover()
        self.id = self._spool_id()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        self.size = os.fstat(self._fd).st_size
        self._dirty_since: float | None = None
        self._pub_offset = 0  # file offset from which unpublished events are searched
        self._batch_end: dict[int, int] = {}
        self.observer: Callable[[Event], None] | None = None  # the agent's metrics (sco.agent.metrics)

    def _spool_id(self) -> str:
        """A random id for this spool, kept beside it: event ids (JetStream's Nats-Msg-Id) carry it, so no
        one can guess them and publish first to make JetStream drop the real events as duplicates."""
        path = self.dir / ID_FILE
        try:
            value = path.read_text().strip()
            if len(value) == 32 and all(c in "0123456789abcdef" for c in value):
                return value
        except (OSError, UnicodeDecodeError):
            pass
        value = secrets.token_hex(16)
        try:
            atomic_write(path, (value + "\n").encode(), mode=0o640)
        except OSError as e:  # replays after a restart may then be duplicated in JetStream, never lost
            log.error("cannot keep the spool id in %s: %s", path, e)
        return value

    @property
    def backlog_bytes(self) -> int:
        """Bytes not yet published, at most: from where the publisher looks next to the end, plus what waits
        in memory (an upper bound: the publisher's offset moves a batch at a time)."""
        if self.last_seq <= self.published_seq:
            return 0
        return max(0, self.size - self._pub_offset) + self._pending_bytes

    @property
    def pending(self) -> int:
        """Records held in memory because the disk refused them."""
        return len(self._pending)

    def _read_cursor(self) -> int:
        try:
            return int(json.loads((self.dir / CURSOR_FILE).read_text())["published_seq"])
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return 0

    def _recover(self) -> None:
        if not self.path.exists():
            return
        end, count = 0, 0
        skipped: list[int] = []
        for rec, _ in _walk(self.path, payloads=False, skipped=skipped):
            end, count = rec.offset + rec.length, count + 1
            self.last_seq = rec.seq
        self.recovery.skipped_bytes = sum(skipped)
        self.recovery.skipped = len(skipped)
        size = self.path.stat().st_size
        if end < size:
            self.recovery.torn_bytes = size - end
            with open(self.path, "r+b") as f:
                f.truncate(end)
                os.fsync(f.fileno())
        self.recovery.records = count

    def close(self) -> None:
        self._flush_pending()
        self.sync()
        os.close(self._fd)

    def sync(self) -> bool:
        """fdatasync what was written; False if the disk refused (the records are then in the page cache only)."""
        if self._dirty_since is not None:
            try:
                os.fdatasync(self._fd)
            except OSError as e:
                self._failed(e)
                return False
            self._dirty_since = None
        return True

    def maybe_sync(self) -> None:
        """Called periodically: bounds how long a routine record stays unsynced, and retries records the
        disk refused (so they land, and the outcome says so, as soon as there is room again)."""
        if self._pending:
            self._flush_pending()
        if self._dirty_since is not None and self.clock() - self._dirty_since >= self.sync_interval:
            self.sync()

    def _encode(self, type_: str, priority: int, fields: dict[str, Any]) -> tuple[Event, bytes]:
        cut: dict[str, int] = {}
        capped = _cap(fields, cut, "")
        for path, n in cut.items():
            capped[f"{path}_len"] = n
        event: Event = {"seq": self.last_seq + 1, "at": round(self.clock(), 6), "type": type_, **self.base, **capped}
        payload = json.dumps(event, separators=(",", ":"), sort_keys=True).encode()
        if len(payload) > MAX_RECORD:  # many fields, long lists: keep what the record was, never a record too big
            event = {
                "seq": event["seq"],
                "at": event["at"],
                "type": type_,
                **self.base,
                "record_too_large": len(payload),
                "fields": sorted(fields)[:64],
            }
            payload = json.dumps(event, separators=(",", ":"), sort_keys=True).encode()
        return event, _frame(payload, priority, event["seq"])

    def append(self, type_: str, priority: int = ROUTINE, **fields: Any) -> Event:
        """Write one record (synced at once when critical). Never raises on a refused write: the drain comes
        first; the record waits in memory and goes to disk, in order, once the disk takes writes again."""
        if type_ in OUTCOME_TYPES and (self.failures.count or self._unreported):
            # The drain's outcome says the disk refused writes during it (even if it takes them again now).
            fields = {
                **fields,
                "spool_unwritable": self._failure_summary() if self.failures.count else self._unreported,
            }
            self._unreported = None
        event, frame = self._encode(type_, priority, fields)
        if self.size + len(frame) > self.max_bytes and not self._pending:
            try:
                self._compact(len(frame))
            except OSError as e:
                self.path.with_name(f".{self.path.name}.compact").unlink(missing_ok=True)
                self._failed(e)
            event, frame = self._encode(type_, priority, fields)
        self.last_seq = event["seq"]
        if self.observer is not None:
            with contextlib.suppress(Exception):  # metrics never cost a record
                self.observer(event)
        self._pending.append((frame, priority))
        self._pending_bytes += len(frame)
        self._flush_pending()
        return event

    def _failure_summary(self) -> dict[str, Any]:
        f = self.failures
        return {"failures": f.count, "error": f.first_error, "since": round(f.since, 3), "held": len(self._pending)}

    def _failed(self, e: OSError) -> None:
        f = self.failures
        if f.count == 0:
            f.first_error = f"{errno.errorcode.get(e.errno or 0, 'E?')}: {e.strerror or e}"
            f.since = self.clock()
            log.error("spool %s cannot be written (%s): records are held in memory; the drain goes on", self.path, e)
        f.count += 1
        f.total += 1
        while self._pending_bytes > MAX_PENDING_BYTES and len(self._pending) > 1:
            # Bound memory: the oldest routine record goes first, then the oldest of any.
            i = next((j for j, (_, p) in enumerate(self._pending) if p < CRITICAL), 0)
            frame, _ = self._pending.pop(i)
            self._pending_bytes -= len(frame)
            self.dropped_total += 1

    def _flush_pending(self) -> None:
        wrote_critical = False
        while self._pending:
            frame, priority = self._pending[0]
            try:
                n = os.write(self._fd, frame)  # one write per record: a kill -9 cannot leave half of one
                if n != len(frame):
                    os.ftruncate(self._fd, self.size)  # a short write (disk full): take the half record back
                    raise OSError(errno.ENOSPC, "short write")
            except OSError as e:
                self._failed(e)
                return
            self._pending.pop(0)
            self._pending_bytes -= len(frame)
            self.size += len(frame)
            wrote_critical = wrote_critical or priority >= CRITICAL
            if self._dirty_since is None:
                self._dirty_since = self.clock()
        if wrote_critical and not self.sync():
            return
        if self.failures.count and not self._pending:
            summary = {**self._failure_summary(), "until": round(self.clock(), 3)}
            self._unreported = summary
            log.error("spool %s is writable again after %d refused write(s)", self.path, self.failures.count)
            self.failures = WriteFailures(total=self.failures.total)
            self.append("spool.unwritable", CRITICAL, **summary)

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
            try:
                atomic_write(self.dir / CURSOR_FILE, json.dumps({"published_seq": seq}).encode())
            except OSError as e:  # JetStream de-duplicates what a restart would publish again
                log.warning("cannot save the publication cursor: %s", e)


def read_cursor(directory: Path) -> int:
    """The last seq JetStream acknowledged, as the spool in ``directory`` recorded it (read-only)."""
    try:
        return int(json.loads((Path(directory) / CURSOR_FILE).read_text())["published_seq"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def read_events(directory: Path, after_seq: int = 0) -> Iterator[Event]:
    """The events of the spool in ``directory``, read-only (no recovery, safe beside a running agent)."""
    for rec, payload in _walk(Path(directory) / SPOOL_FILE, payloads=True):
        if rec.seq > after_seq and payload is not None:
            yield json.loads(payload)
