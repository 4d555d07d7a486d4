"""The ``sco`` command. The one place errors become messages (one line per problem) and exit codes."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sco import __version__
from sco._redact import describe_dsn, strip_userinfo, strip_userinfo_in_text
from sco.errors import ConfigError, FetchError, ScoError

Handler = Callable[[argparse.Namespace], int]


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


def _keyring(args: argparse.Namespace) -> Any:
    from sco.contract.signing import Keyring, load_public

    keys = [load_public(Path(p)) for p in args.trust or []]
    if getattr(args, "trust_dir", None):
        keys += [load_public(p) for p in sorted(Path(args.trust_dir).glob("*.pub"))]
    if not keys:
        raise ConfigError("no trusted key: give --trust PUBKEY (repeatable) or --trust-dir DIR")
    return Keyring(keys)


def _add_trust(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trust", action="append", metavar="PUBKEY", help="trusted public key file (repeatable)")
    p.add_argument(
        "--trust-dir",
        default=_env("SCO_TRUST_DIR"),
        metavar="DIR",
        help="directory of *.pub [$SCO_TRUST_DIR]",
    )


# --- keys -----------------------------------------------------------------------------------------


def _file_name_problem(name: str) -> str | None:
    """Why ``name`` is not one plain file name inside the directory it is meant for (None: it is)."""
    if not name:
        return "expected a file name, got an empty one"
    if "/" in name or name in (".", ".."):
        return "expected a plain file name, not a path (use --out-dir for the directory)"
    if not name.isprintable():  # C0, DEL, C1 (U+0080-U+009F), line separators: never printed raw
        return "control or unprintable characters in a file name"
    return None


def cmd_keygen(args: argparse.Namespace) -> int:
    from sco.contract.signing import generate, write_keypair

    if args.name is not None and (problem := _file_name_problem(args.name)):
        raise ConfigError(f"--name {args.name!r}: {problem}")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    key = generate()
    name = args.name or key.keyid
    write_keypair(key, out / f"{name}.key", out / f"{name}.pub")
    print(f"keyid {key.keyid}: private {out / (name + '.key')} (0600), public {out / (name + '.pub')}")
    if args.purpose == "notice":
        # Same Ed25519 key; nodes trust it through the bundle, so it goes into the hall policy.
        public = bytes(key.signing_key.verify_key).hex()
        print("add to hall.yaml spec.noticeKeys (then compile and publish the bundle):")
        print(f"  - {{keyid: '{key.keyid}', public: '{public}'}}")
    return 0


# --- notices and events ---------------------------------------------------------------------------


def _nats_auth(args: argparse.Namespace) -> dict[str, Any]:
    if args.creds:
        return {"user_credentials": args.creds}
    if args.nkey_seed:
        return {"nkeys_seed": args.nkey_seed}
    if args.token:
        return {"token": args.token}
    if args.user:
        return {"user": args.user, "password": args.password or ""}
    return {}


def _add_nats(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nats", default=_env("SCO_NATS_URL", "nats://127.0.0.1:4222"), help="[$SCO_NATS_URL]")
    _add_nats_auth(p)


def _add_nats_auth(p: argparse.ArgumentParser) -> None:
    p.add_argument("--user", default=_env("SCO_NATS_USER"), help="[$SCO_NATS_USER]")
    p.add_argument("--password", default=_env("SCO_NATS_PASSWORD"), help="[$SCO_NATS_PASSWORD]")
    p.add_argument("--token", default=_env("SCO_NATS_TOKEN"), help="[$SCO_NATS_TOKEN]")
    p.add_argument("--nkey-seed", default=_env("SCO_NATS_NKEY_SEED"), help="nkey seed file [$SCO_NATS_NKEY_SEED]")
    p.add_argument("--creds", default=_env("SCO_NATS_CREDS"), help="NATS creds file [$SCO_NATS_CREDS]")


def _nats_why(e: BaseException) -> str:
    """A connect failure in words (never a URL's credentials): nats-py's own are often an empty TimeoutError."""
    return strip_userinfo_in_text(_nats_reason(e))


def _nats_reason(e: BaseException) -> str:
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, TimeoutError) or type(e).__name__ == "TimeoutError":  # asyncio's, and nats.errors'
        return "timed out (no answer within 5 s)"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _nats_url_ok(url: str) -> bool:
    """A server nats-py can dial: a known scheme, a host and a numeric port (a malformed one is a config error)."""
    import urllib.parse

    u = urllib.parse.urlsplit(url if "://" in url else f"nats://{url}")
    try:
        u.port  # noqa: B018 - raises ValueError on "abc" or 99999
    except ValueError:
        return False
    return u.scheme in ("nats", "tls", "ws", "wss") and bool(u.hostname)


def _nats_run(args: argparse.Namespace, work: Callable[[Any], Any]) -> Any:
    import asyncio
    import contextlib

    async def main() -> Any:
        import nats

        servers = [u.strip() for u in (args.nats or "").split(",") if u.strip()]
        shown = strip_userinfo(args.nats or "")  # credentials in the URL are never printed
        if not servers or not all(_nats_url_ok(u) for u in servers):
            raise ConfigError(f"--nats {shown!r}: expected nats://HOST:PORT (comma-separated for several)")
        errors: list[str] = []
        gave_up = asyncio.Event()

        async def on_error(e: Exception) -> None:
            # nats-py keeps retrying a refused first connection whatever its options say: one error per server
            # tried is the answer, reported at once rather than after the overall bound
            if not gave_up.is_set():
                errors.append(_nats_why(e))
                if len(errors) >= len(servers):
                    gave_up.set()

        connecting = asyncio.ensure_future(
            nats.connect(
                servers,
                connect_timeout=5,
                allow_reconnect=False,
                max_reconnect_attempts=0,
                error_cb=on_error,
                **_nats_auth(args),
            )
        )
        failed = asyncio.ensure_future(gave_up.wait())
        await asyncio.wait({connecting, failed}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        failed.cancel()
        if not connecting.done():
            gave_up.set()
            connecting.cancel()
            with contextlib.suppress(BaseException):
                await connecting
            why = "; ".join(dict.fromkeys(errors)) or "no answer within 10 s"
            raise FetchError(f"NATS {shown}: cannot connect: {why}")
        if (err := connecting.exception()) is not None:
            raise FetchError(f"NATS {shown}: cannot connect: {_nats_why(err)}")
        nc = connecting.result()
        try:
            return await work(nc)
        finally:
            await nc.close()

    return asyncio.run(main())


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


# --- contracts ------------------------------------------------------------------------------------


def _issued_at(args: argparse.Namespace) -> int | None:
    """Reproducible issue time: --issued-at, $SOURCE_DATE_EPOCH, or the repository's HEAD commit time."""
    from sco.contract.compiler import issued_at_problem

    def checked(value: int, where: str) -> int:
        if why := issued_at_problem(value):
            raise ConfigError(f"{where} {value}: {why}")
        return value

    if args.issued_at is not None:
        return checked(int(args.issued_at), "--issued-at")
    if "SOURCE_DATE_EPOCH" in os.environ:
        try:
            value = int(os.environ["SOURCE_DATE_EPOCH"])
        except ValueError:
            raise ConfigError("$SOURCE_DATE_EPOCH: expected an integer") from None
        return checked(value, "$SOURCE_DATE_EPOCH")
    try:
        out = subprocess.run(
            ["git", "-C", str(args.repo), "log", "-1", "--format=%ct", "--", "."],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0 or not out.stdout.strip().isdigit():
        return None
    return checked(int(out.stdout.strip()), f"{args.repo}: git HEAD commit time")


def cmd_check(args: argparse.Namespace) -> int:
    from sco.contract.compiler import compile_repo

    payload = compile_repo(Path(args.repo))
    kinds = Counter(c["scheduler"] for c in payload["contracts"])
    summary = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    print(f"{args.repo}: hall {payload['hall']}: {len(payload['contracts'])} contracts ({summary}): ok")
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    from sco._fs import atomic_write
    from sco.contract.bundle import peek_payload
    from sco.contract.compiler import compile_repo
    from sco.contract.signing import load_private, sign

    keys = [load_private(Path(k)) for k in args.signing_key]
    out = Path(args.output)
    previous = None
    prev_path = Path(args.previous) if args.previous else out
    if prev_path.exists():
        previous = peek_payload(prev_path.read_bytes())
    payload = compile_repo(Path(args.repo), previous=previous, serial=args.serial, issued_at=_issued_at(args))
    raw = sign(payload, keys)
    unchanged = prev_path == out and out.exists() and out.read_bytes() == raw
    if not unchanged:
        atomic_write(out, raw)
    keyids = ",".join(k.keyid for k in keys)
    state = "unchanged" if unchanged else "written"
    print(
        f"{out}: hall {payload['hall']} serial {payload['serial']}: {len(payload['contracts'])} contracts, "
        f"{len(raw)} bytes, signed by {keyids} ({state})"
    )
    return 0


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: {e.strerror}") from None


def cmd_verify(args: argparse.Namespace) -> int:
    from sco.contract.bundle import Bundle, successor

    keyring = _keyring(args)
    bundle = Bundle.from_bytes(_read(args.bundle), keyring, args.bundle)
    if args.cached:
        cached = Bundle.from_bytes(_read(args.cached), keyring, args.cached)
        successor(cached, bundle)
    if args.min_serial is not None and bundle.serial < args.min_serial:
        from sco.errors import RollbackError

        raise RollbackError(f"{args.bundle}: serial {bundle.serial} is below --min-serial {args.min_serial}")
    age = bundle.age_seconds()
    age_s = f", issued {age / 86400:.1f} days ago" if age is not None else ""
    subset = " (launch subset)" if bundle.subset_of else ""
    print(
        f"{args.bundle}: ok: hall {bundle.hall} serial {bundle.serial}{subset}, "
        f"{len(bundle.contracts)} contracts, signed by {bundle.verified.keyid}{age_s}"
    )
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from sco.contract.bundle import Bundle

    bundle = Bundle.from_bytes(_read(args.bundle), _keyring(args), args.bundle)
    if args.contract:
        c = bundle.contracts.get(args.contract)
        if c is None:
            raise ConfigError(f"{args.bundle}: no contract named {args.contract!r}")
        print(json.dumps(c, indent=2, sort_keys=True))
        return 0
    print(f"hall {bundle.hall} serial {bundle.serial} digest {bundle.content_digest[:16]}")
    print(f"{'CONTRACT':28} {'SCHEDULER':10} {'TIER':4} {'BUDGET':>6} {'FINAL':>5}  SELECTOR")
    for name, c in sorted(bundle.contracts.items()):
        sel = c["selector"]
        where = sel.get("namespace") or f"account={sel.get('account')}"
        print(
            f"{name:28} {c['scheduler']:10} {c['tier']:<4} {c['drainBudgetSeconds']:>5}s "
            f"{c.get('finalWriteSeconds', 0):>4}s  {where}"
        )
    return 0


def _http_url_problem(value: str) -> str | None:
    """Why ``value`` is not one http(s) URL (None: it is)."""
    from urllib.parse import urlsplit

    if any(ord(c) <= 0x20 or ord(c) == 0x7F for c in value):
        return "whitespace or control characters in a URL"
    try:
        u = urlsplit(value)
        host = u.hostname
    except ValueError as e:
        return f"not a URL ({e})"
    if u.scheme not in ("http", "https") or not host:
        return "expected an http:// or https:// URL with a host, such as http://distributor:8470"
    return None


def cmd_user_data(args: argparse.Namespace) -> int:
    from sco.contract.bundle import Bundle
    from sco.contract.signing import load_private
    from sco.contract.userdata import render

    if args.distributor_url and (problem := _http_url_problem(args.distributor_url)):
        # it becomes a line of the node's agent.env: a newline in it would add settings of its own
        raise ConfigError(f"--distributor-url {args.distributor_url!r}: {problem}")
    keyring = _keyring(args)
    bundle = Bundle.from_bytes(_read(args.bundle), keyring, args.bundle)
    keys = [load_private(Path(k)) for k in args.signing_key]
    from sco.contract.signing import PublicKey, load_public

    trusted: list[PublicKey] = [load_public(Path(p)) for p in args.trust or []]
    if args.trust_dir:
        trusted += [load_public(p) for p in sorted(Path(args.trust_dir).glob("*.pub"))]
    # The agent's own settings (SCO_AGENT_<KEY>), read by its unit through EnvironmentFile=.
    env = {"SCO_AGENT_HALL": bundle.hall}
    if args.distributor_url:
        env["SCO_AGENT_BUNDLE_URL"] = f"{args.distributor_url.rstrip('/')}/v1/halls/{bundle.hall}/bundle.json"
    text = render(bundle, keys, trusted, schedulers=args.scheduler, names=args.contract, node_env=env)
    if args.output in (None, "-"):
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text)
        print(f"{args.output}: {len(text)} bytes of user-data for hall {bundle.hall} serial {bundle.serial}")
    return 0


def _distributor_root(args: argparse.Namespace) -> Path:
    if not args.root:  # Path("") is the current directory: never serve or publish into it by accident
        raise ConfigError("--root (or $SCO_DISTRIBUTOR_ROOT) is empty: give the distributor's directory")
    return Path(args.root)


def cmd_publish(args: argparse.Namespace) -> int:
    from sco.contract.distributor import bundle_path, publish

    root = _distributor_root(args)
    bundle = publish(_read(args.bundle), root, _keyring(args))
    print(f"published hall {bundle.hall} serial {bundle.serial} at {bundle_path(root, bundle.hall)}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from sco.contract.distributor import DistributorServer, parse_listen

    root = _distributor_root(args)
    if not root.is_dir():
        # serving would answer 404 to every node until someone noticed: say so now
        why = "not a directory" if root.exists() else "no such directory (sco contract publish creates it)"
        raise ConfigError(f"--root {root}: {why}")
    server = DistributorServer(root, parse_listen(args.listen), verbose=args.verbose)
    print(f"serving {args.root} at {server.url}/v1/halls/<hall>/bundle.json", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


# --- node side ------------------------------------------------------------------------------------


def cmd_fetch(args: argparse.Namespace) -> int:
    from sco.agent.bundle_cache import BundleCache, BundleFetcher

    if not args.url:
        raise ConfigError("no bundle URL: give --url or set $SCO_BUNDLE_URL")
    cache = BundleCache(Path(args.cache_dir), _keyring(args))
    fetcher = BundleFetcher(cache, args.url, max_bytes=args.max_bytes, deadline_s=args.deadline)
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


def cmd_slurm_render(args: argparse.Namespace) -> int:
    from sco.contract.bundle import Bundle
    from sco.schedulers.slurm_admission import render_lua, write

    keyring = _keyring(args)
    if not args.reclaimable_partition:
        raise ConfigError("name at least one --reclaimable-partition")
    out = Path(args.out_dir)
    if args.bundle:

        def load() -> Bundle:
            return Bundle.from_bytes(_read(args.bundle), keyring, args.bundle)

    elif args.url:
        from sco.agent.bundle_cache import BundleCache, BundleFetcher

        cache = BundleCache(Path(args.cache_dir), keyring)
        fetcher = BundleFetcher(cache, args.url)

        def load() -> Bundle:
            offer = fetcher.refresh()
            if offer.outcome in ("refused", "error"):
                print(f"sco: warning: {offer.outcome}: {offer.reason}; keeping serial {offer.serial}", file=sys.stderr)
            if cache.bundle is None:
                raise ConfigError(f"{args.url}: no verified bundle yet")
            return cache.bundle

    else:
        raise ConfigError("give a BUNDLE file or --url")
    while True:
        bundle = load()
        text = render_lua(bundle.hall, bundle.serial, bundle.contracts, args.reclaimable_partition)
        changed = write(out, text, bundle.serial)
        n = sum(1 for c in bundle.contracts.values() if c["scheduler"] == "slurm")
        print(
            f"{out}: serial {bundle.serial}, {n} slurm contracts, reclaimable {','.join(args.reclaimable_partition)}"
            f" ({'written' if changed else 'unchanged'})",
            flush=True,
        )
        if not args.watch:
            return 0
        time.sleep(args.interval)


# --- contracts into the cluster (issue 13: Kubernetes admission reads them) -----------------------


def cmd_publish_configmap(args: argparse.Namespace) -> int:
    from sco.contract.bundle import Bundle
    from sco.schedulers.kube_contracts import KubeConfigMaps, configmap, publish

    keyring = _keyring(args)
    if bool(args.bundle) == bool(args.url):
        raise ConfigError("give a BUNDLE file or --url (the distributor's bundle URL), not both")
    if args.url:
        from sco.agent.bundle_cache import BundleCache, BundleFetcher

        cache = BundleCache(Path(args.cache_dir), keyring)
        fetcher = BundleFetcher(cache, args.url)

        def load() -> Bundle:
            offer = fetcher.refresh()
            if offer.outcome in ("refused", "error"):
                print(f"sco: warning: {offer.outcome}: {offer.reason}; keeping serial {offer.serial}", file=sys.stderr)
            if cache.bundle is None:
                raise ConfigError(f"{args.url}: no verified bundle yet")
            return cache.bundle

    else:

        def load() -> Bundle:
            return Bundle.from_bytes(_read(args.bundle), keyring, args.bundle)

    if args.output:
        cm = configmap(load(), args.namespace, args.name)
        text = json.dumps(cm, indent=2, sort_keys=True) + "\n"
        if args.output == "-":
            sys.stdout.write(text)
        else:
            Path(args.output).write_text(text)
            print(f"{args.output}: configmap {args.namespace}/{args.name} for serial {cm['data']['_serial']}")
        return 0
    if not args.kube_url:
        raise ConfigError("no Kubernetes API: give --kube-url (or $SCO_KUBE_URL), or --output to write the manifest")
    api = KubeConfigMaps(
        args.kube_url,
        token_file=Path(args.token_file) if args.token_file else None,
        ca_file=Path(args.ca_file) if args.ca_file else None,
    )
    while True:
        result = publish(api, load(), args.namespace, args.name)
        print(
            json.dumps(
                {"configmap": f"{args.namespace}/{args.name}", "outcome": result.outcome, "serial": result.serial}
            ),
            flush=True,
        )
        if not args.watch:
            return 0
        time.sleep(args.interval)


def _add_publish_configmap(cs: Any) -> None:
    x = cs.add_parser(
        "publish-configmap", help="publish the bundle's contracts into the cluster as the ConfigMap admission reads"
    )
    x.add_argument("bundle", nargs="?", help="bundle file (or --url)")
    x.add_argument("--url", default=_env("SCO_BUNDLE_URL"), help="fetch from the distributor [$SCO_BUNDLE_URL]")
    x.add_argument("--cache-dir", default=_env("SCO_CACHE_DIR", "/var/lib/sco/bundle"))
    _add_trust(x)
    x.add_argument("--kube-url", default=_env("SCO_KUBE_URL"), help="Kubernetes API URL [$SCO_KUBE_URL]")
    x.add_argument("--token-file", default=_env("SCO_KUBE_TOKEN_FILE"), help="bearer token [$SCO_KUBE_TOKEN_FILE]")
    x.add_argument("--ca-file", default=_env("SCO_KUBE_CA_FILE"), help="API server CA [$SCO_KUBE_CA_FILE]")
    x.add_argument("--namespace", default=_env("SCO_CONTRACTS_NAMESPACE", "sco-system"))
    x.add_argument("--name", default=_env("SCO_CONTRACTS_CONFIGMAP", "sco-contracts"))
    x.add_argument("-o", "--output", help="write the ConfigMap manifest (JSON) here instead ('-': stdout)")
    x.add_argument("--watch", action="store_true", help="keep publishing as the bundle changes")
    x.add_argument("--interval", type=float, default=60.0)
    x.set_defaults(func=cmd_publish_configmap)


def cmd_demo(args: argparse.Namespace) -> int:
    from sco.demo import run_demo

    return run_demo(Path(args.workdir) if args.workdir else None)


# --- fleet state and the provider (sco db, sco reclaim) ---------------------------------------------


def cmd_db_migrate(args: argparse.Namespace) -> int:
    from sco.state.db import applied, check_dsn, connect, dsn_from_env, migrate, migrations

    if args.embedded:
        from sco.state.embedded import EmbeddedPostgres

        pg = EmbeddedPostgres(Path(args.embedded), port=args.port)
        if not (pg.pgdata / "postmaster.pid").exists():
            pg.start()
        dsn = pg.dsn()
        print(f"embedded PostgreSQL in {args.embedded}: {describe_dsn(dsn)}")
    else:
        dsn = dsn_from_env(args.dsn)
        check_dsn(dsn, "--dsn" if args.dsn else "$SCO_DB_DSN")
    if args.check:
        # What a real run would apply, applying nothing (the fleet_state role's check mode).
        with connect(dsn) as conn:
            have = applied(conn)
        todo = [m for m in migrations() if m.version not in have]
        for m in todo:
            print(f"would apply {m.version:04d}_{m.name}")
        print("fleet state up to date" if not todo else f"{len(todo)} migration(s) pending")
        return 0
    with connect(dsn) as conn:
        done = migrate(conn)
    for m in done:
        print(f"applied {m.version:04d}_{m.name}")
    print("fleet state up to date" if not done else f"{len(done)} migration(s) applied")
    return 0


def _cloud(name: str | None) -> Any:
    import openstack

    try:
        return openstack.connect(cloud=name) if name else openstack.connect()
    except Exception as e:
        raise ConfigError(f"OpenStack cloud {name or '(from OS_* variables)'}: {e}") from None


def cmd_reclaim(args: argparse.Namespace) -> int:
    import asyncio

    from sco.provider.reclaimer import Reclaimer, window_problem
    from sco.state.db import dsn_from_env
    from sco.state.fleet import FleetState

    if not args.nats:
        raise ConfigError("no notice relay: give --nats URL or set $SCO_NATS_URL")
    if (problem := window_problem("--window", args.window)) is not None:
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
    if not key_files:
        raise ConfigError(
            "no notice key: give --notice-key KEY or set $SCO_NOTICE_KEY (agents refuse unsigned notices)"
        )
    keys = [load_private(Path(k)) for k in key_files]

    async def go() -> int:
        with FleetState(dsn_from_env(args.dsn), application="sco reclaim") as st, st.writer(args.hall, args.lock_wait):
            r = Reclaimer(
                _cloud(args.os_cloud), st, args.nats, window_s=args.window, signing_keys=keys,
                nats_auth=_nats_auth(args),
            )  # fmt: skip
            try:
                for rc in await r.notify(args.hall, args.nodes):
                    sent = "published" if rc.published_at else "NOT published (relay down; metadata only)"
                    print(f"{rc.instance.name}: notice {rc.notice['id']} {sent}, deleted at {rc.terminate_at:.3f}")
                if not args.no_wait:
                    await r.run(args.hall)
                    for rc in r.reclaims.values():
                        inst = st.instance(rc.instance.id)
                        print(f"{inst.name}: {inst.state} (agent: {rc.agent_state or 'no account'})")
            finally:
                await r.close()
        return 0

    return asyncio.run(go())


def _add_fleet_commands(sub: Any) -> None:
    db = sub.add_parser("db", help="the fleet state (PostgreSQL)")
    dbs = db.add_subparsers(dest="db_command", required=True)
    x = dbs.add_parser("migrate", help="apply the schema migrations not yet applied, in order")
    x.add_argument("--dsn", default=_env("SCO_DB_DSN"), help="libpq connection string [$SCO_DB_DSN]")
    x.add_argument("--embedded", metavar="DIR", help="start (if needed) an embedded PostgreSQL in DIR and use it")
    x.add_argument("--port", type=int, default=5433, help="the embedded server's port (with --embedded)")
    x.add_argument("--check", action="store_true", help="list the migrations a run would apply; apply none")
    x.set_defaults(func=cmd_db_migrate)

    x = sub.add_parser("reclaim", help="take instances back: notice now, delete at T+window")
    x.add_argument("--hall", required=True)
    x.add_argument("nodes", nargs="+", metavar="NODE", help="instance (node) names")
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
    x.add_argument("--no-wait", action="store_true", help="send the notices and return (a later run deletes)")
    x.set_defaults(func=cmd_reclaim)


# --- parser ---------------------------------------------------------------------------------------


# --- plan (issue 11: the portfolio planner) --------------------------------------------------------


def cmd_plan(args: argparse.Namespace) -> int:
    import yaml

    from sco.contract.bundle import Bundle
    from sco.control.inputs import contracts_from_bundle, parse, plan_input
    from sco.control.planner import plan

    bundle = Bundle.from_bytes(_read(args.bundle), _keyring(args), args.bundle)
    try:
        doc = yaml.safe_load(_read(args.input))
    except yaml.YAMLError as e:
        raise ConfigError(f"{args.input}: not YAML/JSON: {e}") from None
    inp = plan_input(parse(doc, args.input), contracts_from_bundle(bundle.contracts), time.time())
    result = plan(inp)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, sort_keys=True))
        return 0
    print(f"{'pool':<24} {'kind':<12} {'now':>5} {'target':>6} {'launch':>6} {'delete':>6}  subset")
    for x in result.pools:
        print(
            f"{x.pool:<24} {x.kind:<12} {x.current:>5} {x.target:>6} {x.launch:>6} {len(x.delete):>6}  "
            f"{','.join(x.launch_contracts)}"
        )
    for name, milli in sorted(result.shortfall_milli.items()):
        print(f"shortfall {name}: {milli / 1000:g} units (for the fallback arbiter)")
    print(f"plan {result.digest[:16]}: {'changes' if result.changed else 'unchanged'}")
    if args.explain:
        print()
        for line in result.explain():
            print(line)
    return 0


def _plan_subcommand(sub: Any) -> None:
    x = sub.add_parser("plan", help="the portfolio planner: target instances per pool, every decision explained")
    x.add_argument("--input", required=True, metavar="FILE", help="pools, settings, reservations, fleet, demand")
    x.add_argument("--bundle", default=_env("SCO_BUNDLE"), required=_env("SCO_BUNDLE") is None, help="[$SCO_BUNDLE]")
    _add_trust(x)
    x.add_argument("--explain", action="store_true", help="print every decision with its reason")
    x.add_argument("--json", action="store_true", help="the whole plan as JSON")
    x.set_defaults(func=cmd_plan)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sco", description="Spot Capacity Orchestrator")
    p.add_argument("--version", action="version", version=f"sco {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    k = sub.add_parser("keygen", help="create an Ed25519 signing key pair")
    k.add_argument("--out-dir", default=_env("SCO_KEY_DIR", "."), help="where to write NAME.key/NAME.pub")
    k.add_argument("--name", help="file name stem (default: the key id)")
    k.add_argument(
        "--for",
        dest="purpose",
        choices=["bundle", "notice"],
        default="bundle",
        help="notice: also print the hall policy's noticeKeys entry",
    )
    k.set_defaults(func=cmd_keygen)

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

    c = sub.add_parser("contract", help="compile, sign, verify and distribute contract bundles")
    cs = c.add_subparsers(dest="contract_command", required=True)

    x = cs.add_parser("check", help="validate a contract repository (every problem at once)")
    x.add_argument("repo")
    x.set_defaults(func=cmd_check)

    x = cs.add_parser("compile", help="compile and sign a contract repository into a bundle")
    x.add_argument("repo")
    x.add_argument("-o", "--output", required=True, help="bundle file to write")
    x.add_argument(
        "--signing-key", action="append", required=True, metavar="KEY", help="private key (repeat to rotate)"
    )
    x.add_argument("--previous", help="previous bundle to continue the serial from (default: --output)")
    x.add_argument("--serial", type=int, help="explicit serial (must exceed the previous one)")
    x.add_argument("--issued-at", type=int, help="issue time, epoch seconds (default: git HEAD time)")
    x.set_defaults(func=cmd_compile)

    x = cs.add_parser("verify", help="verify a bundle's signature, form and serial")
    x.add_argument("bundle")
    _add_trust(x)
    x.add_argument("--cached", help="bundle the node holds now: refuse a rollback against it")
    x.add_argument("--min-serial", type=int, help="refuse a bundle below this serial")
    x.set_defaults(func=cmd_verify)

    x = cs.add_parser("show", help="list a verified bundle's contracts, or one contract")
    x.add_argument("bundle")
    _add_trust(x)
    x.add_argument("--contract")
    x.set_defaults(func=cmd_show)

    x = cs.add_parser("user-data", help="render cloud-init user-data carrying a signed launch subset")
    x.add_argument("bundle")
    _add_trust(x)
    x.add_argument("--signing-key", action="append", required=True, metavar="KEY")
    x.add_argument("--scheduler", action="append", choices=["kubernetes", "spark", "slurm"])
    x.add_argument("--contract", action="append", metavar="NAME")
    x.add_argument("--distributor-url", default=_env("SCO_DISTRIBUTOR_URL"))
    x.add_argument("-o", "--output")
    x.set_defaults(func=cmd_user_data)

    x = cs.add_parser("publish", help="verify a bundle and publish it under the distributor's root")
    x.add_argument("bundle")
    x.add_argument("--root", required=True, default=_env("SCO_DISTRIBUTOR_ROOT"))
    _add_trust(x)
    x.set_defaults(func=cmd_publish)

    x = cs.add_parser("serve", help="serve published bundles over HTTP (ETag / If-None-Match)")
    x.add_argument("--root", default=_env("SCO_DISTRIBUTOR_ROOT", "/var/lib/sco/distributor"))
    x.add_argument("--listen", default=_env("SCO_DISTRIBUTOR_LISTEN", "127.0.0.1:8470"))
    x.add_argument("-v", "--verbose", action="store_true")
    x.set_defaults(func=cmd_serve)

    _add_publish_configmap(cs)

    n = sub.add_parser("node", help="node-side bundle cache")
    ns = n.add_subparsers(dest="node_command", required=True)
    x = ns.add_parser("fetch-bundle", help="fetch, verify and cache the hall's bundle")
    x.add_argument("--url", default=_env("SCO_BUNDLE_URL"))
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

    sl = sub.add_parser("slurm", help="Slurm admission glue")
    sls = sl.add_subparsers(dest="slurm_command", required=True)
    x = sls.add_parser("render-contracts", help="render the verified bundle for job_submit.lua (atomically)")
    x.add_argument("bundle", nargs="?", help="bundle file (or --url)")
    x.add_argument("--url", default=_env("SCO_BUNDLE_URL"), help="fetch from the distributor [$SCO_BUNDLE_URL]")
    x.add_argument("--cache-dir", default=_env("SCO_CACHE_DIR", "/var/lib/sco/bundle"))
    _add_trust(x)
    x.add_argument("--out-dir", default=_env("SCO_SLURM_DIR", "/etc/slurm"), help="beside slurm.conf")
    x.add_argument("--reclaimable-partition", action="append", metavar="NAME", help="repeatable")
    x.add_argument("--watch", action="store_true")
    x.add_argument("--interval", type=float, default=60.0)
    x.set_defaults(func=cmd_slurm_render)

    _plan_subcommand(sub)

    d = sub.add_parser("demo", help="the main job on the embedded local hall")
    d.add_argument("--workdir", help="keep the demo's files here (default: a temporary directory)")
    d.set_defaults(func=cmd_demo)
    _add_fleet_commands(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Handler = args.func
    try:
        return func(args)
    except ScoError as e:
        for line in e.lines():
            print(f"sco: error: {line}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader went away (| head): nothing more to say; keep Python from complaining while it flushes
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as e:  # a path that cannot be read or written, a port in use: one line naming it
        where = f"{e.filename}: " if e.filename else ""
        print(f"sco: error: {where}{e.strerror or e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
