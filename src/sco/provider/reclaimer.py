"""The reclaimer: the provider side of a notice.

For each instance taken back (an operator's command, a pool shrinking, a Blazar lease starting) it fixes the
termination time T = now + window once, records it in the fleet state, publishes the notice on the hall's NATS
relay (``sco.notice.<hall>.<node>``, the shape the agent parses), writes it into the instance's metadata (the
agent's poll channel, for when the relay is down), and deletes the instance through Nova at T, whatever the
agent reported. The agent's own account of its drain arrives on JetStream (``sco.events.<hall>.>``) and is
folded into the fleet state (draining, drained or overrun), once per event however often it is redelivered.

A restarted reclaimer resumes from the fleet state: every instance under reclaim still has its T there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sco._redact import strip_userinfo, strip_userinfo_in_text
from sco.contract.notice import sign_notice
from sco.contract.signing import PrivateKey
from sco.errors import ConfigError, Problem
from sco.state.fleet import RECLAIMING, FleetState, Instance

log = logging.getLogger("sco.reclaimer")

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
_RECORDED_PREFIXES = ("notice.", "node.", "drain.", "scheduler.", "job.")


def window_problem(what: str, window: object) -> str | None:
    """Why ``window`` cannot be a notice window (seconds from the notice to the delete), or None."""
    if isinstance(window, int | float) and not isinstance(window, bool) and 0 < window <= MAX_WINDOW_S:
        return None  # (NaN fails the comparison)
    return f"{what}: expected more than 0 and at most {MAX_WINDOW_S:g} seconds, got {window}"


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
        give_up_after_s: float = 120.0,
    ) -> None:
        self.cloud = cloud  # an openstacksdk Connection
        self.state = state
        self.nats_url = nats_url
        self.window_s = window_s
        self.clock = clock
        self.signing_keys = signing_keys
        self.events_stream = events_stream
        self.gone_poll_s = gone_poll_s
        # How long past T a delete that keeps failing (Nova down, refusing) is retried before this run gives up
        # on it; the instance stays under reclaim in the fleet state, so the next run deletes it.
        self.give_up_after_s = give_up_after_s
        self.abandoned: set[int] = set()
        if (problem := window_problem("window", window_s)) is not None:
            raise ConfigError(problem)
        # nats.connect's credentials (user/password, token, nkeys_seed or user_credentials): the relay's
        # reclaimer identity, which may publish notices and read the hall's events
        self.nats_auth = dict(nats_auth or {})
        if not signing_keys:
            raise ConfigError("no notice key: the hall's agents refuse unsigned notices (hall policy noticeKeys)")
        self.nc: Any = None
        self.reclaims: dict[int, Reclaim] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(nova_concurrency, thread_name_prefix="nova")

    async def _connect(self) -> Any:
        if self.nc is None or self.nc.is_closed:
            import nats

            # nats-py retries a refused first connection whatever its options say: bound the first one.
            self.nc = await asyncio.wait_for(
                nats.connect(
                    self.nats_url, connect_timeout=2, max_reconnect_attempts=-1, allow_reconnect=True, **self.nats_auth
                ),
                5,
            )
        return self.nc

    async def close(self) -> None:
        if self.nc is not None and not self.nc.is_closed:
            try:
                await self.nc.drain()
            except Exception:  # the relay went away meanwhile (reconnecting): nothing left to flush
                await self.nc.close()
        self.nc = None
        self._pool.shutdown(wait=False)

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

    async def notify(self, hall: str, nodes: list[str]) -> list[Reclaim]:
        """Notice every node (nothing happens if any is unknown); an instance already under reclaim keeps its T.

        Each T is recorded first (a crash from then on still deletes at T), then every notice goes on the relay
        (milliseconds each), then the metadata writes (a Nova call each) run in parallel.
        """
        targets = self._targets(hall, nodes)
        out = [self._schedule(hall, inst) for inst in targets]
        try:
            nc = await self._connect()
        except Exception as e:  # the relay is down: the metadata channel still carries every notice
            log.warning(
                "notice relay %s unreachable: %s", strip_userinfo(self.nats_url), strip_userinfo_in_text(str(e))
            )
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
        return out

    def _schedule(self, hall: str, inst: Instance) -> Reclaim:
        started = self.clock()
        if inst.state in RECLAIMING and inst.terminate_at is not None and inst.reclaim_id:
            nid, t = inst.reclaim_id, inst.terminate_at  # repeat the same notice: the agent de-duplicates by id
        else:
            nid, t = f"reclaim-{uuid.uuid4().hex[:16]}", started + self.window_s
            self.state.transition(
                inst.id, "notified", "reclaim.scheduled", only_from=("active",), reclaim_id=nid, terminate_at=t,
                window_s=self.window_s,
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
                self.cloud.compute.set_server_metadata,
                inst.server_id,
                sco_reclaim_id=nid,
                sco_reclaim_at=f"{r.terminate_at:.3f}",
                sco_reclaim_issued_at=f"{r.started_at:.3f}",
            )
            r.metadata_at = self.clock()
            self.state.event(hall, "notice.metadata_written", instance_id=inst.id, pool=inst.pool, notice=nid)
        except Exception as e:
            self.state.event(hall, "notice.metadata_failed", instance_id=inst.id, notice=nid, error=str(e)[:500])

    async def _nova(self, fn: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        """A blocking openstacksdk call on the reclaimer's own threads (many at once at a deadline)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *a, **kw))

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
        return self.state.agent_event(hall, ev, state, only_from)

    async def _follow_events(self, hall: str) -> Any:
        nc = await self._connect()
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

    # --- delete at T -----------------------------------------------------------------------------------

    async def run(self, hall: str, *, follow_events: bool = True, stop: asyncio.Event | None = None) -> None:
        """Delete every instance under reclaim at its T and fold the agent's events meanwhile; returns when
        none of the hall's instances is left under reclaim (or ``stop`` is set)."""
        sub = None
        if follow_events:
            try:
                sub = await self._follow_events(hall)
            except Exception as e:
                log.warning("agent events unavailable (%s): deleting on time regardless", e)
        try:
            while stop is None or not stop.is_set():
                now = self.clock()
                self._give_up(hall, now)
                due = [i for i in self.state.due(hall) if i.id not in self.abandoned]
                if not due:
                    return
                deleting = [i for i in due if i.state == "deleting"]
                overdue = [i for i in due if i.state != "deleting" and (i.terminate_at or 0) <= now]
                upcoming = [i.terminate_at - now for i in due if i.state != "deleting" and i.terminate_at]
                # Every instance due now is deleted at once, not one after another.
                await asyncio.gather(*(self._delete(hall, i) for i in overdue))
                gone = await asyncio.gather(*(self._gone(i) for i in deleting))
                for inst, g in zip(deleting, gone, strict=True):
                    if g:
                        self.state.transition(inst.id, "deleted", "instance.deleted", only_from=("deleting",))
                wait = min([self.gone_poll_s, *(u for u in upcoming if u > 0)])
                await asyncio.sleep(max(0.0, wait))  # a failed delete is retried after gone_poll_s, not hot
        finally:
            if sub is not None:
                # Events already in flight still land: give the subscription a moment to drain.
                await asyncio.sleep(0.2)
                await sub.unsubscribe()

    def _give_up(self, hall: str, now: float) -> None:
        """Stop retrying deletes that still fail give_up_after_s past T (recorded; a later run tries again)."""
        for inst in self.state.due(hall):
            if inst.id in self.abandoned or inst.terminate_at is None:
                continue
            if now > inst.terminate_at + self.give_up_after_s:
                self.abandoned.add(inst.id)
                self.state.event(
                    hall, "delete.abandoned", instance_id=inst.id, pool=inst.pool, state=inst.state,
                    after_deadline_s=round(now - inst.terminate_at, 3),
                )  # fmt: skip
                log.warning("%s: not deleted %.0f s after T; left under reclaim for the next run", inst.name,
                            now - inst.terminate_at)  # fmt: skip

    async def _delete(self, hall: str, inst: Instance) -> None:
        assert inst.terminate_at is not None
        r = self.reclaims.get(inst.id)

        def delete() -> None:
            if r is not None:
                r.delete_sent_at = self.clock()
                r.agent_state = inst.state
            self.cloud.compute.delete_server(inst.server_id, ignore_missing=True)

        try:
            await self._nova(delete)
        except Exception as e:  # Nova refused or is down: the next pass tries again
            self.state.event(hall, "delete.failed", instance_id=inst.id, error=str(e)[:500])
            return
        at = self.clock()
        if r is not None:
            r.deleted_at = at
        self.state.transition(
            inst.id, "deleting", "instance.delete_requested", only_from=RECLAIMING,
            after_deadline_s=round(at - inst.terminate_at, 3), agent_state=inst.state,
        )  # fmt: skip

    async def _gone(self, inst: Instance) -> bool:
        def get() -> bool:
            srv = self.cloud.compute.find_server(inst.server_id, ignore_missing=True)
            return srv is None or srv.status == "DELETED"

        try:
            return bool(await self._nova(get))
        except Exception:
            return False

    async def reclaim(self, hall: str, nodes: list[str]) -> list[Reclaim]:
        """``sco reclaim``: notice now, delete at T, fold the agent's account; returns when all are deleted."""
        out = await self.notify(hall, nodes)
        await self.run(hall)
        return out
