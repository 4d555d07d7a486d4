"""Role notice_relay's stream tool (files/sco-nats-stream.py, the relay unit's ExecStartPost): it waits for a relay
that has just started, within --wait, and paces every try with the product's one backoff (sco._retry: capped
exponential, equal jitter) up to the deadline. A real nats-server, the tool as a process as the unit runs it; its
retry loop called directly with a JetStream that keeps saying "no leader yet". (That it gives up at --wait when no
relay listens: tests/test_relay_cluster.py.)"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from tests.harness import NatsServer, free_port

TOOL = (
    Path(__file__).resolve().parents[1]
    / "collections/ansible_collections/sco/orchestrator/roles/notice_relay/files/sco-nats-stream.py"
)


def tool(port: int, tmp_path: Path, wait: float) -> subprocess.Popen[str]:
    password = tmp_path / "password"
    password.write_text("pw\n")  # a relay without authorization takes any user
    argv = [sys.executable, str(TOOL), "--server", f"nats://127.0.0.1:{port}", "--password-file", str(password),
            "--hall", "local", "--wait", str(wait)]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_relay_that_starts_after_the_tool_is_waited_for(tmp_path: Path) -> None:
    port = free_port()
    proc = tool(port, tmp_path, wait=30)
    time.sleep(2.0)  # the tool is trying a relay that is not there yet
    assert proc.poll() is None
    srv = NatsServer(tmp_path / "nats", port=port).start()
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        srv.stop()
    assert proc.returncode == 0, err
    assert [json.loads(x) for x in out.splitlines()] == [
        {"stream": "SCO_EVENTS", "action": "created"},
        {"stream": "SCO_HEARTBEATS", "action": "created"},
    ]


def load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sco_nats_stream", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_jetstream_without_a_leader_is_tried_again_on_the_shared_backoff_until_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tool's waits are sco._retry's (capped exponential, equal jitter; drawn at the top of each step here, so
    the test knows them), each slept in full, and no try begins past the deadline."""
    from nats.js.errors import APIError

    from sco import _retry

    m = load_tool()
    assert m.Backoff is _retry.Backoff  # the product's one pacing, not a loop of its own
    drawn: list[float] = []

    class Top(_retry.Backoff):
        def next(self) -> float:
            drawn.append(super().next())
            return drawn[-1]

    monkeypatch.setattr(m, "Backoff", lambda first, cap: Top(first, cap, rand=lambda lo, hi: hi))
    tries: list[float] = []

    async def no_leader() -> str:
        tries.append(time.monotonic())
        raise APIError(code=503, err_code=10008, description="JetStream cluster has no meta leader")

    async def run() -> None:
        loop = asyncio.get_running_loop()
        await m.retried(no_leader, loop.time() + 4.0, "SCO_EVENTS")

    started = time.monotonic()
    with pytest.raises(SystemExit, match="stream SCO_EVENTS: JetStream refused: JetStream cluster has no meta leader"):
        asyncio.run(run())
    assert drawn[:4] == [0.2, 0.4, 0.8, 1.6]  # doubling from 0.2 s, capped at 2 s
    assert all(d <= 2.0 for d in drawn)
    gaps = [b - a for a, b in itertools.pairwise(tries)]
    assert len(gaps) == 4 and all(g >= d for g, d in zip(gaps, drawn, strict=False)), (gaps, drawn)
    assert tries[-1] - started <= 4.0 + 0.5  # the last try began by the deadline (0.2+0.4+0.8+1.6 = 3.0 s)
