"""``sco drill``: the reclaim drill (playbook ``sco.orchestrator.drill`` runs it; ``sco.control.drill_run``).

  keys    find (or, with --make, make) the drill's notice keys and check the hall trusts them; one line when not
  run     send the signed notices as the reclaimer (or, with --observe, follow a reclaim the provider's reclaimer
          sends) and follow each agent's events until every node has its final account or T + grace; progress in
          <dir>/<id>.progress.json, the report in <dir>/<id>.html and .json (printed as JSON)
  watch   print the progress lines of a running drill (waits up to --wait s for news)
  finish  add the reclaimer's account of the instances (the reclaim module's `reclaimed`) and write the report

Exit 0 when every node drained (and, with the reclaimer, was deleted); 1 when one did not (the report says which
and why); when the drill cannot run, one line on stderr and the code of its cause (4 a key file, 5 a setting or
a path, 6 the relay or the distributor, 70 an internal error): never 1, which the playbook reads as not drained.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import traceback
from pathlib import Path
from typing import Any

from sco.cli._common import _add_bundle_ca
from sco.errors import ScoError


class DrillInternalError(ScoError):
    """A defect in the drill: one line (the traceback before it), never read as a node that did not drain."""

    exit_code = 70


def _guarded(args: argparse.Namespace) -> int:
    """The subcommand, its failures kept off exit 1 (a node not drained): a path the system refuses is a setting
    (5), anything unforeseen an internal error (70)."""
    from sco.control.drill_run import DrillError

    logging.getLogger("nats").setLevel(logging.CRITICAL)  # a relay's failure is said once, as the drill's line
    try:
        return int(args.drill_func(args))
    except ScoError:
        raise
    except OSError as e:
        raise DrillError(f"{e.filename or ''}{': ' if e.filename else ''}{e.strerror or e}") from None
    except Exception as e:
        traceback.print_exc()
        raise DrillInternalError(f"internal error: {type(e).__name__}: {e}") from None


def cmd_keys(args: argparse.Namespace) -> int:
    from sco.control.drill_run import find_keys

    found = find_keys(args.signing_key, args.make, args.bundle_url or None, args.trust, args.bundle_ca_file or "")
    print(json.dumps({"keys": found}, sort_keys=True))
    return 0


def _said(rep: Any, report_dir: str) -> int:
    print(json.dumps({**rep.as_json(), "html": str(Path(report_dir) / f"{rep.drill}.html")}, sort_keys=True))
    return 0 if not rep.not_drained and not rep.not_deleted else 1


def cmd_run(args: argparse.Namespace) -> int:
    from sco.control.drill_run import Drill, DrillSettings, write_atomic

    settings = DrillSettings(
        hall=args.hall, nodes=list(args.node), report_dir=Path(args.report_dir), id=args.id, server=args.server,
        notice_seconds=args.notice_seconds, grace_seconds=args.grace_seconds, observe=args.observe,
        signing_keys=list(args.signing_key or []), reader=args.reader,
        reader_credentials=args.reader_credentials, reclaimer=args.reclaimer,
        reclaimer_credentials=args.reclaimer_credentials or "", ca_file=args.ca_file or "",
    )  # fmt: skip
    settings.check()
    settings.report_dir.mkdir(parents=True, exist_ok=True)
    drill = Drill(settings)
    try:
        rep = asyncio.run(drill.run())
    except (ScoError, OSError) as e:  # said where the playbook waits for the drill to listen
        line = f"drill: {e}" if not isinstance(e, OSError) else f"drill: {e.filename or ''} {e.strerror or e}"
        write_atomic(drill.dir / f"{drill.id}.progress.json", json.dumps({"error": line, "listening": False}))
        raise
    return _said(rep, args.report_dir)


def cmd_watch(args: argparse.Namespace) -> int:
    from sco.control.drill_run import watch

    for line in watch(Path(args.report_dir), args.id, args.wait):
        print(line)
    return 0


def cmd_finish(args: argparse.Namespace) -> int:
    from sco.control.drill_run import DrillError, load_drill

    try:
        reclaimed = json.loads(args.from_reclaim)
    except ValueError as e:
        raise DrillError(f"--from-reclaim: not JSON ({e})") from None
    rep = load_drill(Path(args.report_dir), args.id).finish(reclaimed if isinstance(reclaimed, list) else [])
    return _said(rep, args.report_dir)


def register(sub: Any) -> None:
    d = sub.add_parser("drill", help="reclaim chosen nodes through the relay and report what each agent did")
    dsub = d.add_subparsers(dest="drill_command", required=True)
    k = dsub.add_parser("keys", help="find or make the notice keys; check the hall trusts one")
    k.add_argument("--signing-key", action="append", required=True, help="notice key file (repeatable)")
    k.add_argument("--make", action="store_true", help="make a missing key file (and its .pub)")
    k.add_argument("--bundle-url", default="", help="the hall's published bundle: check its noticeKeys")
    _add_bundle_ca(k)
    k.add_argument("--trust", action="append", default=[], help="public key the bundle must be signed by")
    k.set_defaults(func=_guarded, drill_func=cmd_keys)
    r = dsub.add_parser("run", help="send the notices (or --observe) and follow the agents")
    r.add_argument("--server", required=True, help="relay URL(s), comma-separated")
    r.add_argument("--hall", required=True)
    r.add_argument("--node", action="append", required=True, help="repeatable")
    r.add_argument("--id", default="", help="the drill's id (names its report files)")
    r.add_argument("--report-dir", required=True)
    r.add_argument("--observe", action="store_true", help="send nothing: follow the provider's reclaimer")
    r.add_argument("--reclaimer", default="reclaimer")
    # a user's creds file (operator mode: the notice_relay role's <user>.creds), nkey seed file (<user>.nk), or a
    # password file; the old names still work
    r.add_argument("--reclaimer-credentials", "--reclaimer-password-file", dest="reclaimer_credentials")
    r.add_argument("--reader", default="control")
    r.add_argument("--reader-credentials", "--reader-password-file", dest="reader_credentials", required=True)
    r.add_argument("--signing-key", action="append", help="notice key file (repeatable)")
    r.add_argument("--ca-file", default="", help="the hall's CA the relay's TLS certificate must chain to")
    r.add_argument("--notice-seconds", type=float, default=120)
    r.add_argument("--grace-seconds", type=float, default=10)
    r.set_defaults(func=_guarded, drill_func=cmd_run)
    w = dsub.add_parser("watch", help="print a running drill's progress")
    w.add_argument("--report-dir", required=True)
    w.add_argument("--id", required=True)
    w.add_argument("--wait", type=float, default=5)
    w.set_defaults(func=_guarded, drill_func=cmd_watch)
    f = dsub.add_parser("finish", help="add the reclaimer's account and write the report")
    f.add_argument("--report-dir", required=True)
    f.add_argument("--id", required=True)
    f.add_argument("--from-reclaim", required=True, metavar="JSON", help="the reclaim module's `reclaimed` list")
    f.set_defaults(func=_guarded, drill_func=cmd_finish)
