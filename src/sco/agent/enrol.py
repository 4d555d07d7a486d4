"""Enrolment at first boot: the one-time token in agent.env exchanged for this node's relay identity and its
Kubernetes token (the control host's ``sco.control.enrolment``; wire format ``sco.contract.enrolment``).

The node names itself by its instance id from the metadata service (the same URL the notice poll reads; OpenStack's
``meta_data.json`` has ``uuid``), makes a user nkey here (the seed never leaves the node: only its public key is
sent) and writes what it is given: the creds file (JWT + its own seed, 0600) and the token file (0600). Every call
has a deadline; failures are retried with capped backoff and jitter for as long as the agent runs; a refusal (4xx)
is said in one line and ends the attempt: the token will not work again, a person must act. Meanwhile the agent
keeps the metadata channel and drains: enrolment never stands in front of a drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sco._fs import atomic_write
from sco._http import AsyncHttpClient, HttpError
from sco._retry import Backoff
from sco._tls import client_context
from sco.agent.spool import CRITICAL, ROUTINE, Spool
from sco.contract.enrolment import PATH, RETRY, creds_text

log = logging.getLogger("sco.agent.enrol")

CALL_DEADLINE_S = 10.0
RETRY_S = (1.0, 60.0)


WAIT_WARN_S = 300.0
"""A first boot waits for its Node to be registered (the service answers 503 "try again" until kubelet has done
it, typically well under a minute): said once at info; a warning once the wait is longer than this."""


class EnrolRefused(Exception):
    """The service refused this node (4xx): retrying cannot help."""


class EnrolWait(HttpError):
    """The service asked this node to try again later (503, 429): a normal wait at first boot."""


@dataclass
class Enrolment:
    """One node's enrolment (one asyncio task, :meth:`run`)."""

    hall: str
    node: str
    url: str
    token: str
    metadata_url: str
    creds_file: Path
    kube_token_file: Path | None
    spool: Spool
    on_done: Callable[[], None] = lambda: None
    ca_file: str = ""
    """The CA an https service's certificate must chain to (agent.enrol_ca_file); "": the system's."""
    metrics_listen: str = ""
    """The agent's metrics address (agent.metrics_listen): told to the service for Prometheus's discovery unless it
    is a loopback address (nothing else could scrape it); a wildcard is told as the address this node reaches
    the service from."""
    deadline_s: float = CALL_DEADLINE_S
    outcome: str = "pending"
    """pending, enrolled, refused (with ``problem``)"""
    problem: str | None = None

    async def _get(self, url: str) -> bytes:
        u = urllib.parse.urlsplit(url)
        client = AsyncHttpClient(f"{u.scheme}://{u.netloc}", timeout=self.deadline_s, max_connections=1)
        try:
            r = await client.request("GET", u.path + (f"?{u.query}" if u.query else ""))
        finally:
            await client.close()
        if r.status != 200:
            raise HttpError(f"{url}: HTTP {r.status}")
        return bytes(r.body)

    async def instance_id(self) -> str:
        try:
            doc = json.loads(await self._get(self.metadata_url))
        except ValueError as e:
            raise HttpError(f"{self.metadata_url}: not JSON ({e})") from None
        uuid = doc.get("uuid") if isinstance(doc, dict) else None
        if not isinstance(uuid, str) or not uuid:
            raise HttpError(f"{self.metadata_url}: no uuid")
        return uuid

    async def metrics_address(self) -> str | None:
        """Where Prometheus can scrape this agent (see ``metrics_listen``), or None."""
        import ipaddress
        import socket

        host, _, port = self.metrics_listen.rpartition(":")
        host = host.strip("[]")
        if not port.isdigit() or host in ("", "localhost"):
            return None
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return None
        if ip.is_loopback:
            return None
        if ip.is_unspecified:  # listening everywhere: the address this node reaches the service from (no packet sent)
            u = urllib.parse.urlsplit(self.url)

            def local() -> str:
                family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
                infos = socket.getaddrinfo(u.hostname, u.port or 80, family, socket.SOCK_DGRAM)
                with socket.socket(family, socket.SOCK_DGRAM) as s:
                    s.connect(infos[0][4])
                    return str(s.getsockname()[0])

            try:
                ip = ipaddress.ip_address(await asyncio.wait_for(asyncio.to_thread(local), self.deadline_s))
            except (OSError, ValueError, TimeoutError):
                return None
        return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"

    async def exchange(self, server_id: str, public: str) -> dict[str, Any]:
        # the answer carries the node's Kubernetes token: over https, checked against the hall's CA
        tls = client_context(self.ca_file) if self.url.startswith("https:") else None
        client = AsyncHttpClient(self.url, timeout=self.deadline_s, max_connections=1, ssl_context=tls)
        body = {"hall": self.hall, "node": self.node, "instance_id": server_id, "token": self.token}
        metrics = await self.metrics_address()
        if metrics:
            body["metrics"] = metrics
        try:
            r = await client.request("POST", PATH, {**body, "nkey_public": public})
        finally:
            await client.close()
        text = bytes(r.body).decode("utf-8", "replace").strip().splitlines()
        line = text[0][:300] if text else f"HTTP {r.status}"
        if r.status == 200:
            doc = json.loads(r.body)
            if not isinstance(doc, dict) or not isinstance(doc.get("nats_user_jwt"), str):
                raise HttpError("the enrolment service answered 200 without nats_user_jwt")
            return doc
        if r.status in (RETRY, 429):
            raise EnrolWait(f"HTTP {r.status}: {line}")
        if r.status >= 500:
            raise HttpError(f"HTTP {r.status}: {line}")
        raise EnrolRefused(f"HTTP {r.status}: {line}")

    def _write(self, doc: dict[str, Any], seed: bytes) -> None:
        kube = doc.get("kube_token")
        if self.kube_token_file is not None and isinstance(kube, str) and kube:
            self.kube_token_file.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.kube_token_file, kube.encode() + b"\n", mode=0o600)
            os.chmod(self.kube_token_file, 0o600)
        self.creds_file.parent.mkdir(parents=True, exist_ok=True)
        # the creds file last: its existence says "enrolled" to the next start
        atomic_write(self.creds_file, creds_text(str(doc["nats_user_jwt"]), seed).encode(), mode=0o600)
        os.chmod(self.creds_file, 0o600)

    async def run(self, stop: asyncio.Event) -> None:
        import nkeys  # type: ignore[import-untyped]  # no stubs, no py.typed

        seed = bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
        kp = nkeys.from_seed(bytearray(seed))
        public = bytes(kp.public_key).decode()
        kp.wipe()
        backoff = Backoff(*RETRY_S)
        said = ""
        loop = asyncio.get_running_loop()
        started, warned = loop.time(), False
        while not stop.is_set():
            try:
                server_id = await self.instance_id()
                doc = await self.exchange(server_id, public)
                self._write(doc, seed)
            except EnrolRefused as e:
                self.outcome, self.problem = "refused", str(e)
                log.error("enrolment refused by %s: %s", self.url, e)
                self.spool.append("enrol.refused", CRITICAL, url=self.url, reason=str(e)[:300])
                return
            except EnrolWait as e:
                # the service's "try again" (its Node not registered yet, the relay away a moment): a normal wait
                self.problem = str(e)
                waited = loop.time() - started
                if str(e) != said:
                    said = str(e)
                    log.info("enrolment at %s: waiting (trying again): %s", self.url, e)
                if waited > WAIT_WARN_S and not warned:
                    warned = True
                    log.warning("enrolment at %s: still waiting after %.0f s: %s", self.url, waited, e)
            except (HttpError, OSError, ValueError, TimeoutError) as e:
                why = f"{type(e).__name__}: {e}".strip()
                self.problem = why
                if why != said:  # one line per kind of failure, not one per retry
                    said = why
                    log.warning("enrolment at %s not done yet (trying again): %s", self.url, why)
            else:
                self.outcome, self.problem = "enrolled", None
                log.info("enrolled: relay account %s; creds in %s", doc.get("nats_account"), self.creds_file)
                self.spool.append(
                    "enrol.done", ROUTINE, account=doc.get("nats_account"), kube_token=bool(doc.get("kube_token"))
                )
                self.on_done()
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), backoff.next())
