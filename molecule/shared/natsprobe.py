"""Real NATS clients against a converged relay, run inside the relay host's network namespace by the verify tests:
what each user may and may not do. Prints one JSON object: for each probe, what the server answered.

    ip netns exec NS python natsprobe.py --server nats://127.0.0.1:4222 --credentials DIR --hall H --node A --other B
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
from pathlib import Path
from typing import Any

import nats


class Client:
    """One user's connection; the server's -ERR answers (permission violations) collected as they arrive."""

    def __init__(self, user: str) -> None:
        self.user = user
        self.errors: list[str] = []
        self.nc: Any = None

    async def connect(
        self, server: str, credentials: Path, creds: bool = False, ca_file: str = "", **options: Any
    ) -> Client:
        async def on_error(e: Exception) -> None:
            self.errors.append(str(e))

        # the relay's users are nkeys (static mode) or, in operator mode, creds files (user JWT and seed)
        auth = (
            {"user_credentials": str(credentials / f"{self.user}.creds")}
            if creds
            else {"nkeys_seed": str(credentials / f"{self.user}.nk")}
        )
        # the relay serves TLS only (sco_relay_tls): its certificate checked against the hall's CA
        tls = {"tls": ssl.create_default_context(cafile=ca_file)} if ca_file else {}
        self.nc = await nats.connect(
            server,
            **auth,
            **tls,
            error_cb=on_error,
            max_reconnect_attempts=0,
            connect_timeout=3,
            **options,
        )
        return self

    async def settle(self) -> list[str]:
        """The errors caused since the last call (the server answers a violation before the PONG of a flush)."""
        await self.nc.flush(timeout=3)
        await asyncio.sleep(0.2)
        out, self.errors = self.errors, []
        return out


async def probe(args: argparse.Namespace) -> dict[str, Any]:
    cred = Path(args.credentials)
    hall, node, other = args.hall, args.node, args.other
    # as the agent connects: replies on the node's own inbox
    me = await Client(f"node-{node}").connect(
        args.server,
        cred,
        args.creds,
        args.ca_file,
        inbox_prefix=f"_INBOX.{hall.replace('.', '_')}.{node.replace('.', '_')}",
    )
    reclaimer = await Client("reclaimer").connect(args.server, cred, args.creds, args.ca_file)
    reader = await Client("control").connect(args.server, cred, args.creds, args.ca_file)
    out: dict[str, Any] = {}

    got: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_notice(msg: Any) -> None:
        await got.put(msg.data)

    await me.nc.subscribe(f"sco.notice.{hall}.{node}", cb=on_notice)
    out["node_subscribes_own_notices"] = await me.settle()
    await me.nc.subscribe(f"sco.notice.{hall}.{other}")
    out["node_subscribes_other_notices"] = await me.settle()
    await me.nc.subscribe(f"sco.notice.{hall}.>")
    out["node_subscribes_all_notices"] = await me.settle()
    await me.nc.publish(f"sco.notice.{hall}.{other}", b'{"id": "forged"}')
    out["node_publishes_notice"] = await me.settle()
    await me.nc.subscribe("_INBOX.>")  # where the readers' consumers deliver every node's events
    out["node_subscribes_all_inboxes"] = await me.settle()

    await reclaimer.nc.publish(f"sco.notice.{hall}.{node}", b'{"id": "probe"}')
    out["reclaimer_publishes_notice"] = await reclaimer.settle()
    try:
        out["node_received"] = (await asyncio.wait_for(got.get(), 3)).decode()
    except TimeoutError:
        out["node_received"] = None
    await reader.nc.publish(f"sco.notice.{hall}.{node}", b'{"id": "forged"}')
    out["reader_publishes_notice"] = await reader.settle()

    js = me.nc.jetstream(timeout=3)
    try:
        ack = await js.publish(f"sco.events.{hall}.{node}", b'{"type": "probe"}', headers={"Nats-Msg-Id": "probe-1"})
        out["node_publishes_own_event"] = {"stream": ack.stream, "seq": ack.seq}
    except Exception as e:
        out["node_publishes_own_event"] = {"error": repr(e)}
    await me.nc.publish(f"sco.events.{hall}.{other}", b'{"type": "forged"}')
    out["node_publishes_other_event"] = await me.settle()

    for c in (me, reclaimer, reader):
        await c.nc.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", default="nats://127.0.0.1:4222")
    p.add_argument("--credentials", required=True)
    p.add_argument("--ca-file", default="", help="the hall's CA (the relay serves TLS only)")
    p.add_argument("--hall", required=True)
    p.add_argument("--node", required=True)
    p.add_argument("--other", required=True)
    p.add_argument("--creds", action="store_true", help="the users' <user>.creds files (operator mode)")
    print(json.dumps(asyncio.run(probe(p.parse_args()))))


if __name__ == "__main__":
    main()
