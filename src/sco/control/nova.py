"""What the acquirer and the reconciler say to Nova, and how they pay for it.

* ``Meter``: every call is paid from the token bucket in the fleet state (shared by every run against one
  cloud) and counted, so a run can say how many calls it made.
* ``hall_servers`` / ``entry_servers``: one tagged list call; a deleted server is no server.
* ``delete_all``: the DELETEs of a batch in parallel (one at a time, 10 deletes took 3x as long as openstacksdk
  issuing them from threads), then ``wait_until`` the list no longer shows them.
* ``wait_until``: polls by list call, not a GET per server; when to ask next is estimated from how fast the
  servers have been moving so far (a build or a delete finishes at the throughput the cloud showed), so a batch
  costs a handful of list calls however long it takes, and the last poll lands soon after the last server.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sco.errors import ScoError

if TYPE_CHECKING:
    from sco.state.fleet import FleetState

TAG = "sco-{}={}"
GONE = ("DELETED", "SOFT_DELETED")


class CloudError(ScoError):
    """The cloud refused or did not answer; the message is the cloud's own."""

    exit_code = 9


def cloud_message(e: BaseException) -> str:
    """The cloud's own words for an openstacksdk exception (its HTTP status and Nova's message)."""
    details = getattr(e, "details", None)
    code = getattr(e, "status_code", None)
    text = str(details or e).strip() or type(e).__name__
    return f"HTTP {code}: {text}" if code and str(code) not in text else text


@dataclass(frozen=True)
class Budget:
    """API calls per minute against one cloud, shared through the fleet state by every run."""

    bucket: str = "openstack"
    per_minute: float = 600.0
    burst: float = 120.0


class Meter:
    """Pays each call from the shared bucket and counts it. Thread-safe (the FleetState connection is not)."""

    def __init__(self, state: FleetState, budget: Budget | None = None, sleep: Callable[[float], None] = time.sleep):
        self.state = state
        self.budget = budget or Budget()
        self.sleep = sleep
        self.calls = 0
        self.lock = threading.Lock()

    def pay(self, n: int = 1) -> None:
        while True:
            with self.lock:
                wait = self.state.take_tokens(
                    self.budget.bucket, n, capacity=self.budget.burst, per_minute=self.budget.per_minute
                )
                if wait == 0:
                    self.calls += n
                    return
            self.sleep(min(wait, 5.0))

    def record(self, fn: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        """Run a fleet-state call under the lock (worker threads share the one connection)."""
        with self.lock:
            return fn(*a, **kw)


def tag_value(server: Any, key: str) -> str | None:
    prefix = f"sco-{key}="
    for t in getattr(server, "tags", None) or []:
        if t.startswith(prefix):
            return str(t[len(prefix) :])
    return None


def slot_of(server: Any) -> int | None:
    v = tag_value(server, "slot")
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None


def _list(cloud: Any, meter: Meter, tags: list[str]) -> list[Any]:
    meter.pay()
    try:
        return [s for s in cloud.compute.servers(details=True, tags=",".join(tags)) if s.status not in GONE]
    except Exception as e:  # openstacksdk's exceptions, keystoneauth's connection errors
        raise CloudError(f"Nova: listing the servers tagged {','.join(tags)}: {cloud_message(e)}") from None


def hall_servers(cloud: Any, meter: Meter, hall: str) -> list[Any]:
    return _list(cloud, meter, [TAG.format("hall", hall)])


def entry_servers(cloud: Any, meter: Meter, hall: str, pool: str, entry: str) -> list[Any]:
    return _list(cloud, meter, [TAG.format("hall", hall), TAG.format("pool", pool), TAG.format("entry", entry)])


def server_still_there(cloud: Any, meter: Meter, server_id: str) -> Any | None:
    """One GET by id: the server when Nova still has it (a tagged list no longer shows it: its tags were removed),
    None when it is gone."""
    from openstack import exceptions

    meter.pay()
    try:
        s = cloud.compute.get_server(server_id)
    except exceptions.NotFoundException:
        return None
    except Exception as e:
        raise CloudError(f"Nova: looking up server {server_id}: {cloud_message(e)}") from None
    return None if s.status in GONE else s


def restore_tags(cloud: Any, meter: Meter, server: Any, tags: list[str]) -> None:
    """Put the product's tags back on a server (one PUT of its whole tag list, what else it carried kept)."""
    keep = [t for t in (getattr(server, "tags", None) or []) if not t.startswith("sco-")]
    meter.pay()
    try:
        server.set_tags(cloud.compute, sorted(set(keep) | set(tags)))
    except Exception as e:
        raise CloudError(f"Nova: tagging server {server.id}: {cloud_message(e)}") from None


def next_poll(started: float, now: float, total: int, done: int, *, floor: float = 0.25, cap: float = 10.0) -> float:
    """Seconds to wait before the next list call: the time the rest should take at the rate seen so far (10% over,
    so the poll lands after, not just before), or as long as it has taken so far while nothing has finished."""
    elapsed = max(now - started, floor)
    left = total - done
    if left <= 0:
        return 0.0
    guess = elapsed * left / done * 1.1 if done else elapsed
    return min(max(guess, floor), cap)


def wait_until(
    done: Callable[[], tuple[int, int]],
    *,
    started: float,
    timeout_s: float,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    cap: float = 10.0,
    floor: float = 0.25,
) -> bool:
    """Poll ``done()`` -> (finished, total) until all have finished or ``timeout_s`` passed; True when all did.
    ``cap``: the longest wait between two polls (how late the last one may land)."""
    end = clock() + timeout_s
    while True:
        finished, total = done()
        if finished >= total:
            return True
        now = clock()
        if now >= end:
            return False
        sleep(min(next_poll(started, now, total, finished, floor=floor, cap=cap), max(end - now, 0.0)))


def delete_all(
    cloud: Any, meter: Meter, ids: Iterable[str], *, concurrency: int = 8
) -> tuple[list[str], dict[str, str]]:
    """DELETE each server in parallel; returns (accepted ids, {id: the cloud's message} for refusals)."""
    ids = list(dict.fromkeys(ids))
    errors: dict[str, str] = {}

    def one(sid: str) -> None:
        meter.pay()
        try:
            cloud.compute.delete_server(sid, ignore_missing=True)
        except Exception as e:
            errors[sid] = cloud_message(e)

    if ids:
        with concurrent.futures.ThreadPoolExecutor(min(concurrency, len(ids))) as ex:
            list(ex.map(one, ids))
    return [i for i in ids if i not in errors], errors


def wait_gone(
    listing: Callable[[], list[Any]],
    ids: Iterable[str],
    *,
    started: float,
    timeout_s: float = 120.0,
    sleep: Callable[[float], None] = time.sleep,
    every: float = 0.5,
) -> set[str]:
    """Wait until none of ``ids`` is in ``listing()`` (one tagged list call); returns those still there at the
    timeout. Polls ``every`` seconds: one list answers for the whole batch, so a short interval costs a few list
    calls where a GET per server each interval would cost the batch size each time."""
    want = set(ids)
    left = set(want)

    def check() -> tuple[int, int]:
        nonlocal left
        listed = {s.id for s in listing()}
        left = want & listed
        return len(want) - len(left), len(want)

    if want:
        # a delete is done in a second or two after it is accepted, and the pace estimate (made for builds) slept
        # up to 2 s past the last one: poll at a fixed short interval instead, as openstacksdk's waits do
        sleep(every)
        wait_until(check, started=started, timeout_s=timeout_s, sleep=sleep, cap=every, floor=min(every, 0.25))
    return left
