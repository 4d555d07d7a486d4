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
LATE_WINDOW_S = 4.0  # a notice past its time still gets this long: taint, evict with the floor grace, verify


@dataclass
class Deadline:
    terminate_at: float
    margin: float
    started_at: float
    clock: Callable[[], float] = field(default=time.time, repr=False)
    late: dict[str, float] | None = None  # set by ``for_notice`` when the notice left no time (best effort)

    @classmethod
    def for_notice(
        cls, terminate_at: float, margin: float, started_at: float, clock: Callable[[], float] = time.time
    ) -> Deadline:
        """The drain's deadline. A notice already past its time, or too close to it for even the floor grace
        before the kill time (clock skew, a late delete, a restart past T), is drained best effort: the
        instance may still be there, so the node is tainted and its pods evicted with the floor grace (kill time
        now + 1 s), the verifier runs until ``max(T, now + LATE_WINDOW_S)`` less the report lead, and the outcome
        says how late the notice was (``late``)."""
        now = clock()
        if terminate_at - margin >= now + MIN_GRACE_S:
            return cls(terminate_at, margin, started_at, clock)
        end = max(terminate_at, now + LATE_WINDOW_S)
        late = {"terminate_at": terminate_at, "past_by_s": round(now - terminate_at, 3)}
        return cls(end, end - (now + MIN_GRACE_S), started_at, clock, late)

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
