"""Hall-scale figures (issue 21): a hall of N nodes on one relay and one fleet state, at N = 500, 1,000 and 5,000.

Each node is simulated by a real NATS client (nats-py) holding its own relay identity: the notice_relay role's
current template is rendered for the N nodes (``tests.test_drill.start_relay``, as tests/test_relay_accounts.py
does: the role's nkey lookup makes every user's seed), a real nats-server runs it, the role's stream tool creates
SCO_EVENTS and SCO_HEARTBEATS, and every node connects with its own seed and the agent's inbox prefix. All N
clients live in this process (connected in batches, at most CONNECT_CONCURRENCY at once); the reclaimer runs in a
process of its own, so the nodes' arrival times are not taken on the publisher's event loop.

``hall_scale`` yields one JSON object per figure and size, then one growth object per figure:

- ``relay``: the relay's RSS from /varz with its configuration loaded and no client, then with the N nodes
  connected (and subscribed to their notice subjects), and after the runs below; how long a relay with this
  configuration takes to start accepting connections, and its CPU meanwhile (a restart, the role's handler for
  any change of the configuration, leaves the hall without a relay that long).
- ``notice_fanout``: the reclaimer's identity publishes signed notices (``sco.provider.reclaimer``'s
  notice_document and publish_notice, one after another as ``Reclaimer.notify`` does: publish and flush each) to
  10 % of the nodes; each node records when its notice arrived. Latency of each notice from its publish call to
  its arrival (p50/p99/max), and from the first publish to the last arrival; $SCO_BENCH_REPEATS rounds to the
  same nodes, medians. Every notice is verified against the reclaimer's key after the run (not timed).
- ``events``: every node publishes one drain event through its own account into SCO_EVENTS with a Nats-Msg-Id,
  as the agent's publisher does (a JetStream publish), all at once; total time (first publish to last ack),
  events/s, ack latency p50/p99 from each publish call (waited for up to 30 s, so that every ack is measured; those
  past the agent's 2 s timeout are counted: the agent would have retried them). Then every node publishes the
  same event again (a spool replaying after an outage): each must be acknowledged as a duplicate, and the stream
  must hold exactly N messages.
- CPU: each phase says the CPU time the relay and this process (the simulated nodes) spent, so a wall time can
  be told apart into the relay's work and the simulator's (N clients on one Python event loop; its heap frozen
  out of the garbage collector once connected, see Fleet.connect).
- ``control_loop``: the fleet state (embedded PostgreSQL, migrated) filled through the product's FleetState API
  with the N instances in P pools (N/25 pools by default: 20, 40, 200; 10 % of them under reclaim, the noticed
  ones), each node's heartbeat on the relay; then the loop's run without a cloud, as ``sco-control-loop`` runs it
  (``sco.control.runner.run_loop``) with the monitoring role's textfile metrics on: begin the run, the plan
  step (fleet state read, planner, plan recorded), the arbitrate step, the acquire step as its offline dry run
  (slots and entries read; no cloud given: no preflight, no Nova), finish the run, read the heartbeats into the
  fleet state, the fleet gauges. SQL statements, transactions and connections counted in this process (psycopg's
  Cursor.execute and friends, every caller). Median of $SCO_BENCH_REPEATS runs (default 3) after one run not
  counted (the steady state: imports done, the heartbeats read once). Left out: the demand step (reads
  Kubernetes or Slurm; the demand is given as the step's result) and the reconcile step (lists Nova).
  ``reads`` times two more reads of the same state: FleetState.instances() (the acquirer's and reclaimer's read)
  and ``sco hall status``.

Growth: each figure's cost per node at each size (per notice for the fan-out's total; the fan-out's per-notice
latencies as they are: each notice is alone on the wire; the events' ack latencies per node: N acks of a burst of N
at once), and its ratio to the smallest size's; ``"linear": true`` when that ratio stays within LINEAR_WITHIN at
every size (cost growing at most in proportion to the hall). The relay's CPU is read from /proc in clock ticks
(10 ms): small figures at 500 nodes are coarse.

Sizes: $SCO_BENCH_HALL_SIZES, e.g. ``500`` (a quick run) or ``500,1000,5000`` (the default); ``N:P`` sets the
pools (``20:2``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import math
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from sco import __version__


def tls_for(url: str) -> dict[str, Any]:
    """The test relay's TLS for a client (tests.relays: its CA), imported late as this module's other test helpers."""
    from tests.relays import tls_for as relay_tls

    return relay_tls(url)


def ca_for(url: str) -> str | None:
    """The test relay's CA file (for the reclaimer's own process)."""
    from tests.relays import ca_for as relay_ca

    return relay_ca(url)


HALL = "local"  # the hall tests.test_drill.start_relay renders the relay for
NOTICE_SHARE = 0.10
CONNECT_CONCURRENCY = 64
AGENT_ACK_TIMEOUT_S = 2.0  # sco.agent.daemon: nc.jetstream(timeout=2)
ACK_WAIT_S = 30.0
LINEAR_WITHIN = 1.5
SIZES_ENV = "SCO_BENCH_HALL_SIZES"
DEFAULT_SIZES = "500,1000,5000"
NODES_PER_POOL = 25
REPO = Path(__file__).resolve().parents[1]
# contract subsets of the instances (the contracts of tests.harness.hall_bundle)
SUBSETS = [("web",), ("batch", "web"), ("genomics-ckpt",), ("climate-sims", "guarded"), ("batch",)]


def sizes_from(text: str | None) -> list[tuple[int, int]]:
    """``500,1000,5000`` or ``20:2``: (nodes, pools) per size; ValueError naming the variable otherwise."""
    out = []
    for part in (text or DEFAULT_SIZES).split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", part)
        nodes = int(m.group(1)) if m else 0
        pools = int(m.group(2)) if m and m.group(2) else max(1, nodes // NODES_PER_POOL)
        if not m or not 10 <= nodes <= 15_000 or not 1 <= pools <= nodes:
            raise ValueError(
                f"${SIZES_ENV}: {part.strip()!r}: expected NODES (10 to 15000) or NODES:POOLS (1 to NODES pools),"
                " comma-separated, such as 500,1000,5000"
            )
        out.append((nodes, pools))
    return out


def node_names(n: int) -> list[str]:
    return [f"n{i:05d}" for i in range(n)]


def noticed(nodes: list[str]) -> list[str]:
    """Every tenth node (10 %, spread over the hall)."""
    k = max(1, round(len(nodes) * NOTICE_SHARE))
    step = len(nodes) / k
    return [nodes[int(i * step)] for i in range(k)]


def pct(values: list[float], p: float) -> float:
    """Nearest-rank percentile (a value that occurred)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


def raise_fd_limit(need: int) -> None:
    """N client sockets here and N in nats-server (which inherits this limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise RuntimeError(
                f"RLIMIT_NOFILE: the hard limit {hard} is below the {need} descriptors {need // 2} nodes need"
            )
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def varz(monitor_port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor_port}/varz", timeout=5) as r:
        return dict(json.loads(r.read()))


def rss_mib(v: dict[str, Any]) -> float:
    return round(float(v["mem"]) / 2**20, 1)


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@contextlib.contextmanager
def cpu(relay_pid: int) -> Iterator[dict[str, float]]:
    """CPU seconds spent meanwhile by the relay and by this process (the simulated nodes): which one a phase's
    wall time is made of."""
    out: dict[str, float] = {}
    r0, p0 = _cpu_s(relay_pid), time.process_time()
    try:
        yield out
    finally:
        out["relay_cpu_ms"] = round((_cpu_s(relay_pid) - r0) * 1000)
        out["nodes_cpu_ms"] = round((time.process_time() - p0) * 1000)


def own_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def relay_start(conf: Path, tmp: Path) -> dict[str, float]:
    """How long a relay with this configuration takes from its start to accepting connections (what a restart
    of the relay, the role's handler on any change of its configuration, leaves the hall without notices), and
    the CPU it spent meanwhile: a second nats-server with a copy of the configuration on other ports."""
    import socket

    from tests.harness import free_port

    port, monitor = free_port(), free_port()
    text, n = re.subn(r'^listen: "([^"]+):\d+"$', f'listen: "127.0.0.1:{port}"', conf.read_text(), flags=re.M)
    text, m = re.subn(r'^http: "127\.0\.0\.1:\d+"$', f'http: "127.0.0.1:{monitor}"', text, flags=re.M)
    text, k = re.subn(r'^(\s*store_dir: )"[^"]*"$', f'\\1"{tmp / "js-copy"}"', text, flags=re.M)
    if (n, m, k) != (1, 1, 1):
        raise RuntimeError(f"{conf}: no single listen, http and store_dir line to move to other ports ({n}, {m}, {k})")
    copy = tmp / "nats-copy.conf"
    copy.write_text(text)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "nats-server"), "-c", str(copy)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        while True:
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            if proc.poll() is not None or time.monotonic() - t0 > 300:
                raise RuntimeError(f"nats-server -c {copy}: not accepting connections (exit {proc.poll()})")
            time.sleep(0.02)
        return {"start_s": round(time.monotonic() - t0, 2), "start_cpu_s": round(_cpu_s(proc.pid), 2)}
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --- the nodes -----------------------------------------------------------------------------------------


def inbox_prefix(node: str) -> str:
    """The agent's inbox prefix for ``node``: AgentConfig's own property (the relay grants a node that alone)."""
    from types import SimpleNamespace

    from sco.agent.config import AgentConfig

    return str(AgentConfig.inbox_prefix.fget(SimpleNamespace(hall=HALL, node=node)))  # type: ignore[attr-defined]


class Fleet:
    """The N simulated nodes: one nats-py client each, with the node's own seed, subscribed to its notices."""

    def __init__(self, url: str, auth: Callable[[str], dict[str, Any]], nodes: list[str], relay_pid: int) -> None:
        self.url, self.auth, self.nodes, self.relay_pid = url, auth, nodes, relay_pid
        self.ncs: dict[str, Any] = {}
        self.arrivals: dict[str, tuple[float, bytes]] = {}
        self.errors: list[str] = []
        self.all_arrived = asyncio.Event()
        self.expected = 0

    async def _error(self, e: Exception) -> None:
        self.errors.append(f"{type(e).__name__}: {e}")

    async def connect(self) -> float:
        import nats

        gate = asyncio.Semaphore(CONNECT_CONCURRENCY)

        async def one(node: str) -> None:
            async with gate:
                nc = await asyncio.wait_for(
                    nats.connect(
                        self.url, connect_timeout=10, allow_reconnect=False, max_reconnect_attempts=0,
                        # as_user's options carry the relay's TLS
                        inbox_prefix=inbox_prefix(node), error_cb=self._error, **self.auth(f"node-{node}"),
                    ),
                    30,
                )  # fmt: skip
                self.ncs[node] = nc

                async def on_notice(msg: Any, node: str = node) -> None:
                    self.arrivals.setdefault(node, (time.monotonic(), msg.data))
                    if len(self.arrivals) >= self.expected:
                        self.all_arrived.set()

                await nc.subscribe(f"sco.notice.{HALL}.{node}", cb=on_notice)
                await nc.flush(timeout=10)  # the server has the subscription before any notice is sent

        t0 = time.perf_counter()
        await asyncio.gather(*(one(n) for n in self.nodes))
        took = time.perf_counter() - t0
        # N clients' objects in one heap (an agent has one): full collections scanning them all made more than
        # half of this process's CPU during the events at 5,000 nodes, a cost no agent has. They live until the
        # end: out of the collector's sight.
        gc.collect()
        gc.freeze()
        return took

    async def close(self) -> None:
        await asyncio.gather(*(nc.close() for nc in self.ncs.values()), return_exceptions=True)
        self.ncs.clear()
        gc.unfreeze()
        gc.collect()  # the N clients' garbage gone before the fleet state's figures are taken

    async def events(self) -> dict[str, Any]:
        """One drain event per node through its own account, all at once, as the agent's publisher sends it
        (JetStream publish with Nats-Msg-Id); then the same events again, as spools replaying after an outage
        would send them: JetStream must take none of them twice."""
        ids = {n: f"{uuid.uuid4().hex}.1" for n in self.nodes}  # the spool's random id, then the event's seq
        bodies = {
            n: json.dumps({"seq": 1, "type": "drain.drained", "hall": HALL, "node": n, "at": time.time(),
                           "notice": f"reclaim-{n}", "seconds": 3.2}).encode()
            for n in self.nodes
        }  # fmt: skip

        async def round_() -> tuple[float, dict[str, tuple[float, float]], dict[str, str], int]:
            acks: dict[str, tuple[float, float]] = {}
            failed: dict[str, str] = {}
            duplicates = 0

            async def one(node: str) -> None:
                nonlocal duplicates
                # longer than the agent's 2 s, so that every ack is measured; those past 2 s are counted
                js = self.ncs[node].jetstream(timeout=ACK_WAIT_S)
                started = time.monotonic()
                try:
                    ack = await js.publish(
                        f"sco.events.{HALL}.{node}", bodies[node], headers={"Nats-Msg-Id": ids[node]}
                    )
                    acks[node] = (started, time.monotonic())
                    duplicates += bool(ack.duplicate)
                except Exception as e:
                    failed[node] = type(e).__name__

            t0 = time.monotonic()
            await asyncio.gather(*(one(n) for n in self.nodes))
            return t0, acks, failed, duplicates

        with cpu(self.relay_pid) as cpu_first:
            t0, acks, failed, _ = await round_()
        total = max((a[1] for a in acks.values()), default=t0) - t0
        latencies = [done - started for started, done in acks.values()]
        _, again, failed_again, duplicates = await round_()
        return {
            "total_s": total,
            "latencies": latencies,
            "from_start": [done - t0 for _, done in acks.values()],
            "failed": len(failed),
            "failures": sorted(set(failed.values())),
            "replayed": len(again),
            "replay_duplicates": duplicates,
            "replay_failed": len(failed_again),
            "cpu": cpu_first,
        }

    async def heartbeats(self) -> None:
        body = {"boot_id": "0" * 36, "version": __version__, "drain": "idle", "bundle_serial": 7, "backlog": 0}
        await asyncio.gather(
            *(nc.publish(f"sco.heartbeat.{HALL}.{n}", json.dumps(body).encode()) for n, nc in self.ncs.items())
        )
        await asyncio.gather(*(nc.flush(timeout=10) for nc in self.ncs.values()))


# --- the reclaimer (its own process) ------------------------------------------------------------------


async def _reclaim(url: str, seed: str, key_file: str, nodes: list[str], ca: str = "") -> dict[str, Any]:
    """Notices to ``nodes`` one after another, as Reclaimer.notify publishes them (publish, flush, next); ``ca``: the
    relay's CA (this process has not the parent's record of it)."""
    import nats

    from sco import _nats
    from sco.contract.signing import load_private
    from sco.provider.reclaimer import notice_document, publish_notice

    keys = [load_private(Path(key_file))]
    nc = await asyncio.wait_for(
        nats.connect(
            url,
            connect_timeout=10,
            allow_reconnect=False,
            max_reconnect_attempts=0,
            nkeys_seed=seed,
            **({"tls": _nats.tls_context(ca)} if ca else {}),
        ),
        30,
    )
    sent = []
    try:
        for node in nodes:
            t = time.monotonic()
            now = time.time()
            notice = notice_document(f"reclaim-{uuid.uuid4().hex[:16]}", HALL, node, now + 120, now)
            await publish_notice(nc, notice, keys)
            sent.append([node, notice["id"], t, time.monotonic()])
    finally:
        await nc.close()
    return {"sent": sent}


async def fanout(fleet: Fleet, url: str, seed: Path, key_file: Path, targets: list[str]) -> dict[str, Any]:
    fleet.expected = len(targets)
    fleet.arrivals.clear()
    fleet.all_arrived.clear()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "benchmarks.bench_hall_scale", "reclaim", url, str(seed), str(key_file),
        ca_for(url) or "",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=REPO,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate("\n".join(targets).encode()), 300)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise RuntimeError("the reclaimer's process did not finish within 300 s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"the reclaimer's process failed ({proc.returncode}): {err.decode()[-2000:]}")
    sent = json.loads(out)["sent"]
    with contextlib.suppress(TimeoutError):  # a notice lost is counted below, never waited for past this
        await asyncio.wait_for(fleet.all_arrived.wait(), 30)
    return {"sent": sent, "arrivals": dict(fleet.arrivals)}


def fanout_figures(result: dict[str, Any], pub: Any) -> dict[str, Any]:
    from sco.contract.notice import verify_notice
    from sco.contract.signing import Keyring

    sent, arrivals = result["sent"], result["arrivals"]
    keyring = Keyring([pub])
    lat, invalid = [], 0
    for node, nid, t_pub, _ in sent:
        if node not in arrivals:
            continue
        t_arr, raw = arrivals[node]
        lat.append(t_arr - t_pub)
        try:
            doc = verify_notice(raw, keyring)
            invalid += doc["id"] != nid or doc["node"] != node
        except Exception:
            invalid += 1
    first = min(s[2] for s in sent)
    publish_s = max(s[3] for s in sent) - first
    last = max((a[0] for a in arrivals.values()), default=first)
    return {
        "notices": len(sent),
        "delivered": sum(1 for s in sent if s[0] in arrivals),
        "invalid": invalid,
        "p50_ms": ms(pct(lat, 50)) if lat else None,
        "p99_ms": ms(pct(lat, 99)) if lat else None,
        "max_ms": ms(max(lat)) if lat else None,
        "publish_all_ms": ms(publish_s),
        "first_publish_to_last_delivery_ms": ms(last - first),
    }


def fanout_rounds(rounds: list[tuple[dict[str, Any], dict[str, float]]], pub: Any) -> dict[str, Any]:
    """Each round's figures; medians over the rounds (the maximum of the maxima), counts summed."""
    each = [{**fanout_figures(fan, pub), **used} for fan, used in rounds]

    def med(key: str) -> float | None:
        values = [x[key] for x in each if x[key] is not None]
        return round(statistics.median(values), 2) if values else None

    return {
        "rounds": len(each),
        "notices": each[0]["notices"],
        "sent": sum(x["notices"] for x in each),
        "delivered": sum(x["delivered"] for x in each),
        "invalid": sum(x["invalid"] for x in each),
        **{k: med(k) for k in ("p50_ms", "p99_ms", "publish_all_ms", "first_publish_to_last_delivery_ms")},
        "max_ms": max((x["max_ms"] for x in each if x["max_ms"] is not None), default=None),
        **{k: med(k) for k in ("relay_cpu_ms", "nodes_cpu_ms")},
    }


async def stream_counts(url: str, auth: dict[str, Any]) -> dict[str, int]:
    import nats

    nc = await asyncio.wait_for(
        nats.connect(url, connect_timeout=10, allow_reconnect=False, **{**tls_for(url), **auth}), 30
    )
    try:
        js = nc.jetstream(timeout=10)
        return {s: int((await js.stream_info(s)).state.messages) for s in ("SCO_EVENTS", "SCO_HEARTBEATS")}
    finally:
        await nc.close()


# --- the fleet state and the control loop -------------------------------------------------------------


class SqlCounter:
    """Counts the SQL this process sends through psycopg (every caller): statements, transactions, connections."""

    def __init__(self) -> None:
        self.statements = self.transactions = self.connections = 0
        self._undo: list[Callable[[], None]] = []

    def __enter__(self) -> SqlCounter:
        import psycopg

        def wrap(cls: Any, name: str, field: str) -> None:
            real = getattr(cls, name)

            def counted(*a: Any, **kw: Any) -> Any:
                setattr(self, field, getattr(self, field) + 1)
                return real(*a, **kw)

            setattr(cls, name, counted)
            self._undo.append(lambda: setattr(cls, name, real))

        wrap(psycopg.Cursor, "execute", "statements")
        wrap(psycopg.Cursor, "executemany", "statements")
        wrap(psycopg.Connection, "transaction", "transactions")
        wrap(psycopg.Connection, "__init__", "connections")  # psycopg.connect() makes each one through it
        return self

    def __exit__(self, *exc: object) -> None:
        for undo in reversed(self._undo):
            undo()

    def snapshot(self) -> tuple[int, int, int]:
        return self.statements, self.transactions, self.connections


def plan_inputs(nodes: list[str], pools: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The pools option and the demand step's result: every node busy (7 of 8 units: no 2-unit request fits
    beside), ~10 % of the hall's capacity more pending, in 2-unit requests over the bundle's contracts."""
    per_pool = math.ceil(len(nodes) / pools)
    specs = [
        {"name": f"pool-{k:03d}", "kind": "reclaimable", "flavor": "m1.xlarge", "vcpus": 8, "ramMiB": 32768,
         "cap": math.ceil(per_pool * 1.3), "group": f"rack-{k % 10:02d}", "pricePerHour": f"0.{10 + k % 7}"}
        for k in range(pools)
    ]  # fmt: skip
    contracts = sorted({c for s in SUBSETS for c in s})
    items = max(1, len(nodes) * 8 // 10 // 2 // len(contracts))  # 10 % of 8 units a node, 2 units an item
    demand = {
        "demand": [
            {"contract": c, "units_milli": items * 2000, "items": items, "requests_milli": {"2000": items}}
            for c in contracts
        ],
        "uncontracted": [],
        "ineligible": [],
        "node_load_milli": {n: 7000 for n in nodes},
    }
    return specs, {"report": demand, "units": {}, "changed": False}


def fill(dsn: str, nodes: list[str], pools: list[dict[str, Any]], reclaims: dict[str, str]) -> dict[str, Any]:
    """The fleet state as the acquirer and the reclaimer would have left it, through their own API."""
    from sco.control.record import PgFleetStore
    from sco.state.fleet import FleetState, Pool

    t0 = time.perf_counter()
    slots: dict[tuple[str, str], int] = {}
    with FleetState(dsn) as st, PgFleetStore(dsn) as store:
        for p in pools:
            st.ensure_pool(Pool(HALL, p["name"], p["flavor"], "sco-node"))
        now = st.now()
        for i, node in enumerate(nodes):
            pool = pools[i % len(pools)]["name"]
            entry = store.ensure_entry(HALL, pool, SUBSETS[i % len(SUBSETS)])
            slot = slots[(pool, entry)] = slots.get((pool, entry), -1) + 1
            inst = st.adopt(HALL, pool, entry, slot, node, f"srv-{uuid.uuid4()}", "active")
            assert inst is not None
            if node in reclaims:
                st.transition(
                    inst.id, "notified", "reclaim.scheduled", only_from=("active",), reclaim_id=reclaims[node],
                    terminate_at=now + 120, window_s=120.0,
                )  # fmt: skip
    return {"fill_s": round(time.perf_counter() - t0, 2)}


def loop_run(dsn: str, common: dict[str, Any], pools: list[dict[str, Any]], demand: dict[str, Any],
             env: dict[str, str], counter: SqlCounter) -> dict[str, Any]:  # fmt: skip
    """One control-loop run without a cloud, in sco-control-loop's order (sco.control.runner.run_loop)."""
    from sco.control import metrics, steps
    from sco.control.record import PgFleetStore
    from sco.provider import heartbeats

    phases: dict[str, dict[str, float]] = {}

    @contextlib.contextmanager
    def phase(name: str) -> Iterator[None]:
        s0, t0 = counter.snapshot(), time.perf_counter()
        yield
        s1 = counter.snapshot()
        phases[name] = {
            "ms": ms(time.perf_counter() - t0), "statements": s1[0] - s0[0], "transactions": s1[1] - s0[1],
            "connections": s1[2] - s0[2],
        }  # fmt: skip

    settings = {"shares": {1: "1/2", 2: "1/2", 3: 1}}
    out: dict[str, Any] = {}
    with phase("total"):
        with phase("begin"):
            store = PgFleetStore(dsn)
            run_id = store.begin_run(HALL)
        try:
            p = {**common, "run_id": run_id, "pools": pools, "settings": settings}
            with phase("plan"):
                out["plan"] = steps.run("plan", {**p, "demand": demand}, check=False)
            with phase("arbitrate"):
                out["arbitrate"] = steps.run("arbitrate", {**p, "plan": out["plan"], "ceiling_per_hour": "0"}, False)
            with phase("acquire_offline"):
                out["acquire"] = steps.run(
                    "acquire", {**p, "plan": out["plan"], "arbitration": out["arbitrate"]}, check=True
                )
            with phase("finish"):
                store.finish_run(run_id, "ok", {"run_id": run_id, "launched": out["acquire"]["launched"]})
            with phase("heartbeats"), _timed(heartbeats, "read") as relay_read:
                out["heartbeats"] = heartbeats.collect_for_loop(store.conn, HALL, env)
            phases["heartbeats"]["relay_read_ms"] = ms(sum(relay_read))  # the rest: recording them
            with phase("gauges"):
                out["gauges"] = len(metrics.fleet_gauges(store, HALL))
        finally:
            store.close()
    out["phases"] = phases
    return out


def reads(dsn: str, counter: SqlCounter) -> dict[str, Any]:
    from sco.state import hall
    from sco.state.db import connect
    from sco.state.fleet import FleetState

    out: dict[str, Any] = {}
    with FleetState(dsn) as st:
        s0, t0 = counter.snapshot(), time.perf_counter()
        n = len(st.instances(HALL))
        out["fleet_state_instances"] = {"ms": ms(time.perf_counter() - t0), "statements": counter.statements - s0[0],
                                        "rows": n}  # fmt: skip
    with connect(dsn) as conn:
        s0, t0 = counter.snapshot(), time.perf_counter()
        hall.status(conn, HALL, stale_s=900, recent_s=3600)
        out["hall_status"] = {"ms": ms(time.perf_counter() - t0), "statements": counter.statements - s0[0]}
    return out


# --- one size ----------------------------------------------------------------------------------------------


def one_size(tmp: Path, pg: Any, nodes_n: int, pools_n: int, repeats: int) -> list[dict[str, Any]]:
    from tests.harness import hall_bundle
    from tests.relays import as_user, start_relay

    from sco.contract.signing import generate, write_keypair

    nodes = node_names(nodes_n)
    tmp.mkdir(parents=True)
    t0 = time.perf_counter()
    srv, creds = start_relay(tmp, nodes)  # the role's current template and stream tool, for these nodes
    relay_up_s = time.perf_counter() - t0
    monitor = int(re.search(r'http: "127\.0\.0\.1:(\d+)"', (tmp / "nats.conf").read_text()).group(1))  # type: ignore[union-attr]
    notice_key = generate()
    write_keypair(notice_key, tmp / "notice.key", tmp / "notice.pub")
    lines: list[dict[str, Any]] = []
    try:
        idle = varz(monitor)
        restart = relay_start(tmp / "nats.conf", tmp)

        relay_pid = srv.proc.pid if srv.proc else 0
        targets = noticed(nodes)

        async def nats_part() -> dict[str, Any]:
            fleet = Fleet(srv.url, lambda user: as_user(creds, user), nodes, relay_pid)
            out: dict[str, Any] = {}
            try:
                with cpu(relay_pid) as out["connect_cpu"]:
                    out["connect_s"] = await fleet.connect()
                out["connected"] = varz(monitor)
                out["fans"] = []
                for _ in range(repeats):  # rounds to the same nodes (a notice repeated, as after a restart)
                    with cpu(relay_pid) as used:
                        fan = await fanout(fleet, srv.url, creds / "reclaimer.nk", tmp / "notice.key", targets)
                    out["fans"].append((fan, used))
                out["ev"] = await fleet.events()
                await fleet.heartbeats()
                out["counts"] = await stream_counts(srv.url, as_user(creds, "control"))
                out["after"] = varz(monitor)
                out["errors"] = fleet.errors[:5]
                out["bench_rss"] = own_rss_mib()
                return out
            finally:
                await fleet.close()

        r = asyncio.run(nats_part())
        connected, ev, counts = r["connected"], r["ev"], r["counts"]
        lines.append({
            "figure": "relay", "nodes": nodes_n, "config_kib": round((tmp / "nats.conf").stat().st_size / 1024),
            "render_and_start_s": round(relay_up_s, 1), **restart, "connect_all_s": round(r["connect_s"], 2),
            **{f"connect_{k}": v for k, v in r["connect_cpu"].items()},
            "connections": connected["connections"], "subscriptions": connected.get("subscriptions"),
            "rss_mib_idle": rss_mib(idle), "rss_mib_connected": rss_mib(connected),
            "rss_mib_after": rss_mib(r["after"]),
            "rss_kib_per_node": round((connected["mem"] - idle["mem"]) / 1024 / nodes_n, 1),
            "bench_process_rss_mib": r["bench_rss"], "client_errors": r["errors"],
        })  # fmt: skip
        lines.append({"figure": "notice_fanout", "nodes": nodes_n, **fanout_rounds(r["fans"], notice_key.public)})
        lat = ev["latencies"]
        lines.append({
            "figure": "events", "nodes": nodes_n, "acked": len(lat), "failed": ev["failed"],
            "failures": ev["failures"], "stream_messages": counts["SCO_EVENTS"], "total_ms": ms(ev["total_s"]),
            "events_per_s": round(len(lat) / ev["total_s"]) if ev["total_s"] else None,
            "ack_p50_ms": ms(pct(lat, 50)) if lat else None, "ack_p99_ms": ms(pct(lat, 99)) if lat else None,
            "ack_max_ms": ms(max(lat)) if lat else None,
            "acks_past_agent_timeout": sum(x > AGENT_ACK_TIMEOUT_S for x in lat),
            "from_start_p50_ms": ms(pct(ev["from_start"], 50)) if lat else None,
            **ev["cpu"], "replayed": ev["replayed"], "replay_duplicates": ev["replay_duplicates"],
            "replay_failed": ev["replay_failed"], "heartbeat_stream_messages": counts["SCO_HEARTBEATS"],
        })  # fmt: skip

        # the fleet state: the loop's run
        db = f"hall_scale_{nodes_n}_{os.getpid()}"
        pg.create_database(db)
        dsn = pg.dsn(db)
        from sco.state.db import connect, migrate

        with connect(dsn) as c:
            migrate(c)
        key = generate()
        trust = tmp / "trusted"
        trust.mkdir()
        write_keypair(key, tmp / "signing.key", trust / "signing.pub")
        (tmp / "bundle.json").write_bytes(hall_bundle(tmp, key))
        pools, demand = plan_inputs(nodes, pools_n)
        reclaims = {s[0]: s[1] for s in r["fans"][-1][0]["sent"]}
        filled = fill(dsn, nodes, pools, reclaims)
        common = {"hall": HALL, "state_dsn": dsn, "bundle": str(tmp / "bundle.json"), "trust_dir": str(trust)}
        ca = ca_for(srv.url)  # the relay serves TLS: the loop's heartbeat read trusts its CA, as a control host's does
        env = {
            "SCO_NATS_URL": srv.url,
            "SCO_NATS_NKEY_SEED": str(creds / "control.nk"),
            **({"SCO_NATS_CA_FILE": ca} if ca else {}),
        }
        metrics_dir = tmp / "metrics"
        metrics_dir.mkdir()
        runs = []
        with SqlCounter() as counter, _env({"SCO_METRICS_TEXTFILE_DIR": str(metrics_dir)}):
            # the loop's steady state: one run first (imports, and the hall's first heartbeat read: before it, the
            # gauges skip the silent-agents query), not counted
            loop_run(dsn, common, pools, demand, env, counter)
            for _ in range(repeats):
                runs.append(loop_run(dsn, common, pools, demand, env, counter))
            read = reads(dsn, counter)
        last = runs[-1]
        ph = {  # times: medians over the runs; counts: the last run's (the same in every run)
            name: {
                k: round(statistics.median(r["phases"][name][k] for r in runs), 2) if k.endswith("ms") else v
                for k, v in last["phases"][name].items()
            }
            for name in last["phases"]
        }
        plan = last["plan"]["plan"]
        lines.append({
            "figure": "control_loop", "nodes": nodes_n, "pools": pools_n, "runs": repeats, **filled,
            "run_ms_median": ph["total"]["ms"], "statements_per_run": ph["total"]["statements"],
            "transactions_per_run": ph["total"]["transactions"], "connections_per_run": ph["total"]["connections"],
            "statements_same_every_run": len({r["phases"]["total"]["statements"] for r in runs}) == 1,
            "phases": ph, "reads": read,
            "plan_current": sum(p["current"] for p in plan.get("pools", [])),
            "plan_launch": sum(p["launch"] for p in plan.get("pools", [])),
            "plan_delete": sum(len(p["delete"]) for p in plan.get("pools", [])),
            "shortfall_units": sum(plan.get("shortfall_milli", {}).values()) / 1000,
            "acquire_entries": len(last["acquire"]["entries"]), "heartbeats_read": last["heartbeats"],
            "gauges": last["gauges"],
        })  # fmt: skip
    finally:
        srv.stop()
    return lines


@contextlib.contextmanager
def _timed(module: Any, name: str) -> Iterator[list[float]]:
    """Seconds spent in async ``module.name`` meanwhile (split a product's call in two without changing it)."""
    real = getattr(module, name)
    spent: list[float] = []

    async def timed(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await real(*a, **kw)
        finally:
            spent.append(time.perf_counter() - t0)

    setattr(module, name, timed)
    try:
        yield spent
    finally:
        setattr(module, name, real)


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# --- growth ------------------------------------------------------------------------------------------------

# (figure, metric, divided by: "nodes", "notices", or None for a per-message latency that should stay flat).
# The events are a burst of N at once: their ack latencies are divided by N (the last ack waits for the burst).
GROWTH = [
    ("relay", "rss_mib_connected", "nodes"),
    ("relay", "render_and_start_s", "nodes"),
    ("relay", "start_s", "nodes"),
    ("relay", "start_cpu_s", "nodes"),
    ("relay", "connect_all_s", "nodes"),
    ("relay", "connect_relay_cpu_ms", "nodes"),
    ("notice_fanout", "p50_ms", None),
    ("notice_fanout", "p99_ms", None),
    ("notice_fanout", "first_publish_to_last_delivery_ms", "notices"),
    ("events", "total_ms", "nodes"),
    ("events", "ack_p50_ms", "nodes"),
    ("events", "ack_p99_ms", "nodes"),
    ("events", "relay_cpu_ms", "nodes"),
    ("events", "nodes_cpu_ms", "nodes"),
    ("control_loop", "run_ms_median", "nodes"),
    ("control_loop", "statements_per_run", "nodes"),
    ("control_loop", "phases.plan.ms", "nodes"),
    ("control_loop", "phases.arbitrate.ms", "nodes"),
    ("control_loop", "phases.acquire_offline.ms", "nodes"),
    ("control_loop", "phases.heartbeats.ms", "nodes"),
    ("control_loop", "phases.gauges.ms", "nodes"),
    ("control_loop", "reads.hall_status.ms", "nodes"),
    ("control_loop", "fill_s", "nodes"),
]


def _get(line: dict[str, Any] | None, path: str) -> Any:
    v: Any = line
    for key in path.split("."):
        v = v.get(key) if isinstance(v, dict) else None
    return v


def growth(lines: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    by = {(x["figure"], x["nodes"]): x for x in lines}
    sizes = sorted({x["nodes"] for x in lines})
    for figure, metric, per in GROWTH:
        per_unit: dict[int, float] = {}
        for n in sizes:
            line = by.get((figure, n))
            v = _get(line, metric)
            if line is None or v is None:
                continue
            per_unit[n] = float(v) / (1 if per is None else line["notices"] if per == "notices" else n)
        base = per_unit.get(sizes[0])
        ratio = {n: round(v / base, 2) if base else None for n, v in per_unit.items()}
        yield {
            "figure": figure, "growth": metric, "per": per or "message",
            "per_unit": {str(n): float(f"{v:.4g}") for n, v in per_unit.items()},
            "ratio_to_smallest": {str(n): r for n, r in ratio.items()},
            # None: the smallest size's figure was 0 (a CPU time under one clock tick), no ratio to take
            "linear": None if None in ratio.values() else all(r <= LINEAR_WITHIN for r in ratio.values() if r),
            "linear_if_ratio_at_most": LINEAR_WITHIN,
        }  # fmt: skip


def bench_hall_scale(sizes: list[tuple[int, int]] | None = None) -> Iterator[dict[str, Any]]:
    from sco.state.embedded import EmbeddedPostgres  # the one the tests start

    if not sizes:
        try:
            sizes = sizes_from(os.environ.get(SIZES_ENV))
        except ValueError as e:
            raise SystemExit(f"hall_scale: {e}") from None  # one line, exit 1
    repeats = int(os.environ.get("SCO_BENCH_REPEATS", "3"))
    raise_fd_limit(2 * max(n for n, _ in sizes) + 1024)
    lines: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="sco-hall-scale-") as tmp:
        pg = EmbeddedPostgres().start()
        try:
            for nodes, pools in sizes:
                for line in one_size(Path(tmp) / str(nodes), pg, nodes, pools, repeats):
                    lines.append(line)
                    yield {**line, "load_avg_1m": round(os.getloadavg()[0], 1)}
        finally:
            pg.destroy()
    yield from growth(lines)


BENCHES = {"hall_scale": bench_hall_scale}


if __name__ == "__main__":  # the reclaimer's process: nodes on stdin, one a line
    if sys.argv[1:2] != ["reclaim"] or len(sys.argv) != 6:
        sys.exit("usage: python -m benchmarks.bench_hall_scale reclaim URL SEED_FILE NOTICE_KEY CA_FILE|'' < nodes")
    targets = sys.stdin.read().split()
    print(json.dumps(asyncio.run(_reclaim(sys.argv[2], sys.argv[3], sys.argv[4], targets, sys.argv[5]))))
