"""The acquirer: makes a hall's pool hold what a plan entry asks for, through Nova (VMs and Ironic nodes alike).

Crash-safe by construction: every server is created with tags naming its hall, pool, plan entry and slot, in the
same create call, so whatever a crashed run managed to launch is found by the next run (one list call) and
adopted instead of launched again. The fleet state records each instance's lifecycle and every launch and
failure. API calls are paid from a token budget in the fleet state that every concurrent run shares.
A quota error or NoValidHost marks the pool unavailable for a while: the run stops launching into it, and later
runs skip it until the time is up, instead of retrying hot.
"""

from __future__ import annotations

import base64
import concurrent.futures
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sco.errors import ConfigError, ScoError
from sco.state.fleet import FleetState, Instance, Pool

DNS = re.compile(r"^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$")
TAG = "sco-{}={}"
UserData = Callable[[str], str]  # node name -> cloud-init user-data


class AcquireError(ScoError):
    exit_code = 9


@dataclass(frozen=True)
class PlanEntry:
    """Hold ``count`` instances of ``pool`` in ``hall`` for plan entry ``entry``."""

    hall: str
    pool: str
    entry: str
    count: int

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


@dataclass(frozen=True)
class Budget:
    """API calls per minute against one cloud, shared through the fleet state by every run."""

    bucket: str = "openstack"
    per_minute: float = 600.0
    burst: float = 120.0


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


def _slot(server: Any) -> int | None:
    for t in server.tags or []:
        if t.startswith("sco-slot="):
            try:
                return int(t.split("=", 1)[1])
            except ValueError:
                return None
    return None


def _quota_error(e: Exception) -> bool:
    code = getattr(e, "status_code", None)
    text = str(e).lower()
    return code == 413 or (code == 403 and "quota" in text)


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
        lock_wait_s: float = 0.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.cloud = cloud  # an openstacksdk Connection
        self.state = state
        self.user_data = user_data
        self.budget = budget or Budget()
        self.unavailable_for_s = unavailable_for_s
        self.concurrency = concurrency
        self.poll_s = poll_s
        self.active_timeout_s = active_timeout_s
        self.lock_wait_s = lock_wait_s
        self.sleep = sleep
        self.api_calls = 0
        self._lock = threading.Lock()  # the FleetState connection is not shared across threads unguarded

    # --- plumbing --------------------------------------------------------------------------------------

    def _pay(self, n: int = 1) -> None:
        while True:
            with self._lock:
                wait = self.state.take_tokens(
                    self.budget.bucket, n, capacity=self.budget.burst, per_minute=self.budget.per_minute
                )
                if wait == 0:
                    self.api_calls += n
                    return
            self.sleep(min(wait, 5.0))

    def _record(self, fn: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        with self._lock:
            return fn(*a, **kw)

    def _list(self, e: PlanEntry) -> list[Any]:
        self._pay()
        return [
            s
            for s in self.cloud.compute.servers(details=True, tags=",".join(e.tags()))
            if s.status not in ("DELETED", "SOFT_DELETED")
        ]

    # --- the run ---------------------------------------------------------------------------------------

    def apply(self, entry: PlanEntry) -> Outcome:
        entry.check()
        out = Outcome(entry)
        calls0 = self.api_calls
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
            servers = self._list(entry)
            by_slot = self._adopt(entry, servers, out)
            missing = [s for s in range(entry.count) if s not in by_slot]
            surplus = [srv for slot, srv in by_slot.items() if slot >= entry.count]
            if surplus:
                self._delete(entry, surplus, out)
            launched = self._launch(entry, pool, missing, out) if missing else []
            if launched or any(s.status != "ACTIVE" for slot, s in by_slot.items() if slot < entry.count):
                self._wait_active(entry, pool, out)
            out.instances = self.state.instances(entry.hall, pool=entry.pool, plan_entry=entry.entry)
            out.active = sum(1 for i in out.instances if i.state == "active")
        out.api_calls = self.api_calls - calls0
        return out

    def _adopt(self, e: PlanEntry, servers: list[Any], out: Outcome) -> dict[int, Any]:
        """Servers found by tag become this run's; a server a crashed run created but never recorded is
        recorded now. Two servers in one slot (only possible by hand) keep the older."""
        by_slot: dict[int, Any] = {}
        for s in sorted(servers, key=lambda s: s.created_at or ""):
            slot = _slot(s)
            if slot is None or slot in by_slot:
                continue
            by_slot[slot] = s
            inst = self.state.by_server(s.id)
            if inst is None or inst.state == "deleted":
                row = self.state.request(e.hall, e.pool, e.entry, slot, e.name(slot))
                if row.server_id and row.server_id != s.id:
                    continue
                self.state.transition(row.id, "launching", "instance.adopted", server_id=s.id, status=s.status)
                out.adopted += 1
        return by_slot

    def _launch(self, e: PlanEntry, pool: Pool, slots: list[int], out: Outcome) -> list[str]:
        stop = threading.Event()  # set on a quota error: no more launches into this pool in this run
        ids: list[str] = []

        def one(slot: int) -> None:
            if stop.is_set():
                return
            name = e.name(slot)
            inst = self._record(self.state.request, e.hall, e.pool, e.entry, slot, name)
            kw: dict[str, Any] = {
                "name": name,
                "image_id": pool.image,
                "flavor_id": pool.flavor,
                "networks": "none",
                "user_data": base64.b64encode(self.user_data(name).encode()).decode(),
                "tags": [*e.tags(), TAG.format("slot", slot)],
                "metadata": {"sco_hall": e.hall, "sco_pool": e.pool, "sco_entry": e.entry},
            }
            if pool.availability_zone:
                kw["availability_zone"] = pool.availability_zone
            self._pay()
            try:
                srv = self.cloud.compute.create_server(**kw)
            except Exception as ex:
                quota = _quota_error(ex)
                self._record(
                    self.state.transition, inst.id, "failed", "launch.failed", error=str(ex)[:500], quota=quota
                )
                with self._lock:
                    out.failed += 1
                if quota:
                    stop.set()
                    self._unavailable(e, f"quota: {str(ex)[:300]}", out)
                return
            self._record(self.state.transition, inst.id, "launching", "launch.requested", server_id=srv.id, name=name)
            with self._lock:
                out.launched += 1
                ids.append(srv.id)

        with concurrent.futures.ThreadPoolExecutor(self.concurrency) as ex:
            for f in [ex.submit(one, s) for s in slots]:
                f.result()
        return ids

    def _unavailable(self, e: PlanEntry, reason: str, out: Outcome) -> None:
        if out.pool_unavailable is None:
            out.pool_unavailable = reason
            self._record(self.state.mark_unavailable, e.hall, e.pool, self.unavailable_for_s, reason)

    def _wait_active(self, e: PlanEntry, pool: Pool, out: Outcome) -> None:
        """One list call per poll for the whole entry (not one GET per server): cheaper on the budget."""
        end = time.monotonic() + self.active_timeout_s
        while True:
            pending = {
                i.server_id: i for i in self.state.instances(e.hall, pool=e.pool, plan_entry=e.entry)
                if i.state in ("launching", "requested") and i.server_id
            }  # fmt: skip
            if not pending:
                return
            if time.monotonic() > end:
                raise AcquireError(f"plan entry {e.entry}: {len(pending)} instances not ACTIVE after the timeout")
            self.sleep(self.poll_s)
            errored = []
            for s in self._list(e):
                inst = pending.get(s.id)
                if inst is None:
                    continue
                if s.status == "ACTIVE":
                    self.state.transition(inst.id, "active", "instance.active", only_from=("launching",))
                elif s.status == "ERROR":
                    fault = (s.fault or {}).get("message", "") if isinstance(s.fault, dict) else str(s.fault or "")
                    self.state.transition(inst.id, "failed", "launch.failed", error=fault[:500], status="ERROR")
                    out.failed += 1
                    errored.append(s)
                    if "no valid host" in fault.lower():
                        self._unavailable(e, f"NoValidHost: {fault[:300]}", out)
                    elif "quota exceeded" in fault.lower():
                        # Nova's API counts only scheduled instances; its conductor rechecks and fails the rest.
                        self._unavailable(e, f"quota: {fault[:300]}", out)
            # A server in ERROR holds quota and a name: take it back now; the next run launches anew if allowed.
            for s in errored:
                self._pay()
                self.cloud.compute.delete_server(s.id, ignore_missing=True)

    def _delete(self, e: PlanEntry, servers: list[Any], out: Outcome) -> None:
        for s in servers:
            inst = self.state.by_server(s.id)
            self._pay()
            self.cloud.compute.delete_server(s.id, ignore_missing=True)
            if inst is not None:
                self.state.transition(inst.id, "deleted", "instance.deleted", reason="plan shrank")
            out.deleted += 1
