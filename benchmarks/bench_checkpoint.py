"""checkpoint_socket: 100 workload clients (the real client library, in 4 separate processes of 25) registered on
the agent's checkpoint socket; a notice; how long until every client has received it (client-side receipt
times), and until every client's ``done`` has come back (the drain may move on)."""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sco.agent.checkpoint import CheckpointServer
from sco.agent.deadline import Deadline

CLIENTS, PROCS, REPEATS = 100, 4, 5


def client_group(path: str, prefix: str, n: int) -> None:
    """Run as a process: n clients; prints ``ready`` and then each notice's receipt time."""
    import threading

    from sco.workload.checkpoint_client import CheckpointClient, Notice

    lock = threading.Lock()

    def on_notice(notice: Notice) -> None:
        t = time.time()
        with lock:
            print(json.dumps({"received": t}), flush=True)

    clients = [CheckpointClient(f"{prefix}-{i}", contract="etl", on_notice=on_notice, path=path) for i in range(n)]
    for c in clients:
        c.connect()
    print(json.dumps({"ready": n}), flush=True)
    sys.stdin.read()  # until the benchmark closes our stdin


async def _once(sock_dir: Path) -> dict[str, float]:
    path = sock_dir / "ck.sock"
    srv = CheckpointServer(path, budget_for=lambda c: 60.0)
    await srv.start()
    per = CLIENTS // PROCS
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "benchmarks.bench_checkpoint",
            str(path),
            f"p{i}",
            str(per),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        for i in range(PROCS)
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            assert "ready" in json.loads(await p.stdout.readline())
        assert len(srv.workloads) == CLIENTS
        t0 = time.time()
        srv.start_notice("bench", Deadline(t0 + 120, 10, t0))
        settled = await srv.wait_settled(until=t0 + 60)
        t_done = time.time()
        received: list[float] = []
        for p in procs:
            assert p.stdout is not None
            for _ in range(per):
                received.append(json.loads(await p.stdout.readline())["received"])
        assert settled.all_done and settled.counts == {"done": CLIENTS}
        return {"all_notified_ms": (max(received) - t0) * 1000, "all_done_ms": (t_done - t0) * 1000}
    finally:
        for p in procs:
            assert p.stdin is not None
            p.stdin.close()
            p.kill()
            await p.wait()
        await srv.close()


def bench_checkpoint_socket() -> Iterator[dict[str, Any]]:
    runs = []
    for _ in range(REPEATS):
        with tempfile.TemporaryDirectory(prefix="sco-bench-ck-") as d:
            runs.append(asyncio.run(_once(Path(d))))
    yield {
        "clients": CLIENTS,
        "client_processes": PROCS,
        "notice_to_all_notified_ms": round(statistics.median(r["all_notified_ms"] for r in runs), 1),
        "notice_to_all_done_ms": round(statistics.median(r["all_done_ms"] for r in runs), 1),
        "max_notice_to_all_notified_ms": round(max(r["all_notified_ms"] for r in runs), 1),
        "repeats": REPEATS,
    }


BENCHES = {"checkpoint_socket": bench_checkpoint_socket}

if __name__ == "__main__":
    client_group(sys.argv[1], sys.argv[2], int(sys.argv[3]))


REGISTRATIONS, NODE_PODS = 200, 110

# One client process in a pod's cgroup: REGISTRATIONS sequential connect-register-close, each timed to the reply.
_REGISTER_LOOP = """
import json, socket, sys, time
path, n, contract = sys.argv[1], int(sys.argv[2]), sys.argv[3]
out = []
for i in range(n):
    t0 = time.perf_counter()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.sendall(json.dumps({"op": "register", "workload": f"w-{i}", "contract": contract}).encode() + b"\\n")
    reply = json.loads(s.makefile("rb").readline())
    out.append((time.perf_counter() - t0) * 1000)
    assert reply["op"] == "registered", reply
    s.close()
print(json.dumps(out))
"""


async def _registrations(bound: bool) -> list[float]:
    from tests.harness import PodCgroups, add_pod, hall_bundle

    from sco.agent.bundle_cache import BundleCache
    from sco.agent.owner import KubeOwners
    from sco.contract.signing import Keyring, generate, write_keypair
    from sco.schedulers.kube import KubeClient
    from sco_devkit.standins.kube_apiserver import KubeApiStandIn

    kube = KubeApiStandIn().start()
    cg = PodCgroups()
    client = KubeClient(kube.url)
    try:
        kube.cluster.add_node("node-1")
        pods = [add_pod(kube, "web", f"web-{i}", "node-1") for i in range(NODE_PODS)]  # a full node's pods
        with tempfile.TemporaryDirectory(prefix="sco-bench-ck-") as d:
            key, root = generate(), Path(d)
            (root / "trusted").mkdir()
            (root / "bundle").mkdir()
            write_keypair(key, root / "signing.key", root / "trusted" / "signing.pub")
            (root / "bundle" / "bundle.json").write_bytes(hall_bundle(root, key))  # the tests' hall: web is 6 s
            cache = BundleCache(root / "bundle", Keyring.from_dir(root / "trusted"), time.time)
            owners = KubeOwners(client, "node-1", lambda: cache.bundle, timeout=2.0, cgroup_root=cg.root)
            path = root / "ck.sock"
            srv = CheckpointServer(
                path, budget_for=lambda c: 6.0, owner_of=owners if bound else None, max_per_uid=REGISTRATIONS
            )
            await srv.start()
            try:
                argv = [sys.executable, "-c", _REGISTER_LOOP, str(path), str(REGISTRATIONS), "web"]
                p = await asyncio.create_subprocess_exec(
                    *cg.argv(pods[NODE_PODS // 2], argv), stdout=asyncio.subprocess.PIPE
                )
                out, _ = await p.communicate()
                assert p.returncode == 0
                return list(json.loads(out))
            finally:
                await srv.close()
    finally:
        await client.close()
        kube.stop()
        cg.close()


def bench_checkpoint_register() -> Iterator[dict[str, Any]]:
    """Registration latency (connect to ``registered``), the client's word taken (before issue 29) against the
    registration bound to its pod (its cgroup read, the node's 110 pods listed from the Kubernetes API stand-in
    over loopback HTTP, the pod's contract from the bundle)."""
    for bound in (False, True):
        ms = sorted(asyncio.run(_registrations(bound)))
        yield {
            "binding": "pod (cgroup + pod list, 110 pods)" if bound else "none (client's word)",
            "registrations": len(ms),
            "p50_ms": round(statistics.median(ms), 2),
            "p99_ms": round(ms[int(len(ms) * 0.99) - 1], 2),
            "max_ms": round(ms[-1], 2),
        }


BENCHES["checkpoint_register"] = bench_checkpoint_register
