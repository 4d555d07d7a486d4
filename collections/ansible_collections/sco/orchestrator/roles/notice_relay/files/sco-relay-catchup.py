"""A relay of a cluster in operator mode catches up with its peers' account JWTs before it starts (the relay unit's
ExecStartPre; role notice_relay, notice_relay_auth_mode: operator, two relays or more).

An account JWT pushed while this relay was down (or cut off) reached only its peers: a node revoked then would still
be admitted here after a restart, because nats-server's own resolver sync asks a queue group that the asking server
answers itself first (2.15: the revoked node was still admitted minutes later). So before the server starts, this
asks each peer for every account JWT it holds (``$SYS.REQ.CLAIMS.PACK``, as the system account's ``relay-sync``
user, which may do nothing else) and writes into the resolver's directory each one newer than the one there, as the
server's own merge does (the same ``jti`` or an older ``iat`` is kept). The server checks every JWT's signature when
it loads it: a forged one is refused there, whatever lies in the directory.

One peer's whole store is enough (each holds every pushed JWT it saw); peers are asked in turn until one answers, each
within --timeout. None answering (the first relay of a cluster starting, every relay down) is said and is not an
error: the relay starts with what it has. Prints one JSON line: {"peer": url or "", "written": n, "kept": n}.

The peers serve TLS only: --ca-file is the hall's CA their certificates must chain to (the connection is the
product's, sco._nats, run with the relay's venv).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import pwd
import re
import sys
from pathlib import Path
from typing import Any

from sco import _nats

PACK = "$SYS.REQ.CLAIMS.PACK"
ACCOUNT = re.compile(r"A[A-Z2-7]{55}")


def claims(token: str) -> dict[str, Any]:
    payload = token.split(".")[1]
    return dict(json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))))


def newer(token: str, path: Path) -> bool:
    """Whether ``token`` would replace the JWT in ``path``, by the server's rule (saveIfNewer)."""
    try:
        have = claims(path.read_text().strip())
    except FileNotFoundError:
        return True
    except (ValueError, IndexError):
        return True  # a damaged file: the server could not use it either
    new = claims(token)
    return have.get("jti") != new.get("jti") and int(have.get("iat", 0)) <= int(new.get("iat", 0))


async def pack(server: str, creds: str, timeout: float, ca_file: str | None = None) -> dict[str, str]:
    """Every account JWT ``server`` holds: one message per JWT (``<account>|<jwt>``), an empty one ends them."""

    async def quiet(e: Exception) -> None:  # said once, by the caller
        pass

    nc = await _nats.connect(
        [server], auth=_nats.auth_options(creds_file=creds, ca_file=ca_file), deadline_s=timeout,
        connect_timeout=timeout, error_cb=quiet,
    )  # fmt: skip
    got: dict[str, str] = {}
    done = asyncio.Event()
    try:
        inbox = nc.new_inbox()

        async def take(msg: Any) -> None:
            if not msg.data:
                done.set()
                return
            for line in msg.data.decode().splitlines():
                account, token = line.partition("|")[::2]
                if ACCOUNT.fullmatch(account) and token:
                    got[account] = token

        await nc.subscribe(inbox, cb=take)
        # a hash no store has: the peer answers with its whole store
        await nc.publish(PACK, bytes(32), reply=inbox)
        await asyncio.wait_for(done.wait(), timeout)
        return got
    finally:
        await nc.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--creds", required=True, help="the relay-sync user's creds file")
    p.add_argument("--resolver-dir", required=True, help="the full resolver's directory (nats-server.conf)")
    p.add_argument("--peer", action="append", default=[], help="a peer relay's client URL (repeat)")
    p.add_argument("--owner", default="", help="the user the server runs as (the files are made its own)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds for each peer")
    p.add_argument("--ca-file", default="", help="the hall's CA the peers' TLS certificates must chain to")
    args = p.parse_args()
    if not Path(args.creds).is_file():
        sys.exit(f"sco-relay-catchup: {args.creds}: no creds file")
    directory = Path(args.resolver_dir)
    directory.mkdir(parents=True, exist_ok=True, mode=0o750)
    owner = pwd.getpwnam(args.owner) if args.owner else None
    for peer in args.peer:
        try:
            store = asyncio.run(pack(peer, args.creds, args.timeout, args.ca_file or None))
        except Exception as e:  # a peer down or starting too: the next one
            print(f"sco-relay-catchup: {peer}: {e or type(e).__name__}", file=sys.stderr)
            continue
        written = 0
        for account, token in sorted(store.items()):
            path = directory / f"{account}.jwt"
            if not newer(token, path):
                continue
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_text(token)
            tmp.chmod(0o640)
            if owner:
                os.chown(tmp, owner.pw_uid, owner.pw_gid)
            os.replace(tmp, path)
            written += 1
        print(json.dumps({"peer": peer, "written": written, "kept": len(store) - written}))
        return
    print(json.dumps({"peer": "", "written": 0, "kept": 0, "why": "no peer answered: starting with what is here"}))


if __name__ == "__main__":
    main()
