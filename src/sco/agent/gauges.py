"""The agent's scrape-time gauges (docs/METRICS.md), each read from the part that knows it; and the scheduler
API probe behind ``sco_agent_scheduler_api_up`` (one cheap read a minute)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from sco.agent.bundle_cache import BundleCache
from sco.agent.metrics import token_expiry
from sco.agent.scheduler import NodeScheduler
from sco.agent.spool import Spool

log = logging.getLogger("sco.agent")

Gauge = tuple[str, str, float | None]


class ApiProbe:
    """Whether the scheduler API answered the last read of this node (None: not probed yet)."""

    def __init__(self, read: Callable[[], Awaitable[Any]], timeout: Callable[[], float], every: float) -> None:
        self.read, self.timeout, self.every = read, timeout, every
        self.up: bool | None = None

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(self.read(), self.timeout())
                self.up = True
            except Exception as e:
                log.debug("scheduler API probe: %s", e)
                self.up = False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.every)


class AgentGauges:
    """Called at scrape time; None: unknown, left out of the exposition."""

    def __init__(
        self,
        *,
        spool: Spool,
        cache: BundleCache,
        clock: Callable[[], float],
        relay_up: Callable[[], bool],
        draining: Callable[[], bool],
        scheduler: Callable[[], NodeScheduler | None],
        preflight: Callable[[], dict[str, Any] | None],
        api_up: Callable[[], bool | None],
    ) -> None:
        self.spool, self.cache, self.clock = spool, cache, clock
        self.relay_up, self.draining, self.scheduler = relay_up, draining, scheduler
        self.preflight, self.api_up = preflight, api_up

    def __call__(self) -> list[Gauge]:
        b, st, now = self.cache.bundle, self.cache.state, self.clock()
        checked = st.last_check_at if st.last_outcome in ("accepted", "unchanged") else None
        checked = checked or st.accepted_at
        sched = self.scheduler()
        expiry = token_expiry(sched.token_file if sched else None)
        renewal = sched.renewer.state()["renewal"] if sched and sched.renewer is not None else None
        preflight, api_up = self.preflight(), self.api_up()
        return [
            (
                "sco_agent_spool_backlog_records",
                "Spooled records not yet published to JetStream.",
                self.spool.last_seq - self.spool.published_seq,
            ),
            (
                "sco_agent_spool_backlog_bytes",
                "Bytes of spooled records not yet published (an upper bound).",
                self.spool.backlog_bytes,
            ),
            ("sco_agent_bundle_serial", "Serial of the verified bundle in use.", b.serial if b else None),
            (
                "sco_agent_bundle_checked_timestamp_seconds",
                "When the distributor last confirmed the bundle in use (fetched or unchanged).",
                checked,
            ),
            (
                "sco_agent_bundle_age_seconds",
                "Seconds since the distributor last confirmed the bundle in use.",
                now - checked if checked else None,
            ),
            (
                "sco_agent_bundle_expired",
                "1 if the bundle in use is past its signed expiry (its budgets still drain the work here; no newer"
                " bundle came), 0 if not or if it carries none.",
                (1.0 if b.expired(now) else 0.0) if b else None,
            ),
            (
                "sco_agent_bundle_expiry_timestamp_seconds",
                "Signed expiry of the bundle in use; absent when it carries none.",
                float(b.expires_at) if b and b.expires_at is not None else None,
            ),
            ("sco_agent_relay_up", "1 if the NATS relay link is connected.", 1.0 if self.relay_up() else 0.0),
            (
                "sco_agent_scheduler_api_up",
                "1 if the scheduler API (Kubernetes or slurmctld) answered the last probe.",
                None if api_up is None else float(api_up),
            ),
            (
                "sco_agent_credential_expiry_timestamp_seconds",
                "Expiry (exp) of the scheduler API bearer token.",
                expiry,
            ),
            (
                "sco_agent_scheduler_preflight_ok",
                "1 if the last preflight found nothing that would stop a drain (node known, credential allowed).",
                None if preflight is None else float(preflight["ok"]),
            ),
            (
                "sco_agent_scheduler_preflight_timestamp_seconds",
                "When the last preflight ran (at start, every preflight_seconds, when the credential changes).",
                None if preflight is None else float(preflight["at"]),
            ),
            (
                "sco_agent_credential_renew_timestamp_seconds",
                "When the agent renews its bound token (80% of its lifetime); absent when it does not renew it.",
                renewal["renew_at"] if renewal else None,
            ),
            (
                "sco_agent_credential_renewal_failures",
                "Token renewals failed in a row (0 after a success); absent when the agent does not renew it.",
                float(renewal["failures"]) if renewal else None,
            ),
            ("sco_agent_draining", "1 while a drain runs.", 1.0 if self.draining() else 0.0),
        ]
