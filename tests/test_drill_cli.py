"""``sco drill`` when the drill cannot run: one line on stderr and the code of its cause, never 1 (which drill.yml
reads as "a node did not drain") and never 2 (argparse's usage error). The drill that runs is tested end to end in
tests/test_drill.py (the playbook) and tests/test_drill_report.py (its report)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path


def drill(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sco.cli", "drill", *args], capture_output=True, text=True, timeout=60)


def last_line(p: subprocess.CompletedProcess[str]) -> str:
    return p.stderr.strip().splitlines()[-1]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_drill_that_cannot_run_says_why_with_the_code_of_its_cause(tmp_path: Path) -> None:
    reports = tmp_path / "reports"
    relay = f"nats://127.0.0.1:{closed_port()}"
    run = ["run", "--server", relay, "--hall", "local", "--node", "node-1", "--id", "d1", "--report-dir", str(reports),
           "--reader-credentials", str(tmp_path / "control.nk"), "--observe"]  # fmt: skip

    p = drill(*run, "--notice-seconds", "nan")
    assert p.returncode == 5 and last_line(p).startswith("sco: error: --notice-seconds must be in (0, 3600]"), p

    p = drill(*run)  # no credentials file: said, and where the playbook waits for the drill to listen
    assert p.returncode == 5, p
    assert (
        last_line(p)
        == f"sco: error: the credentials of relay user control: {tmp_path}/control.nk: No such file or directory"
    )
    error = json.loads((reports / "d1.progress.json").read_text())["error"]
    assert error.startswith("drill: the credentials of relay user control: "), error

    (tmp_path / "control.nk").write_text("a-password\n")
    p = drill(*run)  # nothing listens there: the relay's code
    assert p.returncode == 6 and last_line(p).startswith(f"sco: error: relay {relay} as control: "), p

    (tmp_path / "a-file").write_text("")
    a_file = [str(tmp_path / "a-file") if x == str(reports) else x for x in run]
    p = drill(*a_file)  # a report directory that is a file: a path the system refused, not "not drained"
    assert p.returncode == 5 and "a-file" in last_line(p) and "Traceback" not in p.stderr, p

    p = drill("keys", "--signing-key", str(tmp_path / "keys/notice.key"))
    assert p.returncode == 5 and "notice key" in last_line(p) and "no such key file" in last_line(p), p

    p = drill("finish", "--report-dir", str(reports), "--id", "d1", "--from-reclaim", "[")
    assert p.returncode == 5 and last_line(p).startswith("sco: error: --from-reclaim: not JSON"), p
    p = drill("finish", "--report-dir", str(reports), "--id", "nope", "--from-reclaim", "[]")
    assert p.returncode == 5 and "no report of drill nope" in last_line(p), p
