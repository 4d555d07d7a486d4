"""The control loop in the fleet state: it reads the fleet, and records runs, plans, arbitration decisions, and the
contract subset of each plan entry (migration ``0011_control_loop.sql``).

A plan entry is what the acquirer holds a count of: the instances of one pool launched with one contract subset.
Its name is derived from the subset (``s`` + 8 hex digits of the subset's SHA-256), so the same subset always
lands in the same entry and a second run finds the instances the first one launched.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from psycopg.types.json import Jsonb

from sco.control.arbiter import Arbitration
from sco.control.model import Instance
from sco.control.planner import Plan
from sco.state.db import connect, require_schema
from sco.state.fleet import LIVE, RECLAIMING

# Instances being reclaimed or deleted are no capacity to plan with: the planner sees them as "deleting".
_GOING = (*RECLAIMING, "deleting")


def entry_name(contracts: tuple[str, ...] | list[str]) -> str:
    digest = hashlib.sha256(",".join(sorted(contracts)).encode()).hexdigest()
    return f"s{digest[:8]}"


@dataclass(frozen=True)
class Slot:
    """A live instance as the acquirer sees it: which entry and slot of which pool."""

    id: int
    name: str
    pool: str
    entry: str
    slot: int
    state: str


class PgFleetStore:
    """The control loop's view of the fleet state (one connection, not shared between threads)."""

    def __init__(self, dsn: str, *, application: str = "sco control-loop") -> None:
        self.dsn = dsn
        self.conn: Any = connect(dsn)
        self.conn.execute("SELECT set_config('application_name', %s, false)", (application,))
        require_schema(self.conn)

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> PgFleetStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- reading ---------------------------------------------------------------------------------------

    def fleet(self, hall: str) -> list[Instance]:
        rows = self.conn.execute(
            "SELECT i.id, i.name, i.pool, i.state, extract(epoch FROM i.created_at), coalesce(e.contracts, '{}')"
            " FROM instance i LEFT JOIN plan_entry e ON e.hall = i.hall AND e.pool = i.pool AND e.entry = i.plan_entry"
            " WHERE i.hall = %s AND i.state = ANY(%s) ORDER BY i.pool, i.name, i.id",
            (hall, list(LIVE)),
        )
        return [
            Instance(
                id=str(iid),
                name=name,
                pool=pool,
                contracts=tuple(sorted(contracts)),
                launched_at=float(created),
                state="deleting" if state in _GOING else "active",
            )
            for iid, name, pool, state, created, contracts in rows
        ]

    def fleet_metrics(self, hall: str) -> dict[str, Any]:
        """What the control loop's textfile gauges say of the fleet (sco.control.metrics)."""
        instances = {
            (str(pool), str(state)): int(n)
            for pool, state, n in self.conn.execute(
                "SELECT pool, state, count(*) FROM instance WHERE hall = %s AND state = ANY(%s) GROUP BY pool, state",
                (hall, list(LIVE)),
            )
        }
        pools = {
            str(name): bool(ok)
            for name, ok in self.conn.execute(
                "SELECT name, unavailable_until IS NULL OR unavailable_until <= clock_timestamp() FROM pool"
                " WHERE hall = %s",
                (hall,),
            )
        }
        row = self.conn.execute(
            "SELECT count(*) FILTER (WHERE state = ANY(%s)), count(*) FILTER (WHERE state = 'deleting'),"
            " count(*) FILTER (WHERE state = ANY(%s) AND terminate_at < clock_timestamp())"
            " FROM instance WHERE hall = %s",
            (list(RECLAIMING), list(_GOING), hall),
        ).fetchone()
        reclaiming, deleting, past = row if row else (0, 0, 0)
        return {
            "instances": instances,
            "pools": pools,
            "reclaiming": int(reclaiming),
            "deleting": int(deleting),
            "past_deadline": int(past),
        }

    def slots(self, hall: str) -> list[Slot]:
        rows = self.conn.execute(
            "SELECT id, name, pool, plan_entry, slot, state FROM instance WHERE hall = %s AND state = ANY(%s)"
            " ORDER BY pool, plan_entry, slot",
            (hall, list(LIVE)),
        )
        return [Slot(*r) for r in rows]

    def unavailable(self, hall: str) -> dict[str, str]:
        """Pools the acquirer marked unavailable (quota, no valid host) whose time is not up."""
        rows = self.conn.execute(
            "SELECT name, coalesce(unavailable_reason, 'unavailable'),"
            " extract(epoch FROM unavailable_until - clock_timestamp())"
            " FROM pool WHERE hall = %s AND unavailable_until > clock_timestamp()",
            (hall,),
        )
        return {name: f"{reason} (for {float(left):.0f} s more)" for name, reason, left in rows}

    def entries(self, hall: str) -> dict[tuple[str, str], tuple[str, ...]]:
        rows = self.conn.execute("SELECT pool, entry, contracts FROM plan_entry WHERE hall = %s", (hall,))
        return {(pool, entry): tuple(contracts) for pool, entry, contracts in rows}

    # --- recording -------------------------------------------------------------------------------------

    def ensure_entry(self, hall: str, pool: str, contracts: tuple[str, ...] | list[str]) -> str:
        name = entry_name(contracts)
        self.conn.execute(
            "INSERT INTO plan_entry (hall, pool, entry, contracts) VALUES (%s, %s, %s, %s) ON CONFLICT DO NOTHING",
            (hall, pool, name, sorted(contracts)),
        )
        return name

    def record_plan(self, hall: str, run_id: int | None, result: Plan) -> int:
        with self.conn.transaction():
            self.conn.execute("INSERT INTO hall (name) VALUES (%s) ON CONFLICT DO NOTHING", (hall,))
            row = self.conn.execute(
                "INSERT INTO plan_record (hall, run_id, digest, changed, body, decisions)"
                " VALUES (%s, %s, %s, %s, %s, %s) RETURNING id",
                (
                    hall,
                    run_id,
                    result.digest,
                    result.changed,
                    Jsonb(result.body()),
                    Jsonb([d.to_dict() for d in result.decisions]),
                ),
            ).fetchone()
        return int(row[0])

    def record_arbitration(self, hall: str, run_id: int | None, result: Arbitration) -> None:
        """Every grant and refusal with the tier and authority it was decided against, and the run's spend sample
        per tier (migration 0013: what ``sco hall report`` sets spend against authority from)."""
        with self.conn.transaction():
            self.conn.execute("INSERT INTO hall (name) VALUES (%s) ON CONFLICT DO NOTHING", (hall,))
            for g in result.grants:
                self.conn.execute(
                    "INSERT INTO arbitration_record (hall, run_id, contract, outcome, pool, instances, cost_per_hour,"
                    " reason, tier, authority_per_hour) VALUES (%s, %s, %s, 'grant', %s, %s, %s, %s, %s, %s)",
                    (hall, run_id, g.contract, g.pool, g.instances, g.cost_per_hour, g.reason, g.tier,
                     g.authority_per_hour),
                )  # fmt: skip
            for r in result.refusals:
                self.conn.execute(
                    "INSERT INTO arbitration_record (hall, run_id, contract, outcome, units_milli, reason, tier,"
                    " authority_per_hour) VALUES (%s, %s, %s, 'refuse', %s, %s, %s, %s)",
                    (hall, run_id, r.contract, r.units_milli, r.reason, r.tier, r.authority_per_hour),
                )
            for t in result.tiers:  # one sample: every row at the transaction's time
                self.conn.execute(
                    "INSERT INTO spend_record (hall, run_id, tier, spend_per_hour, granted_per_hour,"
                    " authority_per_hour) VALUES (%s, %s, %s, %s, %s, %s)",
                    (hall, run_id, t.tier, t.spend_per_hour, t.granted_per_hour, t.authority_per_hour),
                )

    def begin_run(self, hall: str, runner_ident: str | None = None) -> int:
        with self.conn.transaction():
            self.conn.execute("INSERT INTO hall (name) VALUES (%s) ON CONFLICT DO NOTHING", (hall,))
            row = self.conn.execute(
                "INSERT INTO control_run (hall, runner_ident) VALUES (%s, %s) RETURNING id", (hall, runner_ident)
            ).fetchone()
        return int(row[0])

    def finish_run(self, run_id: int, status: str, summary: dict[str, Any]) -> None:
        self.conn.execute(
            "UPDATE control_run SET finished_at = clock_timestamp(), status = %s, summary = %s WHERE id = %s",
            (status, Jsonb(summary), run_id),
        )

    def runs(self, hall: str) -> list[dict[str, Any]]:
        rows = self.conn.execute(
            "SELECT id, status, summary FROM control_run WHERE hall = %s ORDER BY id", (hall,)
        ).fetchall()
        return [{"id": i, "status": s, "summary": summary} for i, s, summary in rows]

    def plans(self, hall: str) -> list[dict[str, Any]]:
        rows = self.conn.execute(
            "SELECT id, run_id, digest, changed, body, decisions FROM plan_record WHERE hall = %s ORDER BY id",
            (hall,),
        ).fetchall()
        return [
            {"id": i, "run_id": r, "digest": d, "changed": c, "body": b, "decisions": dec}
            for i, r, d, c, b, dec in rows
        ]

    def arbitrations(self, hall: str) -> list[dict[str, Any]]:
        rows = self.conn.execute(
            "SELECT run_id, contract, outcome, pool, instances, units_milli, cost_per_hour, reason"
            " FROM arbitration_record WHERE hall = %s ORDER BY id",
            (hall,),
        ).fetchall()
        keys = ("run_id", "contract", "outcome", "pool", "instances", "units_milli", "cost_per_hour", "reason")
        return [dict(zip(keys, r, strict=True)) for r in rows]
