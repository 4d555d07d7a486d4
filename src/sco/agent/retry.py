"""The agent's one retry pacing: capped exponential backoff with jitter.

Every retry loop of the agent (the taint, the pod list/watch, each eviction, the late reports to the API server
and to slurmctld) waits ``Backoff.next()`` between tries: the first wait, doubled each time up to the cap, each
drawn from its upper half (``[d/2, d]``: "equal jitter"), so a hall's agents retrying after one outage do not
arrive in lockstep, and no wait is shorter than half its step. A loop whose wait follows from something else
(the token renewal's, from the time left) draws it the same way: :func:`jitter`.
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
    _step: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.first <= self.cap or self.factor < 1:
            raise ValueError(f"backoff: expected 0 < first <= cap and factor >= 1, got {self}")
        self._step = self.first

    def next(self) -> float:
        """The wait before the next try; the step after it doubles, up to the cap."""
        d = self._step
        self._step = min(self.cap, self._step * self.factor)
        return jitter(d, self.rand)

    def reset(self) -> None:
        """After a success: the next failure starts from the first step again."""
        self._step = self.first


def jitter(d: float, rand: Callable[[float, float], float] = random.uniform) -> float:
    """A wait of about ``d``, drawn from ``[d/2, d]`` (equal jitter)."""
    return rand(d / 2, d)
