"""``sco contract ...``: compile, sign, verify, show and distribute contract bundles (HTTP, cloud-init, ConfigMap)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from sco.cli._common import _add_bundle_ca, _add_trust, _bundle_from_url, _env, _keyring, _read
from sco.errors import ConfigError


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
    delegation = None
    if args.delegation:  # the launch key's: the instance trusts the root that signed it (--trust), not the key
        from sco.contract.signing import Delegation

        delegation = Delegation.load(Path(args.delegation), keyring)
    text = render(
        bundle, keys, trusted, schedulers=args.scheduler, names=args.contract, node_env=env, delegation=delegation
    )
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
    tls = None
    if args.tls_cert or args.tls_key:
        from sco._tls import ServerTls, TlsSettingError

        try:
            tls = ServerTls(args.tls_cert, args.tls_key)
        except TlsSettingError as e:
            raise ConfigError(f"--tls-cert/--tls-key: {e}") from None
    server = DistributorServer(root, parse_listen(args.listen), verbose=args.verbose, tls=tls)
    print(f"serving {args.root} at {server.url}/v1/halls/<hall>/bundle.json", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


# --- contracts into the cluster (issue 13: Kubernetes admission reads them) -----------------------


def cmd_publish_configmap(args: argparse.Namespace) -> int:
    from sco.contract.bundle import Bundle
    from sco.schedulers.kube_contracts import KubeConfigMaps, configmap, publish

    if not 1.0 <= args.interval <= 86_400:  # 0 with --watch: a busy loop on the API server (nan compares false)
        raise ConfigError(f"--interval {args.interval}: expected 1 to 86400 seconds")
    keyring = _keyring(args)
    if bool(args.bundle) == bool(args.url):
        raise ConfigError("give a BUNDLE file or --url (the distributor's bundle URL), not both")
    if args.url:
        load = _bundle_from_url(args.url, Path(args.cache_dir), keyring, args.bundle_ca_file)

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


def register(sub: Any) -> None:
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
    x.add_argument("--delegation", metavar="FILE", help="the root's delegation for the --signing-key (sco delegate)")
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

    x = cs.add_parser("serve", help="serve published bundles over HTTPS or HTTP (ETag / If-None-Match)")
    x.add_argument("--root", default=_env("SCO_DISTRIBUTOR_ROOT", "/var/lib/sco-distributor"))
    x.add_argument("--listen", default=_env("SCO_DISTRIBUTOR_LISTEN", "127.0.0.1:8470"))
    x.add_argument(
        "--tls-cert",
        default=_env("SCO_DISTRIBUTOR_TLS_CERT"),
        help="serve TLS only, with this certificate (PEM, its chain after it; read again when it changes)"
        " [$SCO_DISTRIBUTOR_TLS_CERT]",
    )
    x.add_argument("--tls-key", default=_env("SCO_DISTRIBUTOR_TLS_KEY"), help="its key [$SCO_DISTRIBUTOR_TLS_KEY]")
    x.add_argument("-v", "--verbose", action="store_true")
    x.set_defaults(func=cmd_serve)

    _add_publish_configmap(cs)


def _add_publish_configmap(cs: Any) -> None:
    x = cs.add_parser(
        "publish-configmap", help="publish the bundle's contracts into the cluster as the ConfigMap admission reads"
    )
    x.add_argument("bundle", nargs="?", help="bundle file (or --url)")
    x.add_argument("--url", default=_env("SCO_BUNDLE_URL"), help="fetch from the distributor [$SCO_BUNDLE_URL]")
    _add_bundle_ca(x)
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
