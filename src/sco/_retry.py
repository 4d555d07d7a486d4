"""The one retry pacing of the project: capped exponential backoff with jitter.

Every retry loop waits ``Backoff.next()`` between tries: the first wait, multiplied by ``factor`` each time up to the
cap, each drawn from its upper half (``[d/2, d]``: "equal jitter"), so the many clients retrying after one outage
(a hall's agents, a hall's deletes) do not arrive in lockstep, and no wait is shorter than half its step. Its users:
the agent's loops (taint, pod list/watch, evictions, late reports, publish, enrolment), the reclaimer's deletes and
its events subscription, a reclaim run's reconnect to the fleet state, and ``sco._http``'s connect after a refusal.
A loop whose wait follows from something else (the token renewal's, from the time left) draws it the same way:
:func:`jitter`.

Equal rather than full jitter (``[0, d]``): every caller's numbers were set with a floor of half a step, and the
agent's tests hold it (a wait near 0 would retry a failing API server hot).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Backoff:
    first: float
    cap: float
    factor: float = 2.0
    rand: Callable[[float, float], float] = field(default=random.uniform, repr=False)
    attempts: int = field(default=0, init=False)
    """How many waits were drawn since the start or the last reset (the failures so far)."""
    _step: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.first <= self.cap or self.factor < 1:
            raise ValueError(f"backoff: expected 0 < first <= cap and factor >= 1, got {self}")
        self._step = self.first

    def next(self) -> float:
        """The wait before the next try; the step after it grows by ``factor``, up to the cap."""
        d = self._step
        self._step = min(self.cap, self._step * self.factor)  # multiplied, not a power: no overflow however long
        self.attempts += 1
        return jitter(d, self.rand)

    def reset(self) -> None:
        """After a success: the next failure starts from the first step again."""
        self._step = self.first
        self.attempts = 0


def jitter(d: float, rand: Callable[[float, float], float] = random.uniform) -> float:
    """A wait of about ``d``, drawn from ``[d/2, d]`` (equal jitter)."""
    return rand(d / 2, d)
