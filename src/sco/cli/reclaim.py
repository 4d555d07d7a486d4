"""``sco reclaim``: take instances back from the hall (notice now, delete at T+window)."""

from __future__ import annotations

import argparse
from typing import Any

from sco.cli._common import _add_trust, _env
from sco.cli._nats import _add_nats_auth
from sco.errors import ConfigError

# How this command spells the reclaim options (sco.control.options.ReclaimOptions, which the collection's module
# parses into too): its lines name the flag a user gave, with the module's words otherwise.
FLAGS = {
    "hall": "--hall", "nodes": "node", "window": "--window", "nats_url": "--nats", "notice_keys": "--notice-key",
    "lock_wait": "--lock-wait", "retry_for": "--retry-for", "call_timeout": "--call-timeout",
    "reconnect_for": "--reconnect-for", "nats_nkey_seed": "--nkey-seed", "bundle": "--bundle", "trust": "--trust",
    "trust_dir": "--trust-dir", "nats_ca_file": "--nats-ca-file",
}  # fmt: skip


def options(args: argparse.Namespace) -> Any:
    """The command's flags as the reclaim step's one options type (its checks and its lines)."""
    from sco.control.options import ReclaimOptions

    params = {
        "hall": args.hall, "nodes": args.nodes, "before_leases": args.before_leases, "window": args.window,
        "nats_url": args.nats, "nats_user": args.user, "nats_password": args.password, "nats_token": args.token,
        "nats_nkey_seed": args.nkey_seed, "nats_creds": args.creds, "notice_keys": args.notice_key or [],
        "cloud": args.os_cloud, "api_timeout": args.call_timeout, "call_timeout": args.call_timeout,
        "lock_wait": args.lock_wait, "reconnect_for": args.reconnect_for, "retry_for": args.retry_for,
        "wait": not args.no_wait, "finish": args.finish, "bundle": args.bundle, "trust": args.trust,
        "trust_dir": args.trust_dir, "nats_ca_file": args.nats_ca_file,
    }  # fmt: skip
    return ReclaimOptions.from_params(params, names=FLAGS)


def cmd_reclaim(args: argparse.Namespace) -> int:
    import asyncio

    from sco.control.steps import reclaim_floor
    from sco.provider.reclaim_job import reclaim
    from sco.state.db import dsn_from_env

    o = options(args)
    noticing = bool(o.nodes or o.before_leases)  # --finish alone sends no notice
    if noticing:
        o.check_noticing()
    floor = reclaim_floor(o)
    if not noticing and not o.finish:
        raise ConfigError("name the instances (NODE...) to reclaim, or give --before-leases or --finish")
    if not o.wait and not noticing:
        raise ConfigError("--finish deletes at T: it cannot be given with --no-wait alone")
    settings = o.settings(nodes=o.nodes, dsn=dsn_from_env(args.dsn), floor=floor, wait=o.wait)

    def said(rc: Any) -> None:
        sent = "published" if rc.published_at else "NOT published (relay down; metadata only)"
        print(f"{rc.instance.name}: notice {rc.notice['id']} {sent}, deleted at {rc.terminate_at:.3f}", flush=True)

    rc = 0
    for r in asyncio.run(reclaim(settings, o.cloud.connect(), on_notice=said)):
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
