"""Create or update the hall's event stream on the local relay (idempotent; the relay unit's ExecStartPost).

Prints one JSON line: {"stream": NAME, "action": "created" | "updated" | "unchanged"}. Waits up to --wait seconds for
the server that has just started; exits non-zero with a message when it cannot reach it or JetStream refuses.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import nats
from nats.js.api import RetentionPolicy, StorageType, StreamConfig
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


def differs(have: StreamConfig, want: StreamConfig) -> bool:
    fields = ("subjects", "retention", "storage", "max_age", "max_bytes", "duplicate_window")
    return any(getattr(have, f) != getattr(want, f) for f in fields)


async def ensure(args: argparse.Namespace) -> str:
    password = Path(args.password_file).read_text().strip()
    nc = None
    loop = asyncio.get_running_loop()
    end = loop.time() + args.wait
    while nc is None:
        try:
            nc = await nats.connect(
                args.server, user=args.user, password=password, connect_timeout=2, max_reconnect_attempts=0
            )
        except Exception as e:  # the server may still be starting
            if loop.time() > end:
                raise SystemExit(f"sco-nats-stream: cannot reach {args.server}: {e}") from None
            await asyncio.sleep(0.3)
    try:
        js = nc.jetstream(timeout=5)
        want = wanted(args)
        try:
            have = (await js.stream_info(args.stream)).config
        except NotFoundError:
            await js.add_stream(want)
            return "created"
        if differs(have, want):
            await js.update_stream(want)
            return "updated"
        return "unchanged"
    finally:
        await nc.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", default="nats://127.0.0.1:4222")
    p.add_argument("--user", default="relay-admin")
    p.add_argument("--password-file", required=True)
    p.add_argument("--hall", required=True)
    p.add_argument("--stream", default="SCO_EVENTS")
    p.add_argument("--max-age", type=float, default=14 * 86400)
    p.add_argument("--max-bytes", type=int, default=512 * 2**20)
    p.add_argument("--duplicate-window", type=float, default=120)
    p.add_argument("--wait", type=float, default=15)
    args = p.parse_args()
    try:
        action = asyncio.run(ensure(args))
    except SystemExit:
        raise
    except Exception as e:
        sys.exit(f"sco-nats-stream: stream {args.stream}: {e}")
    print(json.dumps({"stream": args.stream, "action": action}))


if __name__ == "__main__":
    main()
