"""Node identities on the relay at hall scale: the notice_relay role's real configuration (one NATS account per node,
SCO_NODE_<node>, with its imports and exports) rendered by Ansible for 500, 1,000 and 5,000 nodes, then a real
nats-server: the render, the config check (``nats-server -t``), the start until it serves, its RSS, and a reload
(SIGHUP, as the unit's ExecReload) after one node is added: how long until the new configuration is in force
(/varz config_load_time), and the longest a connected node's round trip took meanwhile (does a reload stall the
relay?). A listed configuration needs that reload per added node; the figures decide whether that is acceptable.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.harness import BIN, free_port, wait_for
from tests.relays import RENDER, ROLE, as_user, run_playbook

SIZES = (500, 1000, 5000)


def _render(tmp: Path, out: Path, nodes: int, port: int, monitor: int) -> float:
    started = time.monotonic()
    r = run_playbook(
        tmp, RENDER,
        {"role": str(ROLE), "out": str(out), "notice_relay_hall": "bench",
         "notice_relay_nodes": [f"n{i:05d}" for i in range(nodes)], "notice_relay_credentials_dir": str(tmp / "creds"),
         "notice_relay_listen": "127.0.0.1", "notice_relay_port": port, "notice_relay_monitor_port": monitor,
         "notice_relay_store_dir": str(tmp / "js")},
    )  # fmt: skip
    if r.returncode != 0:
        raise RuntimeError(r.stdout + r.stderr)
    return time.monotonic() - started


def _varz(monitor: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/varz", timeout=5) as r:
        return dict(json.loads(r.read()))


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def _reload_under_load(proc: subprocess.Popen[bytes], url: str, creds: Path, monitor: int) -> tuple[float, float]:
    """SIGHUP; returns (seconds until /varz shows the new configuration, longest round trip of a connected node)."""
    import nats

    nc = await nats.connect(url, inbox_prefix="_INBOX.bench.n00000", **as_user(creds, "node-n00000"))
    before = _varz(monitor)["config_load_time"]
    worst = 0.0
    done = False

    async def ping() -> None:
        nonlocal worst
        while not done:
            t = time.monotonic()
            await nc.flush(timeout=30)
            worst = max(worst, time.monotonic() - t)
            await asyncio.sleep(0.005)

    pinger = asyncio.create_task(ping())
    await asyncio.sleep(0.2)
    started = time.monotonic()
    proc.send_signal(signal.SIGHUP)
    loop = asyncio.get_running_loop()
    while (await loop.run_in_executor(None, _varz, monitor))["config_load_time"] == before:
        await asyncio.sleep(0.01)
    took = time.monotonic() - started
    await asyncio.sleep(0.2)
    done = True
    await pinger
    await nc.close()
    return took, worst


def bench_relay_identities() -> Iterator[dict[str, Any]]:
    for nodes in SIZES:
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            port, monitor = free_port(), free_port()
            conf, bigger = tmp / "nats.conf", tmp / "nats-plus-one.conf"
            render_s = _render(tmp, conf, nodes, port, monitor)
            _render(tmp, bigger, nodes + 1, port, monitor)
            started = time.monotonic()
            subprocess.run([str(BIN / "nats-server"), "-t", "-c", str(conf)], check=True, capture_output=True)
            check_s = time.monotonic() - started
            started = time.monotonic()
            proc = subprocess.Popen(
                [str(BIN / "nats-server"), "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            try:

                def up(monitor: int = monitor) -> bool:
                    try:
                        with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/healthz", timeout=1) as r:
                            return bool(r.status == 200)
                    except OSError:
                        return False

                wait_for(up, 120, "nats-server serving", interval=0.01)
                start_s = time.monotonic() - started
                rss_started = _rss_mib(proc.pid)
                os.replace(bigger, conf)  # one node more, as the role writes it
                reload_s, stall_s = asyncio.run(_reload_under_load(proc, f"nats://127.0.0.1:{port}", tmp / "creds",
                                                                   monitor))  # fmt: skip
                yield {
                    "nodes": nodes, "config_bytes": conf.stat().st_size, "render_s": round(render_s, 2),
                    "check_s": round(check_s, 3), "start_s": round(start_s, 3), "rss_mib": round(rss_started, 1),
                    "reload_s": round(reload_s, 3), "reload_round_trip_max_s": round(stall_s, 3),
                    "rss_after_reload_mib": round(_rss_mib(proc.pid), 1),
                }  # fmt: skip
            finally:
                proc.terminate()
                proc.wait(10)


BENCHES = {"relay_identities": bench_relay_identities}
