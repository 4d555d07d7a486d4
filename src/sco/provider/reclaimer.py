"""The reclaimer: the provider side of a notice.

For each instance taken back (an operator's command, a pool shrinking, a Blazar lease starting) it fixes the
termination time T = now + window once, records it in the fleet state, publishes the notice on the hall's NATS
relay (``sco.notice.<hall>.<node>``, the shape the agent parses), writes it into the instance's metadata (the
agent's poll channel, for when the relay is down), and deletes the instance through Nova at T, whatever the
agent reported. The agent's own account of its drain arrives on JetStream (``sco.events.<hall>.>``) and is
folded into the fleet state (draining, drained or overrun), once per event however often it is redelivered, and
only when it is about the notice the instance is under.

A delete is a finalizer: it is retried (capped exponential backoff with jitter) until Nova confirms the server is
gone, by this run and, past this run's retry budget, by every later one; it is never given up. A run that ends
with an instance not confirmed gone says so (``unconfirmed``; ``sco reclaim`` exits 9). Every OpenStack call has
a deadline (the connection's ``api_timeout`` and ``call_timeout_s`` around each call's thread), so a Nova or a
Keystone that accepts connections and never answers costs a failed attempt, not a hung run holding the lock.

A restarted reclaimer resumes from the fleet state: every instance under reclaim still has its T there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sco import _nats
from sco._redact import strip_userinfo, strip_userinfo_in_text
from sco._retry import Backoff
from sco.contract.notice import sign_notice
from sco.contract.signing import PrivateKey
from sco.errors import ConfigError, Problem, ScoError
from sco.state.db import SessionLost, StateError
from sco.state.fleet import RECLAIMING, FleetState, Instance

log = logging.getLogger("sco.reclaimer")


def db_failure(state: FleetState, hall: str, e: Exception) -> StateError:
    """What a fleet-state error mid-reclaim is: SessionLost when the connection itself is gone (PostgreSQL
    restarted, a failover: the run may connect again and go on), else a StateError naming the server's refusal (a
    full disk, a permission, a timeout: connecting again would only meet it again)."""
    why = " ".join(str(e).split())[:500]
    if state.conn.closed or state.conn.broken:
        return SessionLost(
            f"hall {hall}: the fleet state went away mid-reclaim (the hall's lock with it): {why}; instances under"
            " reclaim keep their T: run again"
        )
    return StateError(
        f"hall {hall}: the fleet state refused the reclaim's write: {why}; instances under reclaim keep their T:"
        " run again once it is fixed"
    )


NOTICE_SUBJECT = "sco.notice.{hall}.{node}"
EVENTS_SUBJECT = "sco.events.{hall}.>"
EVENTS_STREAM = "SCO_EVENTS"
MAX_WINDOW_S = 3600.0  # a notice window beyond an hour is a mistake (seconds taken for milliseconds...)
# What the agent's events mean for the instance's lifecycle state (and from which states they may move it).
# the first signs of a drain under way (an API that answered "no" to the taint is one too)
_DRAINING = ("node.tainted", "node.drain_set", "scheduler.unreachable", "scheduler.refused", "job.signalled")
_FOLD: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "drain.drained": ("drained", ("notified", "draining")),
    "drain.overrun": ("overrun", ("notified", "draining")),
    **{t: ("draining", ("notified",)) for t in _DRAINING},
}
RENOTICE_BASE_S, RENOTICE_CAP_S = 1.0, 8.0  # a notice sent again until the agent answers (Reclaimer._renotice)
_RECORDED_PREFIXES = ("notice.", "node.", "drain.", "scheduler.", "job.")
# A notice was tried on a channel (sent or not): the node may know its T. None of these for the reclaim it is
# under: the run that recorded T stopped before it told anyone.
_NOTICE_TRIES = ("notice.published", "notice.publish_failed", "notice.metadata_written", "notice.metadata_failed")


# Below this no drain is possible whatever the contracts say: the agent grants at least 1 s of grace and reports
# an overrun at least 1 s before T, and the notice itself takes its time to arrive.
MIN_WINDOW_S = 3.0


class ReclaimIncomplete(ScoError):
    """Instances the run could not confirm gone from Nova (still under reclaim: a later run keeps deleting)."""

    exit_code = 9  # the README's table: acquiring or deleting instances through Nova


@dataclass(frozen=True)
class DrainFloor:
    """The shortest notice window the hall's contracts can drain in: the largest drain budget plus final write
    of any contract, plus the hall's safety margin."""

    seconds: float
    contract: str
    budget_s: float
    margin_s: float

    def __str__(self) -> str:
        return (
            f"contract {self.contract}'s drain budget and final write ({self.budget_s:g} s) plus the hall's safety"
            f" margin ({self.margin_s:g} s) = {self.seconds:g} s"
        )


def drain_floor(policy: dict[str, Any], contracts: dict[str, dict[str, Any]]) -> DrainFloor | None:
    """The floor of a bundle's hall (its policy and contracts); None for a bundle without contracts."""
    margin = float(policy.get("safetyMarginSeconds", 10))
    worst = max(
        contracts.values(),
        key=lambda c: (float(c.get("drainBudgetSeconds", 0)) + float(c.get("finalWriteSeconds", 0)), c["name"]),
        default=None,
    )
    if worst is None:
        return None
    budget = float(worst.get("drainBudgetSeconds", 0)) + float(worst.get("finalWriteSeconds", 0))
    return DrainFloor(budget + margin, str(worst["name"]), budget, margin)


def window_problem(what: str, window: object, floor: DrainFloor | None = None) -> str | None:
    """Why ``window`` cannot be a notice window (seconds from the notice to the delete), or None.

    Without a floor (the hall's contracts unknown) only windows no drain can fit are refused (below MIN_WINDOW_S).
    """
    if not (isinstance(window, int | float) and not isinstance(window, bool) and 0 < window <= MAX_WINDOW_S):
        # (NaN fails the comparison)
        return f"{what}: expected more than 0 and at most {MAX_WINDOW_S:g} seconds, got {window}"
    if window < MIN_WINDOW_S:
        return f"{what}: {window:g} s leaves no time to drain (at least {MIN_WINDOW_S:g} s)"
    if floor is not None and window < floor.seconds:
        return f"{what}: {window:g} s is shorter than the hall's drain needs: {floor}"
    return None


@dataclass
class DeleteRetry:
    """When one instance's delete (or the check that it is gone) may be tried next: after each failure, the
    shared backoff's next wait (``sco._retry``: capped exponential, equal jitter, so never hot and never in step
    across instances)."""

    backoff: Backoff
    next_at: float = 0.0

    @property
    def attempts(self) -> int:
        return self.backoff.attempts

    def failed(self, now: float) -> float:
        self.next_at = now + self.backoff.next()
        return self.next_at


def notice_document(notice_id: str, hall: str, node: str, terminate_at: float, issued_at: float) -> dict[str, Any]:
    return {"id": notice_id, "hall": hall, "node": node, "terminateAt": terminate_at, "issuedAt": issued_at}


def encode_notice(notice: dict[str, Any], signing_keys: list[PrivateKey]) -> bytes:
    """The bytes published on the relay, signed with the hall's notice keys (agents refuse unsigned notices).
    Every notice goes through here."""
    return sign_notice(notice, signing_keys)


async def publish_notice(nc: Any, notice: dict[str, Any], signing_keys: list[PrivateKey]) -> bytes:
    data = encode_notice(notice, signing_keys)
    await nc.publish(NOTICE_SUBJECT.format(hall=notice["hall"], node=notice["node"]), data)
    await nc.flush(timeout=2)
    return data


@dataclass
class Reclaim:
    instance: Instance
    notice: dict[str, Any]
    terminate_at: float
    started_at: float
    published_at: float | None = None  # None: the relay was unreachable (the metadata still carries it)
    metadata_at: float | None = None
    delete_sent_at: float | None = None  # when the DELETE went to Nova
    deleted_at: float | None = None  # when Nova accepted it
    agent_state: str | None = None  # the agent's account when the delete went out (drained, overrun, draining...)
    gone_at: float | None = None  # when Nova confirmed the server gone
    renotice: Backoff | None = None  # the notice sent again until the agent answers (``Reclaimer._renotice``)
    renotice_at: float = 0.0
    renoticed: int = 0


class Reclaimer:
    def __init__(
        self,
        cloud: Any,
        state: FleetState,
        nats_url: str,
        *,
        window_s: float = 120.0,
        clock: Callable[[], float] = time.time,
        signing_keys: list[PrivateKey],
        events_stream: str = EVENTS_STREAM,
        gone_poll_s: float = 0.5,
        nova_concurrency: int = 32,
        nats_auth: dict[str, Any] | None = None,
        retry_for_s: float = 120.0,
        call_timeout_s: float = 30.0,
        backoff_base_s: float = 0.5,
        backoff_cap_s: float = 30.0,
        floor: DrainFloor | None = None,
        rand: Callable[[float, float], float] = random.uniform,
    ) -> None:
        self.cloud = cloud  # an openstacksdk Connection (sco.provider.cloud.connect: with its api_timeout)
        self.state = state
        self.nats_url = nats_url
        self.window_s = window_s
        self.clock = clock
        self.signing_keys = signing_keys
        self.events_stream = events_stream
        self.gone_poll_s = gone_poll_s
        # How long past the later of this run's start and the last T the run keeps retrying deletes Nova refuses
        # or does not answer before it returns (the instances stay under reclaim: the next run retries at once).
        self.retry_for_s = retry_for_s
        # A deadline on each OpenStack call (its thread may linger until the connection's own api_timeout).
        self.call_timeout_s = call_timeout_s
        self.backoff_base_s, self.backoff_cap_s, self.rand = backoff_base_s, backoff_cap_s, rand
        self.backoff: dict[int, DeleteRetry] = {}
        # instance id -> why it is not confirmed gone (the cloud's last message) when run() returned
        self.unconfirmed: dict[int, str] = {}
        self.last_error: dict[int, str] = {}
        if (problem := window_problem("window", window_s, floor)) is not None:
            raise ConfigError(problem)
        # nats.connect's credentials (user/password, token, nkeys_seed or user_credentials): the relay's
        # reclaimer identity, which may publish notices and read the hall's events
        self.nats_auth = dict(nats_auth or {})
        self.nc: Any = None
        self._relay_down_until = 0.0
        self._connecting = asyncio.Lock()  # one relay connection per run (the events' retry connects beside it)
        self.gone_by: dict[str, tuple[float, str]] = {}
        self.reclaims: dict[int, Reclaim] = {}
        # instance id -> what this run deleted of the reclaims another run noticed (a control host that stopped
        # before T): its T, when the delete went out, how late, what the agent had said
        self.finished: dict[int, dict[str, Any]] = {}
        # instance id -> why it is not deleted: under reclaim by a run that stopped before it sent the notice, and
        # this run has no notice key to send one (deleting it at T would take the node's work without warning)
        self.unnoticed: dict[int, str] = {}
        self._told: set[int] = set()  # instances whose notice was tried (looked up once a run)
        self._calls = asyncio.Semaphore(nova_concurrency)

    async def _connect(self, *, retrying: bool = False) -> Any:
        async with self._connecting:
            return await self._connect_once(retrying)

    async def _connect_once(self, retrying: bool) -> Any:
        if self.nc is None or self.nc.is_closed:
            # it just failed: the run does not wait on it again (the events' retry, beside the run, does)
            if not retrying and time.monotonic() < self._relay_down_until:
                raise ConnectionError(f"relay {strip_userinfo(self.nats_url)} unreachable a moment ago")

            async def said(e: Exception) -> None:  # nats-py's default prints a traceback per attempt
                log.debug("relay %s: %s", strip_userinfo(self.nats_url), strip_userinfo_in_text(str(e)))

            # nats-py retries a refused first connection whatever its options say: bound the first one. Each relay
            # that drops packets costs its 2 s connect_timeout, so the bound grows with the cluster (three silent
            # relays before a live one took 6 s, past a fixed 5 s), capped so a dead relay list fails in time.
            servers = [u.strip() for u in self.nats_url.split(",") if u.strip()]
            try:
                # every relay of the hall's cluster: nats-py fails over between them
                self.nc = await _nats.connect(
                    servers, auth=self.nats_auth, deadline_s=min(15.0, 3.0 + 2.0 * len(servers)), reconnect=True,
                    error_cb=said,
                )  # fmt: skip
            except asyncio.CancelledError:  # the run stopped waiting (its end, a bound): says nothing of the relay
                raise
            except BaseException:
                self._relay_down_until = time.monotonic() + 30
                raise
        return self.nc

    async def close(self) -> None:
        if self.nc is not None and not self.nc.is_closed:
            try:
                await self.nc.drain()
            except Exception:  # the relay went away meanwhile (reconnecting): nothing left to flush
                await self.nc.close()
        self.nc = None

    # --- notice ----------------------------------------------------------------------------------------

    def _targets(self, hall: str, nodes: list[str]) -> list[Instance]:
        found = {i.name: i for i in self.state.instances(hall, names=nodes)}
        problems = [
            Problem(f"hall {hall}", n, "no live instance of that name in the fleet state")
            for n in nodes
            if n not in found
        ]
        problems += [
            Problem(f"hall {hall}", n, f"instance is {found[n].state}: nothing to reclaim")
            for n in nodes
            if n in found and (found[n].state not in ("active", *RECLAIMING) or not found[n].server_id)
        ]
        if problems:
            raise ConfigError("cannot reclaim", problems)
        return [found[n] for n in nodes]

    async def notify(
        self, hall: str, nodes: list[str], *, gone_by: dict[str, tuple[float, str]] | None = None
    ) -> list[Reclaim]:
        """Notice every node (nothing happens if any is unknown); an instance already under reclaim keeps its T.

        ``gone_by``: node -> (time, why) by which it must be gone (a host lease starting): T is then the earlier
        of now + window and that time.

        Each T is recorded first (a crash from then on still deletes at T), then every notice goes on the relay
        (milliseconds each), then the metadata writes (a Nova call each) run in parallel.
        """
        if not self.signing_keys:  # finishing what is under reclaim needs none; a notice does
            raise ConfigError("no notice key: the hall's agents refuse unsigned notices (hall policy noticeKeys)")
        targets = self._targets(hall, nodes)
        self.gone_by.update(gone_by or {})  # a node told again later (a lost session) keeps its deadline
        out = [self._schedule(hall, inst, (gone_by or {}).get(inst.name)) for inst in targets]
        await self._send(hall, out)
        return out

    async def _send(self, hall: str, out: list[Reclaim]) -> None:
        try:
            nc = await self._connect()
        except Exception as e:  # the relay is down: the metadata channel still carries every notice
            log.warning("notice relay %s unreachable: %s", strip_userinfo(self.nats_url), _cloud_message(e))
            nc = None
        for r in out:
            if nc is not None:
                await self._publish(hall, r, nc)
            else:
                self.state.event(
                    hall, "notice.publish_failed", instance_id=r.instance.id, notice=r.notice["id"],
                    error=f"relay {strip_userinfo(self.nats_url)} unreachable",
                )  # fmt: skip
        await asyncio.gather(*(self._write_metadata(hall, r) for r in out))

    def _never_told(self, inst: Instance) -> bool:
        """Under reclaim by an earlier run that recorded its T and stopped before it tried either channel (a
        control host that died between the two): the node does not know it is being reclaimed."""
        if inst.id in self.unnoticed:
            return True
        if inst.id in self.reclaims or inst.id in self._told or inst.state != "notified":
            return False  # noticed by this run, or the agent has answered (draining, drained, overrun)
        tried = any(
            e["kind"] in _NOTICE_TRIES and (e["detail"] or {}).get("notice") == inst.reclaim_id
            for e in self.state.events(instance_id=inst.id)
        )
        if tried:
            self._told.add(inst.id)
        return not tried

    async def _tell_or_hold(self, hall: str, due: list[Instance]) -> list[Instance]:
        """The instances of ``due`` whose notice was never sent are noticed now, with a whole window (their
        recorded T was never told to anyone), or, without a notice key, held back from the delete and said.
        Returns the ones this run may delete at their T."""
        untold = [i for i in due if self._never_told(i)]
        if not untold:
            return [i for i in due if i.id not in self.unnoticed]
        if not self.signing_keys:
            for inst in untold:
                if inst.id not in self.unnoticed:
                    why = (
                        f"its notice {inst.reclaim_id} was never sent (the run that recorded its T stopped first) and"
                        " this run has no notice key: not deleted; run `sco reclaim --finish` with the notice key"
                    )
                    self.unnoticed[inst.id] = why
                    self.state.event(hall, "notice.never_sent", instance_id=inst.id, pool=inst.pool, error=why)
                    log.warning("%s: %s", inst.name, why)
            return [i for i in due if i.id not in self.unnoticed]
        out = []
        for inst in untold:
            started = self.clock()
            nid, t = f"reclaim-{uuid.uuid4().hex[:16]}", started + self.window_s
            by = self.gone_by.get(inst.name)
            if by is not None and by[0] < t:  # a host lease's deadline this run knows: never past it
                t = max(started, by[0])
            self.state.transition(
                inst.id, "notified", "reclaim.rescheduled", only_from=("notified",), reclaim_id=nid, terminate_at=t,
                window_s=round(t - started, 3), replaces=inst.reclaim_id,
                because="its notice was never sent (the run that recorded its T stopped first)",
            )  # fmt: skip
            r = Reclaim(self.state.instance(inst.id), notice_document(nid, hall, inst.name, t, started), t, started)
            self.reclaims[inst.id] = r
            out.append(r)
            self.unnoticed.pop(inst.id, None)
        await self._send(hall, out)
        return self.state.due(hall)

    def _schedule(self, hall: str, inst: Instance, by: tuple[float, str] | None = None) -> Reclaim:
        started = self.clock()
        if inst.state in RECLAIMING and inst.terminate_at is not None and inst.reclaim_id:
            nid, t = inst.reclaim_id, inst.terminate_at  # repeat the same notice: the agent de-duplicates by id
        else:
            nid, t = f"reclaim-{uuid.uuid4().hex[:16]}", started + self.window_s
            why: dict[str, Any] = {}
            if by is not None and by[0] < t:
                t, why = max(started, by[0]), {"gone_by": by[0], "because": by[1][:300]}
            self.state.transition(
                inst.id, "notified", "reclaim.scheduled", only_from=("active",), reclaim_id=nid, terminate_at=t,
                window_s=round(t - started, 3), **why,
            )  # fmt: skip
        r = Reclaim(self.state.instance(inst.id), notice_document(nid, hall, inst.name, t, started), t, started)
        self.reclaims[inst.id] = r
        return r

    async def _publish(self, hall: str, r: Reclaim, nc: Any) -> None:
        nid, inst = r.notice["id"], r.instance
        try:
            await publish_notice(nc, r.notice, self.signing_keys)
            r.published_at = self.clock()
            self.state.event(
                hall, "notice.published", instance_id=inst.id, pool=inst.pool, notice=nid,
                terminate_at=r.terminate_at, ms=round((r.published_at - r.started_at) * 1000, 3),
            )  # fmt: skip
        except Exception as e:
            self.state.event(
                hall, "notice.publish_failed", instance_id=inst.id, notice=nid, error=strip_userinfo_in_text(str(e))
            )

    async def _write_metadata(self, hall: str, r: Reclaim) -> None:
        nid, inst = r.notice["id"], r.instance
        try:
            await self._nova(
                "set_server_metadata",
                inst.server_id,
                sco_reclaim_id=nid,
                sco_reclaim_at=f"{r.terminate_at:.3f}",
                sco_reclaim_issued_at=f"{r.started_at:.3f}",
            )
            r.metadata_at = self.clock()
            self.state.event(hall, "notice.metadata_written", instance_id=inst.id, pool=inst.pool, notice=nid)
        except Exception as e:
            self.state.event(
                hall, "notice.metadata_failed", instance_id=inst.id, notice=nid, error=_cloud_message(e)[:500]
            )

    async def _nova(self, name: str, *a: Any, **kw: Any) -> Any:
        """``cloud.compute.<name>(*a, **kw)`` on a thread of its own, awaited for call_timeout_s at most (then
        TimeoutError). Even ``cloud.compute`` is looked up on that thread: openstacksdk authenticates and
        discovers the endpoint on first use, which is a blocking call too. Daemon threads: one stuck in a silent
        endpoint never holds up the run or the exit."""
        loop = asyncio.get_running_loop()

        def fn() -> Any:
            return getattr(self.cloud.compute, name)(*a, **kw)

        fut: asyncio.Future[Any] = loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if not fut.done():
                (fut.set_result if ok else fut.set_exception)(value)

        def work() -> None:
            try:
                out, ok = fn(), True
            except BaseException as e:  # handed to the awaiting task
                out, ok = e, False
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits for this answer any more
                loop.call_soon_threadsafe(settle, ok, out)

        async with self._calls:
            threading.Thread(target=work, daemon=True, name=f"nova-{name}").start()
            try:
                return await asyncio.wait_for(fut, self.call_timeout_s)
            except TimeoutError:
                raise TimeoutError(f"OpenStack did not answer {name} within {self.call_timeout_s:g} s") from None

    # --- the agent's account ---------------------------------------------------------------------------

    def fold(self, hall: str, ev: dict[str, Any], subject: str | None = None) -> bool:
        """One agent event into the fleet state; False when it is not about a drain, already recorded, or claims
        to be another node's than the subject it came on."""
        t = str(ev.get("type", ""))
        if not t.startswith(_RECORDED_PREFIXES):
            return False
        if subject is not None:
            # The relay lets a node publish only on its own subject, so the subject names the node; the body
            # is the node's word, and a compromised node could name another to forge its account.
            prefix = f"sco.events.{hall}."
            sender = subject[len(prefix) :] if subject.startswith(prefix) else ""
            if ev.get("node") != sender:
                log.warning("event on %s claims node %r: not recorded", subject, ev.get("node"))
                self.state.event(
                    hall, "agent.event_refused", subject=subject, claimed_node=str(ev.get("node"))[:200], type=t[:200]
                )
                return False
        state, only_from = _FOLD.get(t, (None, ()))
        if state is not None and not self._about_current_notice(hall, ev):
            # An account of another notice (an earlier reclaim of a reused name, a replay, a forgery on the node's
            # own subject) is recorded, never taken as the outcome of the notice the instance is under now.
            log.warning("event %s of %r is about notice %r: recorded, state kept", t, ev.get("node"), ev.get("notice"))
            state = None
        return self.state.agent_event(hall, ev, state, only_from)

    def _about_current_notice(self, hall: str, ev: dict[str, Any]) -> bool:
        live = self.state.instances(hall, names=[str(ev.get("node", ""))])
        if not live:
            return False
        current = max(live, key=lambda i: i.id).reclaim_id
        return current is not None and ev.get("notice") == current

    async def _follow_events(self, hall: str, *, retrying: bool = False) -> Any:
        nc = await self._connect(retrying=retrying)
        js = nc.jetstream(timeout=5)
        try:
            await js.stream_info(self.events_stream)
        except Exception:
            await js.add_stream(name=self.events_stream, subjects=["sco.events.>"], duplicate_window=120)

        async def on_msg(msg: Any) -> None:
            try:
                ev = json.loads(msg.data)
                if isinstance(ev, dict):
                    self.fold(hall, ev, msg.subject)
            except ValueError:
                log.warning("unreadable agent event on %s", msg.subject)
            await msg.ack()

        # A durable consumer per hall: a restarted reclaimer continues where the last one acknowledged.
        # The stream is named, not looked up by subject: the relay's reclaimer user may not list streams.
        return await js.subscribe(
            EVENTS_SUBJECT.format(hall=hall),
            stream=self.events_stream,
            durable=f"sco-reclaimer-{hall}",
            cb=on_msg,
            manual_ack=True,
        )

    async def _follow_later(self, hall: str) -> Any:
        """The agents' events followed as soon as the relay lets the run subscribe: tried again with capped backoff
        and jitter until it works (the run cancels it when it ends)."""
        backoff = Backoff(1.0, 8.0, rand=self.rand)
        while True:
            await asyncio.sleep(backoff.next())
            try:
                sub = await asyncio.wait_for(self._follow_events(hall, retrying=True), 10)
            except Exception as e:
                log.debug("agent events still unavailable (%s)", _cloud_message(e))
                continue
            log.warning(
                "agent events followed again (attempt %d): their accounts reach the fleet state", backoff.attempts + 1
            )
            return sub

    # --- delete at T -----------------------------------------------------------------------------------

    async def run(self, hall: str, *, follow_events: bool = True, stop: asyncio.Event | None = None) -> None:
        """Delete every instance under reclaim at its T (retrying with backoff until Nova confirms each gone) and
        fold the agent's events meanwhile. Returns when none of the hall's instances is left under reclaim, when
        ``stop`` is set, or retry_for_s past the later of this run's start and the last T; what is then not
        confirmed gone is in ``unconfirmed`` (with the cloud's last word) and stays under reclaim for the next run.

        A fleet state that goes away mid-run (PostgreSQL restarted, the session ended) raises SessionLost."""
        import psycopg

        sub = None
        retry: asyncio.Task[Any] | None = None
        self.unconfirmed = {}
        try:
            if follow_events:
                try:
                    sub = await asyncio.wait_for(self._follow_events(hall), 10)
                except Exception as e:
                    log.warning("agent events unavailable (%s): deleting on time regardless", _cloud_message(e))
                    # a relay or the stream's leader lost for a moment (a failover under way): the agents' accounts
                    # still belong in the fleet state, so the run keeps trying beside its deletes
                    retry = asyncio.create_task(self._follow_later(hall))
            started, passes = self.clock(), 0
            while True:
                now = self.clock()
                due = self.state.due(hall)
                if not due:
                    return
                last_t = max((i.terminate_at or now for i in due), default=now)
                # every run makes at least one attempt at what is due, however late it starts
                if passes and ((stop is not None and stop.is_set()) or now > max(started, last_t) + self.retry_for_s):
                    self._leave(hall, [i for i in due if i.id not in self.unnoticed], now)
                    return
                due = await self._tell_or_hold(hall, due)
                if not due:  # only instances it may not delete are left (said in unnoticed)
                    return
                await self._renotice(hall, due, now)
                await self._pass(hall, due, now)
                passes += 1
                upcoming = [i.terminate_at - now for i in due if i.state != "deleting" and i.terminate_at]
                retries = [b.next_at - now for b in self.backoff.values()]
                again = [r.renotice_at - now for r in self.reclaims.values() if r.renotice is not None]
                wait = min([self.gone_poll_s, *(u for u in (*upcoming, *retries, *again) if u > 0)])
                await asyncio.sleep(max(0.01, wait))
        except psycopg.Error as e:
            raise db_failure(self.state, hall, e) from None
        finally:
            if retry is not None:
                if retry.done() and not retry.cancelled() and retry.exception() is None:
                    sub = retry.result()
                else:
                    retry.cancel()
                    with contextlib.suppress(BaseException):
                        await retry
            if sub is not None:
                # Events already in flight still land: give the subscription a moment to drain.
                with contextlib.suppress(Exception):
                    await asyncio.sleep(0.2)
                    await asyncio.wait_for(sub.unsubscribe(), 5)

    async def _renotice(self, hall: str, due: list[Instance], now: float) -> None:
        """This run's notices sent again, with growing pauses (RENOTICE_BASE_S to RENOTICE_CAP_S, jittered), until
        the agent answers (its first event moves the instance on from notified) or T: one publish is lost when the
        node is connecting while the relay loads its account, or the relay was down. The agent ignores a notice id
        it has seen; the metadata service carries it too, but only at the agent's 5 s poll."""
        for inst in due:
            r = self.reclaims.get(inst.id)
            if r is None:
                continue
            if inst.state != "notified" or r.terminate_at <= now or r.notice["id"] != inst.reclaim_id:
                if r.renotice is not None and r.renoticed:
                    self.state.event(
                        hall, "notice.republished", instance_id=inst.id, notice=r.notice["id"], times=r.renoticed
                    )
                r.renotice = None
                continue
            if r.renotice is None:
                r.renotice = Backoff(RENOTICE_BASE_S, RENOTICE_CAP_S, rand=self.rand)
                r.renotice_at = (r.published_at or now) + r.renotice.next()
            if now < r.renotice_at:
                continue
            r.renotice_at = now + r.renotice.next()
            nc = self.nc
            if nc is None or not nc.is_connected:
                # never a connect here: the run's deletes at T do not wait on a relay (the events' retry connects)
                continue
            try:  # no flush: the client's own flusher sends it, and the run does not wait on a slow relay
                subject = NOTICE_SUBJECT.format(hall=r.notice["hall"], node=r.notice["node"])
                await nc.publish(subject, encode_notice(r.notice, self.signing_keys))
            except Exception as e:  # the metadata still carries it; the next try comes after the pause
                log.debug("%s: notice not sent again (%s)", inst.name, _cloud_message(e))
                continue
            r.renoticed += 1
            if r.published_at is None:  # the first publish failed: now it is on the relay
                r.published_at = self.clock()
                self.state.event(
                    hall, "notice.published", instance_id=inst.id, pool=inst.pool, notice=r.notice["id"],
                    terminate_at=r.terminate_at, ms=round((r.published_at - r.started_at) * 1000, 3), again=True,
                )  # fmt: skip

    async def _pass(self, hall: str, due: list[Instance], now: float) -> None:
        """One pass: send the deletes that are due (T reached, backoff over), check the ones sent; all at once."""
        ready = [i for i in due if self._ready(i, now)]
        sends = [i for i in ready if i.state != "deleting" and (i.terminate_at or 0) <= now]
        checks = [i for i in ready if i.state == "deleting"]
        await asyncio.gather(*(self._delete(hall, i) for i in sends), *(self._confirm(hall, i) for i in checks))

    def _ready(self, inst: Instance, now: float) -> bool:
        b = self.backoff.get(inst.id)
        return b is None or b.next_at <= now

    def _new_backoff(self) -> Backoff:
        return Backoff(self.backoff_base_s, self.backoff_cap_s, rand=self.rand)

    def _retry(self, instance_id: int) -> DeleteRetry:
        return self.backoff.setdefault(instance_id, DeleteRetry(self._new_backoff()))

    def _failed(self, hall: str, inst: Instance, kind: str, error: str) -> None:
        b = self._retry(inst.id)
        now = self.clock()
        at = b.failed(now)
        self.last_error[inst.id] = error
        self.state.event(
            hall, kind, instance_id=inst.id, pool=inst.pool, error=error[:500], attempt=b.attempts,
            retry_in_s=round(at - now, 3),
        )  # fmt: skip

    def _leave(self, hall: str, due: list[Instance], now: float) -> None:
        """The run's retry budget is spent: say what is not confirmed gone (a later run carries on)."""
        for inst in due:
            why = self.last_error.get(inst.id) or (
                "T not reached yet" if (inst.terminate_at or 0) > now else "Nova has not confirmed the delete yet"
            )
            self.unconfirmed[inst.id] = why
            self.state.event(
                hall, "delete.pending", instance_id=inst.id, pool=inst.pool, state=inst.state, error=why[:500],
                attempts=self.backoff[inst.id].attempts if inst.id in self.backoff else 0,
            )  # fmt: skip
            log.warning("%s: not confirmed gone (%s); left under reclaim for the next run", inst.name, why)

    async def _delete(self, hall: str, inst: Instance) -> None:
        assert inst.terminate_at is not None
        r = self.reclaims.get(inst.id)
        if r is not None and r.delete_sent_at is None:
            r.delete_sent_at = self.clock()
            r.agent_state = inst.state
        try:
            await self._nova("delete_server", inst.server_id, ignore_missing=True)
        except Exception as e:  # Nova refused, is down or silent: retried after the backoff
            self._failed(hall, inst, "delete.failed", _cloud_message(e))
            return
        at = self.clock()
        if r is not None:
            r.deleted_at = at
        elif inst.id not in self.finished:  # noticed by an earlier run: said with how late it comes, if late
            late = round(max(0.0, at - inst.terminate_at), 3)
            self.finished[inst.id] = {
                "name": inst.name, "terminate_at": inst.terminate_at, "deleted_at": round(at, 3), "late_s": late,
                "agent": inst.state,
            }  # fmt: skip
            if late > 1.0:
                log.warning(
                    "%s: deleted %.1f s after its T: the run that noticed it stopped before T (this run finished it)",
                    inst.name, late,
                )  # fmt: skip
        self.backoff.pop(inst.id, None)
        self.state.transition(
            inst.id, "deleting", "instance.delete_requested", only_from=RECLAIMING,
            after_deadline_s=round(at - inst.terminate_at, 3), agent_state=inst.state,
        )  # fmt: skip
        # the next pass asks Nova whether it is gone after gone_poll_s, not at once
        self.backoff[inst.id] = DeleteRetry(self._new_backoff(), at + self.gone_poll_s)

    async def _confirm(self, hall: str, inst: Instance) -> None:
        """Ask Nova whether a deleted server is gone; one still there after its delete is sent again (a DELETE
        Nova accepted can still fail: the server goes to ERROR, or a compute host never acts on it)."""

        try:
            srv = await self._nova("find_server", inst.server_id, ignore_missing=True)
        except Exception as e:
            self._failed(hall, inst, "delete.unconfirmed", _cloud_message(e))
            return
        if srv is None or getattr(srv, "status", None) == "DELETED":
            self.backoff.pop(inst.id, None)
            r = self.reclaims.get(inst.id)
            if r is not None:
                r.gone_at = self.clock()
            self.state.transition(inst.id, "deleted", "instance.deleted", only_from=("deleting",))
            return
        b = self._retry(inst.id)
        if getattr(srv, "status", None) == "ERROR" or (b.attempts and b.attempts % 4 == 0):
            try:
                await self._nova("delete_server", inst.server_id, ignore_missing=True)
            except Exception as e:
                self._failed(hall, inst, "delete.failed", _cloud_message(e))
                return
            self.state.event(hall, "delete.resent", instance_id=inst.id, pool=inst.pool, status=srv.status)
        b.failed(self.clock())  # still there: ask again after a growing pause

    async def reclaim(self, hall: str, nodes: list[str]) -> list[Reclaim]:
        """``sco reclaim``: notice now, delete at T, fold the agent's account; returns when all are deleted."""
        out = await self.notify(hall, nodes)
        await self.run(hall)
        return out


def _cloud_message(e: BaseException) -> str:
    """The cloud's own words for a failed call (openstacksdk's message carries Nova's), never "Unknown error"."""
    text = " ".join(str(e).split()) or type(e).__name__
    details = getattr(e, "details", None)
    if details and str(details) not in text:
        text = f"{text}: {details}"
    return strip_userinfo_in_text(text)
