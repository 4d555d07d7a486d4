"""The node agent: one asyncio process per node (seed view 10). This module only wires its parts.

Sources (NATS, the metadata poll) -> notice intake (``intake``: the NoticeBook's verdict, accounted) -> the drain
supervisor (``drains``) -> the drain path the scheduler factory chose (``scheduler``: ``kube.node`` or
``slurm.drain``). Beside them, root tasks, each named and guarded: the relay link (``relay``, reconnecting
forever), the metadata poll (every 5 s, covering NATS outages), the bundle refresh (``refresh``, every 60 s), the
event publisher (``publisher``: spool to JetStream, in order), the heartbeat, the preflight, the rearm watch and
the housekeeping tick (spool sync, systemd watchdog and status). SIGTERM stops the root tasks first, then the
stragglers, each with a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from sco import __version__
from sco.agent import heartbeat
from sco.agent import metrics as agent_metrics
from sco.agent.boot import boot_id
from sco.agent.bundle_cache import BundleCache, BundleFetcher
from sco.agent.checkpoint import CheckpointServer, Owner, OwnerUnknown
from sco.agent.config import AgentConfig
from sco.agent.drains import DrainSupervisor
from sco.agent.enrol import Enrolment
from sco.agent.gauges import AgentGauges, ApiProbe
from sco.agent.intake import NoticeIntake
from sco.agent.notice_sources import MetadataNoticeSource, NatsNoticeSource
from sco.agent.notices import NoticeBook
from sco.agent.policy import Policy
from sco.agent.preflight import Preflight
from sco.agent.publisher import EventPublisher
from sco.agent.refresh import BundleRefresh
from sco.agent.relay import RelayLink
from sco.agent.scheduler import NodeScheduler, node_scheduler
from sco.agent.sdnotify import notify, watchdog_interval
from sco.agent.spool import CRITICAL, ROUTINE, Spool
from sco.contract.signing import Keyring

log = logging.getLogger("sco.agent")

# nats-py imports aiohttp when it is installed (for websockets), which costs ~11 MiB: the agent never
# uses websockets, so make the import fail before nats is loaded.
sys.modules.setdefault("aiohttp", None)  # type: ignore[arg-type]

STOP_TIMEOUT_S = 2.0  # root tasks, then the drain, each get this long to end at stop


class Agent:
    def __init__(self, cfg: AgentConfig, clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.clock = clock
        self.keyring = Keyring.from_dir(cfg.trust_dir)
        self.cache = BundleCache(cfg.bundle_dir, self.keyring, clock, hall=cfg.hall)
        self.policy = Policy(cfg, self.cache)
        self.spool = Spool(
            cfg.spool_dir,
            max_bytes=cfg.spool_max_bytes,
            sync_interval=cfg.spool_sync_interval,
            clock=clock,
            base={"hall": cfg.hall, "node": cfg.node},
        )
        self.metrics = agent_metrics.AgentMetrics(clock)
        agent_metrics.CURRENT = self.metrics
        self.spool.observer = self.metrics.observe
        self.metrics_server: agent_metrics.MetricsServer | None = None
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.failed_tasks: list[str] = []  # a root task that raised stops the agent, and run exits 1, never 0
        self._status_said = ""  # the drain state last sent as sd_notify STATUS

        # Built in run(), once the checkpoint socket (which the drain path tells) is up.
        self.scheduler: NodeScheduler | None = None
        self.preflight: Preflight | None = None
        self.checkpoint: CheckpointServer | None = None
        self.enrolment: Enrolment | None = None  # while this agent enrols (first boot)
        self.publisher = EventPublisher(
            self.spool, cfg.subject(cfg.events_subject), connection=lambda: self.relay.connection(), clock=clock
        )
        self.book = NoticeBook()
        self.drains = DrainSupervisor(
            spool=self.spool,
            book=self.book,
            bundle=lambda: self.cache.bundle,
            margin=lambda: self.policy.margin,
            clock=clock,
            spawn=self._spawn,
            wake=self.publisher.wake,
            stop=self._stop,
        )
        self.intake = NoticeIntake(
            spool=self.spool,
            metrics=self.metrics,
            clock=clock,
            bundle=lambda: self.cache.bundle,
            drains=self.drains,
            book=self.book,
        )
        common: dict[str, Any] = {
            "hall": cfg.hall,
            "node": cfg.node,
            "clock": clock,
            "window": lambda: self.policy.window,
            "deliver": self.intake.accept,
            "refuse": self.intake.refuse,
        }
        self.nats_source = NatsNoticeSource(trusted=self.intake.notice_keys, foreign=self.intake.foreign, **common)
        self.metadata_source = MetadataNoticeSource(
            url=cfg.metadata_url,
            interval=lambda: self.policy.metadata_poll,
            max_bytes=cfg.metadata_max_bytes,
            **common,
        )
        self.relay = RelayLink(cfg, self.nats_source, on_connected=self.publisher.wake)
        self.api_probe = ApiProbe(
            self._back_in_service, lambda: max(2.0, self.policy.api_timeout * 4), cfg.metrics_probe_seconds
        )
        self.metrics.gauges = AgentGauges(
            spool=self.spool,
            cache=self.cache,
            clock=clock,
            relay_up=self.relay.up,
            draining=lambda: self.drains.current is not None,
            scheduler=lambda: self.scheduler,
            preflight=lambda: self.preflight.last if self.preflight else None,
            api_up=lambda: self.api_probe.up,
        )

    async def _back_in_service(self) -> bool:
        assert self.scheduler is not None
        return await self.scheduler.back_in_service()

    def drain_state(self) -> str:
        return self.drains.state()

    def handle_raw(self, raw: bytes, source: str) -> None:
        src = self.nats_source if source == "nats" else self.metadata_source
        src.handle(raw)

    def stop(self) -> None:
        self._stop.set()

    # --- running ---------------------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.stop)
        cfg = self.cfg
        await self._start_checkpoint()  # before the drain path, which waits on its workloads
        self.scheduler = node_scheduler(
            cfg,
            spool=self.spool,
            cache=self.cache,
            checkpoint=self.checkpoint,
            api_timeout=self.policy.api_timeout,
            on_credential_change=lambda: self.preflight.write_state() if self.preflight else None,
        )
        self.preflight = Preflight(self.scheduler, self.spool, cfg.state_dir, cfg.preflight_seconds, self.clock)
        self.drains.attach(self.scheduler.path, self.checkpoint)
        b = self.cache.bundle
        if b is None:
            # said once, loudly: otherwise the first sign is a refused notice during a reclaim
            refused = self.cache.bundle_path.exists() and self.cache.state.last_error
            log.warning(
                "%s: every NATS notice is refused (the bundle names the notice keys) and a "
                "drain has no contract budgets until one is fetched%s",
                f"the bundle cached in {cfg.bundle_dir} is refused ({self.cache.state.last_error})"
                if refused
                else f"no bundle cached in {cfg.bundle_dir}",
                f" from {cfg.bundle_url}" if cfg.bundle_url else " (bundle_url is not set)",
            )
        self.drains.restore(cfg.hall, cfg.node, boot_id())
        self.spool.append(
            "agent.started",
            ROUTINE,
            version=__version__,
            boot_id=boot_id(),
            bundle_serial=b.serial if b else None,
            notice_keys=len(self.intake.notice_keys()),
            spool_torn_bytes=self.spool.recovery.torn_bytes,
            spool_skipped_bytes=self.spool.recovery.skipped_bytes,
            spool_records=self.spool.recovery.records,
        )
        self.drains.resume(cfg.hall, cfg.node)
        self.drains.follow_ups()
        self._enrol()
        # first boot: the credentials enrolment writes are awaited, not failures (said once, at info)
        self.preflight.waiting = self._enrolling
        if self.scheduler.renewer is not None:
            self.scheduler.renewer.waiting = self._enrolling
        self._spawn(self.relay.run(self._stop), "nats")
        if cfg.metadata_url:
            self._spawn(self.metadata_source.run(self._stop), "metadata-poll")
        self._spawn(self.drains.rearm_watch(cfg.rearm_check_seconds, self.scheduler.back_in_service), "rearm-watch")
        if cfg.bundle_url:
            fetcher = BundleFetcher(
                self.cache,
                cfg.bundle_url,
                max_bytes=cfg.bundle_max_bytes,
                deadline_s=cfg.bundle_fetch_deadline_seconds,
                ca_file=cfg.bundle_ca_file,
            )
            refresh = BundleRefresh(
                fetcher, self.cache, self.spool, interval=lambda: self.policy.bundle_refresh, on_accepted=self._ready
            )
            self._spawn(refresh.run(self._stop), "bundle-refresh")
        self._spawn(self.publisher.run(self._stop), "publisher")
        # the fleet state hears the agent is alive (hall status)
        beat = heartbeat.run(
            connection=self.relay.connection,
            subject=cfg.subject(cfg.heartbeat_subject),
            every=float(cfg.heartbeat_seconds),
            beat=self._beat,
            stop=self._stop,
        )
        self._spawn(beat, "heartbeat")
        self._spawn(self._housekeeping(), "housekeeping")
        self._spawn(self.preflight.run(self._stop), "preflight")  # what would stop a drain; again every few minutes
        if self.scheduler.renewer is not None:
            self._spawn(self.scheduler.renewer.run(self._stop), "token-renew")
        await self._start_metrics()
        self._ready()
        await self._stop.wait()
        await self._shutdown()
        if self.failed_tasks:  # systemd (Restart=on-failure) and whoever ran it must see a failure, not a stop
            log.error("stopped: task(s) %s failed (logged above)", ", ".join(self.failed_tasks))
            return 1
        return 0

    def _beat(self) -> bytes:
        b = self.cache.bundle
        return heartbeat.body(
            node=self.cfg.node,
            boot_id=boot_id(),
            drain=self.drain_state(),
            bundle_serial=b.serial if b else None,
            backlog=self.spool.last_seq - self.spool.published_seq,
            at=self.clock(),
        )

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        async def guarded() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("task %s failed", name)
                self.failed_tasks.append(name)
                self.spool.append("agent.task_failed", CRITICAL, task=name)
                self._stop.set()

        self._tasks.append(asyncio.create_task(guarded(), name=name))

    def _enrol(self) -> None:
        """First boot: exchange the one-time token for the creds file (and the Kubernetes token) in the
        background; the NATS link waits for it, the metadata channel and the drain path do not."""
        c = self.cfg
        if not c.enrols or Path(c.nats_creds_file).exists():
            self.relay.creds_ready.set()
            return
        self.enrolment = Enrolment(
            hall=c.hall, node=c.node, url=c.enrol_url, token=c.enrol_token, metadata_url=c.metadata_url,
            creds_file=Path(c.nats_creds_file), kube_token_file=Path(c.kube_token_file) if c.kube_token_file else None,
            spool=self.spool, on_done=self.relay.creds_ready.set, metrics_listen=c.metrics_listen,
            ca_file=c.enrol_ca_file,
        )  # fmt: skip
        self._spawn(self.enrolment.run(self._stop), "enrol")

    def _enrolling(self) -> bool:
        """Whether this agent's first-boot enrolment is still under way (its credentials not written yet)."""
        return self.enrolment is not None and self.enrolment.outcome == "pending"

    async def _housekeeping(self) -> None:
        wd = watchdog_interval()
        tick = min(0.5, wd) if wd else 0.5
        last_ping = 0.0
        while not self._stop.is_set():
            self.spool.maybe_sync()
            if self.spool.last_seq > self.spool.published_seq:
                self.publisher.wake()
            self.intake.catch_up()  # the foreign-traffic summary after a flood ends
            if wd and time.monotonic() - last_ping >= wd:
                notify("WATCHDOG=1")
                last_ping = time.monotonic()
            self._notify_status()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), tick)

    def _notify_status(self) -> None:
        """STATUS= follows the drain (a datagram only when it changed: the housekeeping tick is 0.5 s)."""
        state = self.drain_state()
        if state == self._status_said:
            return
        self._status_said = state
        b = self.cache.bundle
        where = f"hall {b.hall}, bundle serial {b.serial}" if b is not None else "no verified bundle yet: waiting"
        notify(f"STATUS={state}; {where}")

    def _ready(self) -> None:
        b = self.cache.bundle
        if b is not None:
            notify(f"READY=1\nSTATUS=hall {b.hall}, bundle serial {b.serial}, {len(b.contracts)} contracts")
        else:
            notify("STATUS=no verified bundle yet: waiting (work must not land here)")

    async def _start_checkpoint(self) -> None:
        """The checkpoint socket; a failure to listen is recorded, never a reason not to drain."""
        if not self.cfg.checkpoint_socket:
            return

        def budget_for(contract: str | None) -> float | None:
            b = self.cache.bundle.budget(contract) if (contract and self.cache.bundle) else None
            return float(b.drain_seconds) if b else None

        def on_event(type_: str, **fields: Any) -> None:
            notice = self.checkpoint.notice.id if self.checkpoint and self.checkpoint.notice else None
            self.spool.append(type_, ROUTINE, notice=notice, **fields)

        async def owner_of(pid: int, uid: int) -> Owner:
            # every registration is bound to the caller's pod or job (sco.agent.owner), checked by the scheduler
            if self.scheduler is None or self.scheduler.owner_of is None:
                raise OwnerUnknown("the agent is starting")
            return await self.scheduler.owner_of(pid, uid)

        srv = CheckpointServer(
            Path(self.cfg.checkpoint_socket),
            budget_for=budget_for,
            on_event=on_event,
            group=self.cfg.checkpoint_group,
            max_per_uid=self.cfg.checkpoint_max_per_uid,
            owner_of=owner_of,
            on_refused=self.metrics.checkpoint_refused,
        )
        try:
            await srv.start()
        except OSError as e:
            log.error("checkpoint socket %s: %s", self.cfg.checkpoint_socket, e)
            self.spool.append("checkpoint.unavailable", CRITICAL, path=self.cfg.checkpoint_socket, error=str(e))
            return
        self.checkpoint = srv

    async def _start_metrics(self) -> None:
        """The /metrics endpoint; a failure to listen is logged and recorded, never a reason not to drain."""
        if not self.cfg.metrics_listen:
            return
        try:
            srv = agent_metrics.MetricsServer(
                self.metrics, self.cfg.metrics_listen, self.cfg.metrics_tls_cert_file, self.cfg.metrics_tls_key_file
            )
            await srv.start()
        except (OSError, ValueError) as e:  # sco._tls.TlsSettingError is a ValueError
            log.error("metrics endpoint %s: %s", self.cfg.metrics_listen, e)
            self.spool.append("metrics.unavailable", ROUTINE, listen=self.cfg.metrics_listen, error=str(e))
            return
        self.metrics_server = srv
        log.info("metrics on %s://%s:%d/metrics", "https" if srv.tls else "http", srv.host, srv.port)
        self._spawn(self.api_probe.run(self._stop), "api-probe")

    async def _shutdown(self) -> None:
        notify("STOPPING=1")
        for t in self._tasks:
            t.cancel()
        await asyncio.wait(self._tasks, timeout=STOP_TIMEOUT_S)
        await self.drains.cancel(STOP_TIMEOUT_S)  # resumable from the spool
        await self.relay.close()
        if self.scheduler is not None:
            await self.scheduler.path.close()
        if self.checkpoint is not None:
            await self.checkpoint.close()
        if self.metrics_server is not None:
            await self.metrics_server.close()
        self.intake.record_foreign()  # the total as of the stop, for `sco-agent status`
        self.spool.close()
