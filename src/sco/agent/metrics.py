"""The agent's Prometheus metrics: counters, histograms and scrape-time gauges, and a tiny HTTP endpoint.

No prometheus_client: the agent's footprint budget is 40 MiB and this is ~200 lines of stdlib. The text
exposition format 0.0.4 (what `promtool check metrics` and every Prometheus read). No node, pod or notice-id
labels (the termination handler's lesson: per-node labels took its Prometheus down): the node is the scrape
target, so Prometheus adds ``instance`` itself. Every label here has a small fixed set of values.

Most counters are derived from the spool records the agent writes anyway (`observe`), so what the metrics say
and what the spool says cannot disagree; the eviction response codes (not all recorded) are counted at the call.
Metric reference: docs/METRICS.md.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from sco._tls import ServerTls

log = logging.getLogger("sco.agent.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DURATION_BUCKETS = (1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0)
# Seconds left before T at the outcome: negative is an overrun past T itself (not only past the margin).
LEFT_BUCKETS = (-30.0, -10.0, -5.0, -1.0, 0.0, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
OUTCOMES = {"drain.drained": "drained", "drain.overrun": "overrun", "drain.error": "error"}
CHANNELS = frozenset({"nats", "metadata", "spool"})
_MAX_LABEL_VALUES = 64  # a label set that grew past this is folded into "other": cardinality stays bounded


def _fmt(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if v == int(v) and abs(v) < 1e15:
        return str(int(v))
    return repr(float(v))


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    parts = [f'{n}="{_esc(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


class Counter:
    def __init__(self, name: str, help_: str, labels: tuple[str, ...] = (), initial: Iterable[tuple[str, ...]] = ()):
        assert name.endswith("_total")
        self.name, self.help, self.labelnames = name, help_, labels
        self.values: dict[tuple[str, ...], float] = {tuple(v): 0.0 for v in initial}
        if not labels:
            self.values[()] = 0.0

    def inc(self, *values: str, by: float = 1.0) -> None:
        key = tuple(values)
        if key not in self.values and len(self.values) >= _MAX_LABEL_VALUES:
            key = tuple("other" for _ in values)
        self.values[key] = self.values.get(key, 0.0) + by

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} counter"
        for k, v in sorted(self.values.items()):
            yield f"{self.name}{_labels(self.labelnames, k)} {_fmt(v)}"


class Histogram:
    def __init__(self, name: str, help_: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help_, buckets
        self.counts = [0] * len(buckets)
        self.count = 0
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.count += 1
        self.sum += v
        for i, le in enumerate(self.buckets):
            if v <= le:
                self.counts[i] += 1

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} histogram"
        for le, c in zip(self.buckets, self.counts, strict=True):
            yield f'{self.name}_bucket{{le="{_fmt(le)}"}} {c}'
        yield f'{self.name}_bucket{{le="+Inf"}} {self.count}'
        yield f"{self.name}_sum {_fmt(self.sum)}"
        yield f"{self.name}_count {self.count}"


def token_expiry(path: Path | None) -> float | None:
    """The ``exp`` of a JWT bearer token file (not verified: the API server does that), None if unknown."""
    if path is None:
        return None
    try:
        raw = path.read_bytes()[:16384].strip()
        payload = raw.split(b".")[1]
        doc = json.loads(base64.urlsafe_b64decode(payload + b"=" * (-len(payload) % 4)))
        exp = doc.get("exp")
        return float(exp) if isinstance(exp, int | float) and not isinstance(exp, bool) else None
    except (OSError, IndexError, ValueError, AttributeError):
        return None


class AgentMetrics:
    """Counters and histograms fed by the agent; gauges read from it at scrape time (``gauges``)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.notices = Counter(
            "sco_agent_notices_total",
            "Reclaim notices received, by channel (nats, metadata, spool) and verdict (accepted, duplicate, "
            "absorbed, deadline, refused).",
            ("channel", "verdict"),
        )
        self.refusals = Counter(
            "sco_agent_notice_refusals_total", "Notices refused, by the kind of refusal.", ("kind",)
        )
        self.drains = Counter(
            "sco_agent_drains_total",
            "Drains finished, by outcome (drained, overrun, error).",
            ("outcome",),
            initial=[("drained",), ("overrun",), ("error",)],
        )
        self.drain_duration = Histogram(
            "sco_agent_drain_duration_seconds", "Notice to drain outcome, in seconds.", DURATION_BUCKETS
        )
        self.drain_left = Histogram(
            "sco_agent_drain_seconds_left",
            "Seconds left before the notice's terminate time at the drain's outcome (negative: past it).",
            LEFT_BUCKETS,
        )
        self.evictions = Counter(
            "sco_agent_evictions_total",
            "Eviction API responses, by HTTP status code (error: no answer within the deadline).",
            ("code",),
        )
        self.forced = Counter("sco_agent_forced_deletes_total", "Pods deleted after their drain budget was spent.")
        self.fallbacks = Counter(
            "sco_agent_fallback_engagements_total",
            "Drains that went around a silent scheduler API (logind inhibitor and kubelet graceful shutdown).",
        )
        self.checkpoint_refusals = Counter(
            "sco_agent_checkpoint_refusals_total",
            "Checkpoint socket registrations refused, by reason (not_a_workload: the caller is in no pod or job "
            "of this node; wrong_contract: it named a contract not its pod's or job's; unverified: the scheduler "
            "could not be asked; uid_cap, owner_cap: its uid, or its pod or job, holds checkpoint_max_per_uid already; "
            "full: 1,024 registered).",
            ("reason",),
            initial=[
                ("not_a_workload",),
                ("wrong_contract",),
                ("unverified",),
                ("uid_cap",),
                ("owner_cap",),
                ("full",),
            ],
        )
        self.gauges: Callable[[], list[tuple[str, str, float | None]]] = list

    def checkpoint_refused(self, reason: str) -> None:
        self.checkpoint_refusals.inc(reason)

    def notice(self, channel: str, verdict: str) -> None:
        self.notices.inc(channel if channel in CHANNELS else "other", verdict)

    def eviction(self, code: int | str) -> None:
        self.evictions.inc(str(code))

    def observe(self, event: dict[str, Any]) -> None:
        """Called by the spool for every record it takes."""
        t = event.get("type")
        if t in OUTCOMES:
            self.drains.inc(OUTCOMES[str(t)])
            for h, key in ((self.drain_duration, "elapsed_s"), (self.drain_left, "deadline_in_s")):
                v = event.get(key)
                if isinstance(v, int | float) and not isinstance(v, bool):
                    h.observe(float(v))
        elif t == "eviction.forced":
            self.forced.inc()
        elif t == "drain.fallback":
            self.fallbacks.inc()

    def render(self) -> bytes:
        lines: list[str] = []
        for m in (
            self.notices,
            self.refusals,
            self.drains,
            self.drain_duration,
            self.drain_left,
            self.evictions,
            self.forced,
            self.fallbacks,
            self.checkpoint_refusals,
        ):
            lines += m.render()
        for name, help_, value in self.gauges():
            if value is None:
                continue  # unknown: absent, so alerts on it do not fire on a made-up value
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name} {_fmt(value)}"]
        return ("\n".join(lines) + "\n").encode()


CURRENT: AgentMetrics | None = None  # the running agent's metrics (one agent a process)


def count_eviction(code: int | str) -> None:
    """Hook for the eviction call site (kube.drain): no metrics object to thread through the drain path."""
    if CURRENT is not None:
        CURRENT.eviction(code)


def parse_listen(value: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port``; ValueError naming what is wrong."""
    host, sep, port = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected host:port, got {value!r}")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"port must be 1 to 65535, got {port!r}")
    return host, int(port)


class MetricsServer:
    """GET /metrics over HTTP/1.0 (one request a connection); everything else 404/405.

    Idle clients cannot starve a scrape: every connection is accepted and served on its own task (no fixed pool a
    sleeper holds); its request must arrive within HEADER_TIMEOUT_S (a scraper sends it within milliseconds);
    and with MAX_CONNECTIONS open, a new connection takes the place of the one that has waited longest for its
    request (never one being answered). No cap by address: on loopback the scraper and a local sleeper share
    one, and a cap there would refuse the scraper."""

    MAX_CONNECTIONS = 64
    HEADER_TIMEOUT_S = 2.0
    WRITE_TIMEOUT_S = 5.0

    def __init__(self, metrics: AgentMetrics, listen: str, tls_cert_file: str = "", tls_key_file: str = "") -> None:
        """``tls_cert_file``/``tls_key_file``: TLS only (sco._tls.ServerTls: the pair read again when it changes);
        the handshake is part of the request's HEADER_TIMEOUT_S, and a plaintext request gets no answer."""
        self.metrics = metrics
        self.host, self.port = parse_listen(listen)
        self.tls: ServerTls | None = None
        if tls_cert_file or tls_key_file:
            self.tls = ServerTls(tls_cert_file, tls_key_file)
        self.server: asyncio.Server | None = None
        self._waiting: dict[asyncio.StreamWriter, float] = {}  # connections not yet sent their request -> since
        self._open = 0
        self.refused = 0  # every slot answering: closed at once
        self.shed = 0  # closed to make room for a new connection
        self.timed_out = 0  # no request within header_timeout

    async def start(self) -> None:
        self.server = await asyncio.start_server(
            self._handle,
            self.host,
            self.port,
            limit=8192,
            ssl=self.tls.context if self.tls else None,
            ssl_handshake_timeout=self.HEADER_TIMEOUT_S if self.tls else None,
        )
        self.port = self.server.sockets[0].getsockname()[1]

    def _admit(self) -> bool:
        if self._open >= self.MAX_CONNECTIONS:
            if not self._waiting:
                self.refused += 1
                return False  # every slot writes an answer: a few milliseconds each, and this one is refused
            oldest = min(self._waiting, key=self._waiting.__getitem__)
            del self._waiting[oldest]
            self.shed += 1
            oldest.transport.abort()  # its read returns at once; its handler gives the slot back
        return True

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.tls is not None:
            self.tls.refresh()  # a renewed pair for the handshakes after this one (this one is done)
        if not self._admit():
            writer.transport.abort()
            return
        self._open += 1
        self._waiting[writer] = asyncio.get_running_loop().time()
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.HEADER_TIMEOUT_S)
            except TimeoutError:
                self.timed_out += 1
                return
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                return
            finally:
                self._waiting.pop(writer, None)
            method, _, rest = head.decode("latin-1").partition(" ")
            path = rest.split(" ", 1)[0].split("?", 1)[0]
            if method not in ("GET", "HEAD"):
                status, body, ctype = "405 Method Not Allowed", b"GET only\n", "text/plain"
            elif path != "/metrics":
                status, body, ctype = "404 Not Found", b"see /metrics\n", "text/plain"
            else:
                status, ctype = "200 OK", CONTENT_TYPE
                try:
                    body = self.metrics.render()
                except Exception:  # a metric's callback failing must not take the endpoint (or agent) down
                    log.exception("rendering metrics")
                    status, body, ctype = "500 Internal Server Error", b"metrics failed\n", "text/plain"
            writer.write(
                f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n".encode()
            )
            if method != "HEAD":
                writer.write(body)
            with contextlib.suppress(TimeoutError, ConnectionError):
                await asyncio.wait_for(writer.drain(), self.WRITE_TIMEOUT_S)
        finally:
            self._open -= 1
            writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            for w in list(self._waiting):
                w.transport.abort()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.server.wait_closed(), 2)


__all__ = [
    "CURRENT",
    "AgentMetrics",
    "Counter",
    "Histogram",
    "MetricsServer",
    "count_eviction",
    "parse_listen",
    "token_expiry",
]
