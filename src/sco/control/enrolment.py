"""The enrolment service (issue 28): a launched instance exchanges its one-time token for its own relay identity and
its Kubernetes credential, once; the identities of deleted instances are taken back.

``POST /v1/enrol`` (wire format ``sco.contract.enrolment``). In one fleet-state transaction with the rows locked
(``sco.state.enrolment.claim``): the hall holds an instance with that server id, named as the node says, the token's
hash matches, the instance is live (launching or active) and the token unused. Then, before the transaction
commits: with Kubernetes configured, a TokenRequest for the agent's service account bound to the node's Node (a
Node not registered yet answers 503: the node tries again, the token is not used); the node's relay identity
minted from its public key and pushed to the running relay (``sco.provider.relay_identity``); the token marked used
with what was issued. A failure anywhere leaves the token unused and nothing recorded; a concurrent duplicate waits
on the lock and then finds the token used: nothing is minted twice for one instance.

Every refusal answers one line (4xx, or 503 for "try again") and is counted by reason in
``sco_enrol_refused_total``; issues in ``sco_enrol_issued_total``, revocations in ``sco_enrol_revoked_total``
(``/metrics``; labels are reasons, never nodes). The listener is ``sco._http_server``'s (connection slots, a
per-address limit sized for a hall's burst of launches behind one SNAT address, the request's headers and body within
one deadline, bodies of at most 4 KiB), and each source address has a token bucket (a flood is answered 429 without
touching the database).

``/metrics`` is served on the enrolment listener unless the service is given a listener of its own for it
(:class:`MetricsServer`, ``sco enrol serve --metrics-listen``), which speaks TLS only when given a certificate and key
(``sco._tls.ServerTls``: a plaintext request gets no answer, a renewed pair is served from the next connection); the
enrolment listener then answers ``/metrics`` 404. The enrolment listener speaks TLS only when given a pair of its own
(``sco enrol serve --tls-cert-file``): its answer carries the new node's Kubernetes token, and the agent checks the
certificate against the hall's CA, which the acquirer writes into the instance's user-data with the token.

Revocation (:func:`revoke_deleted`): every enrolment whose instance is deleted, lost or failed and not yet revoked
is revoked on the relay (a newer account JWT revoking every user, read back), then marked revoked; with Kubernetes,
the Node its token was bound to is deleted (only that object, by its uid, and only while no live instance holds the
name), which ends the token. Idempotent and convergent: the service sweeps every few seconds, ``sco enrol revoke``
runs one sweep.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from sco._http_server import BoundedHandler, BoundedHTTPServer
from sco._tls import ServerTls
from sco.contract import enrolment as wire
from sco.provider import relay_identity as ri
from sco.state import enrolment as rows
from sco.state.enrolment import Refused

log = logging.getLogger("sco.control.enrolment")

T = TypeVar("T")

REASONS = (
    "malformed", "too_large", "rate_limited", "unknown_instance", "wrong_hall", "wrong_node", "no_token",
    "wrong_token", "not_live", "replay", "not_ready", "unavailable",
)  # fmt: skip
_STATUS = {
    "malformed": 400, "too_large": 413, "rate_limited": 429, "unknown_instance": 404, "wrong_hall": 404,
    "wrong_node": 403, "no_token": 403, "wrong_token": 403, "not_live": 410, "replay": 409, "not_ready": 503,
    "unavailable": 503,
}  # fmt: skip


@dataclass(frozen=True)
class KubeSettings:
    url: str
    token_file: str
    ca_file: str = ""
    namespace: str = "sco-system"
    service_account: str = "sco-agent"
    token_seconds: int = 86400
    """The first token's lifetime; the agent renews it at 80% (sco.agent.kube.credential)."""


@dataclass(frozen=True)
class Settings:
    hall: str
    dsn: str
    relay_keys: Path
    nats_url: str
    kube: KubeSettings | None = None
    rate_per_s: float = wire.RATE_PER_S
    """Requests a second one source address may make (a token bucket of ``burst``)."""
    burst: int = wire.BURST
    max_sources: int = 10_000
    """Source addresses the rate limit remembers (the least recently seen forgotten first)."""
    db_connections: int = 8
    call_timeout_s: float = 10.0
    """One relay push, one Kubernetes call."""
    revoke_every_s: float = 5.0
    nats_ca_file: str = ""
    """The hall's CA the relay's TLS certificate must chain to (the relay admin's connection)."""
    scrape_targets_file: Path | None = None
    """Prometheus file_sd: the live enrolled instances' agent metrics addresses, rewritten (atomically, when they
    change) after each enrolment and each sweep."""


class RateLimit:
    """A token bucket per source address, at most ``max_sources`` remembered."""

    def __init__(self, rate: float, burst: int, max_sources: int, clock: Callable[[], float] = time.monotonic):
        self.rate, self.burst, self.max_sources, self.clock = rate, float(burst), max_sources, clock
        self._buckets: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def allow(self, source: str) -> bool:
        now = self.clock()
        with self._lock:
            tokens, at = self._buckets.pop(source, (self.burst, now))
            tokens = min(self.burst, tokens + (now - at) * self.rate)
            ok = tokens >= 1.0
            self._buckets[source] = (tokens - 1.0 if ok else tokens, now)
            while len(self._buckets) > self.max_sources:
                self._buckets.popitem(last=False)
        return ok


class _Connections:
    """Fleet-state connections for the handler threads: at most ``n``, a broken one replaced."""

    def __init__(self, dsn: str, n: int) -> None:
        self.dsn = dsn
        self._free: queue.LifoQueue[Any] = queue.LifoQueue()
        self._made = 0
        self._n = n
        self._lock = threading.Lock()

    def _new(self) -> Any:
        from sco.state.db import connect, require_schema

        conn = connect(self.dsn)
        require_schema(conn)
        # a duplicate waits on the first one's lock at most this long; nothing holds a transaction longer
        conn.execute(
            "SELECT set_config('lock_timeout', '30s', false), set_config('statement_timeout', '30s', false),"
            " set_config('idle_in_transaction_session_timeout', '60s', false),"
            " set_config('application_name', 'sco enrol', false)"
        )
        return conn

    @contextlib.contextmanager
    def get(self, wait_s: float = 10.0) -> Iterator[Any]:
        conn = None
        with self._lock:
            if self._free.empty() and self._made < self._n:
                self._made += 1
                make = True
            else:
                make = False
        if make:
            try:
                conn = self._new()
            except BaseException:
                with self._lock:
                    self._made -= 1
                raise
        else:
            try:
                conn = self._free.get(timeout=wait_s)
            except queue.Empty:
                raise Refused("unavailable", "the fleet state is busy: try again", 503) from None
        try:
            yield conn
        finally:
            if conn.closed or conn.broken:
                conn.close()
                with self._lock:
                    self._made -= 1
            else:
                self._free.put(conn)

    def close(self) -> None:
        while not self._free.empty():
            self._free.get_nowait().close()


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.refused: dict[str, int] = dict.fromkeys(REASONS, 0)
        self.issued = 0
        self.revoked = 0
        self.nodes_deleted = 0
        self.revoke_failures = 0

    def refuse(self, reason: str) -> None:
        with self._lock:
            self.refused[reason] = self.refused.get(reason, 0) + 1

    def add(self, what: str, n: int = 1) -> None:
        with self._lock:
            setattr(self, what, getattr(self, what) + n)

    def text(self, refused_connections: int, metrics_tls_failures: int | None = None) -> bytes:
        """The exposition; ``metrics_tls_failures``: the TLS /metrics listener's failed handshakes (None: no such
        listener, the series left out)."""
        with self._lock:
            refused = sorted(self.refused.items())
            issued, revoked, failures = self.issued, self.revoked, self.revoke_failures
            nodes_deleted = self.nodes_deleted
        lines = [
            "# HELP sco_enrol_issued_total Enrolments honoured: a relay identity (and a Kubernetes token) issued.",
            "# TYPE sco_enrol_issued_total counter",
            f"sco_enrol_issued_total {issued}",
            "# HELP sco_enrol_refused_total Enrolment requests refused, by reason.",
            "# TYPE sco_enrol_refused_total counter",
            *(f'sco_enrol_refused_total{{reason="{r}"}} {n}' for r, n in refused),
            "# HELP sco_enrol_revoked_total Identities of deleted instances taken back on the relay.",
            "# TYPE sco_enrol_revoked_total counter",
            f"sco_enrol_revoked_total {revoked}",
            "# HELP sco_enrol_nodes_deleted_total Node objects of deleted instances removed (their bound tokens end).",
            "# TYPE sco_enrol_nodes_deleted_total counter",
            f"sco_enrol_nodes_deleted_total {nodes_deleted}",
            "# HELP sco_enrol_revoke_failures_total Revocation sweeps that failed (tried again at the next sweep).",
            "# TYPE sco_enrol_revoke_failures_total counter",
            f"sco_enrol_revoke_failures_total {failures}",
            "# HELP sco_enrol_refused_connections_total Connections closed at once (connection limits).",
            "# TYPE sco_enrol_refused_connections_total counter",
            f"sco_enrol_refused_connections_total {refused_connections}",
        ]
        if metrics_tls_failures is not None:
            lines += [
                "# HELP sco_enrol_metrics_tls_handshake_failures_total TLS handshakes failed on the /metrics listener"
                " (plaintext scrapers, other CAs' clients, handshakes cut at the deadline).",
                "# TYPE sco_enrol_metrics_tls_handshake_failures_total counter",
                f"sco_enrol_metrics_tls_handshake_failures_total {metrics_tls_failures}",
            ]
        return ("\n".join(lines) + "\n").encode()


@dataclass
class Sweep:
    """One revocation sweep: the nodes whose relay identity was revoked, those whose Node was deleted, and what
    could not be done (tried again at the next sweep)."""

    revoked: list[str]
    nodes_deleted: list[str]
    problems: list[str]


async def revoke_deleted(conn: Any, admin: ri.RelayAdmin, keys: ri.HallKeys, kube: Any = None) -> Sweep:
    """Take back the identities of every enrolled instance that is deleted, lost or failed. Per instance: the relay
    account revoked (a newer account JWT, read back), then, with ``kube`` (a KubeClient), the Node its Kubernetes
    token was bound to deleted, so that token stops working (a hall with no cloud controller manager keeps a gone
    instance's Node, and so its token, for ever). Idempotent: each part is marked done once it is, so a sweep that
    fails part-way (or a crash right after the instance's delete) is finished by the next; a Node that cannot be
    deleted now does not hold back the others."""
    out = Sweep([], [], [])
    for item in await asyncio.to_thread(rows.to_revoke, conn, keys.hall):
        if not item.relay_done:
            identity = ri.NodeIdentity(item.node, item.account, "", item.issued_at, "", "")
            await ri.revoke(admin, keys, identity)
            await asyncio.to_thread(rows.revoked, conn, item)
            log.info("node %s: relay identity revoked (instance %d gone)", item.node, item.instance_id)
            out.revoked.append(item.node)
        if item.node_uid is not None and kube is not None:
            try:
                outcome = await remove_node(conn, kube, item)
            except Exception as e:  # the API away or refusing: this Node waits for the next sweep
                out.problems.append(f"node {item.node}: its Node not deleted yet: {e}")
                continue
            await asyncio.to_thread(rows.node_settled, conn, item, outcome)
            if outcome == "deleted":
                out.nodes_deleted.append(item.node)
    return out


class RevokeIncomplete(Exception):
    """Some Nodes of gone instances could not be deleted this sweep (every relay identity due was revoked)."""


async def remove_node(conn: Any, kube: Any, item: rows.Issued) -> str:
    """Delete the Node object a gone instance's token is bound to, only if it is still that instance's: the one
    with the uid recorded at enrolment (a precondition of the DELETE itself, so a Node registered again under the
    name in between is never the one deleted), whose providerID, when set, names the instance's server, and whose
    name no live instance of the hall holds now (a slot launched again: its kubelet may have taken the object
    over). Returns the outcome recorded: deleted, gone (already) or replaced (left alone)."""
    from sco.schedulers.kube import KubeError

    assert item.node_uid is not None
    if await asyncio.to_thread(rows.name_in_use, conn, item):
        log.info("node %s: its name is a live instance's now: its Node is left alone", item.node)
        return "replaced"
    try:
        found = await kube.get_node(item.node)
    except KubeError as e:
        if e.status == 404:
            return "gone"
        raise
    meta, provider = found.get("metadata") or {}, str((found.get("spec") or {}).get("providerID") or "")
    if meta.get("uid") != item.node_uid or (provider and item.server_id and not provider.endswith(item.server_id)):
        log.info("node %s: registered again by another (uid %s, providerID %r): left alone", item.node,
                 meta.get("uid"), provider)  # fmt: skip
        return "replaced"
    status = await kube.delete_node(item.node, item.node_uid)
    if status == 409:
        log.info("node %s: registered again by another meanwhile: left alone", item.node)
        return "replaced"
    if status == 404:
        return "gone"
    log.info("node %s: Node %s deleted (instance %d gone): its bound token ends", item.node, item.node_uid,
             item.instance_id)  # fmt: skip
    return "deleted"


class Issuer:
    """The service's work, without HTTP: checks, mints, records; revokes. Its relay and Kubernetes calls run on one
    asyncio loop in a thread of its own, each under ``call_timeout_s``."""

    def __init__(self, s: Settings) -> None:
        self.s = s
        self.keys = ri.HallKeys.load(s.relay_keys, s.hall)
        self.metrics = Metrics()
        self.limit = RateLimit(s.rate_per_s, s.burst, s.max_sources)
        self.db = _Connections(s.dsn, s.db_connections)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="enrol-io", daemon=True)
        self._thread.start()
        self._admin: ri.RelayAdmin | None = None
        self._admin_lock: asyncio.Lock | None = None
        self.kube: Any = None
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None
        self._targets_lock = threading.Lock()
        self._targets_written: bytes | None = None
        try:
            self._run(self._start(), s.call_timeout_s * 3)
        except TimeoutError:
            self.close()
            raise ri.RelayIdentityError(
                f"relay {s.nats_url}: no connection as the issuer within {s.call_timeout_s * 3:.0f} s"
            ) from None
        except BaseException:
            self.close()
            raise

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout or self.s.call_timeout_s * 2)
        except TimeoutError:
            fut.cancel()
            raise

    async def _start(self) -> None:
        self._admin_lock = asyncio.Lock()
        await self.admin()
        if self.s.kube is not None:
            from sco.schedulers.kube import Credentials, KubeClient

            k = self.s.kube
            creds = Credentials(k.url, token_file=Path(k.token_file), ca_file=k.ca_file or None)
            self.kube = KubeClient(creds, timeout=self.s.call_timeout_s)

    async def admin(self) -> ri.RelayAdmin:
        assert self._admin_lock is not None
        async with self._admin_lock:
            if self._admin is None or not self._admin.nc.is_connected:
                if self._admin is not None:
                    with contextlib.suppress(Exception):
                        await self._admin.close()
                urls = [u.strip() for u in self.s.nats_url.split(",") if u.strip()]
                self._admin = await ri.RelayAdmin.connect(
                    urls, self.keys, timeout=self.s.call_timeout_s, tls_ca_file=self.s.nats_ca_file or None
                )
            return self._admin

    # --- enrolment --------------------------------------------------------------------------------------

    def enrol(self, body: bytes, source: str) -> dict[str, Any]:
        """One request's answer (200, counted), or :class:`Refused` (counted by whoever answers it)."""
        out = self._enrol(body, source)
        self.metrics.add("issued")
        return out

    def _enrol(self, body: bytes, source: str) -> dict[str, Any]:
        try:
            req = wire.parse_request(json.loads(body))
        except (ValueError, wire.Malformed) as e:
            raise Refused("malformed", f"malformed request: {e}", 400) from None
        if req["hall"] != self.s.hall:
            raise Refused("wrong_hall", f"hall {req['hall']}: this service enrols hall {self.s.hall}", 404)
        node = req["node"]
        with (
            self.db.get() as conn,
            rows.claim(conn, hall=req["hall"], node=node, server_id=req["instance_id"], token=req["token"]) as held,
        ):
            kube_token, kube_expires, node_uid = self._kube_token(node) if self.kube is not None else (None, None, None)
            try:
                identity = self._run(self._issue(node, req["nkey_public"]))
            except (ri.RelayIdentityError, TimeoutError) as e:
                raise Refused("unavailable", f"the relay did not take the identity: {e}; try again", 503) from None
            held.record(
                source=source, nkey_public=req["nkey_public"], account=identity.account,
                issued_at=identity.issued_at, kube_expires=kube_expires, node_uid=node_uid,
                metrics_target=req.get("metrics"),
            )  # fmt: skip
        log.info("node %s enrolled from %s: relay account %s", node, source, identity.account)
        if self.s.scrape_targets_file is not None and req.get("metrics"):
            try:
                self.write_targets()
            except Exception as e:  # the next sweep writes it; the node's enrolment stands
                log.warning("%s: %s", self.s.scrape_targets_file, e)
        return {
            "nats_user_jwt": identity.user_jwt,
            "nats_account": identity.account,
            "kube_token": kube_token,
            "kube_expires": kube_expires,
        }

    async def _issue(self, node: str, public: str) -> ri.NodeIdentity:
        return await ri.issue(await self.admin(), self.keys, node, public)

    def _kube_token(self, node: str) -> tuple[str, float, str]:
        """The node's first token, bound to its Node; (token, expiry, the Node's uid)."""
        from sco.schedulers.kube import KubeError, KubeUnreachable

        k = self.s.kube
        assert k is not None

        async def get() -> tuple[str, float, str]:
            try:
                found = await self.kube.get_node(node)
            except KubeError as e:
                if e.status == 404:  # kubelet has not registered it yet: the node asks again, its token unused
                    raise Refused(
                        "not_ready", f"node {node} is not registered in Kubernetes yet; try again", 503
                    ) from None
                raise
            uid = str(found["metadata"]["uid"])
            token, expires = await self.kube.request_token(
                k.namespace, k.service_account, seconds=k.token_seconds, bound_node=(node, uid)
            )
            return str(token), float(expires), uid

        try:
            return self._run(get())
        except KubeError as e:
            raise Refused("unavailable", f"Kubernetes refused the token request: {e}; try again", 503) from None
        except (KubeUnreachable, TimeoutError) as e:
            raise Refused("unavailable", f"Kubernetes did not answer: {e}; try again", 503) from None

    # --- revocation ---------------------------------------------------------------------------------------

    def revoke_deleted(self) -> list[str]:
        with self.db.get() as conn:

            async def sweep() -> Sweep:
                return await revoke_deleted(conn, await self.admin(), self.keys, self.kube)

            done = self._run(sweep(), self.s.call_timeout_s * 10)
        self.metrics.add("revoked", len(done.revoked))
        self.metrics.add("nodes_deleted", len(done.nodes_deleted))
        if done.problems:
            more = f" (and {len(done.problems) - 3} more)" if done.problems[3:] else ""
            raise RevokeIncomplete("; ".join(done.problems[:3]) + more)
        return done.revoked

    def write_targets(self) -> bool:
        """Prometheus's file_sd for the hall's launched agents (job sco-agent: role monitoring reads this file):
        one target group per live enrolled instance that told its metrics address, labelled with its node, pool and
        hall. Written atomically (0644: addresses, no secret) when it changed; returns whether it did."""
        path = self.s.scrape_targets_file
        if path is None:
            return False
        from sco._fs import atomic_write

        with self.db.get() as conn:
            found = rows.scrape_targets(conn, self.s.hall)
        doc = [{"targets": [t], "labels": {"node": n, "pool": p, "hall": self.s.hall}} for n, p, t in found]
        data = (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()
        with self._targets_lock:
            if data == self._targets_written:
                return False
            atomic_write(path, data, mode=0o644, exact_mode=True)  # Prometheus reads it, whatever our umask
            self._targets_written = data
        return True

    def start_sweeper(self) -> None:
        def loop() -> None:
            said = ""
            while not self._stop.wait(self.s.revoke_every_s):
                try:
                    try:
                        self.write_targets()  # before the revocations: a gone instance's target leaves at once
                    finally:  # a target file that cannot be written never holds back a revocation
                        self.revoke_deleted()
                except Exception as e:  # the relay, the fleet state or the API away: the next sweep tries again
                    self.metrics.add("revoke_failures")
                    # said once while it stays the same (a sweep every few seconds), counted every time
                    (log.warning if str(e) != said else log.debug)("revocation sweep: %s", e)
                    said = str(e)
                else:
                    said = ""

        self._sweeper = threading.Thread(target=loop, name="enrol-revoke", daemon=True)
        self._sweeper.start()

    def close(self) -> None:
        self._stop.set()

        async def shut() -> None:
            if self._admin is not None:
                with contextlib.suppress(Exception):
                    await self._admin.close()
            if self.kube is not None:
                await self.kube.close()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shut(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.db.close()


class _Handler(BoundedHandler):
    server: EnrolmentServer

    def _answer(self, status: int, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        if status == 503:
            self.send_header("Retry-After", "5")
        self.end_and_write(body)

    def _refuse(self, e: Refused) -> None:
        self.close_connection = True
        self._answer(e.status or _STATUS.get(e.reason, 400), f"{e}\n".encode(), "text/plain; charset=utf-8")

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics" and self.server.metrics_server is None:
            text = self.server.issuer.metrics.text(self.server.refused_connections)
            self._answer(200, text, "text/plain; version=0.0.4; charset=utf-8")
        elif path == "/healthz":
            self._answer(200, b"ok\n", "text/plain")
        else:
            self._answer(404, b"not found\n", "text/plain")

    def do_POST(self) -> None:
        issuer = self.server.issuer
        if self.path.split("?", 1)[0] != wire.PATH:
            self.close_connection = True
            self._answer(404, b"not found\n", "text/plain")
            return
        source = str(self.client_address[0])
        try:
            if not issuer.limit.allow(source):
                raise Refused("rate_limited", f"too many requests from {source}: slow down", 429)
            length = self.headers.get("Content-Length", "")
            if not length.isdigit():
                raise Refused("malformed", "Content-Length required", 411)
            if int(length) > wire.MAX_BODY:
                raise Refused("too_large", f"body above {wire.MAX_BODY} bytes", 413)
            # the body within what is left of the request's deadline (headers and body in one)
            self.server.deadlines.arm(self.connection, self.request_started + self.server.header_timeout)
            try:
                body = self.rfile.read(int(length))
            finally:
                self.server.deadlines.disarm(self.connection)
            if len(body) != int(length):
                raise Refused("malformed", "body shorter than its Content-Length", 400)
            answer = issuer.enrol(body, source)
        except Refused as e:
            issuer.metrics.refuse(e.reason)
            log.info("enrolment refused (%s) from %s: %s", e.reason, source, e)
            self._refuse(e)
            return
        except Exception as e:  # the fleet state away, a bug: one line, no traceback to the node
            issuer.metrics.refuse("unavailable")
            log.exception("enrolment from %s failed", source)
            self._refuse(Refused("unavailable", f"enrolment failed: {type(e).__name__}; try again", 503))
            return
        self._answer(200, json.dumps(answer).encode(), "application/json")


MAX_CONNECTIONS = 256


class EnrolmentServer(BoundedHTTPServer):
    """The enrolment service's listener (sco._http_server's bounds). ``max_per_client``: connections open at once
    from one address, sized for instances booting together behind one SNAT address (``wire.MAX_PER_ADDRESS``)."""

    def __init__(
        self,
        issuer: Issuer,
        address: tuple[str, int] = ("127.0.0.1", 8471),
        *,
        verbose: bool = False,
        max_connections: int = MAX_CONNECTIONS,
        max_per_client: int = wire.MAX_PER_ADDRESS,
        header_timeout: float = 10.0,
        idle_timeout: float = 15.0,
        tls: ServerTls | None = None,
    ) -> None:
        self.issuer = issuer
        self.verbose = verbose
        self.metrics_server: MetricsServer | None = None  # set by MetricsServer: /metrics is served there only
        # tls: TLS only (the answer carries the node's Kubernetes token); the handshake counts in header_timeout
        super().__init__(
            address, _Handler, max_connections=max_connections, max_per_client=max_per_client,
            header_timeout=header_timeout, idle_timeout=idle_timeout, name="enrol-deadlines", tls=tls,
        )  # fmt: skip


class _MetricsHandler(BoundedHandler):
    server: MetricsServer

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        status, ctype = 200, "text/plain"
        if path == "/metrics":
            enrol = self.server.enrolment
            tls_failures = self.server.tls_handshake_failures if self.server.tls is not None else None
            body = enrol.issuer.metrics.text(enrol.refused_connections, tls_failures)
            ctype = "text/plain; version=0.0.4; charset=utf-8"
        elif path == "/healthz":
            body = b"ok\n"
        else:
            self.close_connection = True
            status, body = 404, b"not found\n"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_and_write(body)


class MetricsServer(BoundedHTTPServer):
    """The enrolment service's ``/metrics`` on a listener of its own (``tls``: TLS only), so that the counters are
    scraped over TLS while the enrolment listener stays plain HTTP; ``enrolment`` then answers ``/metrics`` 404. A
    scraper's few connections: a handful of slots, a short header deadline (the handshake counts in it)."""

    def __init__(
        self,
        enrolment: EnrolmentServer,
        address: tuple[str, int],
        *,
        tls: ServerTls | None = None,
        max_connections: int = 16,
        max_per_client: int = 4,
        header_timeout: float = 5.0,
        idle_timeout: float = 10.0,
    ) -> None:
        self.enrolment = enrolment
        self.verbose = enrolment.verbose
        super().__init__(
            address, _MetricsHandler, max_connections=max_connections, max_per_client=max_per_client,
            header_timeout=header_timeout, idle_timeout=idle_timeout, name="enrol-metrics-deadlines", tls=tls,
        )  # fmt: skip
        enrolment.metrics_server = self
