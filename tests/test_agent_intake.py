"""The agent's notice intake on its own: what each notice does to the drain, and what it costs.

``sco.agent.intake.NoticeIntake`` over a real spool on disk and the agent's real metrics, with an injected clock
and a recording owner of the drain (the ``Drains`` protocol is the intake's whole view of it). No relay, no
metadata service, no scheduler: the end-to-end paths are the drain tests'; these pin the decisions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from sco.agent.deadline import Deadline
from sco.agent.intake import FOREIGN_SAY_EVERY_S, RECORDS_PER_SECOND, NoticeIntake
from sco.agent.metrics import AgentMetrics
from sco.agent.notices import Notice, NoticeRefused
from sco.agent.spool import Spool

T0 = 1_800_000_000.0


class Clock:
    def __init__(self) -> None:
        self.t = T0

    def __call__(self) -> float:
        return self.t


@dataclass
class RunningDrain:
    """What intake reads of a running drain: its notice and its deadline."""

    notice: Notice
    deadline: Deadline


@dataclass
class RecordingDrains:
    """The owner of the drain as intake sees it: it records every start and every deadline move."""

    clock: Clock
    current: Any = None  # a RunningDrain: intake reads only its notice and deadline
    started: list[Notice] = field(default_factory=list)
    moved: list[float] = field(default_factory=list)

    def start(self, notice: Notice) -> None:
        self.started.append(notice)
        self.current = RunningDrain(notice, Deadline(notice.terminate_at, 5.0, self.clock(), self.clock))

    def move_deadline(self, terminate_at: float) -> None:
        assert self.current is not None
        self.moved.append(terminate_at)
        self.current.deadline = Deadline(terminate_at, 5.0, self.clock(), self.clock)


@pytest.fixture
def parts(tmp_path: Path) -> tuple[NoticeIntake, RecordingDrains, Spool, AgentMetrics, Clock]:
    clock = Clock()
    spool = Spool(tmp_path / "spool", clock=clock, base={"hall": "h", "node": "n1"})
    metrics = AgentMetrics(clock)
    drains = RecordingDrains(clock)
    return (
        NoticeIntake(spool=spool, metrics=metrics, clock=clock, bundle=lambda: None, drains=drains),
        drains,
        spool,
        metrics,
        clock,
    )


def notice(nid: str, terminate_in: float, source: str = "nats", now: float = T0) -> Notice:
    return Notice(nid, "h", "n1", now + terminate_in, now, source, now)


def records(spool: Spool) -> list[dict[str, Any]]:
    return [dict(e) for e in spool.events()]


def of_type(spool: Spool, t: str) -> list[dict[str, Any]]:
    return [e for e in records(spool) if e["type"] == t]


def counted(metrics: AgentMetrics, channel: str, verdict: str) -> float:
    return metrics.notices.values.get((channel, verdict), 0.0)


def test_the_first_notice_starts_one_drain_and_the_other_channels_copy_is_a_duplicate(parts: Any) -> None:
    intake, drains, spool, metrics, _ = parts
    intake.accept(notice("r-1", 60, "nats"))
    intake.accept(notice("r-1", 60, "metadata"))  # the same reclaim through the metadata poll
    intake.accept(notice("r-1", 60, "nats"))  # and redelivered
    assert [n.id for n in drains.started] == ["r-1"]
    accepted = of_type(spool, "notice.accepted")
    assert len(accepted) == 1 and accepted[0]["notice"] == "r-1" and accepted[0]["source"] == "nats"
    assert counted(metrics, "nats", "accepted") == 1
    assert counted(metrics, "metadata", "duplicate") == 1 and counted(metrics, "nats", "duplicate") == 1
    assert drains.moved == [] and intake.absorbed == 0


def test_an_earlier_notice_moves_the_running_drains_deadline_and_a_later_one_is_absorbed(parts: Any) -> None:
    intake, drains, spool, metrics, _ = parts
    intake.accept(notice("r-1", 100))
    intake.accept(notice("r-2", 40, "metadata"))  # another reclaim of the same instance, sooner
    assert drains.moved == [T0 + 40]
    (moved,) = of_type(spool, "notice.deadline")
    assert moved["notice"] == "r-1" and moved["from_notice"] == "r-2" and moved["terminate_at"] == T0 + 40
    assert counted(metrics, "metadata", "deadline") == 1
    intake.accept(notice("r-3", 90))  # later than the deadline now: never a second drain
    assert [n.id for n in drains.started] == ["r-1"] and intake.absorbed == 1
    (absorbed,) = of_type(spool, "notice.absorbed")
    assert absorbed["notice"] == "r-3" and absorbed["draining"] is True and absorbed["of"] == "r-1"


def test_a_deadline_step_under_a_second_is_absorbed_not_a_move(parts: Any) -> None:
    """A flood of notices each a millisecond earlier costs counters, not a deadline move each."""
    intake, drains, spool, _, _ = parts
    intake.accept(notice("r-1", 60))
    for i in range(50):
        intake.accept(notice(f"r-step-{i}", 60 - 0.001 * (i + 1)))
    assert drains.moved == [] and intake.absorbed == 50
    assert of_type(spool, "notice.deadline") == []


def test_after_the_drain_finished_a_new_notice_is_absorbed_until_the_node_is_back_in_service(parts: Any) -> None:
    intake, drains, spool, metrics, _ = parts
    intake.accept(notice("r-1", 60))
    drains.current = None  # the drain finished; the node is cordoned and waits for its end
    intake.accept(notice("r-2", 30))  # even an earlier one: the node is already drained
    intake.accept(notice("r-3", 90))
    assert [n.id for n in drains.started] == ["r-1"] and drains.moved == []
    assert [e["draining"] for e in of_type(spool, "notice.absorbed")] == [False, False]
    intake.book.rearm()  # back in service (untainted / resumed): the next notice drains again
    intake.accept(notice("r-4", 60))
    assert [n.id for n in drains.started] == ["r-1", "r-4"]
    assert counted(metrics, "nats", "accepted") == 2


def test_a_refusal_is_counted_every_time_and_recorded_once_per_message(parts: Any) -> None:
    intake, _, spool, metrics, _ = parts
    bad = NoticeRefused("foreign", "notice x is for node 'n2', this is 'n1'")
    for _ in range(100):  # the same message replayed
        intake.refuse("nats", bad, b'{"id": "x", "node": "n2"}')
    assert intake.refused["foreign"] == 100 and counted(metrics, "nats", "refused") == 100
    assert metrics.refusals.values[("foreign",)] == 100
    (rec,) = of_type(spool, "notice.refused")
    assert rec["kind"] == "foreign" and rec["refused_total"] == {"foreign": 1} and len(rec["sha256"]) == 64


def test_a_flood_of_distinct_refusals_writes_at_most_the_records_a_second_allows(parts: Any) -> None:
    intake, _, spool, _, clock = parts
    bad = NoticeRefused("malformed", "not JSON")
    for i in range(500):
        intake.refuse("nats", bad, f"junk {i}".encode())
    assert len(of_type(spool, "notice.refused")) == RECORDS_PER_SECOND
    clock.t += 1.0  # the next second has its own allowance
    for i in range(500, 510):
        intake.refuse("nats", bad, f"junk {i}".encode())
    assert len(of_type(spool, "notice.refused")) == RECORDS_PER_SECOND + 10
    assert intake.refused["malformed"] == 510


def test_foreign_jetstream_traffic_costs_one_summary_a_minute(parts: Any) -> None:
    intake, _, spool, _, clock = parts
    for _ in range(1000):
        intake.foreign("jetstream-puback")
    summaries = of_type(spool, "notice.foreign_traffic")
    assert [s["foreign_traffic_total"] for s in summaries] == [{"jetstream-puback": 1}]
    clock.t += FOREIGN_SAY_EVERY_S / 2
    intake.catch_up()  # within the minute: nothing new written
    assert len(of_type(spool, "notice.foreign_traffic")) == 1
    clock.t += FOREIGN_SAY_EVERY_S / 2
    intake.catch_up()  # the flood ended: the summary catches up once
    intake.catch_up()
    summaries = of_type(spool, "notice.foreign_traffic")
    assert [s["foreign_traffic_total"] for s in summaries] == [{"jetstream-puback": 1}, {"jetstream-puback": 1000}]


def test_without_a_bundle_no_notice_key_is_trusted(parts: Any) -> None:
    intake, _, _, _, _ = parts
    assert len(intake.notice_keys()) == 0
