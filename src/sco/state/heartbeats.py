"""The agents' heartbeats in the fleet state (migration 0013): the last one per node, and when they were read.

Written in one statement per read, whatever the hall's size; a node's ``heard_at`` only moves forward (a reader
that saw an older message, or none after a relay restart, never makes a node look more silent than it was).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from psycopg.types.json import Jsonb


def record(conn: Any, hall: str, beats: dict[str, tuple[datetime, dict[str, Any]]]) -> int:
    """Upsert ``{node: (heard_at, detail)}`` and note the read; returns the nodes written."""
    nodes = sorted(beats)
    with conn.transaction():
        conn.execute("INSERT INTO hall (name) VALUES (%s) ON CONFLICT DO NOTHING", (hall,))
        if nodes:
            conn.execute(
                "INSERT INTO agent_heartbeat (hall, node, heard_at, detail)"
                " SELECT %s, n, h, d FROM unnest(%s::text[], %s::timestamptz[], %s::jsonb[]) AS b(n, h, d)"
                " ON CONFLICT (hall, node) DO UPDATE SET"
                " detail = CASE WHEN EXCLUDED.heard_at >= agent_heartbeat.heard_at THEN EXCLUDED.detail"
                "  ELSE agent_heartbeat.detail END,"
                " heard_at = greatest(agent_heartbeat.heard_at, EXCLUDED.heard_at), collected_at = clock_timestamp()",
                (hall, nodes, [beats[n][0] for n in nodes], [Jsonb(beats[n][1]) for n in nodes]),
            )
        conn.execute(
            "INSERT INTO heartbeat_collection (hall, collected_at, nodes, tried_at, error)"
            " VALUES (%s, clock_timestamp(), %s, clock_timestamp(), NULL) ON CONFLICT (hall) DO UPDATE SET"
            " collected_at = EXCLUDED.collected_at, nodes = EXCLUDED.nodes, tried_at = EXCLUDED.tried_at, error = NULL",
            (hall, len(nodes)),
        )
    return len(nodes)


def failed(conn: Any, hall: str, error: str) -> None:
    """A read that did not happen: said in the status (the last good read's time stays)."""
    with conn.transaction():
        conn.execute("INSERT INTO hall (name) VALUES (%s) ON CONFLICT DO NOTHING", (hall,))
        conn.execute(
            "INSERT INTO heartbeat_collection (hall, tried_at, error) VALUES (%s, clock_timestamp(), %s)"
            " ON CONFLICT (hall) DO UPDATE SET tried_at = EXCLUDED.tried_at, error = EXCLUDED.error",
            (hall, error[:500]),
        )


def collection(conn: Any, hall: str) -> dict[str, Any] | None:
    """When the heartbeats were last read, how many nodes, and the last try's error (None: never tried)."""
    row = conn.execute(
        "SELECT collected_at, nodes, tried_at, error FROM heartbeat_collection WHERE hall = %s", (hall,)
    ).fetchone()
    if row is None:
        return None
    collected_at, nodes, tried_at, error = row
    return {"collected_at": collected_at, "nodes": int(nodes), "tried_at": tried_at, "error": error}


# States in which a node's agent runs and beats (a drained/overrun node may be powered off already).
AGENT_STATES = ("active", "notified", "draining")


def silent(conn: Any, hall: str, after_s: float) -> list[tuple[str, str, str, datetime | None, float]]:
    """Instances whose agent should beat and was not heard for ``after_s`` (nor ever, for an instance that has
    existed that long): (instance, pool, state, heard_at or None, seconds silent), the longest silent first."""
    rows = conn.execute(
        "SELECT i.name, i.pool, i.state, b.heard_at,"
        " extract(epoch FROM clock_timestamp() - coalesce(b.heard_at, i.created_at))"
        " FROM instance i LEFT JOIN agent_heartbeat b ON b.hall = i.hall AND b.node = i.name"
        " WHERE i.hall = %s AND i.state = ANY(%s)"
        " AND coalesce(b.heard_at, i.created_at) < clock_timestamp() - make_interval(secs => %s)"
        " ORDER BY coalesce(b.heard_at, i.created_at), i.name",
        (hall, list(AGENT_STATES), after_s),
    )
    return [(str(n), str(p), str(s), h, float(x)) for n, p, s, h, x in rows]


__all__ = ["AGENT_STATES", "collection", "failed", "record", "silent"]
