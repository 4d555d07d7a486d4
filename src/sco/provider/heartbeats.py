"""The agents' heartbeats on the relay, read into the fleet state (``sco.agent.heartbeat`` writes them).

Stream ``SCO_HEARTBEATS`` captures ``sco.heartbeat.<hall>.>`` and keeps one message per subject
(``max_msgs_per_subject=1``), in memory, for a day (a node gone that long drops out): the hall's size in messages,
never its history. One read is one ephemeral consumer delivering the last message per subject, pulled in
batches until none is pending, then deleted: no request per node. A node is named by its subject (the relay lets
a node publish only on its own), heard at the relay's time of the message (JetStream's timestamp), never by the
node's clock. Relay restarts lose the stream's contents, not the fleet state's: heard times only move forward.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sco import _nats
from sco.errors import ConfigError, ScoError

log = logging.getLogger("sco.provider.heartbeats")

STREAM = "SCO_HEARTBEATS"
SUBJECTS = "sco.heartbeat.{hall}.>"
MAX_DETAIL_BYTES = 4096
"""A beat is ~200 bytes; a larger body is not stored (the node is still heard)."""


class HeartbeatsUnreadable(ScoError):
    exit_code = 11


def stream_config(hall: str, name: str = STREAM, max_age_s: float = 86400.0) -> Any:
    from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

    return StreamConfig(
        name=name,
        subjects=[SUBJECTS.format(hall=hall)],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.MEMORY,  # one message per node: the next beats refill it after a restart
        max_msgs_per_subject=1,
        max_age=max_age_s,
        discard=DiscardPolicy.OLD,
    )


async def ensure_stream(nc: Any, hall: str, name: str = STREAM) -> str:
    """Create or update the stream (idempotent): created / updated / unchanged."""
    from nats.js.errors import NotFoundError

    js = nc.jetstream(timeout=5)
    want = stream_config(hall, name)
    try:
        have = (await js.stream_info(name)).config
    except NotFoundError:
        await js.add_stream(want)
        return "created"
    keys = ("subjects", "retention", "storage", "max_msgs_per_subject", "max_age", "discard")
    if any(getattr(have, k) != getattr(want, k) for k in keys):
        await js.update_stream(want)
        return "updated"
    return "unchanged"


async def last_heard(
    nc: Any, hall: str, *, stream: str = STREAM, timeout_s: float = 10.0, batch: int = 500
) -> dict[str, tuple[datetime, dict[str, Any]]]:
    """``{node: (heard_at, detail)}``: the last heartbeat of every node in the stream, within ``timeout_s``."""
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
    from nats.js.errors import NotFoundError

    prefix = SUBJECTS.format(hall=hall)[:-1]
    js = nc.jetstream(timeout=min(5.0, timeout_s))
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    try:
        info = await js.stream_info(stream)
    except NotFoundError:
        raise HeartbeatsUnreadable(f"no heartbeat stream {stream} on the relay (sco.heartbeat.{hall}.>)") from None
    out: dict[str, tuple[datetime, dict[str, Any]]] = {}
    if not info.state.messages:
        return out
    cfg = ConsumerConfig(
        deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
        ack_policy=AckPolicy.NONE,
        inactive_threshold=30.0,  # gone by itself if this reader dies before deleting it
        mem_storage=True,
    )
    sub = await js.pull_subscribe(prefix + ">", stream=stream, config=cfg)
    try:
        pending = 1
        while pending > 0:
            left = end - loop.time()
            if left <= 0:
                raise HeartbeatsUnreadable(
                    f"heartbeats of hall {hall}: {len(out)} read, more pending after {timeout_s:g} s"
                )
            try:
                msgs = await sub.fetch(batch, timeout=min(2.0, left))
            except TimeoutError:
                break  # nothing more delivered: every subject's last message was read
            for m in msgs:
                node = m.subject[len(prefix) :] if m.subject.startswith(prefix) else ""
                if not node:
                    continue
                detail: dict[str, Any] = {}
                if len(m.data) <= MAX_DETAIL_BYTES:
                    try:
                        d = json.loads(m.data)
                        detail = d if isinstance(d, dict) else {}
                    except ValueError:
                        detail = {}
                detail.pop("node", None)  # the subject names the node, never the body
                out[node] = (m.metadata.timestamp, detail)
                pending = m.metadata.num_pending
    finally:
        try:
            await asyncio.wait_for(sub.unsubscribe(), 2)
            await asyncio.wait_for(js.delete_consumer(stream, sub._consumer), 2)
        except Exception as e:  # its inactive threshold removes it anyway
            log.debug("heartbeat consumer not deleted: %s", e)
    return out


@dataclass(frozen=True)
class RelayReader:
    """Where and as whom to read the heartbeats: the relay URL(s) and a reader's identity."""

    url: str
    auth: dict[str, Any] = field(default_factory=dict)
    stream: str = STREAM
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.url.strip():
            raise ConfigError("nats url: give the hall's relay (nats://host:4222)")
        if not (math.isfinite(self.timeout_s) and 0 < self.timeout_s <= 120):
            raise ConfigError(f"heartbeat read timeout: expected more than 0 and at most 120 s, got {self.timeout_s}")


async def read(reader: RelayReader, hall: str) -> dict[str, tuple[datetime, dict[str, Any]]]:
    try:
        nc = await _nats.connect(reader.url, auth=reader.auth, deadline_s=reader.timeout_s)
    except Exception as e:
        raise HeartbeatsUnreadable(
            f"relay {_hosts(reader.url)}: cannot connect: {type(e).__name__} {e}".strip()
        ) from None
    try:
        return await asyncio.wait_for(
            last_heard(nc, hall, stream=reader.stream, timeout_s=reader.timeout_s), reader.timeout_s + 5
        )
    except HeartbeatsUnreadable:
        raise
    except Exception as e:  # permissions, JetStream off, a timeout: one line naming the relay
        raise HeartbeatsUnreadable(
            f"relay {_hosts(reader.url)}: heartbeats of hall {hall}: {type(e).__name__} {e}".strip()
        ) from None
    finally:
        await nc.close()


def _hosts(url: str) -> str:
    from sco._redact import strip_userinfo_in_text

    return strip_userinfo_in_text(url)


def collect(reader: RelayReader, conn: Any, hall: str) -> int:
    """Read the heartbeats and record them in the fleet state; a failed read is recorded and raised."""
    from sco.state import heartbeats

    try:
        beats = asyncio.run(read(reader, hall))
    except HeartbeatsUnreadable as e:
        heartbeats.failed(conn, hall, str(e))
        raise
    return heartbeats.record(conn, hall, beats)


def reader_from_env(env: Mapping[str, str]) -> RelayReader | None:
    """The control loop's reader (``sco-control-loop``'s unit): ``$SCO_NATS_URL`` and one identity,
    ``$SCO_NATS_CREDS``, ``$SCO_NATS_NKEY_SEED`` (a seed file: the relay role's users are nkeys) or
    ``$SCO_NATS_USER`` with ``$SCO_NATS_PASSWORD_FILE``, and ``$SCO_NATS_CA_FILE``, the hall's CA the relay's
    certificate must chain to; None without a URL."""
    url = env.get("SCO_NATS_URL", "").strip()
    if not url:
        return None
    creds, seed, user = env.get("SCO_NATS_CREDS"), env.get("SCO_NATS_NKEY_SEED"), env.get("SCO_NATS_USER")
    password = ""
    if creds:
        pass
    elif seed:
        if not os.access(seed, os.R_OK):  # nats-py would only say the relay cannot be reached
            raise ConfigError(f"$SCO_NATS_NKEY_SEED {seed}: no readable nkey seed file there")
    elif user:
        pw_file = env.get("SCO_NATS_PASSWORD_FILE", "")
        try:
            password = open(pw_file, encoding="utf-8").read().strip() if pw_file else ""  # noqa: SIM115
        except OSError as e:
            raise ConfigError(f"$SCO_NATS_PASSWORD_FILE {pw_file}: {e.strerror or e}") from None
    ca = env.get("SCO_NATS_CA_FILE", "").strip() or None
    auth = _nats.auth_options(creds_file=creds, nkey_seed_file=seed, user=user, password=password, ca_file=ca)
    return RelayReader(url, auth)


def collect_for_loop(conn: Any, hall: str, env: Mapping[str, str]) -> int | None:
    """The control loop's read after its run: never fails the run (logged; recorded in the fleet state, which
    the status and ``sco_agent_heartbeats_read_timestamp_seconds`` show). None: not configured or failed."""
    try:
        reader = reader_from_env(env)
        if reader is None:
            return None
        n = collect(reader, conn, hall)
    except ScoError as e:
        log.error("agent heartbeats not read: %s", e)
        return None
    except Exception as e:  # the fleet state itself failing: the run's own outcome is what the unit reports
        log.error("agent heartbeats not recorded: %s: %s", type(e).__name__, e)
        return None
    log.info("agent heartbeats: %d node(s) on the relay", n)
    return n


__all__ = [
    "STREAM",
    "HeartbeatsUnreadable",
    "RelayReader",
    "collect",
    "ensure_stream",
    "last_heard",
    "read",
    "stream_config",
]
