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
    # what is left as the deadline sees it, in floats: NOW + 1.9999999999999964 is NOW + 2.0 at NOW's size (a
    # Hypothesis example failed on it)
    room = d.kill_at - NOW
    assert abs(room - (left - margin)) < 1e-6
    assert isinstance(g, int) and g >= 1
    assert g <= max(1.0, budget) and g <= max(1.0, room)
    assert g >= min(budget, room) - 1


# --- the agent's one retry pacing and the best-effort deadline ---------------------------------------


def test_backoff_is_capped_exponential_with_jitter() -> None:
    import random

    from sco._retry import Backoff

    top = Backoff(0.2, 2.0, rand=lambda a, b: b)
    assert [round(top.next(), 3) for _ in range(6)] == [0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    low = Backoff(0.2, 2.0, rand=lambda a, b: a)
    assert [round(low.next(), 3) for _ in range(5)] == [0.1, 0.2, 0.4, 0.8, 1.0]
    top.reset()
    assert top.next() == 0.2
    rng = random.Random(7)
    waits = [Backoff(0.2, 2.0, rand=rng.uniform).next() for _ in range(50)]
    assert all(0.1 <= w <= 0.2 for w in waits) and len(set(waits)) == 50  # agents do not retry in lockstep


def test_the_agents_retry_loops_all_use_it() -> None:
    """The five loops (taint, list/watch, eviction, the late reports to the API server and to slurmctld) and the
    forced delete: no hand-rolled doubling left."""
    import inspect

    from sco.agent.kube import drain as kube_drain
    from sco.agent.kube import fallback as kube_fallback
    from sco.agent.slurm import drain as slurm_drain

    for mod in (kube_drain, kube_fallback, slurm_drain):
        src = inspect.getsource(mod)
        assert "* 2)" not in src and "Backoff(" in src, mod.__name__


def test_a_notice_past_its_time_gets_a_best_effort_deadline() -> None:
    from sco.agent.deadline import LATE_WINDOW_S, Deadline

    now = 1000.0
    ok = Deadline.for_notice(now + 120, 10, now, clock=lambda: now)
    assert ok.late is None and ok.terminate_at == now + 120
    late = Deadline.for_notice(now - 5, 10, now, clock=lambda: now)
    assert late.late == {"terminate_at": now - 5, "past_by_s": 5.0}
    assert late.kill_at == now + 1 and late.grace(30) == 1 and late.terminate_at == now + LATE_WINDOW_S
    assert now < late.overrun_at < late.terminate_at
    close = Deadline.for_notice(now + 8, 10, now, clock=lambda: now)  # inside the margin: no room for a grace
    assert close.late is not None and close.kill_at == now + 1 and close.terminate_at == now + 8
