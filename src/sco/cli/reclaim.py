"""``sco reclaim``: take instances back from the hall (notice now, delete at T+window)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from sco.cli._common import _add_trust, _env, _keyring, _read
from sco.cli._nats import _add_nats_auth, _nats_auth
from sco.errors import ConfigError


def _cloud(name: str | None, api_timeout: float | None = None) -> Any:
    from sco.provider.cloud import connect

    return connect(cloud=name, api_timeout=api_timeout) if name else connect(api_timeout=api_timeout)


def cmd_reclaim(args: argparse.Namespace) -> int:
    import asyncio

    from sco.provider.reclaim_job import ReclaimSettings, reclaim
    from sco.provider.reclaimer import drain_floor, window_problem
    from sco.state.db import dsn_from_env

    noticing = bool(args.nodes or args.before_leases)  # --finish alone sends no notice
    if not args.nats and noticing:
        raise ConfigError("no notice relay: give --nats URL or set $SCO_NATS_URL")
    floor = None
    if args.bundle:  # the hall's contracts: the window must fit the largest drain budget plus the margin
        from sco.contract.bundle import Bundle

        b = Bundle.from_bytes(_read(args.bundle), _keyring(args), args.bundle)
        floor = drain_floor(b.policy, b.contracts)
    if (problem := window_problem("--window", args.window, floor)) is not None:
        raise ConfigError(problem)
    from sco.contract.notice import subject_name_problem
    from sco.contract.signing import load_private

    bad = [
        m
        for m in (subject_name_problem("--hall", args.hall), *(subject_name_problem("node", n) for n in args.nodes))
        if m
    ]
    if bad:
        raise ConfigError("; ".join(bad))

    key_files = args.notice_key or ([os.environ["SCO_NOTICE_KEY"]] if os.environ.get("SCO_NOTICE_KEY") else [])
    if not key_files and noticing:
        raise ConfigError(
            "no notice key: give --notice-key KEY or set $SCO_NOTICE_KEY (agents refuse unsigned notices)"
        )
    settings = ReclaimSettings(
        hall=args.hall, nodes=tuple(args.nodes), window_s=args.window, nats_url=args.nats or "",
        signing_keys=[load_private(Path(k)) for k in key_files], dsn=dsn_from_env(args.dsn),
        nats_auth=_nats_auth(args), lock_wait_s=args.lock_wait, wait=not args.no_wait, floor=floor,
        retry_for_s=args.retry_for, call_timeout_s=args.call_timeout, before_leases=args.before_leases,
        reconnect_for_s=args.reconnect_for,
    )  # fmt: skip
    if not settings.nodes and not settings.before_leases and not args.finish:
        raise ConfigError("name the instances (NODE...) to reclaim, or give --before-leases or --finish")
    if not settings.wait and not settings.nodes and not settings.before_leases:
        raise ConfigError("--finish deletes at T: it cannot be given with --no-wait alone")

    def said(rc: Any) -> None:
        sent = "published" if rc.published_at else "NOT published (relay down; metadata only)"
        print(f"{rc.instance.name}: notice {rc.notice['id']} {sent}, deleted at {rc.terminate_at:.3f}", flush=True)

    cloud = _cloud(args.os_cloud, args.call_timeout)
    rc = 0
    for r in asyncio.run(reclaim(settings, cloud, on_notice=said)):
        if r.get("unnoticed"):  # its notice was never sent, and no key here to send it
            print(f"{r['name']}: NOT deleted: {r['unnoticed']}")
            rc = 9  # left under reclaim: not finished
        elif r.get("finished"):  # noticed by an earlier run that stopped before T
            when = f"{r['late_s']:.1f} s after its T" if r["late_s"] > 1.0 else "at its T"
            print(f"{r['name']}: {r['state']}, finished (deleted {when}; agent: {r['agent'] or 'no account'})")
        elif settings.wait:
            print(f"{r['name']}: {r['state']} (agent: {r['agent'] or 'no account'})")
    return rc


def register(sub: Any) -> None:
    x = sub.add_parser("reclaim", help="take instances back: notice now, delete at T+window")
    x.add_argument("--hall", required=True)
    x.add_argument("nodes", nargs="*", metavar="NODE", help="instance (node) names")
    x.add_argument(
        "--before-leases", action="store_true",
        help="also reclaim what a Blazar host lease starting within a window (+60 s) would preempt",
    )  # fmt: skip
    x.add_argument("--window", type=float, default=float(_env("SCO_RECLAIM_WINDOW", "120") or 120))
    x.add_argument("--nats", default=_env("SCO_NATS_URL"), help="the hall's notice relay [$SCO_NATS_URL]")
    _add_nats_auth(x)  # the relay's reclaimer identity
    x.add_argument("--os-cloud", default=_env("OS_CLOUD"), help="clouds.yaml entry [$OS_CLOUD]")
    x.add_argument("--dsn", default=_env("SCO_DB_DSN"), help="fleet state [$SCO_DB_DSN]")
    x.add_argument(
        "--notice-key",
        action="append",
        metavar="KEY",
        help="the hall's notice signing key (repeatable) [$SCO_NOTICE_KEY]",
    )
    x.add_argument("--lock-wait", type=float, default=0.0, help="seconds to wait for another writer of the hall")
    x.add_argument(
        "--reconnect-for", type=float, default=90.0, metavar="S",
        help="a fleet state lost mid-run (a Patroni failover): connect again and retake the hall's lock for this long",
    )  # fmt: skip
    x.add_argument("--no-wait", action="store_true", help="send the notices and return (a later run deletes)")
    x.add_argument(
        "--finish", action="store_true",
        help="finish the hall's reclaims an earlier run noticed (delete each at its T, at once if T has passed);"
        " without NODE needs no --nats nor --notice-key",
    )  # fmt: skip
    x.add_argument(
        "--retry-for", type=float, default=120.0, metavar="S",
        help="seconds past the last T to keep retrying deletes Nova refuses (then exit 9; the next run retries)",
    )  # fmt: skip
    x.add_argument(
        "--call-timeout", type=float, default=float(_env("SCO_OPENSTACK_TIMEOUT", "30") or 30), metavar="S",
        help="deadline of each OpenStack call, Keystone's included [$SCO_OPENSTACK_TIMEOUT]",
    )  # fmt: skip
    x.add_argument("--bundle", default=_env("SCO_BUNDLE"), help="the hall's bundle: the window must fit its drains")
    _add_trust(x)
    x.set_defaults(func=cmd_reclaim)
