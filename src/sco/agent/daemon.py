"""The node agent: one asyncio process per node (seed view 10).

Root tasks, each named and guarded: the NATS link (notice subscription, reconnecting forever), the metadata
poll (every 5 s, covering NATS outages), the bundle refresh (every 60 s), the event publisher (spool to
JetStream, in order), the spool syncer and the systemd watchdog. A notice starts the drain task. SIGTERM
stops the root tasks first, then the stragglers, each with a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import signal
import sys
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from sco import __version__
from sco._http import AsyncHttpClient, HttpError
from sco.agent.bundle_cache import BundleCache, BundleFetcher, Offer
from sco.agent.config import AgentConfig
from sco.agent.deadline import Deadline
from sco.agent.drain import Drain, DrainPath
from sco.agent.notices import Notice, NoticeBook, NoticeRefused, parse_metadata, parse_nats
from sco.agent.resume import DrainRecord
from sco.agent.sdnotify import notify, watchdog_interval
from sco.agent.spool import CRITICAL, ROUTINE, Spool
from sco.contract.signing import Keyring
from sco.errors import ConfigError

log = logging.getLogger("sco.agent")

# nats-py imports aiohttp when it is installed (for websockets), which costs ~11 MiB: the agent never
# uses websockets, so make the import fail before nats is loaded.
sys.modules.setdefault("aiohttp", None)  # type: ignore[arg-type]

OUTCOMES = ("drain.drained", "drain.overrun")


class Agent:
    def __init__(self, cfg: AgentConfig, clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.clock = clock
        self.keyring = Keyring.from_dir(cfg.trust_dir)
        self.cache = BundleCache(cfg.bundle_dir, self.keyring, clock)
        self.spool = Spool(
            cfg.spool_dir,
            max_bytes=cfg.spool_max_bytes,
            sync_interval=cfg.spool_sync_interval,
            clock=clock,
            base={"hall": cfg.hall, "node": cfg.node},
        )
        self.book = NoticeBook()
        self.refused: Counter[str] = Counter()
        self._refused_seen: set[str] = set()
        self.path: DrainPath | None = None
        self.drain: Drain | None = None
        self.drain_task: asyncio.Task[None] | None = None
        self.outcomes: list[dict[str, Any]] = []
        self.nc: Any = None
        self._stop = asyncio.Event()
        self._wake_publisher = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.kube: Any = None
        self.slurm: Any = None

    # --- policy, from the bundle unless overridden -------------------------------------------------

    def _policy(self, key: str, override: float, default: float) -> float:
        if override > 0 or (key == "safetyMarginSeconds" and override >= 0):
            return float(override)
        b = self.cache.bundle
        return float(b.policy.get(key, default)) if b else default

    @property
    def window(self) -> float:
        return self._policy("noticeWindowSeconds", self.cfg.notice_window_seconds, 120)

    @property
    def margin(self) -> float:
        return self._policy("safetyMarginSeconds", self.cfg.safety_margin_seconds, 10)

    @property
    def api_timeout(self) -> float:
        return self._policy("schedulerApiTimeoutMs", self.cfg.scheduler_api_timeout_ms, 800) / 1000

    # --- notices -----------------------------------------------------------------------------------

    def handle_raw(self, raw: bytes, source: str) -> None:
        now = self.clock()
        hall, node, window = self.cfg.hall, self.cfg.node, self.window
        try:
            if source == "nats":
                notice: Notice | None = parse_nats(raw, hall=hall, node=node, now=now, window=window)
            else:
                notice = parse_metadata(raw, hall=hall, node=node, now=now, window=window)
        except NoticeRefused as e:
            self.refused[e.kind] += 1
            digest = hashlib.sha256(raw).hexdigest()
            if digest not in self._refused_seen:  # the metadata poll repeats the same refusal every 5 s
                if len(self._refused_seen) > 1000:
                    self._refused_seen.clear()
                self._refused_seen.add(digest)
                self.spool.append(
                    "notice.refused",
                    ROUTINE,
                    source=source,
                    kind=e.kind,
                    reason=e.reason,
                    refused_total=dict(self.refused),
                )
                log.warning("refused %s notice (%s): %s", source, e.kind, e.reason)
            return
        if notice is not None:
            self.accept(notice)

    def accept(self, n: Notice) -> None:
        verdict = self.book.offer(n)
        if verdict == "duplicate":
            return
        if self.drain is not None:
            if n.terminate_at < self.drain.deadline.terminate_at:
                self.spool.append(
                    "notice.deadline",
                    CRITICAL,
                    notice=self.drain.notice.id,
                    terminate_at=n.terminate_at,
                    from_notice=n.id,
                    source=n.source,
                )
                self.drain.update_deadline(n.terminate_at)
            return
        if verdict != "new":
            return  # an earlier time for a notice whose drain has already finished
        self.spool.append("notice.accepted", CRITICAL, **n.as_event())
        self._start_drain(n, None)

    def _start_drain(self, n: Notice, record: DrainRecord | None) -> None:
        if self.cache.bundle is None:
            self.spool.append(
                "bundle.missing",
                CRITICAL,
                notice=n.id,
                reason="no verified bundle cached: work keeps its own grace, capped by the deadline",
            )
        assert self.path is not None
        received = (record.received_at if record else None) or n.received_at
        deadline = Deadline(n.terminate_at, self.margin, received, self.clock)
        drain = self.path.drain(n, deadline, record)
        self.drain = drain
        self.drain_task = asyncio.create_task(self._run_drain(drain), name=f"drain:{n.id}")
        self._wake_publisher.set()

    async def _run_drain(self, drain: Drain) -> None:
        try:
            outcome = await drain.run()
            self.outcomes.append({"notice": drain.notice.id, **outcome})
            self._follow_ups()
        except Exception:
            log.exception("drain for notice %s failed", drain.notice.id)
            self.spool.append("drain.error", CRITICAL, notice=drain.notice.id)
        finally:
            if self.drain is drain:
                self.drain = None
            self._wake_publisher.set()

    def _resume_from_spool(self) -> None:
        """Find a drain the spool says was started and never finished, and carry on with it."""
        open_notice: dict[str, Any] | None = None
        terminate_at: dict[str, float] = {}
        for ev in self.spool.events():
            t, nid = ev["type"], str(ev.get("notice"))
            if t == "notice.accepted":
                open_notice = ev
                terminate_at[nid] = float(ev["terminate_at"])
                self.book.seen[nid] = Notice(
                    nid,
                    self.cfg.hall,
                    self.cfg.node,
                    float(ev["terminate_at"]),
                    float(ev["issued_at"]),
                    ev["source"],
                    float(ev["received_at"]),
                )
            elif t == "notice.deadline" and nid in terminate_at:
                terminate_at[nid] = min(terminate_at[nid], float(ev["terminate_at"]))
            elif (t in OUTCOMES or t == "drain.error") and open_notice is not None and nid == open_notice["notice"]:
                open_notice = None
        if open_notice is None:
            return
        nid = open_notice["notice"]
        n = Notice(
            nid,
            self.cfg.hall,
            self.cfg.node,
            terminate_at[nid],
            float(open_notice["issued_at"]),
            "spool",
            float(open_notice["received_at"]),
        )
        assert self.path is not None
        resume = self.path.record(self.spool, nid)
        done = resume.summary()
        self.spool.append(
            "drain.resumed", CRITICAL, notice=nid, deadline_in_s=round(n.terminate_at - self.clock(), 3), **done
        )
        log.info("resuming drain for notice %s (%.1f s to the deadline)", nid, n.terminate_at - self.clock())
        self._start_drain(n, resume)

    def _follow_ups(self) -> None:
        """Start what the drain path still owes (e.g. telling slurmctld what was done around it)."""
        assert self.path is not None
        for name, coro in self.path.follow_ups(self._stop):
            self._spawn(coro, name)

    # --- root tasks --------------------------------------------------------------------------------

    async def _nats_link(self) -> None:
        import nats

        async def on_msg(msg: Any) -> None:
            self.handle_raw(msg.data, "nats")

        async def disconnected() -> None:
            log.warning("NATS disconnected; the metadata poll covers notices meanwhile")

        async def reconnected() -> None:
            log.info("NATS reconnected")
            self._wake_publisher.set()

        async def error(e: Exception) -> None:
            log.debug("NATS: %s", e)

        servers = [s.strip() for s in self.cfg.nats_url.split(",") if s.strip()]
        # max_reconnect_attempts=-1: nats-py retries forever, the first connection included.
        self.nc = await nats.connect(
            servers=servers,
            name=f"sco-agent {self.cfg.hall}/{self.cfg.node}",
            max_reconnect_attempts=-1,
            reconnect_time_wait=1,
            connect_timeout=2,
            ping_interval=10,
            max_outstanding_pings=3,
            disconnected_cb=disconnected,
            reconnected_cb=reconnected,
            error_cb=error,
        )
        await self.nc.subscribe(self.cfg.subject(self.cfg.notice_subject), cb=on_msg)
        await self.nc.flush(timeout=2)
        log.info("NATS connected; subscribed to %s", self.cfg.subject(self.cfg.notice_subject))
        self._wake_publisher.set()
        await self._stop.wait()

    async def _metadata_poll(self) -> None:
        u = urllib.parse.urlsplit(self.cfg.metadata_url)
        client = AsyncHttpClient(f"{u.scheme}://{u.netloc}", timeout=2.0, max_connections=1)
        path = u.path + (f"?{u.query}" if u.query else "")
        try:
            while not self._stop.is_set():
                try:
                    r = await client.request("GET", path)
                    if r.status == 200:
                        self.handle_raw(r.body, "metadata")
                except HttpError as e:
                    log.debug("metadata poll: %s", e)
                except Exception:  # one bad poll must not stop the channel that covers NATS outages
                    log.exception("metadata poll failed")
                interval = self._policy("metadataPollSeconds", self.cfg.metadata_poll_seconds, 5)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), interval)
        finally:
            await client.close()

    async def _bundle_refresh(self) -> None:
        fetcher = BundleFetcher(self.cache, self.cfg.bundle_url)
        last = None
        while not self._stop.is_set():
            try:
                offer = await asyncio.to_thread(fetcher.refresh)
            except Exception as e:  # disk full, permissions: keep the last good bundle, try again later
                log.exception("bundle refresh failed")
                offer = Offer(
                    "error", self.cache.bundle.serial if self.cache.bundle else None, f"{type(e).__name__}: {e}"
                )
            if offer.outcome == "accepted":
                self.spool.append("bundle.accepted", ROUTINE, serial=offer.serial)
                self._ready()
            elif offer.outcome in ("refused", "error") and (offer.outcome, offer.reason) != last:
                self.spool.append(f"bundle.{offer.outcome}", ROUTINE, serial=offer.serial, reason=offer.reason)
            last = (offer.outcome, offer.reason)
            interval = self._policy("bundleRefreshSeconds", self.cfg.bundle_refresh_seconds, 60)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), interval)

    async def _publisher(self) -> None:
        """Spool to JetStream in seq order; after an outage, replays from the cursor in order."""
        subject = self.cfg.subject(self.cfg.events_subject)
        while not self._stop.is_set():
            self._wake_publisher.clear()
            nc = self.nc
            if nc is not None and nc.is_connected:
                js = nc.jetstream(timeout=2)
                batch = self.spool.unpublished(200)
                done = 0
                try:
                    for ev in batch:
                        msg_id = f"{self.cfg.hall}.{self.cfg.node}.{ev['seq']}"  # JetStream de-duplicates replays
                        await js.publish(subject, json.dumps(ev).encode(), headers={"Nats-Msg-Id": msg_id})
                        done = ev["seq"]
                except Exception as e:  # no stream, timeout, disconnect: retry later from the cursor
                    log.debug("publish paused: %s", e)
                    batch = []
                if done:
                    self.spool.mark_published(done)
                if len(batch) == 200:
                    continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake_publisher.wait(), 1.0)

    async def _housekeeping(self) -> None:
        wd = watchdog_interval()
        tick = min(0.5, wd) if wd else 0.5
        last_ping = 0.0
        while not self._stop.is_set():
            self.spool.maybe_sync()
            if self.spool.last_seq > self.spool.published_seq:
                self._wake_publisher.set()
            if wd and time.monotonic() - last_ping >= wd:
                notify("WATCHDOG=1")
                last_ping = time.monotonic()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), tick)

    def _ready(self) -> None:
        b = self.cache.bundle
        if b is not None:
            notify(f"READY=1\nSTATUS=hall {b.hall}, bundle serial {b.serial}, {len(b.contracts)} contracts")
        else:
            notify("STATUS=no verified bundle yet: waiting (work must not land here)")

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        async def guarded() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("task %s failed", name)
                self.spool.append("agent.task_failed", CRITICAL, task=name)
                self._stop.set()

        self._tasks.append(asyncio.create_task(guarded(), name=name))

    def stop(self) -> None:
        self._stop.set()

    def _drain_path(self) -> DrainPath:
        """The one place that asks which scheduler this node runs beside."""
        if self.cfg.scheduler == "slurm":
            from sco.agent.slurm_drain import SlurmPath
            from sco.schedulers.slurm import SlurmClient

            self.slurm = SlurmClient(
                slurm_conf=self.cfg.slurm_conf, bin_dir=self.cfg.slurm_bin_dir, timeout=self.api_timeout
            )
            return SlurmPath(
                slurm=self.slurm,
                spool=self.spool,
                bundle=lambda: self.cache.bundle,
                node=self.cfg.node,
                slurmd_spool_dir=Path(self.cfg.slurmd_spool_dir.replace("%n", self.cfg.node)),
                cgroup_root=Path(self.cfg.cgroup_root),
            )
        from sco.agent.kube_drain import KubePath
        from sco.schedulers.kube import KubeClient, KubeConfigError

        try:
            self.kube = KubeClient(
                KubePath.credentials(self.cfg), timeout=self.api_timeout, max_connections=self.cfg.evict_concurrency
            )
        except (KubeConfigError, OSError) as e:  # no CA for https, an unreadable kubeconfig
            raise ConfigError(f"kubernetes credentials: {e}") from None
        return KubePath(
            kube=self.kube,
            spool=self.spool,
            bundle=lambda: self.cache.bundle,
            node=self.cfg.node,
            taint_key=self.cfg.taint_key,
            api_timeout=self.api_timeout,
        )

    async def _preflight(self) -> None:
        """Say at start-up what would stop a drain (unknown node, refused credential): fix it before a notice."""
        assert self.path is not None
        problems = await self.path.preflight()
        for p in problems:
            log.error("preflight: %s", p)
        if problems:
            self.spool.append("scheduler.preflight", CRITICAL, problems=problems)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.stop)
        self.path = self._drain_path()
        b = self.cache.bundle
        self.spool.append(
            "agent.started",
            ROUTINE,
            version=__version__,
            bundle_serial=b.serial if b else None,
            spool_torn_bytes=self.spool.recovery.torn_bytes,
            spool_records=self.spool.recovery.records,
        )
        self._resume_from_spool()
        self._follow_ups()
        self._spawn(self._nats_link(), "nats")
        if self.cfg.metadata_url:
            self._spawn(self._metadata_poll(), "metadata-poll")
        if self.cfg.bundle_url:
            self._spawn(self._bundle_refresh(), "bundle-refresh")
        self._spawn(self._publisher(), "publisher")
        self._spawn(self._housekeeping(), "housekeeping")
        self._spawn(self._preflight(), "preflight")  # says what would stop a drain, once
        self._ready()
        await self._stop.wait()
        await self._shutdown()
        return 0

    async def _shutdown(self) -> None:
        notify("STOPPING=1")
        for t in self._tasks:
            t.cancel()
        await asyncio.wait(self._tasks, timeout=2)
        if self.drain_task is not None and not self.drain_task.done():
            self.drain_task.cancel()  # resumable from the spool
            await asyncio.wait([self.drain_task], timeout=2)
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.close(), 2)
        if self.path is not None:
            await self.path.close()
        self.spool.close()
