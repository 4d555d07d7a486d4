"""The Slurm DRAIN reason names the notice and T, within slurmdbd's 255 bytes (a pure function: no cluster)."""

from __future__ import annotations

import calendar

import pytest

from sco.agent.slurm.drain import SLURM_REASON_MAX_BYTES, drain_reason

T = calendar.timegm((2026, 12, 1, 21, 16, 5)) + 0.9  # a T with a fraction: shown rounded down, never later


def test_reason_names_the_notice_and_t_in_utc() -> None:
    r = drain_reason("reclaim-0123456789abcdef", T)
    assert r == "sco reclaim reclaim-0123456789abcdef: instance gone at 2026-12-01T21:16:05Z"


@pytest.mark.parametrize("notice_id", ["n" * 128, "é" * 128, "\U0001f600" * 128, "a" * 204, "a" * 205])
def test_a_long_notice_id_is_cut_never_t(notice_id: str) -> None:
    r = drain_reason(notice_id, T)
    assert len(r.encode()) <= SLURM_REASON_MAX_BYTES == 255  # slurmdbd: TINYTEXT
    assert r.startswith("sco reclaim ") and r.endswith(": instance gone at 2026-12-01T21:16:05Z")
    shown = r[len("sco reclaim ") : -len(": instance gone at 2026-12-01T21:16:05Z")]
    if len(notice_id.encode()) <= SLURM_REASON_MAX_BYTES - 51:
        assert shown == notice_id  # what fits is kept whole
    else:
        assert shown.endswith("...") and notice_id.startswith(shown[:-3]) and len(shown) > 3
