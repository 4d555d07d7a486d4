"""The one Deadline every drain loop reads, on an injected clock."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sco.agent.deadline import Deadline

NOW = 1_700_000_000.0


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_times_for_a_120_s_notice_with_a_10_s_margin() -> None:
    c = Clock()
    d = Deadline(terminate_at=1120.0, margin=10.0, started_at=1000.0, clock=c)
    assert d.kill_at == 1110.0
    assert d.overrun_at == 1115.0  # half the margin before the end (ARCHITECTURE.md)
    assert d.budget_end(30) == 1030.0
    assert d.budget_end(200) == 1110.0  # never past the kill time
    assert d.grace(30) == 30
    c.t = 1095.5
    assert d.grace(30) == 14  # whole seconds left before the kill time
    assert d.left() == pytest.approx(24.5)


def test_grace_is_never_zero() -> None:
    c = Clock()
    d = Deadline(terminate_at=1020.0, margin=2.0, started_at=1000.0, clock=c)
    assert d.grace(0) == 1  # no contract, final write 0: still 1 (kubectl's floor without --force)
    c.t = 1019.5  # past the kill time
    assert d.grace(30) == 1


def test_overrun_time_is_at_least_one_second_before_the_end() -> None:
    c = Clock()
    small = Deadline(terminate_at=1020.0, margin=0.5, started_at=1000.0, clock=c)
    assert small.overrun_at == 1019.0
    assert Deadline(terminate_at=1020.0, margin=2.0, started_at=1000.0, clock=c).overrun_at == 1019.0
    c.t = 1018.99
    assert not small.overrun()
    c.t = 1019.0
    assert small.overrun()


def test_moving_earlier_is_seen_live_and_later_is_ignored() -> None:
    c = Clock()
    d = Deadline(terminate_at=1120.0, margin=10.0, started_at=1000.0, clock=c)
    end_before = d.budget_end(90)
    grace_before = d.grace(90)
    assert d.move_earlier(1090.0) is True
    assert d.move_earlier(1100.0) is False  # a later notice never extends the drain
    assert d.terminate_at == 1090.0
    assert (end_before, d.budget_end(90)) == (1090.0, 1080.0)
    assert (grace_before, d.grace(90)) == (90, 80)
    assert d.overrun_at == 1085.0
    # a 90 s grace granted at 1000 under T+120 now ends past the kill time: it must be cut
    assert d.ends_too_late(1000.0 + 90)
    assert not d.ends_too_late(1000.0 + 80)


def test_call_timeout_never_runs_past_the_overrun_time() -> None:
    c = Clock()
    d = Deadline(terminate_at=1020.0, margin=2.0, started_at=1000.0, clock=c)
    assert d.call_timeout(0.8) == 0.8
    c.t = 1018.7
    assert d.call_timeout(0.8) == pytest.approx(0.3)
    c.t = 1019.5
    assert d.call_timeout(0.8) == 0.05


@given(budget=st.floats(0, 200), left=st.floats(-50, 200), margin=st.floats(0, 20))
def test_grace_is_the_smaller_of_budget_and_time_left_and_at_least_one(
    budget: float, left: float, margin: float
) -> None:
    d = Deadline(terminate_at=NOW + left, margin=margin, started_at=NOW - 1, clock=lambda: NOW)
    g = d.grace(budget)
    assert isinstance(g, int) and g >= 1
    assert g <= max(1.0, budget) and g <= max(1.0, left - margin)
    assert g >= min(budget, left - margin) - 1
