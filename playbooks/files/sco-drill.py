#!/usr/bin/env python3
"""Reclaim drill: send reclaim notices to chosen nodes through the hall's relay, as the reclaimer, and report what
each node's agent did (from its events on sco.events.<hall>.<node>), as one JSON document on stdout; or, with
--from-reclaim, the same report of a drill the provider's reclaimer ran (the reclaim module's result).

The notice is the real one, signed with the hall's notice key (its public half is in the hall policy's noticeKeys,
so nodes trust it through their bundle): the agent drains for real. The instances are not deleted here: that is the
provider's reclaimer (the reclaim module, `sco reclaim`), which drill.yml runs instead when the hall's cloud is given.
Exit 0 when every node drained (and, from a reclaim, was deleted), 1 otherwise, 2 on bad input or an unreachable relay.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import nats

from sco.contract.notice import sign_notice
from sco.contract.signing import load_private

FINAL = {"drain.drained": "drained", "drain.overrun": "overrun", "drain.error": "error", "notice.refused": "refused"}


async def drill(args: argparse.Namespace) -> dict[str, Any]:
    servers = [s.strip() for s in args.server.split(",") if s.strip()]
    reader = await nats.connect(
        servers=servers,
        user=args.reader,
        password=Path(args.reader_password_file).read_text().strip(),
        connect_timeout=3,
        max_reconnect_attempts=3,
    )
    reclaimer = await nats.connect(
        servers=servers,
        user=args.reclaimer,
        password=Path(args.reclaimer_password_file).read_text().strip(),
        connect_timeout=3,
        max_reconnect_attempts=3,
    )
    keys = [load_private(Path(k)) for k in args.signing_key]
    drill_id = f"drill-{int(time.time())}-{uuid.uuid4().hex[:6]}"
    nodes: dict[str, dict[str, Any]] = {
        n: {"outcome": "no answer", "summary": "no answer", "events": []} for n in args.node
    }
    done = asyncio.Event()

    async def on_event(msg: Any) -> None:
        node = msg.subject.rsplit(".", 1)[-1]
        if node not in nodes:
            return
        try:
            ev = json.loads(msg.data)
        except ValueError:
            return
        rec = nodes[node]
        rec["events"].append(ev.get("type"))
        if ev.get("type") in FINAL and rec["outcome"] == "no answer":
            rec["outcome"] = rec["summary"] = FINAL[ev["type"]]
            rec["seconds_after_notice"] = round(time.time() - sent_at, 3)
            rec["detail"] = {k: v for k, v in ev.items() if k not in ("type", "seq")}
        if all(r["outcome"] != "no answer" for r in nodes.values()):
            done.set()

    # subscribe before the notices go out, so no event is missed
    for node in nodes:
        await reader.subscribe(f"sco.events.{args.hall}.{node}", cb=on_event)
    await reader.flush(timeout=3)
    sent_at = time.time()
    terminate_at = sent_at + args.notice_seconds
    for node in nodes:
        notice = {
            "id": f"{drill_id}-{node}",
            "hall": args.hall,
            "node": node,
            "terminateAt": terminate_at,
            "issuedAt": sent_at,
        }
        await reclaimer.publish(f"sco.notice.{args.hall}.{node}", sign_notice(notice, keys))
    await reclaimer.flush(timeout=3)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(done.wait(), args.notice_seconds + args.grace_seconds)
    await reader.close()
    await reclaimer.close()
    return {
        "drill": drill_id,
        "hall": args.hall,
        "notice_seconds": args.notice_seconds,
        "terminate_at": terminate_at,
        "nodes": nodes,
        "drained": sorted(n for n, r in nodes.items() if r["outcome"] == "drained"),
        "not_drained": sorted(n for n, r in nodes.items() if r["outcome"] != "drained"),
    }


# the agent's account when the reclaimer's delete went out (the fleet state's instance state then)
AGENT = {"drained": "drained", "overrun": "overrun", "draining": "draining (no final account)", "notified": "no answer"}


def from_reclaim(hall: str, notice_seconds: float, reclaimed: list[dict[str, Any]]) -> dict[str, Any]:
    """The report of a drill the provider's reclaimer ran (the reclaim module's `reclaimed` list)."""
    nodes: dict[str, dict[str, Any]] = {}
    for r in reclaimed:
        agent = r.get("agent")
        outcome = AGENT.get(agent, str(agent)) if agent else "not deleted yet"
        nodes[r["name"]] = {"outcome": outcome, "instance": r.get("state"), "notice": r.get("notice"),
                            "terminate_at": r.get("terminate_at"), "published": r.get("published"),
                            "summary": f"{outcome}, {r.get('state')}"}  # fmt: skip
    return {
        "hall": hall,
        "notice_seconds": notice_seconds,
        "nodes": nodes,
        "drained": sorted(n for n, r in nodes.items() if r["outcome"] == "drained"),
        "not_drained": sorted(n for n, r in nodes.items() if r["outcome"] != "drained"),
        "not_deleted": sorted(n for n, r in nodes.items() if r["instance"] != "deleted"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", help="relay URL(s), comma-separated")
    p.add_argument("--hall", required=True)
    p.add_argument("--node", action="append", help="repeatable")
    p.add_argument("--reclaimer", default="reclaimer")
    p.add_argument("--reclaimer-password-file")
    p.add_argument("--reader", default="control")
    p.add_argument("--reader-password-file")
    p.add_argument("--signing-key", action="append", help="notice key file (repeatable)")
    p.add_argument("--notice-seconds", type=float, default=120)
    p.add_argument("--grace-seconds", type=float, default=10)
    p.add_argument("--from-reclaim", metavar="JSON", help="report the reclaim module's `reclaimed` list; send nothing")
    args = p.parse_args()
    if args.from_reclaim is not None:
        report = from_reclaim(args.hall, args.notice_seconds, json.loads(args.from_reclaim))
        print(json.dumps(report, indent=1, sort_keys=True))
        sys.exit(0 if not report["not_drained"] and not report["not_deleted"] else 1)
    missing = [f"--{o.replace('_', '-')}" for o in ("server", "node", "reclaimer_password_file",
               "reader_password_file", "signing_key") if not getattr(args, o)]  # fmt: skip
    if missing:
        p.error(f"sending the notices needs {', '.join(missing)}")
    try:
        report = asyncio.run(drill(args))
    except (OSError, nats.errors.Error) as e:
        print(f"sco-drill: {args.server}: {e}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(report, indent=1, sort_keys=True))
    sys.exit(0 if not report["not_drained"] else 1)


if __name__ == "__main__":
    main()
