"""``sco hall status`` and ``sco hall report``: what the fleet state says of a hall, for the on-call engineer.

Read-only: no lock is taken, nothing is written but the agents' heartbeats ``--nats`` read from the relay (the
control loop records the same). ``--json`` prints one object (keys in docs/RUNBOOK.md).
"""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime
from typing import Any

from sco._redact import describe_dsn
from sco.cli._common import _env
from sco.cli._nats import _add_nats_auth
from sco.errors import ConfigError


def _open(args: argparse.Namespace) -> tuple[Any, str]:
    from sco.state.db import check_dsn, dsn_from_env
    from sco.state.fleet import FleetState
    from sco.state.hall import resolve_hall

    dsn = dsn_from_env(args.dsn)
    check_dsn(dsn, "--dsn" if args.dsn else "$SCO_DB_DSN")
    fs = FleetState(dsn, application="sco hall")
    try:
        hall = resolve_hall(fs.conn, args.hall, describe_dsn(dsn))
    except BaseException:
        fs.close()
        raise
    return fs, hall


def _table(headers: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return (indent + "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))).rstrip()

    return [line(headers), *(line(r) for r in rows)]


def _secs(s: float | None) -> str:
    if s is None:
        return "-"
    a = abs(s)
    if a < 120:
        return f"{a:.0f}s"
    if a < 7200:
        return f"{a / 60:.0f}m"
    h = a / 3600
    return f"{h:.0f}h" if h == round(h) else f"{h:.1f}h"


def _to_t(s: float | None) -> str:
    if s is None:
        return "no T"
    return f"in {_secs(s)}" if s >= 0 else f"{_secs(s)} PAST T"


def status_lines(st: dict[str, Any]) -> list[str]:
    out = [f"hall {st['hall']} at {st['now']}", "pools:"]
    out += _table(
        ["POOL", "KIND", "FLAVOR", "INSTANCES"],
        [
            [
                p["name"] + ("" if p["available"] else " (UNAVAILABLE)"),
                p["kind"],
                p["flavor"],
                ", ".join(f"{s} {n}" for s, n in p["instances"].items()) or "none",
            ]
            for p in st["pools"]
        ],
    )
    out.append(f"reclaims under way: {len(st['reclaims']) or 'none'}")
    if st["reclaims"]:
        out += _table(
            ["INSTANCE", "POOL", "STATE", "NOTICE", "T", "TO T"],
            [
                [
                    r["instance"],
                    r["pool"],
                    r["state"],
                    r["notice"] or "-",
                    r["terminate_at"] or "-",
                    _to_t(r["seconds_to_t"]),
                ]
                for r in st["reclaims"]
            ],
        )
    out.append(f"overruns in the last {_secs(st['recent_s'])}: {len(st['overruns']) or 'none'}")
    for o in st["overruns"]:
        out.append(
            f"  {o['at']}  {o['instance']} ({o['pool'] or '-'}) notice {o['notice'] or '-'}: {'; '.join(o['reasons'])}"
        )
    out.append(f"last control runs: {len(st['runs']) or 'none recorded'}")
    if st["runs"]:
        out += _table(
            ["RUN", "STARTED", "RESULT", "DURATION"],
            [
                [
                    str(r["id"]),
                    r["started_at"],
                    r["status"],
                    _secs(r["duration_s"]) + ("" if r["finished_at"] else " so far"),
                ]
                for r in st["runs"]
            ],
        )
    out.append(f"pools unavailable: {len(st['unavailable_pools']) or 'none'}")
    for u in st["unavailable_pools"]:
        out.append(f"  {u['pool']}: {u['reason']} (until {u['until']}, {_secs(u['seconds_left'])} more)")
    hb = st["heartbeats"]
    if hb["read_at"] is None:
        read = "never read for this hall (the control loop reads them with $SCO_NATS_URL set, or give --nats)"
    else:
        read = f"read {_secs(hb['read_age_s'])} ago, {hb['nodes']} node(s) on the relay"
    if hb["last_error"]:
        read += f"; the last read at {hb['last_try_at']} FAILED: {hb['last_error']}"
    out.append(f"agent heartbeats: {read}")
    out.append(f"agents not heard for {_secs(st['stale_after_s'])} or more: {len(st['stale_agents']) or 'none'}")
    if st["stale_agents"]:
        out += _table(
            ["INSTANCE", "POOL", "STATE", "LAST HEARD", "SILENT"],
            [
                [a["instance"], a["pool"], a["state"], a["heard_at"] or "never", _secs(a["silent_s"])]
                for a in st["stale_agents"]
            ],
        )
    return out


def report_lines(rp: dict[str, Any]) -> list[str]:
    out = [f"hall {rp['hall']} from {rp['since']} to {rp['until']}", "reclaims:"]

    def row(name: str, t: dict[str, Any]) -> list[str]:
        d = t["drain_s"]
        return [
            name,
            str(t["reclaims"]),
            str(t["drained"]),
            str(t["overrun"]),
            str(t["error"]),
            str(t["no_outcome"]),
            "-" if d["p50"] is None else f"{d['p50']:.1f}s",
            "-" if d["p99"] is None else f"{d['p99']:.1f}s",
        ]

    out += _table(
        ["POOL", "RECLAIMS", "DRAINED", "OVERRUN", "ERROR", "NO OUTCOME", "DRAIN P50", "DRAIN P99"],
        [*(row(p, t) for p, t in rp["reclaims"].items()), row("(all)", rp["total"])],
    )
    out.append("instance-hours:")
    out += _table(
        ["POOL", "KIND", "FLAVOR", "INSTANCES", "HOURS"],
        [
            [h["pool"], h["kind"], h["flavor"], str(h["instances"]), f"{h['instance_hours']:.2f}"]
            for h in rp["instance_hours"]
        ],
    )
    od = rp["on_demand"]
    out.append(f"on-demand grants: {len(od['grants']) or 'none'}")
    if od["grants"]:
        out += _table(
            ["CONTRACT", "TIER", "POOL", "GRANTS", "INSTANCES", "COST/H GRANTED", "AUTHORITY/H"],
            [
                [
                    g["contract"],
                    "-" if g["tier"] is None else str(g["tier"]),
                    g["pool"] or "-",
                    str(g["grants"]),
                    str(g["instances"]),
                    g["cost_per_hour_granted"],
                    g["authority_per_hour"] or "-",
                ]
                for g in od["grants"]
            ],
        )
    if od["refusals"]:
        out.append("on-demand refusals: " + ", ".join(f"{c} {n}" for c, n in od["refusals"].items()))
    spend = od["spend_against_authority"]
    out.append(f"on-demand spend per tier against authority: {'' if spend else 'no arbitrate run recorded'}".rstrip())
    if spend:
        out += _table(
            ["TIER", "SPENT", "AUTHORITY", "SHARE", "HOURS", "OVER AUTHORITY", "PEAK/H", "NOW/H", "AUTHORITY/H"],
            [
                [
                    str(t["tier"]) + (" (not in bundle)" if t["tier"] == 0 else ""),
                    t["spend"],
                    t["authority"],
                    "-" if t["spend_ratio"] is None else f"{t['spend_ratio']:.0%}",
                    f"{t['hours_covered']:.2f}",
                    f"{t['hours_over_authority']:.2f}h",
                    t["peak_spend_per_hour"],
                    t["spend_per_hour"],
                    t["authority_per_hour"],
                ]
                for t in spend
            ],
        )
    return out


def cmd_hall_status(args: argparse.Namespace) -> int:
    from sco.state.hall import MAX_RUNS, parse_duration, status

    if not 1 <= args.runs <= MAX_RUNS:
        raise ConfigError(f"--runs: expected 1 to {MAX_RUNS:,}, got {args.runs}")
    stale_s = parse_duration("--stale", args.stale)
    recent_s = parse_duration("--recent", args.recent)
    reader = _reader(args)
    fs, hall = _open(args)
    with fs:
        if reader is not None:
            _read_heartbeats(reader, fs.conn, hall)
        st = status(fs.conn, hall, stale_s=stale_s, recent_s=recent_s, runs=args.runs)
    print(json.dumps(st, sort_keys=True) if args.json else "\n".join(status_lines(st)))
    return 0


def _reader(args: argparse.Namespace) -> Any:
    """The relay to read heartbeats from (--nats), checked before any connection; None: the fleet state's."""
    if not args.nats:
        return None
    from sco._redact import strip_userinfo
    from sco.cli._nats import _nats_auth, _nats_url_ok
    from sco.provider.heartbeats import RelayReader

    if not all(_nats_url_ok(u.strip()) for u in args.nats.split(",") if u.strip()):
        raise ConfigError(
            f"--nats {strip_userinfo(args.nats)!r}: expected nats://HOST:PORT (comma-separated for several)"
        )
    return RelayReader(args.nats, _nats_auth(args))


def _read_heartbeats(reader: Any, conn: Any, hall: str) -> None:
    """Read the relay's last beat per node into the fleet state first; a failed read is said, and the status
    shows what the fleet state last heard (with the failure)."""
    import sys

    from sco.provider.heartbeats import HeartbeatsUnreadable, collect

    try:
        collect(reader, conn, hall)
    except HeartbeatsUnreadable as e:
        print(f"sco hall status: warning: {e}", file=sys.stderr)


def cmd_hall_report(args: argparse.Namespace) -> int:
    from sco.state.hall import db_now, parse_since, report

    # A malformed --since is named before any connection is tried (whether it is in the future needs the
    # fleet state's clock).
    parse_since(args.since, datetime.max.replace(tzinfo=UTC))
    fs, hall = _open(args)
    with fs:
        since = parse_since(args.since, db_now(fs.conn))
        rp = report(fs.conn, hall, since)
    print(json.dumps(rp, sort_keys=True) if args.json else "\n".join(report_lines(rp)))
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dsn", default=_env("SCO_DB_DSN"), help="libpq connection string [$SCO_DB_DSN]")
    p.add_argument("--hall", default=_env("SCO_HALL"), help="the hall (default: the only one recorded) [$SCO_HALL]")
    p.add_argument("--json", action="store_true", help="one JSON object (keys in docs/RUNBOOK.md)")


def register(sub: Any) -> None:
    h = sub.add_parser("hall", help="what the fleet state says of a hall (read-only)")
    hs = h.add_subparsers(dest="hall_command", required=True)
    s = hs.add_parser("status", help="instances per pool, reclaims under way, overruns, control runs, agents not heard")
    _common(s)
    s.add_argument(
        "--stale", default="15m", metavar="DURATION",
        help="an agent not heard this long is listed (at most 10 years: 3650d) [15m]",
    )  # fmt: skip
    s.add_argument(
        "--recent", default="24h", metavar="DURATION",
        help="overruns this recent are listed (at most 10 years: 3650d) [24h]",
    )  # fmt: skip
    s.add_argument("--runs", type=int, default=5, metavar="N", help="the last N control runs (1 to 10,000) [5]")
    s.add_argument(
        "--nats", default=_env("SCO_NATS_URL"), metavar="URL",
        help="read the agents' heartbeats from the hall's relay first (a reader's identity below) [$SCO_NATS_URL]",
    )  # fmt: skip
    _add_nats_auth(s)
    s.set_defaults(func=cmd_hall_status)
    r = hs.add_parser(
        "report", help="reclaims, drain outcomes and times, instance-hours, on-demand spend against authority"
    )
    _common(r)
    r.add_argument(
        "--since", required=True,
        help="an ISO 8601 time (UTC if no zone), from 1970 up to 9000, or a duration back (7d, 12h; at most 10"
        " years: 3650d)",
    )  # fmt: skip
    r.set_defaults(func=cmd_hall_report)
