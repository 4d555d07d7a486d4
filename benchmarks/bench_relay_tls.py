"""What the relay's TLS costs (issue 29): a real nats-server in operator mode (relay_identity.server_config, as role
notice_relay renders it), once in plaintext and once with TLS (the hall's CA, a P-256 certificate, as the role makes
it), clients through sco._nats as SCO's connect. Measured each way: a notice's publish -> delivery latency (the
reclaimer publishes to a node's notice subject, the node's client receives it; one at a time, so each is a round of
its own), an agent event's JetStream publish -> ack, and a client's connect (TCP, TLS handshake, the nonce's
signature). Medians and p99 per mode, then the TLS / plaintext ratio of each median. The relay's CPU (utime + stime)
over the notice round too."""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.harness import BIN, free_port, wait_for
from tests.relays import Pki

from sco import _nats
from sco.provider import relay_identity as ri

NOTICES = 2000
EVENTS = 1000
CONNECTS = 50


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def _ms(values: list[float]) -> dict[str, float]:
    return {"p50_ms": round(statistics.median(values) * 1000, 3), "p99_ms": round(_pct(values, 99) * 1000, 3)}


async def _measure(tmp: Path, url: str, keys: ri.HallKeys, ca: str | None, pid: int) -> dict[str, Any]:
    admin = await ri.RelayAdmin.connect(url, keys, tls_ca_file=ca)
    try:
        key = ri.NKey.generate("user")
        node = await ri.issue(admin, keys, "n1", key.public)
    finally:
        await admin.close()
    node_creds = tmp / "node.creds"
    node_creds.write_text(ri.creds(node.user_jwt, key.seed))
    rkey = ri.NKey.generate("user")
    reclaimer_creds = tmp / "reclaimer.creds"
    reclaimer_creds.write_text(ri.creds(ri.reclaimer_user_jwt(keys, rkey.public), rkey.seed))
    akey = ri.NKey.generate("user")
    admin_creds = tmp / "admin.creds"
    admin_creds.write_text(ri.creds(ri.stream_admin_user_jwt(keys, akey.public), akey.seed))

    def auth(creds: Path) -> dict[str, Any]:
        return _nats.auth_options(creds_file=str(creds), ca_file=ca)

    connects: list[float] = []
    for _ in range(CONNECTS):
        started = time.perf_counter()
        nc = await _nats.connect(url, auth=auth(node_creds), deadline_s=10, inbox_prefix=ri.node_inbox(keys.hall, "n1"))
        connects.append(time.perf_counter() - started)
        await nc.close()

    sa = await _nats.connect(url, auth=auth(admin_creds), deadline_s=10)
    await sa.jetstream(timeout=5).add_stream(name=ri.STREAM, subjects=[f"sco.events.{keys.hall}.>"])
    await sa.close()

    nc = await _nats.connect(url, auth=auth(node_creds), deadline_s=10, inbox_prefix=ri.node_inbox(keys.hall, "n1"))
    rc = await _nats.connect(url, auth=auth(reclaimer_creds), deadline_s=10)
    try:
        got: asyncio.Queue[float] = asyncio.Queue()

        async def take(msg: Any) -> None:
            got.put_nowait(time.perf_counter())

        await nc.subscribe(f"sco.notice.{keys.hall}.n1", cb=take)
        await nc.flush(timeout=5)
        payload = b'{"kind": "reclaim", "sig": "' + b"x" * 400 + b'"}'  # about a signed notice's size
        for _ in range(50):  # warm up (the node's account import, the first deliveries)
            await rc.publish(f"sco.notice.{keys.hall}.n1", payload)
            await asyncio.wait_for(got.get(), 5)
        notices: list[float] = []
        cpu = _cpu_s(pid)
        for _ in range(NOTICES):
            started = time.perf_counter()
            await rc.publish(f"sco.notice.{keys.hall}.n1", payload)
            await rc.flush(timeout=5)
            notices.append(await asyncio.wait_for(got.get(), 5) - started)
        relay_cpu = _cpu_s(pid) - cpu
        js = nc.jetstream(timeout=5)
        events: list[float] = []
        for i in range(EVENTS):
            started = time.perf_counter()
            await js.publish(f"sco.events.{keys.hall}.n1", b'{"type": "drain.progress", "n": %d}' % i)
            events.append(time.perf_counter() - started)
    finally:
        await nc.close()
        await rc.close()
    return {
        "notice": _ms(notices), "event_ack": _ms(events), "connect": _ms(connects),
        "relay_cpu_s_per_1000_notices": round(relay_cpu / NOTICES * 1000, 3),
    }  # fmt: skip


def _one(tls: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        keys = ri.HallKeys.generate("bench")
        port, monitor = free_port(), free_port()
        relay_tls = Pki(tmp / "pki").relay_tls() if tls else None
        conf = tmp / "nats.conf"
        conf.write_text(
            ri.server_config(
                keys, resolver_dir=tmp / "resolver", store_dir=tmp / "js", listen="127.0.0.1", port=port,
                monitor_port=monitor, tls=relay_tls,
            )
        )  # fmt: skip
        proc = subprocess.Popen(
            [str(BIN / "nats-server"), "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:

            def up() -> bool:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/healthz", timeout=1) as r:
                        return bool(r.status == 200)
                except OSError:
                    return False

            wait_for(up, 60, "nats-server serving", interval=0.01)
            ca = relay_tls.ca_file if relay_tls else None
            return {"tls": tls, **asyncio.run(_measure(tmp, f"nats://127.0.0.1:{port}", keys, ca, proc.pid))}
        finally:
            proc.terminate()
            proc.wait(10)


def bench_relay_tls() -> Iterator[dict[str, Any]]:
    plain = _one(False)
    yield plain
    tls = _one(True)
    yield tls
    yield {
        "ratio_tls_over_plain": {
            k: round(tls[k]["p50_ms"] / plain[k]["p50_ms"], 2) for k in ("notice", "event_ack", "connect")
        },
        "notices": NOTICES, "events": EVENTS, "connects": CONNECTS,
    }  # fmt: skip


BENCHES = {"relay_tls": bench_relay_tls}
