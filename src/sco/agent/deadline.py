"""One deadline per drain, read live by every loop (seed view 19: notice at T, instance gone at T+120 s).

Every time a drain path needs ("how much grace may this pod get", "when is this job's budget spent", "when do
we declare an overrun") is a question to this one value, never arithmetic copied into a loop, so a later notice
with an earlier termination moves every loop at once (``move_earlier``). Times are the clock's seconds (the
wall clock by default: notices carry wall-clock times); tests inject their own clock.

The times, for a notice received at ``started_at`` with the instance gone at ``terminate_at``:

- **kill time** ``terminate_at - margin``: no work may run past it; every grace ends by then.
- **budget end** ``min(started_at + budget, kill time)``: a contract's drain budget runs from the notice.
- **overrun time** ``terminate_at - max(1 s, margin / 2)``: the verifier stops and the outcome is spooled (and
  sent) then, however the API behaves, so it reaches the hall before the instance is gone.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

REPORT_LEAD_S = 1.0  # the outcome is spooled at least this long before the instance is gone
MIN_GRACE_S = 1  # never 0: a real API server removes a grace-0 pod at once while its containers still run


@dataclass
class Deadline:
    terminate_at: float
    margin: float
    started_at: float
    clock: Callable[[], float] = field(default=time.time, repr=False)

    def now(self) -> float:
        return self.clock()

    @property
    def kill_at(self) -> float:
        return self.terminate_at - self.margin

    @property
    def overrun_at(self) -> float:
        return self.terminate_at - max(REPORT_LEAD_S, self.margin / 2)

    def left(self) -> float:
        """Seconds to the instance's end."""
        return self.terminate_at - self.clock()

    def until_overrun(self) -> float:
        return self.overrun_at - self.clock()

    def overrun(self) -> bool:
        return self.clock() >= self.overrun_at

    def budget_end(self, budget_s: float) -> float:
        """When a workload's drain budget (counted from the notice) is spent, never past the kill time."""
        return min(self.started_at + budget_s, self.kill_at)

    def grace(self, budget_s: float) -> int:
        """Whole seconds of grace to ask for now: the budget, cut to what is left before the kill time, at
        least 1 (as kubectl sends unless --force)."""
        left = self.kill_at - self.clock()
        return max(MIN_GRACE_S, math.floor(min(budget_s, left)))

    def ends_too_late(self, grace_ends: float) -> bool:
        """Whether a grace granted earlier now ends past the kill time (the deadline moved earlier). Half a
        second of slack: the API's deletionTimestamp has whole seconds."""
        return grace_ends > self.kill_at + 0.5

    def call_timeout(self, api_timeout: float) -> float:
        """A call's timeout: the API timeout, but no call runs past the overrun time."""
        return max(0.05, min(api_timeout, self.until_overrun()))

    def move_earlier(self, terminate_at: float) -> bool:
        """Take an earlier termination (a later notice); a later one never moves the deadline."""
        if terminate_at < self.terminate_at:
            self.terminate_at = terminate_at
            return True
        return False

    def elapsed(self) -> float:
        return self.clock() - self.started_at
