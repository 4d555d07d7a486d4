"""The notice relay in operator mode, on the controller: the hall's keys, the users' creds, the relay's configuration
and the push of its accounts to the running relay (role notice_relay, notice_relay_auth_mode: operator).

Runs with the Python that runs Ansible (``ansible_playbook_python``: the project's venv), which has
spot-capacity-orchestrator: everything signed here is minted by ``sco.provider.relay_identity``.

- ``issue``: the hall's operator, system and account keys (``<dir>/operator/<name>.nk``, 0600, made on first use;
  the operator's, notices' and events' public keys beside them, ``<name>.pub``, for the enrolment service) and one
  creds file per user (``<dir>/<user>.creds``, 0600): the reclaimers, the readers, ``relay-admin`` (the stream tool),
  ``relay-sync`` (a cluster's relay catching up with its peers before it starts: ``sco-relay-catchup.py``) and
  ``node-<node>`` for each node of the inventory, each user's key being its seed ``<dir>/<user>.nk`` (the one
  the static mode's nkey lookup makes). A node's account is its own (``SCO_NODE_<node>``), kept across runs
  (the creds name it). Prints ``{"changed": [files]}``.
- ``config``: nats-server.conf (``relay_identity.server_config``: operator JWT, system account, full resolver with
  the hall's accounts preloaded) with the inventory nodes' accounts preloaded too. The relay's current configuration
  on stdin: a JWT whose claims did not change is kept as it is there (same ``iat``), so a second run renders the
  same file. Prints ``{"config": text, "restart_digest": sha256 of what only a restart applies}``: everything but
  the preloaded accounts, which a push applies to the running relay. ``--route`` (two or more, every relay of the
  hall's cluster): a ``cluster {}`` block whose routes are TLS, each side showing a certificate the hall's CA signed
  (``--tls-cert``, ``--tls-key``, ``--tls-ca``: paths on the relay); no shared secret. ``--tls-*`` alone: clients
  over TLS only.
- ``push``: the accounts preloaded in the configuration on stdin, pushed to the running relay
  (``$SYS.REQ.CLAIMS.UPDATE``, as the system account's issuer user, from the keys here): no restart, no reload.
  ``--if-running``: a relay that refuses the TCP connection (not started yet) is skipped; it loads them from its
  configuration when it starts. Prints ``{"pushed": n}`` or ``{"pushed": 0, "skipped": why}``.

``--check``: nothing is written; keys and seeds not there yet are made in memory only, to say what would change.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import os
import re
import socket
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

try:
    from sco._fs import atomic_write
    from sco.errors import ScoError
    from sco.provider import relay_identity as ri
except ImportError as e:  # pragma: no cover - the controller's Python is not the project's
    sys.exit(f"sco-relay-operator: {sys.executable} lacks spot-capacity-orchestrator ({e}): run Ansible from its venv")

PRELOAD = "resolver_preload {\n"
JWT = re.compile(r"eyJ[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+")
PRELOADED = re.compile(r"^\s+(A[A-Z2-7]{55}): (eyJ\S+)$", re.M)


# --- files ------------------------------------------------------------------------------------------------------


def write(path: Path, data: bytes, check: bool, changed: list[str]) -> None:
    """``path`` holds ``data`` (0600) afterwards; its name is added to ``changed`` when it did not already."""
    if path.exists() and path.read_bytes() == data:
        return
    changed.append(str(path))
    if not check:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        atomic_write(path, data, 0o600)


def user_key(path: Path, check: bool, changed: list[str]) -> ri.NKey:
    """The user seed in ``path``, made on first use as the role's nkey lookup makes it (the first writer wins)."""
    if not path.exists():
        changed.append(str(path))
        key = ri.NKey.generate("user")
        if check:
            return key
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key.seed + b"\n")
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    seed = path.read_bytes().strip()
    if not seed.startswith(b"SU"):
        sys.exit(f"sco-relay-operator: {path} holds no NATS user seed (SU...)")
    return ri.NKey.from_seed(seed)


def hall_keys(args: argparse.Namespace, changed: list[str]) -> ri.HallKeys:
    """The hall's keys from ``<dir>/operator`` (made on first use; in check mode in memory only), with the role's
    stream names."""
    where = Path(args.dir) / "operator"
    names = ("operator", "operator-signer", "system", "notices", "events", "node-issuer", "system-admin")
    missing = [str(where / f"{n}.nk") for n in names if not (where / f"{n}.nk").exists()]
    changed += missing
    # in check mode, keys not made yet are made in memory only
    keys = ri.HallKeys.generate(args.hall) if missing and args.check else ri.HallKeys.ensure(where, args.hall)
    return dataclasses.replace(keys, stream=args.stream, heartbeat_stream=args.heartbeat_stream)


# --- JWTs: keep what was issued while its claims hold -----------------------------------------------------------


def _claims(token: str) -> dict[str, Any]:
    return {k: v for k, v in ri.decode_jwt(token).items() if k not in ("iat", "jti")}


def kept(token: str, before: str) -> str:
    """``before`` if it says what ``token`` says (only its issue time and id differ), else ``token``."""
    try:
        return before if before and _claims(before) == _claims(token) else token
    except Exception:  # not a JWT any more (a damaged file): the new one
        return token


def keep_unchanged(text: str, previous: str) -> str:
    """``text`` with each JWT replaced by the one about the same subject in ``previous`` when only its issue time
    differs: the same claims render the same file, and the relay keeps what it already holds."""
    before = {ri.decode_jwt(t).get("sub"): t for t in JWT.findall(previous)}
    return JWT.sub(lambda m: kept(m.group(0), before.get(ri.decode_jwt(m.group(0)).get("sub"), "")), text)


def read_creds(path: Path) -> tuple[str, str]:
    """The user JWT and the seed of a creds file ("" for each when there is none)."""
    if not path.exists():
        return "", ""
    text = path.read_text()
    jwt = JWT.search(text)
    seed = re.search(r"\bSU[A-Z2-7]{56}\b", text)
    return (jwt.group(0) if jwt else ""), (seed.group(0) if seed else "")


def node_account(creds: Path) -> str:
    """The account of an inventory node: the one its creds name, else a new one (its seed is dropped, as at
    enrolment: the operator's signing key signs the account, the node issuer its user)."""
    token, _seed = read_creds(creds)
    account = str(ri.decode_jwt(token).get("nats", {}).get("issuer_account", "")) if token else ""
    return account if ri.is_public_key(account, "account") else ri.NKey.generate("account").public


def node_user_jwt(keys: ri.HallKeys, node: str, account: str, user: str) -> str:
    """As ``relay_identity.enrol`` mints it: a scoped user of the node's account, no permissions of its own."""
    return ri.encode_jwt(keys.node_issuer, user, {"type": "user", "issuer_account": account}, name=f"node-{node}")


# --- commands ---------------------------------------------------------------------------------------------------


def issue(args: argparse.Namespace) -> dict[str, Any]:
    changed: list[str] = []
    keys = hall_keys(args, changed)
    d = Path(args.dir)
    # the public halves beside the seeds: the enrolment service (role control_loop) gets the seeds it signs with
    # and only these of the keys it never signs with
    for name in ("operator", "notices", "events"):
        write(d / "operator" / f"{name}.pub", f"{getattr(keys, name).public}\n".encode(), args.check, changed)
    minted = {
        **{u: (lambda pub, u=u: ri.reclaimer_user_jwt(keys, pub, u)) for u in args.reclaimer},
        **{u: (lambda pub, u=u: ri.reader_user_jwt(keys, pub, u)) for u in args.reader},
        "relay-admin": lambda pub: ri.stream_admin_user_jwt(keys, pub),
        "relay-sync": lambda pub: ri.sync_user_jwt(keys, pub),
    }
    for node in args.node:
        account = node_account(d / f"node-{node}.creds")
        minted[f"node-{node}"] = lambda pub, node=node, account=account: node_user_jwt(keys, node, account, pub)
    for user, mint in minted.items():
        key = user_key(d / f"{user}.nk", args.check, changed)
        before, _before_seed = read_creds(d / f"{user}.creds")
        write(d / f"{user}.creds", ri.creds(kept(mint(key.public), before), key.seed).encode(), args.check, changed)
    return {"changed": changed}


def config(args: argparse.Namespace) -> dict[str, Any]:
    keys = hall_keys(args, [])
    d = Path(args.dir)
    cluster = None
    tls = ri.RelayTls(args.tls_cert, args.tls_key, args.tls_ca) if args.tls_cert else None
    if args.route:
        if tls is None:
            sys.exit(
                "sco-relay-operator: a cluster's routes prove themselves by certificate: "
                "give --tls-cert, --tls-key and --tls-ca"
            )
        cluster = ri.Cluster(
            name=args.cluster_name or args.hall, listen=args.cluster_listen, routes=args.route, tls=tls
        )
    text = ri.server_config(
        keys, resolver_dir=Path(args.resolver_dir), store_dir=Path(args.store_dir), listen=args.listen,
        port=args.port, monitor_port=args.monitor_port, server_name=args.server_name,
        max_memory_store=args.max_memory_store, max_file_store=args.max_file_store, cluster=cluster, tls=tls,
    )  # fmt: skip
    head, sep, preload = text.partition(PRELOAD)
    if not sep or not preload.endswith("\n}\n"):
        sys.exit("sco-relay-operator: relay_identity.server_config no longer ends with its resolver_preload block")
    # the inventory's nodes: their accounts preloaded beside the hall's (the relay knows them from its start)
    nodes = [
        f"  {a}: {ri.node_account_jwt(keys, n, a)}\n" for n in args.node for a in [node_account(d / f"node-{n}.creds")]
    ]
    text = keep_unchanged(head + sep + preload[:-2] + "".join(nodes) + "}\n", sys.stdin.read())
    text = "# Managed by role sco.orchestrator.notice_relay (operator mode): do not edit.\n" + text
    static = text.partition(PRELOAD)[0]
    return {"config": text, "restart_digest": hashlib.sha256(static.encode()).hexdigest()}


def push(args: argparse.Namespace) -> dict[str, Any]:
    accounts = PRELOADED.findall(sys.stdin.read().partition(PRELOAD)[2])
    if not accounts:
        sys.exit("sco-relay-operator: push: no preloaded account in the configuration on stdin")
    url = urlsplit(args.server)
    try:
        socket.create_connection((url.hostname or "127.0.0.1", url.port or 4222), timeout=args.timeout).close()
    except ConnectionRefusedError:
        if args.if_running:
            return {"pushed": 0, "skipped": f"{args.server} not running: it loads them from its configuration"}
        raise
    keys = hall_keys(args, [])

    async def run() -> int:
        admin = await ri.RelayAdmin.connect(args.server, keys, timeout=args.timeout, tls_ca_file=args.ca_file or None)
        try:
            return await admin.push_many(token for _account, token in accounts)
        finally:
            await admin.close()

    return {"pushed": asyncio.run(run())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["issue", "config", "push"])
    p.add_argument("--dir", required=True, help="the controller's credentials directory of the relay")
    p.add_argument("--hall", required=True)
    p.add_argument("--stream", default=ri.STREAM)
    p.add_argument("--heartbeat-stream", default=ri.HEARTBEAT_STREAM, help='"" for none')
    p.add_argument("--node", action="append", default=[], help="a node of the inventory (repeat)")
    p.add_argument("--reclaimer", action="append", default=[], help="a user that publishes notices (repeat)")
    p.add_argument("--reader", action="append", default=[], help="a user that reads the events (repeat)")
    p.add_argument("--server-name", default="")
    p.add_argument("--listen", default="0.0.0.0")
    p.add_argument("--port", type=int, default=4222)
    p.add_argument("--monitor-port", type=int, default=8222)
    p.add_argument("--store-dir", default="/var/lib/sco-nats")
    p.add_argument("--resolver-dir", default="/var/lib/sco-nats/accounts")
    p.add_argument("--max-memory-store", default="64M")
    p.add_argument("--max-file-store", default="1G")
    p.add_argument("--route", action="append", default=[], help="config: a relay of the cluster, host:port (repeat)")
    p.add_argument("--cluster-name", default="", help="config: the cluster's name (default: the hall)")
    p.add_argument("--cluster-listen", default="0.0.0.0:6222", help="config: where routes connect, host:port")
    p.add_argument(
        "--tls-cert", default="", help="config: the relay's certificate (on the relay); clients over TLS only"
    )
    p.add_argument("--tls-key", default="", help="config: the relay's key (on the relay)")
    p.add_argument("--tls-ca", default="", help="config: the CA the relay trusts for routes (on the relay)")
    p.add_argument("--ca-file", default="", help="push: the hall's CA the relay's certificate must chain to (here)")
    p.add_argument("--server", default="nats://127.0.0.1:4222", help="push: the relay's client URL")
    p.add_argument("--if-running", action="store_true", help="push: skip a relay that is not running")
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--check", action="store_true", help="write nothing; say what would change")
    args = p.parse_args()
    try:
        print(json.dumps({"issue": issue, "config": config, "push": push}[args.command](args)))
    except (ScoError, OSError) as e:
        sys.exit(f"sco-relay-operator: {args.command}: {e}")


if __name__ == "__main__":
    main()
