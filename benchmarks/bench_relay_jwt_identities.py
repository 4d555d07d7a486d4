"""Node identities issued at run time (sco.provider.relay_identity): a real nats-server in operator mode with a full
resolver, started with the hall's accounts only; then 5,000 node identities minted and their accounts pushed to the
running relay ($SYS.REQ.CLAIMS.UPDATE, no reload), every node connected with its own creds (each connection loads
its account), and a sample of them revoked one at a time while connected: the time from the revocation's push to
the node's client closed by the relay. Relay CPU seconds (utime + stime, /proc) and RSS after each phase.
Compare bench relay_identities (the listed configuration: one account per node in nats-server.conf, a reload per
change)."""

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

from sco.provider import relay_identity as ri

NODES = 5000
REVOKED = 200  # revocations measured, one at a time, each against a connected node
CONNECT_BATCH = 250


def _cpu_s(pid: int) -> float:

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


async def _run(tmp: Path, url: str, keys: ri.HallKeys, pid: int, out: dict[str, Any]) -> dict[str, Any]:
    """Fills ``out`` as it goes (``phase``: the step under way, so a failure says where it happened)."""
    import nats

    out.update({"nodes": NODES, "phase": "mint"})
    cpu0 = _cpu_s(pid)
    out["rss_started_mib"] = round(_rss_mib(pid), 1)

    started = time.monotonic()
    node_keys = [ri.NKey.generate("user") for _ in range(NODES)]
    identities = [ri.enrol(keys, f"n{i:05d}", k.public) for i, k in enumerate(node_keys)]
    out["mint_s"] = round(time.monotonic() - started, 2)

    admin = await ri.RelayAdmin.connect(url, keys, timeout=10)
    try:
        out["phase"] = "push"
        cpu = _cpu_s(pid)
        started = time.monotonic()
        await admin.push_many((i.account_jwt for i in identities), concurrency=128)
        out["push_s"] = round(time.monotonic() - started, 2)
        out["push_relay_cpu_s"] = round(_cpu_s(pid) - cpu, 2)
        out["rss_after_push_mib"] = round(_rss_mib(pid), 1)

        out["phase"] = "issue one more"
        # one more node, enrolled while the relay holds the 5,000: push to connected
        extra_key = ri.NKey.generate("user")
        started = time.monotonic()
        extra = await ri.issue(admin, keys, "extra", extra_key.public)
        path = tmp / "extra.creds"
        path.write_text(ri.creds(extra.user_jwt, extra_key.seed))
        nc = await nats.connect(url, user_credentials=str(path), inbox_prefix=ri.node_inbox(keys.hall, "extra"))
        out["issue_to_connected_s"] = round(time.monotonic() - started, 3)
        await nc.close()

        out["phase"] = "connect all"
        closed = {i.node: asyncio.Event() for i in identities}
        clients: list[Any] = []
        cpu = _cpu_s(pid)
        started = time.monotonic()

        async def quiet(e: Exception) -> None:
            pass

        async def connect(identity: ri.NodeIdentity, key: ri.NKey) -> Any:
            path = tmp / f"{identity.node}.creds"
            path.write_text(ri.creds(identity.user_jwt, key.seed))
            event = closed[identity.node]

            async def on_closed() -> None:
                event.set()

            nc = await nats.connect(
                url, user_credentials=str(path), inbox_prefix=ri.node_inbox(keys.hall, identity.node),
                allow_reconnect=False, closed_cb=on_closed, error_cb=quiet, connect_timeout=30,
            )  # fmt: skip
            await nc.subscribe(f"sco.notice.{keys.hall}.{identity.node}")
            return nc

        for b in range(0, NODES, CONNECT_BATCH):
            pairs = list(zip(identities[b : b + CONNECT_BATCH], node_keys[b : b + CONNECT_BATCH], strict=True))
            clients += await asyncio.gather(*(connect(i, k) for i, k in pairs))
        out["connect_all_s"] = round(time.monotonic() - started, 2)
        out["connect_relay_cpu_s"] = round(_cpu_s(pid) - cpu, 2)
        out["rss_all_connected_mib"] = round(_rss_mib(pid), 1)

        out["phase"] = "revoke"
        latencies: list[float] = []
        cpu = _cpu_s(pid)
        for identity in identities[:: NODES // REVOKED][:REVOKED]:
            started = time.monotonic()
            await ri.revoke(admin, keys, identity)
            await asyncio.wait_for(closed[identity.node].wait(), 10)
            latencies.append(time.monotonic() - started)
        out["revocations"] = len(latencies)
        out["revoke_to_closed_p50_ms"] = round(statistics.median(latencies) * 1000, 2)
        out["revoke_to_closed_p99_ms"] = round(_pct(latencies, 99) * 1000, 2)
        out["revoke_to_closed_max_ms"] = round(max(latencies) * 1000, 2)
        out["revoke_relay_cpu_s"] = round(_cpu_s(pid) - cpu, 2)
        out["relay_cpu_total_s"] = round(_cpu_s(pid) - cpu0, 2)
        out["rss_end_mib"] = round(_rss_mib(pid), 1)
        out["resolver_files"] = len(list((tmp / "resolver").glob("*.jwt")))
        out.pop("phase")
        await asyncio.gather(*(c.close() for c in clients if not c.is_closed), return_exceptions=True)
    finally:
        await admin.close()
    return out


def bench_relay_jwt_identities() -> Iterator[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        keys = ri.HallKeys.generate("bench")
        port, monitor = free_port(), free_port()
        conf = tmp / "nats.conf"
        conf.write_text(
            ri.server_config(
                keys, resolver_dir=tmp / "resolver", store_dir=tmp / "js", listen="127.0.0.1", port=port,
                monitor_port=monitor,
            )
        )  # fmt: skip
        started = time.monotonic()
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
            start_s = time.monotonic() - started
            out: dict[str, Any] = {"start_s": round(start_s, 3), "config_bytes": conf.stat().st_size}
            try:
                asyncio.run(_run(tmp, f"nats://127.0.0.1:{port}", keys, proc.pid, out))
            except Exception as e:  # a shared machine under load: say which step failed, with what got that far
                out["error"] = f"{out.get('phase')}: {type(e).__name__}: {e}"
            yield out
        finally:
            proc.terminate()
            proc.wait(10)


BENCHES = {"relay_jwt_identities": bench_relay_jwt_identities}
