"""The agent's link to the hall's NATS relay: one connection, under the node's own identity, reconnecting forever.

It subscribes the notice source to ``sco.notice.<hall>.<node>``; the publisher and the heartbeat use the same
connection (``connection()``). While the agent enrols, it connects only once the creds file is written.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from sco import _nats
from sco._redact import strip_userinfo_in_text
from sco.agent.config import AgentConfig
from sco.agent.notice_sources import NatsNoticeSource

log = logging.getLogger("sco.agent")

CONNECT_TIMEOUT_S = 2
RECONNECT_WAIT_S = 1
PING_INTERVAL_S = 10
MAX_OUTSTANDING_PINGS = 3
FLUSH_TIMEOUT_S = 2
CLOSE_TIMEOUT_S = 2


def nats_auth(c: AgentConfig) -> dict[str, Any]:
    """The node's own relay identity (the first of creds file, nkey seed file, token, user and password), and the
    hall's CA the relay's certificate must chain to (nats_ca_file)."""
    return _nats.auth_options(
        creds_file=c.nats_creds_file,
        nkey_seed_file=c.nats_nkey_seed_file,
        token=c.nats_token,
        user=c.nats_user,
        password=c.nats_password,
        ca_file=c.nats_ca_file or None,
    )


class RelayLink:
    def __init__(self, cfg: AgentConfig, source: NatsNoticeSource, on_connected: Callable[[], None]) -> None:
        """``on_connected``: called on the first connection and every reconnection (the publisher replays)."""
        self.cfg, self.source, self.on_connected = cfg, source, on_connected
        self.nc: Any = None
        self.creds_ready = asyncio.Event()  # set at once unless enrolment writes the creds file first

    def connection(self) -> Any:
        """The nats-py client (None before the first connection): connected or reconnecting."""
        return self.nc

    def up(self) -> bool:
        return self.nc is not None and bool(self.nc.is_connected)

    async def run(self, stop: asyncio.Event) -> None:
        if not self.creds_ready.is_set():  # enrolling: connect once the creds file is written
            log.info("NATS: waiting for enrolment to write %s", self.cfg.nats_creds_file)
            waits = [asyncio.create_task(self.creds_ready.wait()), asyncio.create_task(stop.wait())]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
            if stop.is_set():
                return

        async def disconnected() -> None:
            if stop.is_set():  # the agent's own shutdown closing the link
                log.debug("NATS disconnected (stopping)")
                return
            log.warning("NATS disconnected; the metadata poll covers notices meanwhile")

        async def reconnected() -> None:
            log.info("NATS reconnected")
            self.on_connected()

        async def error(e: Exception) -> None:
            # Authorization and permission errors are the relay refusing this node: say so at the default level.
            level = logging.WARNING if "authoriz" in str(e).lower() or "permission" in str(e).lower() else logging.DEBUG
            log.log(level, "NATS: %s", strip_userinfo_in_text(str(e)))

        # reconnect, no deadline: nats-py retries forever, the first connection included.
        self.nc = await _nats.connect(
            self.cfg.nats_url,
            auth=nats_auth(self.cfg),
            deadline_s=None,
            reconnect=True,
            connect_timeout=CONNECT_TIMEOUT_S,
            name=f"sco-agent {self.cfg.hall}/{self.cfg.node}",
            reconnect_time_wait=RECONNECT_WAIT_S,
            ping_interval=PING_INTERVAL_S,
            max_outstanding_pings=MAX_OUTSTANDING_PINGS,
            disconnected_cb=disconnected,
            reconnected_cb=reconnected,
            error_cb=error,
            # Replies (JetStream acks) come back on the node's own inbox: the relay lets a node subscribe only
            # there, never to _INBOX.>, where the control users' consumers deliver every node's events.
            inbox_prefix=self.cfg.inbox_prefix,
        )
        subject = self.cfg.subject(self.cfg.notice_subject)
        await self.source.subscribe(self.nc, subject)
        await self.nc.flush(timeout=FLUSH_TIMEOUT_S)
        log.info("NATS connected; subscribed to %s", subject)
        self.on_connected()
        await stop.wait()

    async def close(self) -> None:
        if self.nc is not None:
            try:
                await asyncio.wait_for(self.nc.close(), CLOSE_TIMEOUT_S)
            except Exception as e:  # closing at stop: nothing left to do about it
                log.debug("NATS close: %s", e)
