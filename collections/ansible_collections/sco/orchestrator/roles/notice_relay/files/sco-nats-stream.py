"""Create or update the hall's streams on the local relay (idempotent; the relay unit's ExecStartPost): the agents'
events, and their heartbeats (the last one per node, in memory: sco.provider.heartbeats reads them).

Prints one JSON line per stream: {"stream": NAME, "action": "created" | "updated" | "unchanged"}. Waits up to --wait
seconds for the server that has just started; exits non-zero with a message when it cannot reach it or JetStream
refuses.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import nats
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError


def wanted(args: argparse.Namespace) -> StreamConfig:
    return StreamConfig(
        name=args.stream,
        subjects=[f"sco.events.{args.hall}.>"],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=float(args.max_age),
        max_bytes=int(args.max_bytes),
        duplicate_window=float(args.duplicate_window),
    )


def heartbeats_wanted(args: argparse.Namespace) -> StreamConfig:
    # One message per node (the last), whatever the hall's size; a restart loses them until the next beats.
    return StreamConfig(
        name=args.heartbeat_stream,
        subjects=[f"sco.heartbeat.{args.hall}.>"],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.MEMORY,
        max_msgs_per_subject=1,
        max_age=float(args.heartbeat_max_age),
        discard=DiscardPolicy.OLD,
        # the server's own default, said: nats-py's is 0, which the server stores as 120 s, so every later run
        # found the stream "differing" and updated it (the relay's ExecStartPost was never idempotent)
        duplicate_window=120.0,
    )


def differs(have: StreamConfig, want: StreamConfig) -> bool:
    fields = ("subjects", "retention", "storage", "max_age", "max_bytes", "duplicate_window", "max_msgs_per_subject")
    return any(getattr(have, f) != getattr(want, f) for f in fields if getattr(want, f) is not None)


async def ensure(args: argparse.Namespace) -> list[tuple[str, str]]:
    # the relay's own users are nkeys (the seed file); a password file for a relay configured otherwise
    auth = (
        {"nkeys_seed": args.nkey_seed}
        if args.nkey_seed
        else {"user": args.user, "password": Path(args.password_file).read_text().strip()}
    )
    nc = None
    loop = asyncio.get_running_loop()
    end = loop.time() + args.wait
    while nc is None:
        try:
            nc = await nats.connect(args.server, connect_timeout=2, max_reconnect_attempts=0, **auth)
        except Exception as e:  # the server may still be starting
            if loop.time() > end:
                raise SystemExit(f"sco-nats-stream: cannot reach {args.server}: {e}") from None
            await asyncio.sleep(0.3)
    try:
        js = nc.jetstream(timeout=5)
        done = []
        for want in [wanted(args)] + ([heartbeats_wanted(args)] if args.heartbeat_stream else []):
            try:
                have = (await js.stream_info(want.name)).config
            except NotFoundError:
                await js.add_stream(want)
                done.append((want.name, "created"))
                continue
            if differs(have, want):
                await js.update_stream(want)
                done.append((want.name, "updated"))
            else:
                done.append((want.name, "unchanged"))
        return done
    finally:
        await nc.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", default="nats://127.0.0.1:4222")
    p.add_argument("--user", default="relay-admin")
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--nkey-seed", help="the user's nkey seed file")
    who.add_argument("--password-file", help="the user's password file (with --user)")
    p.add_argument("--hall", required=True)
    p.add_argument("--stream", default="SCO_EVENTS")
    p.add_argument("--max-age", type=float, default=14 * 86400)
    p.add_argument("--max-bytes", type=int, default=512 * 2**20)
    p.add_argument("--duplicate-window", type=float, default=120)
    p.add_argument("--heartbeat-stream", default="SCO_HEARTBEATS", help='"" for none')
    p.add_argument("--heartbeat-max-age", type=float, default=86400)
    p.add_argument("--wait", type=float, default=15)
    args = p.parse_args()
    try:
        done = asyncio.run(ensure(args))
    except SystemExit:
        raise
    except Exception as e:
        sys.exit(f"sco-nats-stream: stream {args.stream}: {e}")
    for stream, action in done:
        print(json.dumps({"stream": stream, "action": action}))


if __name__ == "__main__":
    main()
