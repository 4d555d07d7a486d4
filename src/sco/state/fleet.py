"""The fleet state: what the acquirer and the reclaimer read and write.

Every change of an instance's lifecycle state is written together with its lifecycle event, in one
transaction, so the record always explains the state. Times are PostgreSQL's ``clock_timestamp()`` unless the
caller has a time of its own (a deadline), which it passes as epoch seconds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from psycopg.types.json import Jsonb

from sco.state.db import connect, hall_lock, require_schema

LIVE = ("requested", "launching", "active", "notified", "draining", "drained", "overrun", "deleting")
RECLAIMING = ("notified", "draining", "drained", "overrun")
LOST = "lost"
"""The server vanished outside the product (an operator, Blazar's preemption): no capacity, no slot held."""
KINDS = ("reclaimable", "committed", "on-demand")
PLATFORMS = ("vm", "baremetal")


def _ts(epoch: float | None) -> datetime | None:
    return None if epoch is None else datetime.fromtimestamp(epoch, UTC)


def _epoch(ts: datetime | None) -> float | None:
    return None if ts is None else ts.timestamp()


@dataclass(frozen=True)
class Pool:
    hall: str
    name: str
    flavor: str
    image: str
    kind: str = "reclaimable"
    availability_zone: str = ""
    platform: str = "vm"  # "baremetal": Ironic nodes, booted through Nova like any other flavor
    unavailable_until: float | None = None
    unavailable_reason: str | None = None


@dataclass(frozen=True)
class Instance:
    id: int
    hall: str
    pool: str
    plan_entry: str
    slot: int
    name: str
    server_id: str | None
    state: str
    reclaim_id: str | None
    terminate_at: float | None
    last_seen: float | None = None
    """When a reconciliation last saw the server in Nova's list."""


_ICOLS = "id, hall, pool, plan_entry, slot, name, server_id, state, reclaim_id, terminate_at, last_seen_at"


def _inst(row: tuple[Any, ...]) -> Instance:
    iid, hall, pool, entry, slot, name, server_id, state, reclaim_id, terminate_at, seen = row
    return Instance(
        iid, hall, pool, entry, slot, name, server_id, state, reclaim_id, _epoch(terminate_at), _epoch(seen)
    )


class FleetState:
    """One connection to the fleet state (not shared between threads)."""

    def __init__(self, dsn: str, *, application: str = "sco") -> None:
        self.dsn = dsn
        self.conn = connect(dsn)
        self.conn.execute("SELECT set_config('application_name', %s, false)", (application,))
        require_schema(self.conn)

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> FleetState:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def writer(self, hall: str, wait_s: float = 0.0) -> Iterator[None]:
        with hall_lock(self.conn, hall, wait_s=wait_s):
            yield

    def now(self) -> float:
        return float(self.conn.execute("SELECT extract(epoch FROM clock_timestamp())").fetchone()[0])

    # --- halls and pools -------------------------------------------------------------------------------

    def ensure_pool(self, p: Pool) -> None:
        with self.conn.transaction():
            self.conn.execute("INSERT INTO hall (name) VALUES (%s) ON CONFLICT DO NOTHING", (p.hall,))
            self.conn.execute(
                "INSERT INTO pool (hall, name, flavor, availability_zone, kind, platform, image)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (hall, name) DO UPDATE SET flavor = EXCLUDED.flavor,"
                " availability_zone = EXCLUDED.availability_zone, kind = EXCLUDED.kind,"
                " platform = EXCLUDED.platform, image = EXCLUDED.image",
                (p.hall, p.name, p.flavor, p.availability_zone, p.kind, p.platform, p.image),
            )

    def pool(self, hall: str, name: str) -> Pool | None:
        row = self.conn.execute(
            "SELECT hall, name, flavor, image, kind, availability_zone, platform, unavailable_until,"
            " unavailable_reason FROM pool WHERE hall = %s AND name = %s",
            (hall, name),
        ).fetchone()
        if row is None:
            return None
        hall_, name_, flavor, image, kind, az, platform, until, reason = row
        return Pool(hall_, name_, flavor, image, kind, az, platform, _epoch(until), reason)

    def pool_names(self, hall: str) -> set[str]:
        return {r[0] for r in self.conn.execute("SELECT name FROM pool WHERE hall = %s", (hall,))}

    def mark_unavailable(self, hall: str, pool: str, for_s: float, reason: str) -> float:
        """The pool takes no launches for ``for_s`` seconds (quota, no valid host); returns until when."""
        with self.conn.transaction():
            until = self.conn.execute(
                "UPDATE pool SET unavailable_until = clock_timestamp() + make_interval(secs => %s),"
                " unavailable_reason = %s WHERE hall = %s AND name = %s RETURNING unavailable_until",
                (for_s, reason, hall, pool),
            ).fetchone()[0]
            self._event(hall, None, pool, "pool.unavailable", {"for_s": for_s, "reason": reason})
        return float(until.timestamp())

    # --- instances -------------------------------------------------------------------------------------

    def instances(
        self,
        hall: str,
        *,
        pool: str | None = None,
        plan_entry: str | None = None,
        states: tuple[str, ...] | None = LIVE,
        names: list[str] | None = None,
    ) -> list[Instance]:
        q = f"SELECT {_ICOLS} FROM instance WHERE hall = %s"
        args: list[Any] = [hall]
        for col, val in (("pool", pool), ("plan_entry", plan_entry)):
            if val is not None:
                q += f" AND {col} = %s"
                args.append(val)
        if states is not None:
            q += " AND state = ANY(%s)"
            args.append(list(states))
        if names is not None:
            q += " AND name = ANY(%s)"
            args.append(names)
        return [_inst(r) for r in self.conn.execute(q + " ORDER BY pool, plan_entry, slot, id", args)]

    def in_flight(self, hall: str, window_s: float) -> dict[int, float]:
        """``requested`` records with no server written less than ``window_s`` ago (the database's clock): their
        create may still be inside Nova's API (a run killed mid-call). {record id: seconds left of the window}."""
        rows = self.conn.execute(
            "SELECT id, %s - extract(epoch FROM clock_timestamp() - updated_at) FROM instance"
            " WHERE hall = %s AND state = 'requested' AND server_id IS NULL"
            " AND updated_at > clock_timestamp() - make_interval(secs => %s)",
            (window_s, hall, window_s),
        )
        return {int(r[0]): max(0.0, float(r[1])) for r in rows}

    def instance(self, iid: int) -> Instance:
        return _inst(self.conn.execute(f"SELECT {_ICOLS} FROM instance WHERE id = %s", (iid,)).fetchone())

    def by_server(self, server_id: str) -> Instance | None:
        row = self.conn.execute(f"SELECT {_ICOLS} FROM instance WHERE server_id = %s", (server_id,)).fetchone()
        return _inst(row) if row else None

    def by_servers(self, server_ids: list[str]) -> dict[str, Instance]:
        """The record of each of these servers that has one (the first written), in one query."""
        out: dict[str, Instance] = {}
        if server_ids:
            rows = self.conn.execute(
                f"SELECT {_ICOLS} FROM instance WHERE server_id = ANY(%s) ORDER BY id", (list(server_ids),)
            )
            for r in rows:
                out.setdefault(r[6], _inst(r))
        return out

    def request(self, hall: str, pool: str, plan_entry: str, slot: int, name: str) -> Instance:
        """The slot's live instance row, created in state ``requested`` if there is none."""
        with self.conn.transaction():
            row = self.conn.execute(
                f"SELECT {_ICOLS} FROM instance WHERE hall = %s AND pool = %s AND plan_entry = %s AND slot = %s"
                " AND state = ANY(%s)",
                (hall, pool, plan_entry, slot, list(LIVE)),
            ).fetchone()
            if row:
                return _inst(row)
            row = self.conn.execute(
                "INSERT INTO instance (hall, pool, plan_entry, slot, name, state) VALUES (%s, %s, %s, %s, %s,"
                f" 'requested') RETURNING {_ICOLS}",
                (hall, pool, plan_entry, slot, name),
            ).fetchone()
            self._event(hall, row[0], pool, "instance.requested", {"name": name, "slot": slot})
        return _inst(row)

    def transition(
        self,
        iid: int,
        state: str,
        kind: str,
        *,
        only_from: tuple[str, ...] | None = None,
        server_id: str | None = None,
        reclaim_id: str | None = None,
        terminate_at: float | None = None,
        **detail: Any,
    ) -> bool:
        """Move an instance to ``state`` and record ``kind``; with ``only_from``, only from those states
        (the event is recorded either way, so a late report is never lost). Returns whether the state moved."""
        with self.conn.transaction():
            q = (
                "UPDATE instance SET state = %s, updated_at = clock_timestamp(),"
                " server_id = coalesce(%s, server_id), reclaim_id = coalesce(%s, reclaim_id),"
                " terminate_at = coalesce(%s, terminate_at) WHERE id = %s"
            )
            args: list[Any] = [state, server_id, reclaim_id, _ts(terminate_at), iid]
            if only_from is not None:
                q += " AND state = ANY(%s)"
                args.append(list(only_from))
            moved = self.conn.execute(q + " RETURNING hall, pool", args).fetchone()
            if moved is None:
                hall, pool = self.conn.execute("SELECT hall, pool FROM instance WHERE id = %s", (iid,)).fetchone()
            else:
                hall, pool = moved
            self._event(hall, iid, pool, kind, {"state": state if moved else None, **detail})
        return moved is not None

    def adopt(
        self, hall: str, pool: str, plan_entry: str, slot: int, name: str, server_id: str, state: str, **detail: Any
    ) -> Instance | None:
        """Record a server Nova has and the fleet state did not: it takes its slot's record if that record never
        got a server (a run stopped between its create call and recording the answer), else a new record.
        Returns None when the slot is held by another server (the caller deletes the duplicate)."""
        with self.conn.transaction():
            row = self.conn.execute(
                f"SELECT {_ICOLS} FROM instance WHERE hall = %s AND pool = %s AND plan_entry = %s AND slot = %s"
                " AND state = ANY(%s) FOR UPDATE",
                (hall, pool, plan_entry, slot, list(LIVE)),
            ).fetchone()
            if row is not None and row[6] is not None and row[6] != server_id:
                return None
            if row is None:
                row = self.conn.execute(
                    "INSERT INTO instance (hall, pool, plan_entry, slot, name, state, server_id, last_seen_at)"
                    f" VALUES (%s, %s, %s, %s, %s, %s, %s, clock_timestamp()) RETURNING {_ICOLS}",
                    (hall, pool, plan_entry, slot, name, state, server_id),
                ).fetchone()
            else:
                row = self.conn.execute(
                    "UPDATE instance SET state = %s, server_id = %s, last_seen_at = clock_timestamp(),"
                    f" updated_at = clock_timestamp() WHERE id = %s RETURNING {_ICOLS}",
                    (state, server_id, row[0]),
                ).fetchone()
            self._event(hall, row[0], pool, "instance.adopted", {"state": state, "server_id": server_id, **detail})
        return _inst(row)

    def lose(self, iid: int, why: str, **detail: Any) -> bool:
        """The server is gone from Nova without the product deleting it: ``lost``, with why and when it was last
        seen, in one transaction with its ``instance.lost`` event. Only from a state that holds capacity."""
        with self.conn.transaction():
            row = self.conn.execute(
                "UPDATE instance i SET state = 'lost', updated_at = clock_timestamp() FROM instance old"
                " WHERE i.id = old.id AND i.id = %s AND i.state = ANY(%s)"
                " RETURNING i.hall, i.pool, old.state, extract(epoch FROM i.last_seen_at)",
                (iid, ["requested", "launching", "active"]),
            ).fetchone()
            if row is None:
                return False
            hall, pool, was, seen = row
            last = None if seen is None else float(seen)
            self._event(hall, iid, pool, "instance.lost", {"why": why, "was": was, "last_seen": last, **detail})
        return True

    def seen(self, server_ids: list[str]) -> None:
        """Nova listed these servers just now."""
        if server_ids:
            self.conn.execute(
                "UPDATE instance SET last_seen_at = clock_timestamp() WHERE server_id = ANY(%s)", (server_ids,)
            )

    def record_reconcile(self, hall: str, run_id: int | None, listed: int, drift: int, body: dict[str, Any]) -> int:
        with self.conn.transaction():
            self.conn.execute("INSERT INTO hall (name) VALUES (%s) ON CONFLICT DO NOTHING", (hall,))
            row = self.conn.execute(
                "INSERT INTO reconcile_record (hall, run_id, listed, drift, body) VALUES (%s, %s, %s, %s, %s)"
                " RETURNING id",
                (hall, run_id, listed, drift, Jsonb(body)),
            ).fetchone()
        return int(row[0])

    def event(self, hall: str, kind: str, *, instance_id: int | None = None, pool: str | None = None, **d: Any) -> None:
        with self.conn.transaction():
            self._event(hall, instance_id, pool, kind, d)

    def _event(self, hall: str, iid: int | None, pool: str | None, kind: str, detail: dict[str, Any]) -> None:
        self.conn.execute(
            "INSERT INTO lifecycle_event (hall, instance_id, pool, kind, detail) VALUES (%s, %s, %s, %s, %s)",
            (hall, iid, pool, kind, Jsonb(detail)),
        )

    def agent_event(self, hall: str, ev: dict[str, Any], state: str | None, only_from: tuple[str, ...]) -> bool:
        """Fold one of the agent's events (at-least-once delivery): recorded once per (node, seq); moves the
        node's live instance to ``state`` when given and allowed. Returns False for a duplicate."""
        node = str(ev.get("node", ""))
        with self.conn.transaction():
            row = self.conn.execute(
                "SELECT id, pool FROM instance WHERE hall = %s AND name = %s ORDER BY (state = 'deleted'), id DESC"
                " LIMIT 1",
                (hall, node),
            ).fetchone()
            iid, pool = (row[0], row[1]) if row else (None, None)
            ins = self.conn.execute(
                "INSERT INTO lifecycle_event (hall, instance_id, pool, kind, detail) VALUES (%s, %s, %s, %s, %s)"
                " ON CONFLICT DO NOTHING RETURNING id",
                (hall, iid, pool, f"agent.{ev.get('type')}", Jsonb(ev)),
            ).fetchone()
            if ins is None:
                return False
            if state is not None and iid is not None:
                self.conn.execute(
                    "UPDATE instance SET state = %s, updated_at = clock_timestamp() WHERE id = %s AND state = ANY(%s)",
                    (state, iid, list(only_from)),
                )
        return True

    def events(self, *, instance_id: int | None = None, hall: str | None = None) -> list[dict[str, Any]]:
        q = "SELECT kind, extract(epoch FROM at), detail, instance_id, pool FROM lifecycle_event WHERE true"
        args: list[Any] = []
        if instance_id is not None:
            q += " AND instance_id = %s"
            args.append(instance_id)
        if hall is not None:
            q += " AND hall = %s"
            args.append(hall)
        return [
            {"kind": k, "at": float(at), "detail": d, "instance_id": i, "pool": p}
            for k, at, d, i, p in self.conn.execute(q + " ORDER BY at, id", args)
        ]

    def build_seconds(self, hall: str, pool: str, *, last: int = 20, quantile: float = 0.9) -> float | None:
        """How long the pool's recent servers took from their create to ACTIVE by Nova's own timestamps (the
        ``build_s`` of the last ``last`` ``instance.active`` events, at ``quantile``); None before the first."""
        row = self.conn.execute(
            "SELECT percentile_cont(%s) WITHIN GROUP (ORDER BY b) FROM (SELECT (detail ->> 'build_s')::float AS b"
            " FROM lifecycle_event WHERE hall = %s AND pool = %s AND kind = 'instance.active'"
            " AND detail ? 'build_s' ORDER BY at DESC LIMIT %s) recent",
            (quantile, hall, pool, last),
        ).fetchone()
        return None if row is None or row[0] is None else float(row[0])

    def due(self, hall: str) -> list[Instance]:
        """Instances under reclaim, earliest deadline first."""
        return [
            _inst(r)
            for r in self.conn.execute(
                f"SELECT {_ICOLS} FROM instance WHERE hall = %s AND state = ANY(%s) ORDER BY terminate_at",
                (hall, [*RECLAIMING, "deleting"]),
            )
        ]

    # --- the acquirer's token budget -------------------------------------------------------------------

    def take_tokens(self, bucket: str, n: float, *, capacity: float, per_minute: float) -> float:
        """Take ``n`` API-call tokens from a bucket shared by every run; returns 0 when granted, else how many
        seconds to wait before asking again (nothing is taken then)."""
        with self.conn.transaction():
            self.conn.execute(
                "INSERT INTO token_bucket (name, capacity, refill_per_minute, tokens) VALUES (%s, %s, %s, %s)"
                " ON CONFLICT (name) DO UPDATE SET capacity = EXCLUDED.capacity,"
                " refill_per_minute = EXCLUDED.refill_per_minute",
                (bucket, capacity, per_minute, capacity),
            )
            tokens, rate, cap, elapsed = self.conn.execute(
                "SELECT tokens, refill_per_minute, capacity, extract(epoch FROM clock_timestamp() - updated_at)"
                " FROM token_bucket WHERE name = %s FOR UPDATE",
                (bucket,),
            ).fetchone()
            tokens = min(cap, tokens + float(elapsed) * rate / 60.0)
            granted = tokens >= n
            if granted:
                tokens -= n
            self.conn.execute(
                "UPDATE token_bucket SET tokens = %s, updated_at = clock_timestamp() WHERE name = %s",
                (tokens, bucket),
            )
        return 0.0 if granted else (n - tokens) * 60.0 / rate
