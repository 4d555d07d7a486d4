"""The agent's drain lifecycle on its own: what the supervisor does with a drain, around the drain path.

``sco.agent.drains.DrainSupervisor`` over a real spool on disk and the real notice book, with an injected clock and a
recording drain path (the ``DrainPath`` protocol is the supervisor's whole view of a scheduler). The drains
themselves (taint, evict, signal, verify) are the drain paths' tests; these pin what happens around one: what is
said when there is no bundle or the notice is late, that the deadline a drain gets is the notice's less the margin,
that a moved deadline reaches the running drain and the checkpoint socket, that a failed drain is an error event and
frees the node for the next, the follow-ups owed after each drain, resuming a drain the spool left open after a
restart, the latch that keeps a restart on the same boot from draining twice, and rearming once back in service.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from sco.agent.deadline import Deadline
from sco.agent.drains import DrainSupervisor
from sco.agent.notices import Notice, NoticeBook
from sco.agent.resume import DrainRecord
from sco.agent.spool import CRITICAL, Spool

T0 = 1_800_000_000.0
MARGIN = 5.0


class Clock:
    def __init__(self) -> None:
        self.t = T0

    def __call__(self) -> float:
        return self.t


class Record(DrainRecord):
    """A drain path's resume record: it counts the notice's events the spool holds."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[str] = []

    def apply(self, type_: str, ev: dict[str, Any]) -> None:
        self.steps.append(type_)

    def summary(self) -> dict[str, Any]:
        return {"steps_done": len(self.steps)}


@dataclass
class FakeDrain:
    """One drain as the supervisor sees it: it runs until released, then returns its outcome (or raises)."""

    notice: Notice
    deadline: Deadline
    record: DrainRecord | None
    release: asyncio.Event = field(default_factory=asyncio.Event)
    fail: bool = False
    moved: list[float] = field(default_factory=list)

    async def run(self) -> dict[str, Any]:
        await self.release.wait()
        if self.fail:
            raise RuntimeError("the scheduler's answer made no sense")
        return {"outcome": "drained", "pods": 3}

    def update_deadline(self, terminate_at: float) -> bool:
        self.moved.append(terminate_at)
        return self.deadline.move_earlier(terminate_at)

    def summary(self) -> dict[str, Any]:
        return {}

    def progress(self) -> tuple[int, int]:
        return 1, 3


@dataclass
class RecordingPath:
    """A drain path that records each drain it is asked for and owes one follow-up after each."""

    fail_next: bool = False
    drains: list[FakeDrain] = field(default_factory=list)
    follow_up_calls: int = 0

    def record(self, spool: Spool, notice_id: str) -> DrainRecord:
        return Record.from_spool(spool, notice_id)

    def drain(self, notice: Notice, deadline: Deadline, record: DrainRecord | None) -> FakeDrain:
        d = FakeDrain(notice, deadline, record, fail=self.fail_next)
        self.drains.append(d)
        return d

    async def preflight(self) -> list[str]:
        return []

    def follow_ups(self, stop: asyncio.Event) -> list[tuple[str, Coroutine[Any, Any, None]]]:
        self.follow_up_calls += 1

        async def tell() -> None:
            return None

        return [(f"follow-up-{self.follow_up_calls}", tell())]


class Checkpoint:
    """The checkpoint socket as the supervisor sees it: told at a drain's start and when its deadline moves."""

    def __init__(self) -> None:
        self.started: list[tuple[str, float]] = []
        self.updates = 0

    def start_notice(self, notice_id: str, deadline: Deadline) -> None:
        self.started.append((notice_id, deadline.kill_at))

    def update_deadline(self) -> None:
        self.updates += 1


@dataclass
class Parts:
    sup: DrainSupervisor
    path: RecordingPath
    spool: Spool
    book: NoticeBook
    clock: Clock
    checkpoint: Checkpoint
    spawned: list[str]
    wakes: list[float]


def make(tmp_path: Path, *, bundle: object = object(), spool_dir: Path | None = None) -> Parts:
    clock = Clock()
    spool = Spool(spool_dir or tmp_path / "spool", clock=clock, base={"hall": "h", "node": "n1"})
    book = NoticeBook()
    path = RecordingPath()
    checkpoint = Checkpoint()
    spawned: list[str] = []
    wakes: list[float] = []

    def spawn(coro: Coroutine[Any, Any, None], name: str) -> None:
        spawned.append(name)
        coro.close()  # the supervisor's job is to hand it over; running it is the daemon's

    sup = DrainSupervisor(
        spool=spool,
        book=book,
        bundle=lambda: bundle,  # type: ignore[arg-type,return-value]
        margin=lambda: MARGIN,
        clock=clock,
        spawn=spawn,
        wake=lambda: wakes.append(clock()),
        stop=asyncio.Event(),
    )
    sup.attach(path, checkpoint)  # type: ignore[arg-type]
    return Parts(sup, path, spool, book, clock, checkpoint, spawned, wakes)


def notice(nid: str, terminate_in: float, now: float = T0) -> Notice:
    return Notice(nid, "h", "n1", now + terminate_in, now, "nats", now)


def types(spool: Spool) -> list[str]:
    return [str(e["type"]) for e in spool.events()]


def in_loop(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """The test's body in an event loop of its own (the supervisor creates tasks)."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))

    return run


@in_loop
async def test_a_drain_runs_against_the_notices_deadline_less_the_margin_and_reports_its_outcome(
    tmp_path: Path,
) -> None:
    p = make(tmp_path)
    assert p.sup.state() == "idle"
    p.sup.start(notice("r1", 120.0))
    d = p.path.drains[0]
    assert d.deadline.terminate_at == T0 + 120.0 and d.deadline.kill_at == T0 + 120.0 - MARGIN
    assert p.checkpoint.started == [("r1", T0 + 120.0 - MARGIN)]  # workloads told at once, with the same kill time
    assert p.sup.state() == "draining 1/3 for notice r1"
    assert p.wakes == [T0]  # the publisher woken at the start
    d.release.set()
    assert p.sup.task is not None
    await p.sup.task
    assert p.sup.current is None
    assert p.sup.outcomes == [{"notice": "r1", "outcome": "drained", "pods": 3}]
    assert p.sup.state() == "drained for notice r1"
    assert p.spawned == ["follow-up-1"]  # what the path owes after a drain is started once
    assert len(p.wakes) == 2  # and at the end
    assert "bundle.missing" not in types(p.spool) and "notice.late" not in types(p.spool)


@in_loop
async def test_without_a_verified_bundle_the_drain_still_runs_and_says_so(tmp_path: Path) -> None:
    p = make(tmp_path, bundle=None)
    p.sup.start(notice("r1", 120.0))
    [ev] = [e for e in p.spool.events() if e["type"] == "bundle.missing"]
    assert ev["notice"] == "r1" and "capped by the deadline" in ev["reason"]
    assert len(p.path.drains) == 1
    p.path.drains[0].release.set()
    assert p.sup.task is not None
    await p.sup.task


@in_loop
async def test_a_notice_past_its_time_is_drained_best_effort_and_the_lateness_is_recorded(tmp_path: Path) -> None:
    p = make(tmp_path)
    p.clock.t = T0 + 130.0  # the notice said T0 + 120: ten seconds late
    p.sup.start(notice("late", 120.0))
    [ev] = [e for e in p.spool.events() if e["type"] == "notice.late"]
    assert ev["past_by_s"] == 10.0 and ev["terminate_at"] == T0 + 120.0
    d = p.path.drains[0]
    assert d.deadline.late is not None and d.deadline.kill_at > p.clock.t  # still a kill time ahead, not in the past
    d.release.set()
    assert p.sup.task is not None
    await p.sup.task


@in_loop
async def test_a_moved_deadline_reaches_the_running_drain_and_the_checkpoint_socket(tmp_path: Path) -> None:
    p = make(tmp_path)
    p.sup.move_deadline(T0 + 10.0)  # no drain yet: nothing to move, nothing raised
    assert p.checkpoint.updates == 1
    p.sup.start(notice("r1", 120.0))
    p.sup.move_deadline(T0 + 60.0)
    assert p.path.drains[0].moved == [T0 + 60.0] and p.checkpoint.updates == 2
    p.path.drains[0].release.set()
    assert p.sup.task is not None
    await p.sup.task


@in_loop
async def test_a_drain_that_raises_is_an_error_event_and_frees_the_node(tmp_path: Path) -> None:
    p = make(tmp_path)
    p.path.fail_next = True
    p.sup.start(notice("r1", 120.0))
    p.path.drains[0].release.set()
    assert p.sup.task is not None
    await p.sup.task
    [ev] = [e for e in p.spool.events() if e["type"] == "drain.error"]
    assert ev["notice"] == "r1"
    assert p.sup.current is None and p.sup.outcomes == []
    assert p.spawned == []  # no follow-ups for a drain that did not finish
    assert len(p.wakes) == 2


@in_loop
async def test_after_a_restart_the_drain_the_spool_left_open_resumes_with_what_it_had_done(tmp_path: Path) -> None:
    first = make(tmp_path)
    n = notice("r1", 120.0)
    first.spool.append(
        "notice.accepted", CRITICAL, notice="old", terminate_at=T0, issued_at=T0, received_at=T0, source="nats"
    )
    first.spool.append("drain.drained", CRITICAL, notice="old")
    first.spool.append(
        "notice.accepted",
        CRITICAL,
        notice="r1",
        terminate_at=n.terminate_at,
        issued_at=n.issued_at,
        received_at=n.received_at,
        source="nats",
    )
    first.spool.append("notice.deadline", CRITICAL, notice="r1", terminate_at=T0 + 90.0)  # an earlier notice
    first.spool.append("drain.tainted", CRITICAL, notice="r1")
    first.spool.close()

    # the same spool directory, read by a new agent 30 s later
    p = make(tmp_path, spool_dir=tmp_path / "spool")
    p.clock.t = T0 + 30.0
    p.sup.resume("h", "n1")
    # "old" (an earlier drain) finished: only the open one resumes, with the earlier deadline and its first receipt
    assert set(p.book.seen) == {"r1", "old"}
    [d] = p.path.drains
    assert d.notice.id == "r1" and d.notice.source == "spool" and d.deadline.terminate_at == T0 + 90.0
    assert d.deadline.started_at == T0  # budgets run from the first receipt, not from the restart
    assert isinstance(d.record, Record) and d.record.steps == ["notice.deadline", "drain.tainted"]
    [ev] = [e for e in p.spool.events() if e["type"] == "drain.resumed"]
    assert ev["notice"] == "r1" and ev["deadline_in_s"] == 60.0 and ev["steps_done"] == 2
    d.release.set()
    assert p.sup.task is not None
    await p.sup.task


@in_loop
async def test_nothing_to_resume_when_every_drain_the_spool_knows_finished(tmp_path: Path) -> None:
    p = make(tmp_path)
    p.spool.append(
        "notice.accepted", CRITICAL, notice="r1", terminate_at=T0, issued_at=T0, received_at=T0, source="nats"
    )
    p.spool.append("drain.error", CRITICAL, notice="r1")
    p.sup.resume("h", "n1")
    assert p.path.drains == [] and set(p.book.seen) == {"r1"}
    assert "drain.resumed" not in types(p.spool)


@in_loop
async def test_node_back_in_service_rearms_the_book_and_a_scheduler_away_is_asked_again(tmp_path: Path) -> None:
    p = make(tmp_path)
    p.book.offer(notice("r1", 120.0))
    answers: list[Any] = [ConnectionError("scheduler away"), False, True]
    asked = 0

    async def back_in_service() -> bool:
        nonlocal asked
        asked += 1
        a = answers.pop(0) if answers else True
        if isinstance(a, Exception):
            raise a
        return bool(a)

    task = asyncio.create_task(p.sup.rearm_watch(0.01, back_in_service))
    for _ in range(200):
        await asyncio.sleep(0.01)
        if "notice.rearmed" in types(p.spool):
            break
    p.sup.stop.set()
    await asyncio.wait_for(task, 2.0)
    assert asked == 3  # an error and a "not yet" are asked again, not taken as back
    assert p.book.current is None and p.book.seen == {}
    [ev] = [e for e in p.spool.events() if e["type"] == "notice.rearmed"]
    assert ev["after"] == "r1" and ev["reason"] == "node back in service"


@in_loop
async def test_a_node_still_draining_is_not_rearmed(tmp_path: Path) -> None:
    p = make(tmp_path)
    p.book.offer(notice("r1", 120.0))
    p.sup.start(notice("r1", 120.0))
    asked = 0

    async def back_in_service() -> bool:
        nonlocal asked
        asked += 1
        return True

    task = asyncio.create_task(p.sup.rearm_watch(0.01, back_in_service))
    await asyncio.sleep(0.1)
    p.sup.stop.set()
    await asyncio.wait_for(task, 2.0)
    assert asked == 0 and p.book.current is not None  # the drain's own taint is not "back in service"
    await p.sup.cancel(1.0)
    assert p.sup.task is not None and p.sup.task.cancelled()


@pytest.mark.parametrize("same_boot", [True, False])
@in_loop
async def test_a_restart_on_the_same_boot_keeps_the_latched_notice_and_a_new_boot_does_not(
    tmp_path: Path, same_boot: bool
) -> None:
    p = make(tmp_path)
    p.spool.append("agent.started", CRITICAL, boot_id="boot-1")
    p.spool.append(
        "notice.accepted", CRITICAL, notice="r1", terminate_at=T0 + 120, issued_at=T0, received_at=T0, source="nats"
    )
    p.spool.append("drain.drained", CRITICAL, notice="r1")
    p.sup.restore("h", "n1", "boot-1" if same_boot else "boot-2")
    if same_boot:
        assert p.book.current is not None and p.book.current.id == "r1"
        assert p.book.offer(notice("r2", 120.0)) == "absorbed"  # no second drain on this instance
    else:
        assert p.book.current is None
