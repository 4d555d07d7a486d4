"""Where reclaim notices come from: one class per channel, each handing a Notice to the NoticeBook's owner.

- ``NatsNoticeSource``: ``sco.notice.<hall>.<node>`` on the hall's relay. A notice must be signed by a
  notice key the cached bundle's hall policy names; unsigned, untrusted or forged ones are refused (and
  counted) before their fields are read.
- ``MetadataNoticeSource``: the OpenStack instance metadata, polled (every 5 s by default). It is the cloud's
  own path, reachable only from the instance, so it needs no signature; it covers NATS outages.

A source only parses and refuses; what a notice means (a drain, a deadline move, a duplicate) is the
NoticeBook's decision (``sco.agent.notices``), taken by whoever ``deliver`` reaches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import urllib.parse
from collections.abc import Callable
from typing import Any

from sco._http import AsyncHttpClient, HttpError
from sco.agent.notices import Notice, NoticeRefused, foreign_traffic, notice_from_nats, parse_metadata
from sco.contract.notice import verify_notice
from sco.contract.signing import Keyring
from sco.errors import NoticeAuthError

log = logging.getLogger("sco.agent.notices")

Deliver = Callable[[Notice], None]
Refuse = Callable[[str, NoticeRefused, bytes], None]


class NoticeSource:
    """Parse raw bytes from one channel into a Notice (to ``deliver``) or a refusal (to ``refuse``)."""

    name = ""

    def __init__(
        self,
        *,
        hall: str,
        node: str,
        clock: Callable[[], float],
        window: Callable[[], float],
        deliver: Deliver,
        refuse: Refuse,
    ) -> None:
        self.hall, self.node, self.clock, self.window = hall, node, clock, window
        self.deliver, self.refuse = deliver, refuse
        self.received = 0

    def parse(self, raw: bytes, now: float) -> Notice | None:
        raise NotImplementedError

    def handle(self, raw: bytes) -> None:
        self.received += 1
        try:
            n = self.parse(raw, self.clock())
        except NoticeRefused as e:
            self.refuse(self.name, e, raw)
            return
        if n is not None:
            self.deliver(n)


class NatsNoticeSource(NoticeSource):
    name = "nats"

    def __init__(self, *, trusted: Callable[[], Keyring], foreign: Callable[[str], None], **kw: Any) -> None:
        super().__init__(**kw)
        self.trusted = trusted  # the notice keys of the bundle cached now
        self.foreign = foreign  # JetStream traffic another client routed here: counted, never a refusal each

    def parse(self, raw: bytes, now: float) -> Notice:
        try:
            doc = verify_notice(raw, self.trusted())
        except NoticeAuthError as e:
            raise NoticeRefused(e.kind, e.reason) from None
        return notice_from_nats(doc, hall=self.hall, node=self.node, now=now, window=self.window())

    async def subscribe(self, nc: Any, subject: str) -> None:
        async def on_msg(msg: Any) -> None:
            try:
                if kind := foreign_traffic(msg.data, msg.reply or "", msg.headers):
                    self.foreign(kind)
                    return
                self.handle(msg.data)
            except Exception:  # nats-py would report it to its error callback only, at DEBUG: say it loudly
                log.exception("handling a notice from %s failed", msg.subject)

        await nc.subscribe(subject, cb=on_msg)


class MetadataNoticeSource(NoticeSource):
    name = "metadata"

    def __init__(
        self, *, url: str, interval: Callable[[], float], max_bytes: int, timeout: float = 2.0, **kw: Any
    ) -> None:
        super().__init__(**kw)
        self.url, self.interval, self.max_bytes, self.timeout = url, interval, max_bytes, timeout
        self._last_refused: bytes | None = None

    def parse(self, raw: bytes, now: float) -> Notice | None:
        return parse_metadata(raw, hall=self.hall, node=self.node, now=now, window=self.window())

    def handle(self, raw: bytes) -> None:
        # The poll reads the same document every few seconds: refuse a bad one once, not every poll.
        try:
            n = self.parse(raw, self.clock())
        except NoticeRefused as e:
            if raw != self._last_refused:
                self._last_refused = raw
                self.refuse(self.name, e, raw)
            return
        self._last_refused = None
        self.received += 1
        if n is not None:
            self.deliver(n)

    async def run(self, stop: asyncio.Event) -> None:
        u = urllib.parse.urlsplit(self.url)
        client = AsyncHttpClient(
            f"{u.scheme}://{u.netloc}", timeout=self.timeout, max_connections=1, max_body=self.max_bytes
        )
        path = u.path + (f"?{u.query}" if u.query else "")
        try:
            while not stop.is_set():
                try:
                    r = await client.request("GET", path)
                    if r.status == 200:
                        self.handle(r.body)
                except HttpError as e:
                    log.debug("metadata poll: %s", e)
                    if "exceeds" in str(e):
                        self.refuse(self.name, NoticeRefused("malformed", f"metadata: {e}"), b"")
                except Exception:  # one bad poll must not stop the channel that covers NATS outages
                    log.exception("metadata poll failed")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.interval())
        finally:
            await client.close()
