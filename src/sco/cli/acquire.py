"""``sco acquire`` and ``sco reconcile``: the loop's acquire and reconcile steps outside Ansible.

``sco acquire --input FILE`` reads one YAML/JSON document with the acquire module's options (hall, cloud or
auth, pools, plan, arbitration, bundle, trust_dir, signing_keys, ...) and runs the same step; ``--check`` runs
the preflight and reports what would be launched and deleted. ``sco reconcile --hall H`` compares the hall's
servers in Nova with the fleet state and settles the difference (``--check``: report only). Both print JSON
(``--json``) or one line per item; a cloud that refuses or does not answer exits 9 with its message.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from sco._document import read_document
from sco.errors import ConfigError


def _doc(path: str) -> dict[str, Any]:
    doc = read_document(path)
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a mapping of the acquire module's options")
    return doc


def _print(result: dict[str, Any], as_json: bool, lines: list[str]) -> None:
    if as_json:
        print(json.dumps(result, indent=2, sort_keys=True, default=str))
        return
    for line in lines:
        print(line)


def cmd_acquire(args: argparse.Namespace) -> int:
    from sco.control import steps

    params = _doc(args.input)
    if args.dsn:
        params["state_dsn"] = args.dsn
    if args.os_cloud and not params.get("cloud"):
        params["cloud"] = args.os_cloud
    result = steps.run("acquire", params, args.check)
    lines = [
        f"{e['pool']}/{e['entry']}: hold {e['count']} (+{e['launch']} -{len(e['delete'])})" for e in result["entries"]
    ]
    lines += [f"preflight {pool}: {v}" for pool, v in sorted(result["preflight"].items())]
    verb = "would launch" if args.check else "launched"
    lines.append(
        f"{verb} {result['launched']}, deleted {result['deleted']}, launch failures {result['launch_failures']}"
    )
    lines += [f"error: {e}" for e in result["errors"]] + [f"warning: {w}" for w in result["warnings"]]
    _print(result, args.json, lines)
    return 0


def cmd_reconcile(args: argparse.Namespace) -> int:
    from sco.control import steps

    params: dict[str, Any] = {"hall": args.hall, "state_dsn": args.dsn, "lock_wait": args.lock_wait}
    if args.os_cloud:
        params["cloud"] = args.os_cloud
    result = steps.run("reconcile", params, args.check)
    _print(result, args.json, result["explain"] + [f"warning: {w}" for w in result["warnings"]])
    return 0


def register(sub: Any) -> None:
    env = os.environ.get
    x = sub.add_parser("acquire", help="make each pool hold what a plan says, through Nova (after a preflight)")
    x.add_argument("--input", required=True, metavar="FILE", help="the acquire module's options (YAML or JSON)")
    x.add_argument("--os-cloud", default=env("OS_CLOUD"), help="clouds.yaml entry when the file names none [$OS_CLOUD]")
    x.add_argument("--dsn", default=env("SCO_DB_DSN"), help="fleet state [$SCO_DB_DSN]")
    x.add_argument("--check", action="store_true", help="preflight and report; launch and delete nothing")
    x.add_argument("--json", action="store_true", help="the whole result as JSON")
    x.set_defaults(func=cmd_acquire)

    x = sub.add_parser("reconcile", help="make the fleet state agree with Nova (adopt, settle, mark lost)")
    x.add_argument("--hall", required=True)
    x.add_argument("--os-cloud", default=env("OS_CLOUD"), help="clouds.yaml entry [$OS_CLOUD]")
    x.add_argument("--dsn", default=env("SCO_DB_DSN"), help="fleet state [$SCO_DB_DSN]")
    x.add_argument("--lock-wait", type=float, default=0.0, help="seconds to wait for another writer of the hall")
    x.add_argument("--check", action="store_true", help="report the differences; change nothing")
    x.add_argument("--json", action="store_true", help="the whole result as JSON")
    x.set_defaults(func=cmd_reconcile)
