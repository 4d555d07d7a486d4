"""What the fleet state says of one hall, read-only: ``sco hall status`` and ``sco hall report``.

Every time is PostgreSQL's (``clock_timestamp()``), the clock the records were written with, so ages and
seconds to T do not depend on the reader's clock. Results are plain dicts of JSON types with stable keys (the
``--json`` output; docs/RUNBOOK.md lists them); times are ISO 8601 UTC strings.
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from sco.errors import ConfigError
from sco.state import heartbeats
from sco.state.fleet import LIVE, RECLAIMING

# The agent's drain outcomes as the reclaimer folds them into lifecycle_event (kind "agent." + the agent's type).
OUTCOMES = {"agent.drain.drained": "drained", "agent.drain.overrun": "overrun", "agent.drain.error": "error"}
# Instances that no longer hold capacity: their lifetime ended at their last update.
ENDED = ("deleted", "failed", "lost")

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def iso(ts: datetime | None) -> str | None:
    return None if ts is None else ts.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# Bounds of what the options take, said in --help: beyond them Python's dates and PostgreSQL's intervals and
# timestamps overflow (a traceback), and no hall's question needs more.
MAX_DURATION_S = 3650 * 86400  # 10 years
MAX_DURATION_TEXT = "10 years (3650d)"
MIN_YEAR, MAX_YEAR = 1970, 9000  # --since as a time: from 1970 up to (not including) 9000
MAX_RUNS = 10_000


def parse_duration(what: str, text: str) -> float:
    """Seconds of ``90s``, ``15m``, ``12h``, ``7d``, ``2w``, above 0 and at most ``MAX_DURATION_S`` (ConfigError
    naming ``what`` otherwise)."""
    m = _DURATION.match(text or "")
    if not m or float(m.group(1)) <= 0:
        raise ConfigError(
            f"{what}: expected a duration above 0 such as 90s, 15m, 12h, 7d or 2w, got {str(text)[:80]!r}"
        )
    secs = float(m.group(1)) * _UNIT_S[m.group(2)]
    if not secs <= MAX_DURATION_S:  # also inf, from digits past a float's range
        raise ConfigError(f"{what}: at most {MAX_DURATION_TEXT}, got {str(text).strip()[:80]!r}")
    return secs


def parse_since(text: str, now: datetime) -> datetime:
    """``--since``: a duration back from ``now`` (``7d``, at most ``MAX_DURATION_S``) or an ISO 8601 time (no
    zone: UTC) in the years ``MIN_YEAR`` to ``MAX_YEAR`` (excluded)."""
    if _DURATION.match(text or ""):
        return now - timedelta(seconds=parse_duration("--since", text))
    try:
        t = datetime.fromisoformat(text.strip())
    except (ValueError, AttributeError):
        raise ConfigError(
            f"--since: expected an ISO 8601 time (2026-11-24T00:00:00Z) or a duration (7d, 12h), got {str(text)[:80]!r}"
        ) from None
    # the year as written, checked before any arithmetic: 9999-12-31T23:59:59-14:00 in UTC is past datetime.max
    if not MIN_YEAR <= t.year < MAX_YEAR:
        raise ConfigError(f"--since: expected a time from {MIN_YEAR} up to {MAX_YEAR}, got {str(text).strip()[:80]!r}")
    t = t if t.tzinfo is not None else t.replace(tzinfo=UTC)
    if t > now:
        raise ConfigError(f"--since: {iso(t)} is in the future (the fleet state's clock says {iso(now)})")
    return t


def db_now(conn: Any) -> datetime:
    now: datetime = conn.execute("SELECT clock_timestamp()").fetchone()[0]
    return now


def halls(conn: Any) -> list[str]:
    return [str(r[0]) for r in conn.execute("SELECT name FROM hall ORDER BY name")]


def resolve_hall(conn: Any, hall: str | None, where: str) -> str:
    """The hall asked for, or the only one there is; ConfigError naming the halls the fleet state has."""
    known = halls(conn)
    listed = ", ".join(known) or "none"
    if hall is None:
        if len(known) == 1:
            return known[0]
        if not known:
            raise ConfigError(f"fleet state at {where}: no hall recorded yet (no control-loop run or launch)")
        raise ConfigError(f"fleet state at {where} has several halls ({listed}): give --hall NAME")
    if hall not in known:
        raise ConfigError(f"hall {hall!r}: no such hall in the fleet state at {where} (halls: {listed})")
    return hall


def _reasons(detail: dict[str, Any]) -> list[str]:
    """An overrun's reasons as the agent gave them: Kubernetes drains list ``reasons``; Slurm drains list the
    ``remaining`` jobs, each with why it is still there."""
    given = detail.get("reasons")
    if isinstance(given, list) and given:
        return [str(r) for r in given]
    out = []
    for r in detail.get("remaining") or []:
        if isinstance(r, dict):
            what = next((f"{k} {r[k]}" for k in ("job", "pod") if k in r), "item")
            out.append(f"{what}: {r.get('why', 'still there')}")
    return out or ["(the agent gave no reason)"]


def status(conn: Any, hall: str, *, stale_s: float, recent_s: float, runs: int = 5) -> dict[str, Any]:
    """The hall now: pools and their instances, reclaims under way, recent overruns, the last control runs,
    pools unavailable, and instances whose agent was not heard for ``stale_s`` (its heartbeats)."""
    now = db_now(conn)
    counts: dict[str, dict[str, int]] = {}
    for pool, state, n in conn.execute(
        "SELECT pool, state, count(*) FROM instance WHERE hall = %s AND state = ANY(%s) GROUP BY pool, state"
        " ORDER BY pool, state",
        (hall, [*LIVE, "lost"]),
    ):
        counts.setdefault(pool, {})[state] = int(n)
    pools = []
    unavailable = []
    for name, kind, flavor, az, platform, until, reason in conn.execute(
        "SELECT name, kind, flavor, availability_zone, platform, unavailable_until, unavailable_reason FROM pool"
        " WHERE hall = %s ORDER BY name",
        (hall,),
    ):
        down = None
        if until is not None and until > now:
            down = {
                "pool": name,
                "reason": reason or "unavailable",
                "until": iso(until),
                "seconds_left": round((until - now).total_seconds(), 1),
            }
            unavailable.append(down)
        pools.append(
            {
                "name": name,
                "kind": kind,
                "flavor": flavor,
                "availability_zone": az,
                "platform": platform,
                "instances": counts.pop(name, {}),
                "available": down is None,
            }
        )
    reclaims = [
        {
            "instance": name,
            "pool": pool,
            "state": state,
            "notice": reclaim_id,
            "terminate_at": iso(t),
            "seconds_to_t": None if t is None else round((t - now).total_seconds(), 1),
        }
        for name, pool, state, reclaim_id, t in conn.execute(
            "SELECT name, pool, state, reclaim_id, terminate_at FROM instance WHERE hall = %s AND state = ANY(%s)"
            " ORDER BY terminate_at NULLS LAST, name",
            (hall, [*RECLAIMING, "deleting"]),
        )
    ]
    overruns = [
        {"at": iso(at), "instance": node or "", "pool": pool, "notice": notice, "reasons": _reasons(detail)}
        for at, node, pool, notice, detail in conn.execute(
            "SELECT at, detail ->> 'node', pool, detail ->> 'notice', detail FROM lifecycle_event"
            " WHERE hall = %s AND kind = 'agent.drain.overrun' AND at >= %s ORDER BY at DESC, id DESC LIMIT 20",
            (hall, now - timedelta(seconds=recent_s)),
        )
    ]
    last_runs = [
        {
            "id": int(rid),
            "started_at": iso(started),
            "finished_at": iso(finished),
            "status": st,
            "duration_s": round(((finished or now) - started).total_seconds(), 1),
        }
        for rid, started, finished, st in conn.execute(
            "SELECT id, started_at, finished_at, status FROM control_run WHERE hall = %s"
            " ORDER BY started_at DESC, id DESC LIMIT %s",
            (hall, runs),
        )
    ]
    # An agent beats every heartbeat_seconds onto the relay; the control loop (or this command with --nats) reads
    # the last beat per node into agent_heartbeat. Instances whose agent should beat and was not heard for stale_s:
    stale = [
        {"instance": name, "pool": pool, "state": state, "heard_at": iso(heard), "silent_s": round(silent_s, 1)}
        for name, pool, state, heard, silent_s in heartbeats.silent(conn, hall, stale_s)
    ]
    read = heartbeats.collection(conn, hall)
    beats = {
        "read_at": iso(read["collected_at"]) if read else None,
        "read_age_s": round((now - read["collected_at"]).total_seconds(), 1) if read and read["collected_at"] else None,
        "nodes": read["nodes"] if read else 0,
        "last_try_at": iso(read["tried_at"]) if read else None,
        "last_error": read["error"] if read else None,
    }
    return {
        "hall": hall,
        "now": iso(now),
        "stale_after_s": stale_s,
        "recent_s": recent_s,
        "pools": pools,
        "reclaims": reclaims,
        "overruns": overruns,
        "runs": last_runs,
        "unavailable_pools": unavailable,
        "stale_agents": stale,
        "heartbeats": beats,
    }


def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile (a value that occurred, never an interpolation); None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def _tally() -> dict[str, Any]:
    return {"reclaims": 0, "drained": 0, "overrun": 0, "error": 0, "no_outcome": 0, "_drain": []}


def _close(t: dict[str, Any]) -> dict[str, Any]:
    d = t.pop("_drain")
    t["drain_s"] = {"n": len(d), "p50": percentile(d, 50), "p99": percentile(d, 99)}
    return t


def report(conn: Any, hall: str, since: datetime) -> dict[str, Any]:
    """The hall since ``since``: reclaims per pool with their outcomes and drain times, instance-hours per pool
    and flavor, the fallback arbiter's on-demand grants and refusals, and on-demand spend per tier against the
    arbiter's authority."""
    now = db_now(conn)
    per_pool: dict[str, dict[str, Any]] = {}
    total = _tally()
    # A reclaim is its reclaim.scheduled record (the notice, at T - window); its outcome the first drain outcome
    # the agent reported for that notice. Drain time: notice recorded -> outcome recorded, both on one clock.
    for pool, outcome, drain_s in conn.execute(
        "SELECT s.pool, o.kind, extract(epoch FROM o.at - s.at) FROM lifecycle_event s"
        " JOIN instance i ON i.id = s.instance_id"
        " LEFT JOIN LATERAL (SELECT kind, at FROM lifecycle_event o WHERE o.instance_id = s.instance_id"
        "  AND o.kind = ANY(%s) AND o.at >= s.at AND o.detail ->> 'notice' = i.reclaim_id ORDER BY o.at, o.id"
        "  LIMIT 1) o ON true"
        " WHERE s.hall = %s AND s.kind = 'reclaim.scheduled' AND s.detail ->> 'state' = 'notified'"
        " AND s.at >= %s ORDER BY s.at",
        (list(OUTCOMES), hall, since),
    ):
        for t in (per_pool.setdefault(pool or "", _tally()), total):
            t["reclaims"] += 1
            t[OUTCOMES.get(outcome, "no_outcome")] += 1
            if outcome in ("agent.drain.drained", "agent.drain.overrun"):
                t["_drain"].append(round(float(drain_s), 3))
    # Capacity held: from the record's creation to its end (deleted, failed or lost: its last update), cut to
    # the window. It counts the launch too, the time the cloud bills for.
    hours = [
        {"pool": pool, "kind": kind, "flavor": flavor, "instances": int(n), "instance_hours": round(float(h), 3)}
        for pool, kind, flavor, n, h in conn.execute(
            "SELECT i.pool, p.kind, p.flavor, count(*), sum(extract(epoch FROM"
            "  least(CASE WHEN i.state = ANY(%s) THEN i.updated_at ELSE %s END, %s) - greatest(i.created_at, %s)"
            " )) / 3600.0 FROM instance i JOIN pool p ON p.hall = i.hall AND p.name = i.pool"
            " WHERE i.hall = %s AND i.created_at < %s"
            " AND (NOT i.state = ANY(%s) OR i.updated_at > %s)"
            " GROUP BY i.pool, p.kind, p.flavor ORDER BY i.pool",
            (list(ENDED), now, now, since, hall, now, list(ENDED), since),
        )
    ]
    grants = [
        {
            "contract": contract,
            "pool": pool,
            "tier": tier,
            "authority_per_hour": None if auth is None else str(auth),
            "grants": int(n),
            "instances": int(inst),
            "cost_per_hour_granted": str(cost),
        }
        for contract, pool, tier, auth, n, inst, cost in conn.execute(
            "SELECT contract, pool, tier, max(authority_per_hour), count(*), sum(instances), sum(cost_per_hour)"
            " FROM arbitration_record WHERE hall = %s AND outcome = 'grant' AND created_at >= %s"
            " GROUP BY contract, pool, tier ORDER BY contract, pool, tier",
            (hall, since),
        )
    ]
    refusals = {
        str(contract): int(n)
        for contract, n in conn.execute(
            "SELECT contract, count(*) FROM arbitration_record WHERE hall = %s AND outcome = 'refuse'"
            " AND created_at >= %s GROUP BY contract ORDER BY contract",
            (hall, since),
        )
    }
    return {
        "hall": hall,
        "since": iso(since),
        "until": iso(now),
        "reclaims": {pool: _close(t) for pool, t in sorted(per_pool.items())},
        "total": _close(total),
        "instance_hours": hours,
        "on_demand": {
            "grants": grants,
            "refusals": refusals,
            "spend_against_authority": spend_against_authority(conn, hall, since, now),
        },
    }


def spend_against_authority(conn: Any, hall: str, since: datetime, now: datetime) -> list[dict[str, Any]]:
    """Per contract tier, from the arbiter's samples (``spend_record``, one per arbitrate run): the on-demand money
    spent in the window against the authority over the same time (each sample's rates hold until the next sample;
    the sample in force at ``since`` counts from ``since``; nothing is known before the first sample), the peak
    spend per hour, the hours spent above authority, and the latest rates. Money as strings with 2 decimals."""
    rows = conn.execute(
        "SELECT created_at, tier, spend_per_hour, granted_per_hour, authority_per_hour FROM spend_record"
        " WHERE hall = %s AND created_at <= %s AND created_at >= coalesce((SELECT max(created_at) FROM spend_record"
        "  WHERE hall = %s AND created_at <= %s), %s) ORDER BY created_at, tier",
        (hall, now, hall, since, since),
    ).fetchall()
    samples: list[tuple[datetime, dict[int, tuple[Decimal, Decimal, Decimal]]]] = []
    for at, tier, spend, granted, auth in rows:
        if not samples or samples[-1][0] != at:
            samples.append((at, {}))
        samples[-1][1][int(tier)] = (Decimal(spend), Decimal(granted), Decimal(auth))
    zero = Decimal(0)
    out: dict[int, dict[str, Any]] = {}
    for i, (at, tiers) in enumerate(samples):
        start = max(at, since)
        end = samples[i + 1][0] if i + 1 < len(samples) else now
        hours = Decimal(max(0.0, (end - start).total_seconds())) / 3600
        for tier in set(tiers) | set(out):
            spend, granted, auth = tiers.get(tier, (zero, zero, zero))  # a tier gone from the bundle: no more
            t = out.setdefault(
                tier,
                {"spend": zero, "authority": zero, "hours": zero, "hours_over": zero, "peak": zero, "granted": zero},
            )
            t["spend"] += spend * hours
            t["authority"] += auth * hours
            t["hours"] += hours
            if spend > auth:
                t["hours_over"] += hours
            t["peak"] = max(t["peak"], spend)
            if at >= since:  # the grants of runs inside the window only
                t["granted"] += granted
            t["last"] = (spend, auth)
    cent = Decimal("0.01")
    return [
        {
            "tier": tier,
            "spend": str(t["spend"].quantize(cent)),
            "authority": str(t["authority"].quantize(cent)),
            "spend_ratio": None if not t["authority"] else round(float(t["spend"] / t["authority"]), 4),
            "hours_covered": round(float(t["hours"]), 3),
            "hours_over_authority": round(float(t["hours_over"]), 3),
            "peak_spend_per_hour": str(t["peak"].quantize(cent)),
            "granted_per_hour": str(t["granted"].quantize(cent)),
            "spend_per_hour": str(t["last"][0].quantize(cent)),
            "authority_per_hour": str(t["last"][1].quantize(cent)),
        }
        for tier, t in sorted(out.items())
    ]
