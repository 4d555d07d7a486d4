"""The bundle refresh: ask the distributor for a newer bundle every ``bundleRefreshSeconds`` (60 s by default).

A refused or failed refresh keeps the last good bundle; each new refusal or error is spooled once (not every
minute while it lasts) and said once in the agent's log (a WARNING naming the reason: a distributor whose TLS
certificate is not the hall's, an expired or rolled-back bundle), each accepted bundle once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from sco.agent.bundle_cache import BundleCache, BundleFetcher, Offer
from sco.agent.spool import ROUTINE, Spool

log = logging.getLogger("sco.agent")


class BundleRefresh:
    def __init__(
        self,
        fetcher: BundleFetcher,
        cache: BundleCache,
        spool: Spool,
        interval: Callable[[], float],
        on_accepted: Callable[[], None],
    ) -> None:
        self.fetcher, self.cache, self.spool = fetcher, cache, spool
        self.interval, self.on_accepted = interval, on_accepted

    async def run(self, stop: asyncio.Event) -> None:
        last = None
        while not stop.is_set():
            try:
                offer = await asyncio.to_thread(self.fetcher.refresh)
            except Exception as e:  # disk full, permissions: keep the last good bundle, try again later
                log.exception("bundle refresh failed")
                offer = Offer(
                    "error", self.cache.bundle.serial if self.cache.bundle else None, f"{type(e).__name__}: {e}"
                )
            if offer.outcome == "accepted":
                self.spool.append("bundle.accepted", ROUTINE, serial=offer.serial)
                self.on_accepted()
            elif offer.outcome in ("refused", "error") and (offer.outcome, offer.reason) != last:
                self.spool.append(f"bundle.{offer.outcome}", ROUTINE, serial=offer.serial, reason=offer.reason)
                log.warning("bundle %s, serial %s kept: %s", offer.outcome, offer.serial, offer.reason)
            last = (offer.outcome, offer.reason)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval())
