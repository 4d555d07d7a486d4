"""Create or update the hall's streams on the local relay (idempotent; the relay unit's ExecStartPost): the agents'
events, and their heartbeats (the last one per node, in memory: sco.provider.heartbeats reads them).

Prints one JSON line per stream: {"stream": NAME, "action": "created" | "updated" | "unchanged"}. Waits up to --wait
seconds for the server that has just started; exits non-zero with a message when it cannot reach it or JetStream
refuses.

On a cluster every relay runs it after its own start, at about the same time: JetStream creates a stream once (the
others are told it exists and report "unchanged", or "updated" when they changed it themselves), and while the
cluster has no leader yet (its servers starting, a replica count it cannot place yet) each step is tried again,
with backoff and jitter, until --wait runs out.

It runs with the product's interpreter (the role installs spot-capacity-orchestrator of the collection's release in
notice_relay_venv for it, and the unit's ExecStartPost names that venv's python), so it connects and paces its
retries with the product's own helpers: sco._nats (the identity mapping, a connect with a deadline) and sco._retry
(capped exponential backoff, equal jitter), all within --wait.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, NotFoundError

from sco._nats import auth_options, connect
from sco._retry import Backoff

# JetStream's answers that pass: no meta leader yet (10008), too few servers up for the replicas (10023), no peer
# known to have room yet (10005: a relay that has just started has not told the leader its storage), another relay
# created the stream with the other configuration a moment ago (10058: read it again), a leader change under way
# (10074 no suitable peers, 10060 stream not current). 503: nobody answers JetStream's API yet. A lasting one (too
# little storage for the stream's limits) is said when --wait runs out.
TRANSIENT = {10005, 10008, 10023, 10058, 10060, 10074}
# The stream's metadata key naming the run of this tool that created it.
CREATOR = "sco.created-by"


def wanted(args: argparse.Namespace) -> StreamConfig:
    return StreamConfig(
        name=args.stream,
        subjects=[f"sco.events.{args.hall}.>"],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=float(args.max_age),
        max_bytes=int(args.max_bytes),
        duplicate_window=float(args.duplicate_window),
        num_replicas=args.replicas,
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
        num_replicas=args.replicas,
    )


def differs(have: StreamConfig, want: StreamConfig) -> bool:
    fields = (
        "subjects", "retention", "storage", "max_age", "max_bytes", "duplicate_window", "max_msgs_per_subject",
        "num_replicas",
    )  # fmt: skip
    return any(getattr(have, f) != getattr(want, f) for f in fields if getattr(want, f) is not None)


async def ensure(args: argparse.Namespace) -> list[tuple[str, str]]:
    # the relay's own users are nkeys (the seed file), or in operator mode a creds file (user JWT and seed); a
    # password file for a relay configured otherwise
    if args.creds and not Path(args.creds).is_file():  # nats-py would only say so once --wait has run out
        raise SystemExit(f"sco-nats-stream: {args.creds}: no creds file")
    password = Path(args.password_file).read_text().strip() if args.password_file else None
    auth = auth_options(
        creds_file=args.creds, nkey_seed_file=args.nkey_seed, user=args.user, password=password,
        ca_file=args.ca_file or None,
    )  # fmt: skip
    loop = asyncio.get_running_loop()
    end = loop.time() + args.wait
    backoff = Backoff(0.2, 2.0)
    while True:
        try:
            # the server may still be starting: each attempt within what is left of --wait (nats-py keeps retrying
            # a refused first connection inside one attempt, so the deadline is what bounds it)
            nc = await connect(args.server, auth=auth, deadline_s=max(0.5, end - loop.time()), connect_timeout=2)
            break
        except Exception as e:
            pause = backoff.next()
            if loop.time() + pause > end:
                why = str(e) or type(e).__name__
                raise SystemExit(f"sco-nats-stream: cannot reach {args.server} in {args.wait:g} s: {why}") from None
            await asyncio.sleep(pause)
    try:
        js = nc.jetstream(timeout=5)
        done = []
        for want in [wanted(args)] + ([heartbeats_wanted(args)] if args.heartbeat_stream else []):
            done.append((want.name, await retried(lambda w=want: converge(nc, js, w), end, want.name)))
        return done
    finally:
        await nc.close()


async def converge(nc: Any, js: Any, want: StreamConfig) -> str:
    try:
        have = (await js.stream_info(want.name)).config
    except NotFoundError:
        return await create(nc, want)
    if differs(have, want):
        await js.update_stream(want.evolve(metadata=have.metadata))
        return "updated"
    return "unchanged"


async def create(nc: Any, want: StreamConfig) -> str:
    # Every relay of a cluster may find the stream missing at once. Each asks for it with a mark of its own: the
    # first request makes it; the others' differ from it in that mark only, JetStream refuses them (10058, "already
    # in use with a different configuration"), and their next try finds the stream made.
    mark = uuid.uuid4().hex
    mine = want.evolve(metadata={**(want.metadata or {}), CREATOR: mark})
    msg = await nc.request(f"$JS.API.STREAM.CREATE.{want.name}", json.dumps(mine.as_dict()).encode(), timeout=5)
    answer = json.loads(msg.data)
    if "error" in answer:
        e = answer["error"]
        raise APIError(code=e.get("code"), err_code=e.get("err_code"), description=e.get("description"))
    return "created" if (answer.get("config", {}).get("metadata") or {}).get(CREATOR) == mark else "unchanged"


async def retried(step: Callable[[], Awaitable[str]], end: float, name: str) -> str:
    """``step`` until it passes, a transient refusal tried again after the shared backoff's wait (jitter: the relays
    of a cluster start together), none begun past ``end``."""
    loop = asyncio.get_running_loop()
    backoff = Backoff(0.2, 2.0)
    while True:
        try:
            return await step()
        except (TimeoutError, APIError, NoRespondersError, NatsTimeoutError) as e:
            code = getattr(e, "err_code", None)
            passing = code in TRANSIENT or getattr(e, "code", None) == 503 or not isinstance(e, APIError)
            pause = backoff.next()
            if not passing or loop.time() + pause > end:
                raise SystemExit(f"sco-nats-stream: stream {name}: {describe(e)}") from None
        await asyncio.sleep(pause)


def describe(e: Exception) -> str:
    if isinstance(e, APIError):
        return f"JetStream refused: {e.description} (err_code {e.err_code})"
    return f"JetStream did not answer in time ({type(e).__name__})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", default="nats://127.0.0.1:4222")
    p.add_argument("--user", default="relay-admin")
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--nkey-seed", help="the user's nkey seed file")
    who.add_argument("--creds", help="the user's creds file (a relay in operator mode)")
    who.add_argument("--password-file", help="the user's password file (with --user)")
    p.add_argument("--ca-file", default="", help="the hall's CA the relay's TLS certificate must chain to")
    p.add_argument("--hall", required=True)
    p.add_argument("--stream", default="SCO_EVENTS")
    p.add_argument("--max-age", type=float, default=14 * 86400)
    p.add_argument("--max-bytes", type=int, default=512 * 2**20)
    p.add_argument("--duplicate-window", type=float, default=120)
    p.add_argument("--heartbeat-stream", default="SCO_HEARTBEATS", help='"" for none')
    p.add_argument("--heartbeat-max-age", type=float, default=86400)
    p.add_argument("--replicas", type=int, default=1, choices=range(1, 6), help="copies of each stream (a cluster)")
    p.add_argument("--wait", type=float, default=15, help="seconds to wait for the server and a JetStream leader")
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
