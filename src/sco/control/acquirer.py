"""The acquirer: makes a hall's plan entry hold the number of instances the plan asks for, through Nova (VMs and
Ironic nodes alike).

Crash-safe by construction: every server is created with tags naming its hall, pool, plan entry and slot, in the
same create call, so whatever a crashed run managed to launch is found by the next run (one list call, through
the reconciler) and adopted instead of launched again. ``count`` is a count, not a range of slots: an entry holds
``count`` live instances, new ones take the lowest free slots, so a slot freed by a reclaim is never refilled
unless the plan asks for an instance. Surplus instances are deleted all at once (named ones first, then the idle
ones in the highest slots), and waited for until Nova no longer lists them.

API calls are paid from a token budget in the fleet state that every concurrent run shares. A quota error or
NoValidHost marks the pool unavailable for a while: the run stops launching into it, says so in its warnings,
and later runs skip it until the time is up, instead of retrying hot.

A run observes its entry once (the fleet state's records and one tagged list call, ``reconcile.FleetIO.observe``),
decides purely (``decide_entry``: the entry's reconciliation, then what to delete and which slots to launch into),
applies that (``Acquirer.apply``), and waits for the builds (``FleetIO.settle_builds``, the reconciler's wait too).
"""

from __future__ import annotations

import base64
import concurrent.futures
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from sco.control.launch import LaunchParams
from sco.control.nova import TAG, Budget, CloudError, Meter, cloud_message, delete_all, wait_gone
from sco.control.reconcile import Adopt, Decisions, Delete, FleetIO, Move, View, building, decide, project
from sco.errors import ConfigError, ScoError
from sco.provider.reservations import merge_hints
from sco.state import enrolment
from sco.state.fleet import FleetState, Instance, Pool

__all__ = ["AcquireError", "Acquirer", "Budget", "Failure", "Outcome", "PlanEntry"]

DNS = re.compile(r"^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$")
UserData = Callable[..., str]
"""node name -> cloud-init user-data; with enrolment, (node name, the instance's own agent.env keys) -> user-data"""
ENROL_TOKEN = "SCO_AGENT_ENROL_TOKEN"
ENROL_URL = "SCO_AGENT_ENROL_URL"


class AcquireError(ScoError):
    exit_code = 9


@dataclass(frozen=True)
class PlanEntry:
    """Hold ``count`` live instances of ``pool`` in ``hall`` for plan entry ``entry``; ``delete`` names instances
    to take away first when the count shrinks (the plan's idle ones)."""

    hall: str
    pool: str
    entry: str
    count: int
    delete: tuple[str, ...] = ()

    def check(self) -> None:
        for what in ("hall", "pool", "entry"):
            v = getattr(self, what)
            if not DNS.match(v):
                raise ConfigError(f"plan entry: {what}: {v!r} is not a DNS label of at most 32 characters")
        if self.count < 0:
            raise ConfigError(f"plan entry {self.entry}: count: must be >= 0, got {self.count}")

    def name(self, slot: int) -> str:
        return f"{self.hall}-{self.pool}-{self.entry}-{slot}"

    def tags(self) -> list[str]:
        return [TAG.format("hall", self.hall), TAG.format("pool", self.pool), TAG.format("entry", self.entry)]


@dataclass
class Outcome:
    entry: PlanEntry
    skipped: str | None = None  # why nothing was tried (the pool is unavailable)
    adopted: int = 0
    launched: int = 0
    active: int = 0
    failed: int = 0
    deleted: int = 0
    pool_unavailable: str | None = None
    api_calls: int = 0
    instances: list[Instance] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """The cloud's own messages for launches it refused or failed (quota, NoValidHost, a bad request)."""
    warnings: list[str] = field(default_factory=list)
    attempts: int = 0
    """Creates this run sent to Nova."""
    failures: list[Failure] = field(default_factory=list)
    """This run's launches that did not become an instance: refused by the API or built to ERROR."""
    pending: int = 0
    """Instances the entry asks for that it does not hold at the end of the run (a build Nova failed, taken back;
    a create refused): the next run launches them again. 0 when the entry holds its count."""


@dataclass(frozen=True)
class Failure:
    name: str
    message: str
    """The cloud's own words (the API's answer, or the ERROR build's fault)."""
    at: str
    """create (the API refused it) or build (Nova accepted it, the build went to ERROR)"""
    capacity: bool = False
    """Quota or no valid host: the pool is marked unavailable."""


def _quota_error(e: Exception) -> bool:
    code = getattr(e, "status_code", None)
    text = str(e).lower()
    return code == 413 or (code == 403 and "quota" in text)


def capacity_reason(fault: str) -> str | None:
    """Why a pool takes no more launches for a while, from a build's fault (None: not for capacity)."""
    low = fault.lower()
    if "no valid host" in low:
        return f"NoValidHost: {fault[:300]}"
    if "exhausted all hosts" in low:  # builds refused on every host (e.g. a group policy)
        return f"no host left after retries: {fault[:300]}"
    if "quota exceeded" in low:  # Nova's API counts only scheduled instances; its conductor rechecks and fails the rest
        return f"quota: {fault[:300]}"
    return None


@dataclass(frozen=True)
class EntryDecisions:
    """What one run does to its entry: the entry's reconciliation, then the plan's count held by deleting
    ``retire`` (an instance adopted in this run has id 0 until its record is written) or launching into
    ``launch`` (slots)."""

    reconcile: Decisions
    retire: tuple[Instance, ...] = ()
    launch: tuple[int, ...] = ()
    live: tuple[Instance, ...] = ()
    """The entry's live instances once the reconciliation is written."""


def victims(e: PlanEntry, live: Iterable[Instance], n: int) -> list[Instance]:
    """The plan's named instances first, then idle ones from the highest slot down; never one under reclaim
    (the reclaimer is taking it away on its own schedule)."""
    live = list(live)
    named = [i for i in live if i.name in e.delete]
    rest = sorted(
        (i for i in live if i.name not in e.delete and i.state in ("requested", "launching", "active")),
        key=lambda i: -i.slot,
    )
    return (named + rest)[:n]


def free_slots(live: Iterable[Instance], n: int) -> list[int]:
    """The ``n`` lowest slots no live instance holds."""
    used = {i.slot for i in live}
    return [s for s in range(len(used) + n + 1) if s not in used][:n]


def decide_entry(e: PlanEntry, v: View) -> EntryDecisions:
    """Pure: the entry's view in, what to write, delete and launch out."""
    d = decide(v)
    live = project(v.records, d.changes)
    surplus = len(live) - e.count
    retire = victims(e, live, surplus) if surplus > 0 else []
    launch = free_slots(live, -surplus) if surplus < 0 else []
    return EntryDecisions(d, tuple(retire), tuple(launch), tuple(live))


class Acquirer:
    def __init__(
        self,
        cloud: Any,
        state: FleetState,
        user_data: UserData,
        *,
        budget: Budget | None = None,
        unavailable_for_s: float = 300.0,
        concurrency: int = 8,
        poll_s: float = 0.5,
        active_timeout_s: float = 600.0,
        delete_timeout_s: float = 120.0,
        lock_wait_s: float = 0.0,
        sleep: Callable[[float], None] = time.sleep,
        meter: Meter | None = None,
        scheduler_hints: dict[str, dict[str, str]] | None = None,
        enrol_url: str = "",
    ) -> None:
        self.cloud = cloud  # an openstacksdk Connection
        self.state = state
        self.user_data = user_data
        self.meter = meter or Meter(state, budget, sleep)
        self.unavailable_for_s = unavailable_for_s
        self.concurrency = concurrency
        self.poll_s = poll_s  # the shortest wait between two list calls
        self.active_timeout_s = active_timeout_s
        self.delete_timeout_s = delete_timeout_s
        self.lock_wait_s = lock_wait_s
        self.sleep = sleep
        # pool -> scheduler hints of its creates (a committed pool's Blazar reservation: reservation_hints)
        self.scheduler_hints = dict(scheduler_hints or {})
        # the enrolment service's URL: each instance launched gets a one-time token of its own, its hash bound to
        # the instance's record before the create is sent (sco.control.enrolment); "": no enrolment
        self.enrol_url = enrol_url
        self._sent: set[str] = set()

    @property
    def api_calls(self) -> int:
        return self.meter.calls

    def _record(self, fn: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        return self.meter.record(fn, *a, **kw)

    # --- the run ---------------------------------------------------------------------------------------

    def apply(self, entry: PlanEntry, params: LaunchParams | None = None) -> Outcome:
        """Hold the entry's count. ``params``: the pool's resolved create arguments (``sco.control.launch``);
        without them, the pool's flavor and image ids from the fleet state and no network."""
        entry.check()
        out = Outcome(entry)
        self._sent = set()  # servers this run created (its own builds, not a crashed run's)
        calls0 = self.meter.calls
        with self.state.writer(entry.hall, wait_s=self.lock_wait_s):
            pool = self.state.pool(entry.hall, entry.pool)
            if pool is None:
                raise ConfigError(f"plan entry {entry.entry}: pool {entry.hall}/{entry.pool} is not in the fleet state")
            now = self.state.now()
            if pool.unavailable_until and pool.unavailable_until > now:
                out.skipped = (
                    f"pool {entry.pool} unavailable for {pool.unavailable_until - now:.0f} s more: "
                    f"{pool.unavailable_reason}"
                )
                self.state.event(entry.hall, "acquire.skipped", pool=entry.pool, entry=entry.entry, reason=out.skipped)
                return out
            # a bare Acquirer (library use) boots without a network; the acquire step always passes the pool's
            # resolved launch options, whose default is Nova's automatic network
            params = params or LaunchParams(flavor_id=pool.flavor, image_id=pool.image, networks="none")
            io = FleetIO(
                self.cloud, self.state, self.meter, entry.hall, pool=entry.pool, entry=entry.entry,
                concurrency=self.concurrency, delete_timeout_s=self.delete_timeout_s, sleep=self.sleep,
            )  # fmt: skip
            # what a crashed run left: one list call for the entry, compared with its records. An entry with no
            # record at all, live or past, has no server: each create is recorded (requested) before it is sent,
            # so there is nothing to list (a server tagged behind the fleet state's back is the hall
            # reconciliation's, which lists the whole hall before the acquire step). A create a killed run sent
            # may still land: observe waits for it (its window), so it is adopted, not launched again.
            ever = io.records(None)
            records = [r for r in ever if r.state not in ("deleted", "failed")]
            servers = io.servers() if ever else []
            view = io.observe(records, servers, wait_in_flight=True, pools=frozenset({entry.pool}))
            d = decide_entry(entry, view)
            started = time.monotonic()
            self._apply(entry, pool, params, io, view, d, out)
            if building(i for i in d.live if i not in d.retire) or out.launched:
                self._settle(entry, io, out, started)
            out.instances = self.state.instances(entry.hall, pool=entry.pool, plan_entry=entry.entry)
            out.active = sum(1 for i in out.instances if i.state == "active")
            out.pending = max(0, entry.count - len(out.instances))
            if out.pending:
                # not launched again in this run: the build failed in Nova (or the create was refused), and a
                # retry now meets the same cloud; the timer's next run launches them (its plan asks again)
                why = "; ".join(out.errors[-out.pending :]) or "see errors"
                out.warnings.append(
                    f"{entry.pool}/{entry.entry}: holds {len(out.instances)} of {entry.count}, {out.pending} pending:"
                    f" {why}; the next run launches them again"
                )
        out.api_calls = self.meter.calls - calls0
        return out

    def _apply(
        self, e: PlanEntry, pool: Pool, params: LaunchParams, io: FleetIO, view: View, d: EntryDecisions, out: Outcome
    ) -> None:
        """The run's writes: the entry's reconciliation (each change with its event; surplus servers deleted until
        gone), then the plan's deletes or launches."""
        applied = io.apply(d.reconcile, seen=[s.id for s in view.servers])
        out.adopted = sum(1 for c in d.reconcile.changes if isinstance(c, Adopt))
        out.warnings += [*d.reconcile.warnings, *applied.warnings]
        if d.retire:
            adopted = applied.adopted
            retire = [adopted.get((i.pool, i.plan_entry, i.slot), i) if i.id == 0 else i for i in d.retire]
            self._delete(e, io, [i for i in retire if i.id], out)
        elif d.launch:
            self._launch(e, pool, params, list(d.launch), out)

    def _launch(self, e: PlanEntry, pool: Pool, params: LaunchParams, slots: list[int], out: Outcome) -> None:
        stop = threading.Event()  # set on a quota error: no more launches into this pool in this run
        base = params.create_kwargs()

        def one(slot: int) -> None:
            if stop.is_set():
                return
            name = e.name(slot)
            inst = self._record(self.state.request, e.hall, e.pool, e.entry, slot, name)
            kw: dict[str, Any] = {
                **base,
                "name": name,
                "user_data": base64.b64encode(self._user_data(inst).encode()).decode(),
                "tags": [*e.tags(), TAG.format("slot", slot)],
                "metadata": {"sco_hall": e.hall, "sco_pool": e.pool, "sco_entry": e.entry},
            }
            if pool.availability_zone and "availability_zone" not in kw:
                kw["availability_zone"] = pool.availability_zone
            kw = merge_hints(kw, self.scheduler_hints.get(e.pool))  # a server group's hint is kept
            self.meter.pay()
            with self.meter.lock:
                out.attempts += 1
            try:
                srv = self.cloud.compute.create_server(**kw)
            except Exception as ex:
                quota = _quota_error(ex)
                msg = cloud_message(ex)
                self._record(self.state.transition, inst.id, "failed", "launch.failed", error=msg[:500], quota=quota)
                with self.meter.lock:
                    out.failed += 1
                    out.errors.append(f"{name}: {msg[:500]}")
                    out.failures.append(Failure(name, msg[:500], "create", quota))
                if quota:
                    stop.set()
                    self._unavailable(e, f"quota: {msg[:300]}", out)
                return
            self._record(self.state.transition, inst.id, "launching", "launch.requested", server_id=srv.id, name=name)
            with self.meter.lock:
                out.launched += 1
                self._sent.add(srv.id)

        with concurrent.futures.ThreadPoolExecutor(max(1, min(self.concurrency, len(slots)))) as ex:
            for f in [ex.submit(one, s) for s in slots]:
                f.result()

    def _user_data(self, inst: Instance) -> str:
        """The instance's user-data; with enrolment, a new one-time token in its agent.env, only its SHA-256 kept
        (bound to the record before the create is sent: a token never reaches a server the record does not know)."""
        if not self.enrol_url:
            return self.user_data(inst.name)
        token = secrets.token_urlsafe(32)
        self._record(enrolment.offer, self.state.conn, inst.id, enrolment.token_hash(token))
        return self.user_data(inst.name, {ENROL_TOKEN: token, ENROL_URL: self.enrol_url})

    def _unavailable(self, e: PlanEntry, reason: str, out: Outcome) -> None:
        if out.pool_unavailable is None:
            out.pool_unavailable = reason
            out.warnings.append(
                f"pool {e.pool}: no launches for {self.unavailable_for_s:.0f} s ({reason}); the plan sees it"
                " unavailable until then"
            )
            self._record(self.state.mark_unavailable, e.hall, e.pool, self.unavailable_for_s, reason)

    def _settle(self, e: PlanEntry, io: FleetIO, out: Outcome, started: float) -> None:
        """Wait for the entry's builds (``FleetIO.settle_builds``); a build in ERROR is a failure of this run (its
        pool marked unavailable when Nova ran out of room), its server taken back at once, not waited for."""
        errored: list[str] = []

        def act(b: Decisions) -> None:
            io.apply(Decisions(tuple(c for c in b.changes if not isinstance(c, Delete))))
            for c in b.changes:
                if not (isinstance(c, Move) and c.kind == "fail" and c.server_id):
                    continue
                fault, name = str(c.detail.get("error", "")), c.record.name
                out.failed += 1
                out.errors.append(f"{name}: {fault}")
                errored.append(c.server_id)
                reason = capacity_reason(fault)
                if c.server_id in self._sent:
                    out.failures.append(Failure(name, fault or "ERROR, no fault given", "build", reason is not None))
                if reason is not None:
                    self._unavailable(e, reason, out)

        # the first list call when the last create should be ACTIVE, going by how long the pool's recent builds
        # took (Nova's own created/launched times): a batch then costs two or three list calls, where polling on
        # the pace seen so far spent two or three more before the first server was ACTIVE
        expected = self.state.build_seconds(e.hall, e.pool)
        first = max(self.poll_s, min(expected or 0.0, self.active_timeout_s))
        try:
            # look_up: a build the tagged list does not show is looked up by id before it is called lost (a GET
            # only then, none in a run where every build is listed)
            done = io.settle_builds(
                act, by=None, look_up=True, started=started, first_wait=first, timeout_s=self.active_timeout_s
            )
        finally:
            # A server in ERROR holds quota and a name: take it back now; the next run launches anew if allowed.
            if errored:
                delete_all(self.cloud, self.meter, errored, concurrency=self.concurrency)
        if not done:
            raise AcquireError(f"plan entry {e.entry}: servers not ACTIVE after {self.active_timeout_s:.0f} s")

    def _delete(self, e: PlanEntry, io: FleetIO, victims: list[Instance], out: Outcome) -> None:
        """All DELETEs at once, each recorded as it is accepted; then wait until Nova no longer lists them."""
        t0 = time.monotonic()
        with_server = {i.server_id: i for i in victims if i.server_id}
        for i in victims:
            if not i.server_id:  # a slot whose launch never reached Nova
                self.state.transition(i.id, "failed", "launch.failed", error="plan shrank before the launch")
        accepted, refused = delete_all(self.cloud, self.meter, list(with_server), concurrency=self.concurrency)
        for sid in accepted:
            self.state.transition(with_server[sid].id, "deleted", "instance.deleted", reason="plan shrank")
            out.deleted += 1
        for sid, msg in refused.items():
            out.errors.append(f"deleting {with_server[sid].name}: {msg}")
        left = wait_gone(io.servers, accepted, started=t0, timeout_s=self.delete_timeout_s, sleep=self.sleep)
        for sid in left:
            out.warnings.append(
                f"{with_server[sid].name} ({sid}): Nova still lists it {self.delete_timeout_s:.0f} s after the"
                " delete; the next run's reconciliation deletes it again"
            )
        if refused:
            raise CloudError(f"plan entry {e.entry}: Nova refused deletes: " + "; ".join(out.errors[-len(refused) :]))
