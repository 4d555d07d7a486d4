"""The one atomic write (sco._fs.atomic_write): the file replaced whole, no temporary left, its mode as the umask
leaves it or, with exact_mode, as given (the control loop's metrics files and the drill's progress file are read by
another user's process; the agent's token must be 0600 whatever the umask)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from sco._fs import atomic_write


@pytest.fixture
def umask_077() -> Iterator[None]:
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_replaces_whole_and_leaves_no_temporary(tmp_path: Path) -> None:
    p = tmp_path / "sco_control_plan.prom"
    p.write_bytes(b"old\n")
    atomic_write(p, b"new\n")
    assert p.read_bytes() == b"new\n"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["sco_control_plan.prom"]


def test_mode_is_filtered_by_the_umask_unless_exact(tmp_path: Path, umask_077: None) -> None:
    atomic_write(tmp_path / "a", b"x", 0o644)
    assert mode(tmp_path / "a") == 0o600
    atomic_write(tmp_path / "b", b"x", 0o644, exact_mode=True)
    assert mode(tmp_path / "b") == 0o644
    atomic_write(tmp_path / "b", b"y", 0o600, exact_mode=True)  # a replaced file takes the new mode
    assert mode(tmp_path / "b") == 0o600 and (tmp_path / "b").read_bytes() == b"y"


def test_the_metrics_file_is_world_readable_whatever_the_loops_umask(tmp_path: Path, umask_077: None) -> None:
    from sco.control.metrics import _replace

    _replace(tmp_path / "sco_control_plan.prom", b"# nothing\n")
    assert mode(tmp_path / "sco_control_plan.prom") == 0o644


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    p = tmp_path / "bundle.json"
    p.write_bytes(b"old")

    def fail(_written: int) -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(p, b"new", chunk_hook=fail)
    assert p.read_bytes() == b"old" and [x.name for x in tmp_path.iterdir()] == ["bundle.json"]
