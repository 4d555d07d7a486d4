"""Where a secret must never be seen while a converge runs: any process's arguments or environment (what `ps e`
and /proc show every local user), the run's output and ansible-runner's artifacts."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from types import TracebackType


class ProcSampler:
    """Reads /proc/*/cmdline and /proc/*/environ in a loop (root reads every process's environ) until stopped;
    ``seen`` lists (pid, file, the process's argv[0]) for each process that showed one of ``secrets``."""

    def __init__(self, *secrets: str) -> None:
        self.secrets = [s.encode() for s in secrets if s]
        self.seen: list[tuple[int, str, str]] = []
        self.passes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me = os.getpid()
        while not self._stop.is_set():
            for name in os.listdir("/proc"):
                if not name.isdigit() or int(name) == me:
                    continue
                for f in ("cmdline", "environ"):
                    try:
                        data = Path(f"/proc/{name}/{f}").read_bytes()
                    except OSError:  # gone, or a kernel thread
                        continue
                    if any(s in data for s in self.secrets):
                        argv0 = data.split(b"\0")[0].decode(errors="replace") if f == "cmdline" else ""
                        self.seen.append((int(name), f, argv0))
            self.passes += 1

    def __enter__(self) -> ProcSampler:
        self._thread.start()
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(10)


def files_showing(root: Path, *secrets: str) -> list[str]:
    """The files under ``root`` holding one of ``secrets`` (an ansible-runner artifacts directory, a log dir)."""
    found = []
    for p in sorted(root.rglob("*")):
        if p.is_file() and any(s.encode() in p.read_bytes() for s in secrets if s):
            found.append(str(p.relative_to(root)))
    return found
