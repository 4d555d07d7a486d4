"""``sco node ...``: the node-side bundle cache (fetch, verify, keep the last good one)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from sco.cli._common import _add_bundle_ca, _add_trust, _bundle_ca_checked, _env, _keyring
from sco.errors import ConfigError


def cmd_fetch(args: argparse.Namespace) -> int:
    from sco.agent.bundle_cache import BundleCache, BundleFetcher

    if not args.url:
        raise ConfigError("no bundle URL: give --url or set $SCO_BUNDLE_URL")
    # the agent's own bounds (agent.toml): no deadline is no deadline at all (inf, nan), --interval 0 a busy loop
    for flag, value, lo, hi, unit in (
        ("--deadline", args.deadline, 1.0, 600.0, " seconds"),
        ("--max-bytes", args.max_bytes, 64 * 1024, 1 << 30, " bytes"),
        ("--interval", args.interval, 1.0, 86_400.0, " seconds"),
    ):
        if not lo <= value <= hi:  # nan compares false: refused too
            raise ConfigError(f"{flag} {value}: expected {lo:g} to {hi:g}{unit}")
    cache = BundleCache(Path(args.cache_dir), _keyring(args))
    ca_file = _bundle_ca_checked(args.bundle_ca_file)
    fetcher = BundleFetcher(cache, args.url, max_bytes=args.max_bytes, deadline_s=args.deadline, ca_file=ca_file)
    while True:
        offer = fetcher.refresh()
        line = {
            "outcome": offer.outcome,
            "serial": offer.serial,
            **({"reason": offer.reason} if offer.reason else {}),
        }
        print(json.dumps(line), flush=True)
        if offer.outcome not in ("accepted", "unchanged"):
            print(f"sco: error: bundle {offer.outcome}: {offer.reason}", file=sys.stderr, flush=True)
        if not args.watch:
            # the README's codes: 3 a bundle refused (tampered, untrusted, rolled back), 6 a fetch that failed
            return {"accepted": 0, "unchanged": 0, "refused": 3}.get(offer.outcome, 6)
        time.sleep(args.interval)


def cmd_status(args: argparse.Namespace) -> int:
    from sco.agent.bundle_cache import BundleCache

    cache = BundleCache(Path(args.cache_dir), _keyring(args))
    print(json.dumps(cache.status(), indent=2))
    return 0 if cache.bundle is not None else 1


def register(sub: Any) -> None:
    n = sub.add_parser("node", help="node-side bundle cache")
    ns = n.add_subparsers(dest="node_command", required=True)
    x = ns.add_parser("fetch-bundle", help="fetch, verify and cache the hall's bundle")
    x.add_argument("--url", default=_env("SCO_BUNDLE_URL"))
    _add_bundle_ca(x)
    x.add_argument("--cache-dir", default=_env("SCO_CACHE_DIR", "/var/lib/sco/bundle"))
    _add_trust(x)
    x.add_argument("--watch", action="store_true", help="keep refreshing")
    x.add_argument("--interval", type=float, default=60.0)
    x.add_argument("--max-bytes", type=int, default=32 << 20, help="refuse a larger response (default 32 MiB)")
    x.add_argument("--deadline", type=float, default=30.0, help="seconds for the whole request (default 30)")
    x.set_defaults(func=cmd_fetch)
    x = ns.add_parser("bundle-status", help="the cached bundle: serial, age, last refresh outcome")
    x.add_argument("--cache-dir", default=_env("SCO_CACHE_DIR", "/var/lib/sco/bundle"))
    _add_trust(x)
    x.set_defaults(func=cmd_status)
