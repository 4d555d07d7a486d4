"""One reclaim run as ``sco reclaim`` and the collection's ``reclaim`` module both make it: the hall's lock, the
notices, the deletes until Nova confirms them, and the outcome (an exception for what is not confirmed gone).

Kept out of the CLI and the module so both say and do the same thing.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sco._retry import Backoff
from sco.contract.signing import PrivateKey
from sco.errors import ConfigError, Problem
from sco.provider.reclaimer import DrainFloor, Reclaimer, ReclaimIncomplete, db_failure
from sco.state.db import HallBusy, SessionLost, StateError, hall_lock
from sco.state.fleet import FleetState

log = logging.getLogger("sco.reclaimer")

# A run whose session keeps going (more failovers than a hall has in a day) stops and says so.
MAX_SESSION_LOSSES = 5


@dataclass(frozen=True)
class ReclaimSettings:
    hall: str
    nodes: tuple[str, ...]
    window_s: float
    nats_url: str
    signing_keys: list[PrivateKey]
    dsn: str
    nats_auth: dict[str, Any] = field(default_factory=dict)
    lock_wait_s: float = 0.0
    wait: bool = True
    """Wait for the deletes (else return once the notices are sent; a later run deletes)."""
    floor: DrainFloor | None = None
    """The hall's drain floor (from its bundle): a shorter window is refused."""
    retry_for_s: float = 120.0
    call_timeout_s: float = 30.0
    lock_idle_s: float = 120.0
    """The hall's lock ends with a run that stops talking to the fleet state for this long (a hung run)."""
    before_leases: bool = False
    """Also reclaim the hall's reclaimable instances on hosts a Blazar lease takes within a window (plus
    ``lease_lookahead_s``), so they are gone ``lease_margin_s`` before it starts (Blazar would delete them)."""
    lease_lookahead_s: float = 60.0
    """How often the runs that look come (the control loop's period): a lease is seen at least a window early."""
    lease_margin_s: float = 10.0
    reconnect_for_s: float = 90.0
    """A fleet state that goes away mid-run (a Patroni failover, a PostgreSQL restart) is connected to again, and the
    hall's lock taken again, for this long before the run gives up (Patroni's default ttl is 30 s)."""

    def __post_init__(self) -> None:
        bad = limit_problems(
            retry_for=self.retry_for_s,
            call_timeout=self.call_timeout_s,
            lock_wait=self.lock_wait_s,
            reconnect_for=self.reconnect_for_s,
        )
        if bad:
            raise ConfigError("; ".join(bad))


def limit_problems(names: Mapping[str, str] | None = None, **values: float) -> list[str]:
    """What is wrong with a reclaim run's numbers (retry_for, call_timeout, lock_wait, reconnect_for, in seconds),
    each line naming the value as ``names`` spells it (a CLI's flag) or by its key. The one rule of ReclaimSettings
    and of sco.control.options.ReclaimOptions, which ``sco reclaim`` and the collection's reclaim module both parse
    into; retry_for 0 is one attempt, no retries."""
    # name: (least, most, whether the least itself is allowed, the rule said)
    rules: dict[str, tuple[float, float, bool, str]] = {
        "retry_for": (0, 86400, True, "0 to 86400 seconds"),
        "call_timeout": (0, 600, False, "more than 0 and at most 600 s"),
        "lock_wait": (0, 3600, True, "0 to 3600 seconds"),
        "reconnect_for": (0, 3600, True, "0 to 3600 seconds"),
    }
    bad = []
    for what, v in values.items():
        least, most, least_ok, rule = rules[what]
        if not (math.isfinite(v) and (least <= v if least_ok else least < v) and v <= most):
            bad.append(f"{(names or {}).get(what, what)}: expected {rule}, got {v}")
    return bad


async def reclaim(
    s: ReclaimSettings, cloud: Any, *, on_notice: Callable[[Any], None] | None = None
) -> list[dict[str, Any]]:
    """Notice ``s.nodes`` (instances already under reclaim keep their T), then delete every instance of the hall
    under reclaim at its T until Nova confirms it gone (also those an earlier run noticed and did not finish: at
    their recorded T, or at once when it has passed). Returns one dict per noticed instance, then one per
    finished one (``finished``, with ``late_s``: how long after its T its delete went out), then one per instance
    left because its notice was never sent and this run has no key to send it (``unnoticed``: why); raises
    ReclaimIncomplete (exit 9) naming every instance not confirmed gone and the cloud's last word on it."""
    import asyncio

    import psycopg

    with contextlib.ExitStack() as held:
        st = held.enter_context(FleetState(s.dsn, application="sco reclaim"))
        held.enter_context(hall_lock(st.conn, s.hall, wait_s=s.lock_wait_s, idle_timeout_s=s.lock_idle_s))
        r = Reclaimer(
            cloud, st, s.nats_url, window_s=s.window_s, signing_keys=s.signing_keys, nats_auth=s.nats_auth,
            retry_for_s=s.retry_for_s, call_timeout_s=s.call_timeout_s, floor=s.floor,
        )  # fmt: skip
        losses, notice_lost = 0, False
        try:
            nodes, gone_by = list(s.nodes), {}
            if s.before_leases:
                gone_by = await asyncio.wait_for(_before_leases(s, cloud, st, st.now()), 4 * s.call_timeout_s)
                nodes += [n for n in gone_by if n not in nodes]
            try:
                done = await r.notify(s.hall, nodes, gone_by=gone_by) if nodes else []
            except psycopg.Error as e:
                lost = db_failure(st, s.hall, e)
                if not isinstance(lost, SessionLost) or not s.wait:
                    raise lost from None
                # T is recorded before anything is sent: the run below tells whoever this one had not told yet,
                # each with a whole window (this run has the notice key)
                st = r.state = await _take_back(s, held, lost)
                losses, done, notice_lost = losses + 1, [], True
                r.reclaims.clear()  # what was told is what the fleet state recorded as tried, nothing else
            for rc in done:
                if on_notice is not None:
                    on_notice(rc)
            while s.wait:  # also finishes the reclaims earlier runs noticed (a control host that stopped before T)
                try:
                    await r.run(s.hall, follow_events=bool(s.nats_url))
                    break
                except SessionLost as lost:  # the lock went with the session: take both again, then go on
                    if losses >= MAX_SESSION_LOSSES:
                        raise SessionLost(f"{lost} (lost {losses + 1} times in this run: giving up)") from None
                    st = r.state = await _take_back(s, held, lost)
                    losses += 1
            if notice_lost:  # the nodes the run told again after the loss are this run's notices
                done = [rc for rc in r.reclaims.values() if rc.instance.name in nodes]
                for rc in done:
                    if on_notice is not None:
                        on_notice(rc)
            out = [
                {
                    "name": rc.instance.name,
                    "notice": rc.notice["id"],
                    "terminate_at": rc.terminate_at,
                    "published": rc.published_at is not None,
                    "state": st.instance(rc.instance.id).state,
                    # what the agent had reported when the delete went out (None: not deleted in this run)
                    "agent": rc.agent_state,
                }
                for rc in done
            ] + [
                {
                    "name": f["name"], "notice": None, "terminate_at": f["terminate_at"], "published": None,
                    "state": st.instance(iid).state, "agent": f["agent"], "finished": True,
                    "deleted_at": f["deleted_at"], "late_s": f["late_s"],
                }
                for iid, f in r.finished.items()
            ] + [
                {"name": st.instance(iid).name, "state": st.instance(iid).state, "unnoticed": why}
                for iid, why in r.unnoticed.items()
            ]  # fmt: skip
            if r.unconfirmed:
                names = {i.id: i.name for i in st.instances(s.hall, states=None)}
                problems = [
                    Problem(f"hall {s.hall}", names.get(iid, str(iid)), why) for iid, why in r.unconfirmed.items()
                ]
                first = problems[0]
                raise ReclaimIncomplete(
                    f"hall {s.hall}: {len(problems)} instance(s) not confirmed gone from Nova, left under reclaim"
                    f" (the next run deletes them): {first.field}: {first.message}",
                    problems,
                )
            return out
        except psycopg.Error as e:  # outside the notices and the deletes: said as what it is, never a traceback
            raise db_failure(st, s.hall, e) from None
        finally:
            await r.close()


async def _take_back(s: ReclaimSettings, held: contextlib.ExitStack, lost: SessionLost) -> FleetState:
    """A new session and the hall's lock again after ``lost`` (the multi-host DSN finds the new primary), trying
    with capped backoff and jitter for up to ``s.reconnect_for_s``. The instances under reclaim keep their recorded
    T, so the run goes on where it was. HallBusy if another writer took the hall meanwhile (it finishes them);
    ``lost`` itself, with the last error, when no writable fleet state came back in time."""
    import asyncio

    import psycopg

    held.close()  # the dead session (its lock is gone with it: nothing to unlock)
    end, backoff, last = time.monotonic() + s.reconnect_for_s, Backoff(0.5, 5.0), ""
    while True:
        try:
            st = held.enter_context(FleetState(s.dsn, application="sco reclaim"))
            held.enter_context(hall_lock(st.conn, s.hall, wait_s=0, idle_timeout_s=s.lock_idle_s))
            log.warning("hall %s: the fleet state's session was lost mid-reclaim; connected again, lock taken", s.hall)
            return st
        except HallBusy as busy:
            raise HallBusy(
                f"{busy} (this run lost its session mid-reclaim and that writer took the hall meanwhile: it finishes"
                " the instances under reclaim; nothing to run again)"
            ) from None
        except (StateError, psycopg.Error) as e:  # not reachable yet, a standby still, or gone again
            held.close()
            last = str(e)
        now = time.monotonic()
        if now >= end:
            raise SessionLost(f"{lost} (no writable fleet state for {s.reconnect_for_s:g} s after: {last[:300]})")
        await asyncio.sleep(min(end - now, backoff.next()))


async def _before_leases(s: ReclaimSettings, cloud: Any, st: FleetState, now: float) -> dict[str, tuple[float, str]]:
    """The hall's active reclaimable instances on hosts a host lease takes within a window (plus the look-ahead):
    name -> (when it must be gone, why)."""
    import asyncio
    import hashlib

    from sco.provider.reservations import leases_to_clear, read_host_allocations, read_reservations

    # every project's host leases: /leases shows a non-admin credential its own project's only, the hosts'
    # allocations show them all (docs/OPENSTACK-POLICY.md)
    leases = await asyncio.to_thread(read_reservations, cloud)
    allocations = await asyncio.to_thread(read_host_allocations, cloud)
    clearings = leases_to_clear(leases, allocations, now, s.window_s + s.lease_lookahead_s)
    if not clearings:
        return {}
    by_host = {h: c for c in reversed(clearings) for h in c.hosts}  # the earliest lease wins a host

    def servers() -> dict[str, tuple[str, ...]]:
        # The hall's servers are the control plane's project's (the acquirer's credential), so no all_projects
        # (an admin rule). A member does not see a server's host (OS-EXT-SRV-ATTR, admin by default) but sees its
        # hostId, Nova's sha224(project id + host): each lease host is hashed alike and compared, so the step
        # needs no Nova rule beyond a member's (docs/OPENSTACK-POLICY.md).
        found = cloud.compute.servers(details=True, tags=f"sco-hall={s.hall}")
        out = {}
        for x in found:
            named = [h for h in (x.compute_host, x.hypervisor_hostname) if h]
            hashed = [hashlib.sha224(f"{x.project_id or ''}{h}".encode()).hexdigest() for h in by_host]
            out[x.id] = tuple(named) + tuple(h for h, d in zip(by_host, hashed, strict=True) if d == x.host_id)
        return out

    hosts_of = await asyncio.to_thread(servers)
    reclaimable = {
        p for p in {i.pool for i in st.instances(s.hall)} if (x := st.pool(s.hall, p)) and x.kind == "reclaimable"
    }
    out: dict[str, tuple[float, str]] = {}
    for inst in st.instances(s.hall, states=("active",)):
        if inst.pool not in reclaimable or not inst.server_id:
            continue
        c = next((by_host[h] for h in hosts_of.get(inst.server_id, ()) if h in by_host), None)
        if c is not None:
            why = f"lease {c.lease_name} ({c.lease_id}) takes host {', '.join(c.hosts)} at {c.start:.0f}"
            out[inst.name] = (c.start - s.lease_margin_s, why)
    return out
