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
from collections import Counter
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from sco import __version__
from sco._redact import strip_userinfo_in_text
from sco._retry import Backoff
from sco.agent import heartbeat
from sco.agent import metrics as agent_metrics
from sco.agent.boot import boot_id
from sco.agent.bundle_cache import BundleCache, BundleFetcher, Offer
from sco.agent.checkpoint import CheckpointServer
from sco.agent.config import AgentConfig
from sco.agent.deadline import Deadline
from sco.agent.drain import Drain, DrainPath
from sco.agent.notice_sources import MetadataNoticeSource, NatsNoticeSource, NoticeSource
from sco.agent.notices import Notice, NoticeBook, NoticeRefused
from sco.agent.resume import DrainRecord
from sco.agent.sdnotify import notify, watchdog_interval
from sco.agent.spool import CRITICAL, ROUTINE, Spool
from sco.contract.notice import notice_keyring
from sco.contract.signing import Keyring
from sco.errors import ConfigError

log = logging.getLogger("sco.agent")

# nats-py imports aiohttp when it is installed (for websockets), which costs ~11 MiB: the agent never
# uses websockets, so make the import fail before nats is loaded.
sys.modules.setdefault("aiohttp", None)  # type: ignore[arg-type]

OUTCOMES = ("drain.drained", "drain.overrun")
PUBLISH_WARN_EVERY_S = 60.0
PUBLISH_RETRY_S = (0.5, 10.0)  # first and longest wait after a refused publish (sco._retry.Backoff)
FOREIGN_SAY_EVERY_S = 60.0


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
        self.metrics = agent_metrics.AgentMetrics(clock)
        self.metrics.gauges = self._gauges
        agent_metrics.CURRENT = self.metrics
        self.spool.observer = self.metrics.observe
        self.metrics_server: agent_metrics.MetricsServer | None = None
        self.api_up: bool | None = None  # the scheduler API answered the last probe (None: not probed yet)
        self.refused: Counter[str] = Counter()
        self._refused_seen: set[str] = set()
        self._record_budget = (0.0, 0)  # (second, records) for refusal / absorbed records: floods cost no disk
        self._absorbed_recorded = 0
        self._keys: tuple[str | None, Keyring] = (None, Keyring())
        self.absorbed = 0
        common: dict[str, Any] = {
            "hall": cfg.hall,
            "node": cfg.node,
            "clock": clock,
            "window": lambda: self.window,
            "deliver": self.accept,
            "refuse": self._refuse,
        }
        self.foreign_traffic: Counter[str] = Counter()
        self._foreign_said = -FOREIGN_SAY_EVERY_S  # clock time of the last warning and summary record
        self._foreign_recorded: dict[str, int] = {}
        self.nats_source = NatsNoticeSource(trusted=self.notice_keys, foreign=self._foreign, **common)
        self.metadata_source = MetadataNoticeSource(
            url=cfg.metadata_url,
            interval=lambda: self._policy("metadataPollSeconds", self.cfg.metadata_poll_seconds, 5),
            max_bytes=cfg.metadata_max_bytes,
            **common,
        )
        self._publish_failing: tuple[float, str] | None = None
        self.path: DrainPath | None = None
        self.drain: Drain | None = None
        self._status_said = ""  # the drain state last sent as sd_notify STATUS
        self.drain_task: asyncio.Task[None] | None = None
        self.outcomes: list[dict[str, Any]] = []
        self.nc: Any = None
        self._stop = asyncio.Event()
        self._wake_publisher = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.failed_tasks: list[str] = []  # a root task that raised stops the agent, and run exits 1, never 0
        self.kube: Any = None
        self.preflight: dict[str, Any] | None = None  # the last preflight: {"at", "ok", "problems"}
        self.renewer: Any = None  # the bound token's renewal (kube_credential), when the agent renews it
        self.slurm: Any = None
        self.checkpoint: CheckpointServer | None = None
        self.enrolment: Any = None  # sco.agent.enrol.Enrolment while this agent enrols (first boot)
        self._creds_ready = asyncio.Event()  # the NATS link waits for the creds file enrolment writes

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

    def notice_keys(self) -> Keyring:
        """The notice keys the cached bundle's hall policy names (rebuilt when the bundle changes)."""
        b = self.cache.bundle
        digest = b.content_digest if b else None
        if self._keys[0] != digest:
            self._keys = (digest, notice_keyring(b.policy) if b else Keyring())
        return self._keys[1]

    def handle_raw(self, raw: bytes, source: str) -> None:
        src: NoticeSource = self.nats_source if source == "nats" else self.metadata_source
        src.handle(raw)

    def _may_record(self) -> bool:
        """At most 20 refusal/absorbed records a second: a flood is counted, not written one by one."""
        sec = int(self.clock())
        at, n = self._record_budget
        if at != sec:
            at, n = sec, 0
        self._record_budget = (at, n + 1)
        return n < 20

    def _refuse(self, source: str, e: NoticeRefused, raw: bytes) -> None:
        self.refused[e.kind] += 1
        self.metrics.notice(source, "refused")
        self.metrics.refusals.inc(e.kind)
        digest = hashlib.sha256(raw).hexdigest()
        if digest in self._refused_seen:
            return
        if len(self._refused_seen) > 1000:
            self._refused_seen.clear()
        self._refused_seen.add(digest)
        if self._may_record():
            self.spool.append(
                "notice.refused",
                ROUTINE,
                source=source,
                kind=e.kind,
                reason=e.reason,
                bytes=len(raw),
                sha256=digest,  # which message: a sender can tell its own notice from someone else's
                refused_total=dict(self.refused),
            )
            log.warning("refused %s notice (%s): %s", source, e.kind, e.reason[:300])

    def _foreign(self, kind: str) -> None:
        """JetStream acks or deliveries another client routed onto the notice subject: one warning and one
        summary record a minute at most (a flood costs a counter, not a disk write per message)."""
        self.foreign_traffic[kind] += 1
        now = self.clock()
        if now - self._foreign_said >= FOREIGN_SAY_EVERY_S:
            self._foreign_said = now
            log.warning(
                "foreign traffic on the notice subject, ignored (%s so far): another client routes JetStream "
                "replies or deliveries here (check the relay's permissions)",
                dict(self.foreign_traffic),
            )
            self._record_foreign()

    def _record_foreign(self) -> None:
        if dict(self.foreign_traffic) != self._foreign_recorded:
            self._foreign_recorded = dict(self.foreign_traffic)
            self.spool.append("notice.foreign_traffic", ROUTINE, foreign_traffic_total=self._foreign_recorded)

    def accept(self, n: Notice) -> None:
        verdict = self.book.offer(n)
        if verdict == "duplicate":
            self.metrics.notice(n.source, "duplicate")
            return
        drain = self.drain
        if verdict == "start" and drain is None:
            self.metrics.notice(n.source, "accepted")
            self.spool.append("notice.accepted", CRITICAL, **n.as_event())
            self._start_drain(n, None)
            return
        if drain is not None and n.terminate_at <= drain.deadline.terminate_at - 1.0:
            self.spool.append(
                "notice.deadline",
                CRITICAL,
                notice=drain.notice.id,
                terminate_at=n.terminate_at,
                from_notice=n.id,
                source=n.source,
            )
            drain.update_deadline(n.terminate_at)
            self.metrics.notice(n.source, "deadline")
            if self.checkpoint is not None:  # workloads are told the shorter budget at once
                self.checkpoint.update_deadline()
            return
        # Another notice while the node drains or after it drained: counted, never a second drain.
        self.absorbed += 1
        self.metrics.notice(n.source, "absorbed")
        if self._may_record():
            self.spool.append(
                "notice.absorbed",
                ROUTINE,
                notice=n.id,
                source=n.source,
                terminate_at=n.terminate_at,
                draining=drain is not None,
                of=self.book.current.id if self.book.current else None,
                absorbed_total=self.absorbed,
            )

    def _restore_book(self) -> None:
        """After a restart on the same instance, a drain this instance started still holds: no second one."""
        last: dict[str, Any] | None = None
        deadline: float | None = None
        boot = None
        for ev in self.spool.events():
            t = ev["type"]
            if t == "agent.started":
                boot = ev.get("boot_id")
            elif t == "notice.accepted":
                last, deadline = ev, float(ev["terminate_at"])
            elif t == "notice.deadline" and last is not None and ev.get("notice") == last["notice"]:
                deadline = min(deadline or float(ev["terminate_at"]), float(ev["terminate_at"]))
            elif t == "notice.rearmed":
                last, deadline = None, None
        if last is None or deadline is None or boot != boot_id():
            return
        self.book.restore(
            Notice(
                str(last["notice"]),
                self.cfg.hall,
                self.cfg.node,
                float(last["terminate_at"]),
                float(last["issued_at"]),
                str(last["source"]),
                float(last["received_at"]),
            ),
            deadline,
        )

    async def _node_back_in_service(self) -> bool:
        if self.cfg.scheduler == "slurm":
            state = await self.slurm.node_state(self.cfg.node)
            return "DRAIN" not in state.upper()
        node = await self.kube.get_node(self.cfg.node)
        spec = node.get("spec", {})
        tainted = any(t.get("key") == self.cfg.taint_key for t in spec.get("taints") or [])
        return not tainted and not spec.get("unschedulable")

    async def _rearm_watch(self) -> None:
        """After a drain the node stays drained: notices are absorbed until someone puts it back."""
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.cfg.rearm_check_seconds)
            if self.book.current is None or self.drain is not None or self._stop.is_set():
                continue
            try:
                back = await self._node_back_in_service()
            except Exception as e:  # scheduler away: look again later
                log.debug("rearm check: %s", e)
                continue
            if back:
                prev = self.book.current.id
                self.book.rearm()
                self.spool.append("notice.rearmed", CRITICAL, after=prev, reason="node back in service")
                log.info("node back in service after notice %s: the next notice drains it again", prev)

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
        deadline = Deadline.for_notice(n.terminate_at, self.margin, received, self.clock)
        if deadline.late is not None:
            log.warning("notice %s is past its time (%s): draining best effort", n.id, deadline.late)
            self.spool.append("notice.late", CRITICAL, notice=n.id, **deadline.late)
        drain = self.path.drain(n, deadline, record)
        self.drain = drain
        if self.checkpoint is not None:  # workloads on the checkpoint socket are told at once
            self.checkpoint.start_notice(n.id, deadline)
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

    # --- metrics ----------------------------------------------------------------------------------

    def _gauges(self) -> list[tuple[str, str, float | None]]:
        """Read at scrape time (docs/METRICS.md); None: unknown, left out."""
        b, st, now = self.cache.bundle, self.cache.state, self.clock()
        checked = st.last_check_at if st.last_outcome in ("accepted", "unchanged") else None
        checked = checked or st.accepted_at
        creds = getattr(self.kube, "creds", None)
        expiry = agent_metrics.token_expiry(getattr(creds, "token_file", None))
        renewal = self.renewer.state()["renewal"] if self.renewer is not None else None
        nc = self.nc
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
                "sco_agent_relay_up",
                "1 if the NATS relay link is connected.",
                1.0 if nc is not None and nc.is_connected else 0.0,
            ),
            (
                "sco_agent_scheduler_api_up",
                "1 if the scheduler API (Kubernetes or slurmctld) answered the last probe.",
                None if self.api_up is None else float(self.api_up),
            ),
            (
                "sco_agent_credential_expiry_timestamp_seconds",
                "Expiry (exp) of the scheduler API bearer token.",
                expiry,
            ),
            (
                "sco_agent_scheduler_preflight_ok",
                "1 if the last preflight found nothing that would stop a drain (node known, credential allowed).",
                None if self.preflight is None else float(self.preflight["ok"]),
            ),
            (
                "sco_agent_scheduler_preflight_timestamp_seconds",
                "When the last preflight ran (at start, every preflight_seconds, when the credential changes).",
                None if self.preflight is None else float(self.preflight["at"]),
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
            ("sco_agent_draining", "1 while a drain runs.", 1.0 if self.drain is not None else 0.0),
        ]

    async def _api_probe(self) -> None:
        """The scheduler API's reachability for sco_agent_scheduler_api_up: one cheap read a minute."""
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._node_back_in_service(), max(2.0, self.api_timeout * 4))
                self.api_up = True
            except Exception as e:
                log.debug("scheduler API probe: %s", e)
                self.api_up = False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.cfg.metrics_probe_seconds)

    async def _start_metrics(self) -> None:
        """The /metrics endpoint; a failure to listen is logged and recorded, never a reason not to drain."""
        if not self.cfg.metrics_listen:
            return
        srv = agent_metrics.MetricsServer(self.metrics, self.cfg.metrics_listen)
        try:
            await srv.start()
        except OSError as e:
            log.error("metrics endpoint %s: %s", self.cfg.metrics_listen, e)
            self.spool.append("metrics.unavailable", ROUTINE, listen=self.cfg.metrics_listen, error=str(e))
            return
        self.metrics_server = srv
        log.info("metrics on http://%s:%d/metrics", srv.host, srv.port)
        self._spawn(self._api_probe(), "api-probe")

    # --- root tasks --------------------------------------------------------------------------------

    def _nats_auth(self) -> dict[str, Any]:
        c = self.cfg
        if c.nats_creds_file:
            return {"user_credentials": c.nats_creds_file}
        if c.nats_nkey_seed_file:
            return {"nkeys_seed": c.nats_nkey_seed_file}
        if c.nats_token:
            return {"token": c.nats_token}
        if c.nats_user:
            return {"user": c.nats_user, "password": c.nats_password}
        return {}

    def _enrol(self) -> None:
        """First boot: exchange the one-time token for the creds file (and the Kubernetes token) in the
        background; the NATS link waits for it, the metadata channel and the drain path do not."""
        if not self.cfg.enrols or Path(self.cfg.nats_creds_file).exists():
            self._creds_ready.set()
            return
        from sco.agent.enrol import Enrolment

        c = self.cfg
        self.enrolment = Enrolment(
            hall=c.hall, node=c.node, url=c.enrol_url, token=c.enrol_token, metadata_url=c.metadata_url,
            creds_file=Path(c.nats_creds_file), kube_token_file=Path(c.kube_token_file) if c.kube_token_file else None,
            spool=self.spool, on_done=self._creds_ready.set,
        )  # fmt: skip
        self._spawn(self.enrolment.run(self._stop), "enrol")

    async def _nats_link(self) -> None:
        import nats

        if not self._creds_ready.is_set():  # enrolling: connect once the creds file is written
            waits = [asyncio.create_task(self._creds_ready.wait()), asyncio.create_task(self._stop.wait())]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
            if self._stop.is_set():
                return

        async def disconnected() -> None:
            log.warning("NATS disconnected; the metadata poll covers notices meanwhile")

        async def reconnected() -> None:
            log.info("NATS reconnected")
            self._wake_publisher.set()

        async def error(e: Exception) -> None:
            # Authorization and permission errors are the relay refusing this node: say so at the default level.
            level = logging.WARNING if "authoriz" in str(e).lower() or "permission" in str(e).lower() else logging.DEBUG
            log.log(level, "NATS: %s", strip_userinfo_in_text(str(e)))

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
            # Replies (JetStream acks) come back on the node's own inbox: the relay lets a node subscribe only
            # there, never to _INBOX.>, where the control users' consumers deliver every node's events.
            inbox_prefix=self.cfg.inbox_prefix,
            **self._nats_auth(),
        )
        subject = self.cfg.subject(self.cfg.notice_subject)
        await self.nats_source.subscribe(self.nc, subject)
        await self.nc.flush(timeout=2)
        log.info("NATS connected; subscribed to %s", subject)
        self._wake_publisher.set()
        await self._stop.wait()

    async def _bundle_refresh(self) -> None:
        fetcher = BundleFetcher(
            self.cache,
            self.cfg.bundle_url,
            max_bytes=self.cfg.bundle_max_bytes,
            deadline_s=self.cfg.bundle_fetch_deadline_seconds,
        )
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
        """Spool to JetStream in seq order; after an outage, replays from the cursor in order. A publish
        JetStream refuses (no stream, a timeout) is tried again after a backoff with jitter, not at every wake-up
        (twice a second while a backlog waits: a hall's agents would all hammer a broken stream in step)."""
        subject = self.cfg.subject(self.cfg.events_subject)
        backoff = Backoff(PUBLISH_RETRY_S[0], PUBLISH_RETRY_S[1])
        while not self._stop.is_set():
            self._wake_publisher.clear()
            nc = self.nc
            if nc is not None and nc.is_connected:
                js = nc.jetstream(timeout=2)
                batch = self.spool.unpublished(200)
                done = 0
                try:
                    for ev in batch:
                        # JetStream de-duplicates replays by this id; the random spool id makes it unguessable.
                        msg_id = f"{self.spool.id}.{ev['seq']}"
                        await js.publish(subject, json.dumps(ev).encode(), headers={"Nats-Msg-Id": msg_id})
                        done = ev["seq"]
                    self._published_ok()
                    backoff.reset()
                except Exception as e:  # no stream, timeout, disconnect: retry later from the cursor
                    self._publish_failed(subject, e)
                    batch = []
                    if nc.is_connected:  # refused on a live connection; a dropped one is nats-py's to reconnect
                        if done:
                            self.spool.mark_published(done)
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self._stop.wait(), backoff.next())
                        continue
                if done:
                    self.spool.mark_published(done)
                if len(batch) == 200:
                    continue
            else:
                backoff.reset()  # reconnected later: publish at once, the outage was not JetStream's refusal
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake_publisher.wait(), 1.0)

    def _publish_failed(self, subject: str, e: Exception) -> None:
        now = self.clock()
        reason = f"{type(e).__name__}: {e}".strip().rstrip(":")
        if "NoResponders" in reason or "NoStream" in reason or "no responders" in reason.lower():
            reason = f"no JetStream stream captures {subject} ({type(e).__name__})"
        prev = self._publish_failing
        if prev is None or now - prev[0] >= PUBLISH_WARN_EVERY_S:
            backlog = self.spool.last_seq - self.spool.published_seq
            log.warning("events cannot be published: %s; %d event(s) wait in the spool", reason, backlog)
            self._publish_failing = (now, reason)

    def _published_ok(self) -> None:
        if self._publish_failing is not None:
            log.warning("events publishing again (was: %s)", self._publish_failing[1])
            self._publish_failing = None

    async def _housekeeping(self) -> None:
        wd = watchdog_interval()
        tick = min(0.5, wd) if wd else 0.5
        last_ping = 0.0
        while not self._stop.is_set():
            self.spool.maybe_sync()
            if self.spool.last_seq > self.spool.published_seq:
                self._wake_publisher.set()
            if self.clock() - self._foreign_said >= FOREIGN_SAY_EVERY_S:
                self._record_foreign()  # the summary catches up after a flood ends
            if wd and time.monotonic() - last_ping >= wd:
                notify("WATCHDOG=1")
                last_ping = time.monotonic()
            self._notify_status()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), tick)

    def drain_state(self) -> str:
        """idle / draining n/m (pods or jobs gone of those seen) / drained / overrun: for systemctl status."""
        drain = self.drain
        if drain is not None:
            progress = getattr(drain, "progress", None)
            done, total = progress() if progress is not None else (0, 0)
            return f"draining {done}/{total} for notice {drain.notice.id}"
        if self.outcomes:
            last = self.outcomes[-1]
            return f"{last.get('outcome', 'finished')} for notice {last.get('notice')}"
        return "idle"

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
                checkpoint=self.checkpoint,
            )
        from sco.agent.inhibit import Logind
        from sco.agent.kube_drain import KubePath
        from sco.agent.kube_node import KubeNodePath
        from sco.schedulers.kube import KubeClient, KubeConfigError

        try:
            self.kube = KubeClient(
                KubePath.credentials(self.cfg), timeout=self.api_timeout, max_connections=self.cfg.evict_concurrency
            )
        except (KubeConfigError, OSError) as e:  # no CA for https, an unreadable kubeconfig
            raise ConfigError(f"kubernetes credentials: {e}") from None
        if (
            self.cfg.kube_token_file
            and self.cfg.kube_token_renew
            and not (self.cfg.kube_in_cluster or self.cfg.kube_kubeconfig)
        ):
            # in-cluster and kubeconfig tokens are kubelet's or a person's to renew; the agent's own file is its
            from sco.agent.kube_credential import TokenRenewer

            self.renewer = TokenRenewer(
                self.kube,
                Path(self.cfg.kube_token_file),
                self.cfg.node,
                self.spool,
                timeout=max(2.0, self.api_timeout),
                on_change=self._write_scheduler_state,
            )
        # Spark executors first, a driver last; around a silent API server, logind and kubelet (kube_node).
        return KubeNodePath(
            kube=self.kube,
            spool=self.spool,
            bundle=lambda: self.cache.bundle,
            node=self.cfg.node,
            taint_key=self.cfg.taint_key,
            api_timeout=self.api_timeout,
            logind=Logind(self.cfg.logind_bus),
            checkpoint=self.checkpoint,
            shutdown=self.cfg.kube_fallback,
        )

    def _credential_signature(self) -> Any:
        sig = getattr(self.kube, "token_file_signature", None)
        return sig() if sig is not None else None

    async def _preflight_once(self) -> None:
        """One preflight: what would stop a drain (unknown node, refused credential). Spooled when its answer
        changes (problems found, other problems, all well again), never every run; the last answer is in
        ``scheduler.json`` for `sco-agent status` and in the metrics."""
        assert self.path is not None
        problems = await self.path.preflight()
        prev = self.preflight
        self.preflight = {"at": round(self.clock(), 3), "ok": not problems, "problems": problems}
        if prev is None or prev["problems"] != problems:
            for p in problems:
                log.error("preflight: %s", p)
            if problems:
                self.spool.append("scheduler.preflight", CRITICAL, problems=problems)
            elif prev is not None:
                log.info("preflight: all well again")
                self.spool.append("scheduler.preflight_ok", ROUTINE)
        self._write_scheduler_state()

    async def _preflight(self) -> None:
        """The preflight at start, every ``preflight_seconds`` and at once when the credential file changes (a
        rotated or renewed token is checked before a notice needs it, not at the next start)."""
        loop = asyncio.get_running_loop()
        while not self._stop.is_set():
            sig = self._credential_signature()
            try:
                await self._preflight_once()
            except Exception as e:  # a bug here must not end the repeats (nor the agent)
                log.error("preflight: %s", e)
            until = loop.time() + self.cfg.preflight_seconds
            while not self._stop.is_set() and loop.time() < until:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), min(1.0, max(0.0, until - loop.time())))
                if self._credential_signature() != sig:
                    break  # the credential file changed: check the new credential now

    def _scheduler_state(self) -> dict[str, Any]:
        creds = getattr(self.kube, "creds", None)
        tf = getattr(creds, "token_file", None)
        out: dict[str, Any] = {"preflight": self.preflight}
        if tf is not None:
            out["credential"] = {"token_file": str(tf), "expiry": agent_metrics.token_expiry(tf)}
            if self.renewer is not None:
                out["credential"].update(self.renewer.state())
        return out

    def _write_scheduler_state(self) -> None:
        """``scheduler.json`` beside the spool: the last preflight and the credential's expiry, for `sco-agent
        status` (which reads the state directory only). A failure to write is logged: never a reason to stop."""
        from sco._fs import atomic_write

        try:
            data = json.dumps(self._scheduler_state(), sort_keys=True).encode()
            atomic_write(self.cfg.state_dir / "scheduler.json", data)
        except OSError as e:
            log.warning("%s: %s", self.cfg.state_dir / "scheduler.json", e)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.stop)
        await self._start_checkpoint()  # before the drain path, which waits on its workloads
        self.path = self._drain_path()
        b = self.cache.bundle
        if b is None:
            # said once, loudly: otherwise the first sign is a refused notice during a reclaim
            refused = self.cache.bundle_path.exists() and self.cache.state.last_error
            log.warning(
                "%s: every NATS notice is refused (the bundle names the notice keys) and a "
                "drain has no contract budgets until one is fetched%s",
                f"the bundle cached in {self.cfg.bundle_dir} is refused ({self.cache.state.last_error})"
                if refused
                else f"no bundle cached in {self.cfg.bundle_dir}",
                f" from {self.cfg.bundle_url}" if self.cfg.bundle_url else " (bundle_url is not set)",
            )
        self._restore_book()
        self.spool.append(
            "agent.started",
            ROUTINE,
            version=__version__,
            boot_id=boot_id(),
            bundle_serial=b.serial if b else None,
            notice_keys=len(self.notice_keys()),
            spool_torn_bytes=self.spool.recovery.torn_bytes,
            spool_skipped_bytes=self.spool.recovery.skipped_bytes,
            spool_records=self.spool.recovery.records,
        )
        self._resume_from_spool()
        self._follow_ups()
        self._enrol()
        self._spawn(self._nats_link(), "nats")
        if self.cfg.metadata_url:
            self._spawn(self.metadata_source.run(self._stop), "metadata-poll")
        self._spawn(self._rearm_watch(), "rearm-watch")
        if self.cfg.bundle_url:
            self._spawn(self._bundle_refresh(), "bundle-refresh")
        self._spawn(self._publisher(), "publisher")
        self._spawn(heartbeat.run(self), "heartbeat")  # the fleet state hears the agent is alive (hall status)
        self._spawn(self._housekeeping(), "housekeeping")
        self._spawn(self._preflight(), "preflight")  # says what would stop a drain; again every few minutes
        if self.renewer is not None:
            self._spawn(self.renewer.run(self._stop), "token-renew")
        await self._start_metrics()
        self._ready()
        await self._stop.wait()
        await self._shutdown()
        if self.failed_tasks:  # systemd (Restart=on-failure) and whoever ran it must see a failure, not a stop
            log.error("stopped: task(s) %s failed (logged above)", ", ".join(self.failed_tasks))
            return 1
        return 0

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

        srv = CheckpointServer(Path(self.cfg.checkpoint_socket), budget_for=budget_for, on_event=on_event)
        try:
            await srv.start()
        except OSError as e:
            log.error("checkpoint socket %s: %s", self.cfg.checkpoint_socket, e)
            self.spool.append("checkpoint.unavailable", CRITICAL, path=self.cfg.checkpoint_socket, error=str(e))
            return
        self.checkpoint = srv

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
        if self.checkpoint is not None:
            await self.checkpoint.close()
        if self.metrics_server is not None:
            await self.metrics_server.close()
        self._record_foreign()  # the total as of the stop, for `sco-agent status`
        self.spool.close()
