"""Crash-safe file replacement: the project's one atomic write (the distributor, the node's bundle cache, spool
cursors and credentials, the control loop's metrics files, the drill's progress file).

Write to a temporary file in the same directory, fsync it, rename it over the target, fsync the
directory. rename(2) is atomic within a filesystem, so a reader (or the next start after a crash or
kill -9) sees either the old file or the new one, never a mix; fsyncs make that hold across power loss.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

_CHUNK = 64 * 1024


def atomic_write(
    path: Path,
    data: bytes,
    mode: int = 0o644,
    chunk_hook: Callable[[int], None] | None = None,
    *,
    exact_mode: bool = False,
) -> None:
    """Replace ``path`` with ``data`` atomically. ``mode`` is filtered by the umask unless ``exact_mode`` (a file
    another user's process reads, whatever the writer's umask). ``chunk_hook(bytes_written)`` is for crash tests."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")  # a hidden name that ends in no reader's suffix
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        if exact_mode:
            os.fchmod(fd, mode)
        written = 0
        view = memoryview(data)
        while written < len(data):
            written += os.write(fd, view[written : written + _CHUNK])
            if chunk_hook is not None:
                chunk_hook(written)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(directory: Path, name: str) -> int:
    """Delete temporaries a killed writer left behind (they are never read). Returns how many.

    A temporary whose writer (the pid in its name) still runs is left alone: another process may be
    in the middle of replacing the same file.
    """
    n = 0
    for p in Path(directory).glob(f".{name}.tmp.*"):
        pid = p.name.rsplit(".", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
            continue
        p.unlink(missing_ok=True)
        n += 1
    return n
