"""Logging and sd_notify STATUS.

Before: overruns were logged at INFO; ``sco`` and ``sco-control-loop`` configured no logging (the reclaimer's INFO
lines were dropped: Python's last-resort handler shows WARNING and above only); no JSON format; STATUS was sent
once at start and never said a drain was under way or how it ended."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sco_devkit.standins.kube_apiserver import Identity, KubeApiStandIn
from tests.harness import AgentEnv, NatsServer, add_pod

KEYS = {"time", "level", "logger", "message"}


def _emit(entry: str, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run an entry point's main() in a fresh interpreter, then log one INFO line as the reclaimer would."""
    code = (
        "import logging, sys\n"
        f"from {entry} import main\n"
        f"rc = main({args!r})\n"
        "logging.getLogger('sco.control.reclaim').info('reclaim of %s: delete requested', 'vm-1')\n"
        "sys.exit(rc)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env={**os.environ, **env}
    )


@pytest.mark.parametrize(
    ("entry", "args", "rc"),
    [("sco.cli", ["keygen", "--out-dir", "{d}"], 0), ("sco.control.runner", [], 5)],  # the loop: args missing
)
def test_sco_and_control_loop_keep_info_lines_in_json(tmp_path: Path, entry: str, args: list[str], rc: int) -> None:
    args = [a.replace("{d}", str(tmp_path)) for a in args]
    text = _emit(entry, args, {"SCO_LOG_FORMAT": ""})
    assert text.returncode == rc, text.stderr
    assert "INFO sco.control.reclaim: reclaim of vm-1: delete requested" in text.stderr  # dropped before
    js = _emit(entry, ["--log-format", "json", *args], {})
    assert js.returncode == rc, js.stderr
    lines = [json.loads(ln) for ln in js.stderr.splitlines() if ln.startswith("{")]
    (line,) = [ln for ln in lines if ln["logger"] == "sco.control.reclaim"]
    assert set(line) == KEYS and line["level"] == "INFO" and line["message"] == "reclaim of vm-1: delete requested"
    assert line["time"].endswith("+00:00")


def test_a_bad_log_format_is_a_clear_error(tmp_path: Path) -> None:
    r = _emit("sco.cli", ["keygen", "--out-dir", str(tmp_path)], {"SCO_LOG_FORMAT": "xml"})
    assert r.returncode == 5 and "log format 'xml'" in r.stderr and "SCO_LOG_FORMAT" in r.stderr, r.stderr
    assert not list(tmp_path.iterdir())  # nothing done


def test_agent_json_logs_warning_overrun_and_status_follows_the_drain(
    tmp_path: Path, nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    sock_path = str(tmp_path / "notify.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    srv.bind(sock_path)
    srv.settimeout(15)
    monkeypatch.setenv("NOTIFY_SOCKET", sock_path)  # the agent's process inherits it, as systemd sets it
    monkeypatch.setenv("SCO_LOG_FORMAT", "json")
    # the taint is refused: the drain can only end in an overrun (never "drained" on an untainted node)
    kube = KubeApiStandIn(tokens={"agent": Identity("sco-agent", deny=("patch nodes",))}).start()
    tok = tmp_path / "token"
    tok.write_text("agent\n")
    env = AgentEnv(tmp_path / "a", kube, nats_server, kube_token_file=str(tok))
    statuses: list[str] = []

    def until(pred: str) -> None:
        while not any(s.startswith(pred) for s in statuses):
            for part in srv.recv(4096).decode().split("\n"):
                if part.startswith("STATUS="):
                    statuses.append(part.removeprefix("STATUS="))

    try:
        for i in range(2):
            add_pod(kube, "web", f"w-{i}", env.node, prestop=1.5)  # the 0.5 s tick sees 0/2
        env.start().wait_subscribed()
        until("idle")
        env.send(env.notice("over-1", 6))
        until("draining")
        until("overrun for notice over-1")
        out = env.outcome(5)
        assert out["type"] == "drain.overrun"
    finally:
        env.stop()
        kube.stop()
        srv.close()
    draining = [s for s in statuses if s.startswith("draining")]
    assert draining[0].startswith("draining 0/2 for notice over-1"), statuses
    assert any(s.startswith("draining 2/2") for s in draining), statuses  # pods went; the taint did not stick
    assert all("hall local, bundle serial" in s for s in statuses), statuses
    lines = [json.loads(ln) for ln in env.logtext().splitlines() if ln.strip()]  # every line one JSON object
    assert lines and all(set(ln) >= KEYS for ln in lines)
    (over,) = [ln for ln in lines if ln["message"].startswith("drain overrun for notice over-1")]
    assert over["level"] == "WARNING" and over["logger"].startswith("sco.agent")
