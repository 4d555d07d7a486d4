"""The one retry pacing (sco._retry): capped exponential backoff, each wait drawn from the upper half of its step
(equal jitter), the draw injectable; and the places that had their own copy (the reclaimer's deletes, a reclaim
run's reconnect, sco._http's connect after a refusal) pacing with it on the numbers they had."""

from __future__ import annotations

import inspect
import random

import pytest

from sco._retry import Backoff, jitter


def test_each_wait_is_within_the_upper_half_of_its_step_and_the_step_is_capped() -> None:
    rng = random.Random(32)
    b = Backoff(0.5, 30.0, rand=rng.uniform)
    steps = [0.5 * 2**n for n in range(6)] + [30.0] * 10  # 0.5 .. 16, then the cap
    for step in steps:
        w = b.next()
        assert step / 2 <= w <= step, (step, w)
    assert b.attempts == len(steps)


def test_the_draw_is_injected_and_sees_the_half_step_and_the_step() -> None:
    seen: list[tuple[float, float]] = []

    def rand(a: float, b: float) -> float:
        seen.append((a, b))
        return a

    b = Backoff(0.02, 0.2, rand=rand)
    assert [b.next() for _ in range(5)] == [0.01, 0.02, 0.04, 0.08, 0.1]
    assert seen[-1] == (0.1, 0.2)
    b.reset()
    assert (b.attempts, b.next()) == (0, 0.01)


def test_waits_are_spread_not_in_step() -> None:
    rng = random.Random(7)
    waits = [Backoff(1.0, 8.0, rand=rng.uniform).next() for _ in range(100)]
    assert len(set(waits)) == 100 and min(waits) >= 0.5 and max(waits) <= 1.0
    assert 0.5 <= jitter(1.0, rng.uniform) <= 1.0


def test_factor_and_a_long_outage() -> None:
    b = Backoff(1.0, 10.0, factor=3.0, rand=lambda a, b: b)
    assert [b.next() for _ in range(4)] == [1.0, 3.0, 9.0, 10.0]
    for _ in range(5000):  # the step is multiplied and capped, never a power: no overflow
        b.next()
    assert b.next() == 10.0


@pytest.mark.parametrize("first,cap,factor", [(0, 1, 2), (2, 1, 2), (1, 2, 0.5), (-1, 1, 2)])
def test_nonsense_is_refused(first: float, cap: float, factor: float) -> None:
    with pytest.raises(ValueError, match="backoff"):
        Backoff(first, cap, factor)


def test_the_reclaimers_delete_retries_keep_their_numbers() -> None:
    """Before: the n-th retry at now + d/2 + r*d/2, d = min(30, 0.5 * 2**n), r from random.random."""
    from sco.provider.reclaimer import DeleteRetry

    r = 0.25
    retry = DeleteRetry(Backoff(0.5, 30.0, rand=lambda a, b: a + (b - a) * r))
    for n in range(10):
        d = min(30.0, 0.5 * 2.0**n)
        assert retry.failed(100.0) == pytest.approx(100.0 + d / 2 + r * d / 2)
        assert retry.attempts == n + 1


def test_no_hand_rolled_backoff_left() -> None:
    import sco._http
    import sco.provider.reclaim_job
    import sco.provider.reclaimer

    for mod in (sco._http, sco.provider.reclaimer, sco.provider.reclaim_job):
        src = inspect.getsource(mod)
        assert (
            "Backoff(" in src
            and "* 2)" not in src
            and "2.0 **" not in src
            and "random." not in src.replace("random.uniform,", "")
        ), mod.__name__
