"""``sco notice send`` and ``sco events create-stream``: the hall's NATS relay (notices in, events out)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from sco.cli._nats import _add_nats, _nats_run
from sco.errors import ConfigError


def cmd_notice_send(args: argparse.Namespace) -> int:
    import uuid

    from sco.contract.notice import sign_notice, subject_name_problem
    from sco.contract.signing import load_private

    bad = [m for m in (subject_name_problem("--hall", args.hall), subject_name_problem("--node", args.node)) if m]
    if bad:
        raise ConfigError("; ".join(bad))
    keys = [load_private(Path(k)) for k in args.signing_key]
    if not 0 <= args.in_seconds <= 3600:
        raise ConfigError(f"--in {args.in_seconds}: expected 0 to 3600 seconds")
    now = time.time()
    notice = {
        "id": args.id or f"reclaim-{uuid.uuid4().hex[:12]}",
        "hall": args.hall,
        "node": args.node,
        "issuedAt": round(now, 3),
        "terminateAt": round(now + args.in_seconds, 3),
    }
    raw = sign_notice(notice, keys)
    subject = f"sco.notice.{args.hall}.{args.node}"
    if args.dry_run:
        sys.stdout.write(raw.decode() + "\n")
        return 0

    async def send(nc: Any) -> None:
        await nc.publish(subject, raw)
        await nc.flush(timeout=5)

    _nats_run(args, send)
    print(
        f"sent notice {notice['id']} to {subject}: instance gone in {args.in_seconds:g} s (signed by "
        f"{', '.join(k.keyid for k in keys)})"
    )
    return 0


def cmd_events_stream(args: argparse.Namespace) -> int:
    async def ensure(nc: Any) -> str:
        return await ensure_events_stream(nc, args.name, args.subjects, args.max_age_days)

    print(_nats_run(args, ensure))
    return 0


async def ensure_events_stream(
    nc: Any, name: str = "SCO_EVENTS", subjects: str = "sco.events.>", max_age_days: float = 30
) -> str:
    """Create the JetStream stream the agents publish events to (idempotent): without it events go nowhere."""
    from nats.js.api import StreamConfig
    from nats.js.errors import NotFoundError

    js = nc.jetstream(timeout=5)
    cfg = StreamConfig(name=name, subjects=[subjects], duplicate_window=120, max_age=max_age_days * 86400)
    try:
        await js.stream_info(name)
        await js.update_stream(cfg)
        return f"stream {name} on {subjects}: updated"
    except NotFoundError:
        await js.add_stream(cfg)
        return f"stream {name} on {subjects}: created"


def register(sub: Any) -> None:
    nt = sub.add_parser("notice", help="signed reclaim notices")
    nts = nt.add_subparsers(dest="notice_command", required=True)
    x = nts.add_parser("send", help="sign a reclaim notice and publish it on sco.notice.<hall>.<node>")
    x.add_argument("--hall", required=True)
    x.add_argument("--node", required=True)
    x.add_argument(
        "--signing-key",
        action="append",
        required=True,
        metavar="KEY",
        help="notice key (its public half is in the hall policy's noticeKeys)",
    )
    x.add_argument("--in", dest="in_seconds", type=float, default=120.0, help="seconds until the instance is gone")
    x.add_argument("--id", help="notice id (default: a random one)")
    x.add_argument("--dry-run", action="store_true", help="print the signed notice instead of sending it")
    _add_nats(x)
    x.set_defaults(func=cmd_notice_send)

    ev = sub.add_parser("events", help="the JetStream stream node events go to")
    evs = ev.add_subparsers(dest="events_command", required=True)
    x = evs.add_parser("create-stream", help="create (or update) the events stream: idempotent")
    x.add_argument("--name", default="SCO_EVENTS")
    x.add_argument("--subjects", default="sco.events.>")
    x.add_argument("--max-age-days", type=float, default=30)
    _add_nats(x)
    x.set_defaults(func=cmd_events_stream)
