"""The node's Kubernetes credential renewed with no manual step: TokenRequest, bound to its own Node.

How host agents do it: kubelet renews its client certificate through a CertificateSigningRequest before it
expires, and renews every projected service-account token once 80% of its lifetime has passed, through the
TokenRequest API (``POST /api/v1/namespaces/NS/serviceaccounts/SA/token``). The agent does the latter for
itself: once 80% of its token's lifetime (``iat`` to ``exp`` in the JWT) has passed, it asks for a new token
for the same service account, with the same lifetime and audiences, bound (``boundObjectRef``) to its own
Node object by name and uid, writes it over the token file atomically (0600) and the client uses it on its
next request (it stats the file before each one). Never another node's credential: the node bound is always
``agent.node`` (the own-node policy refuses any other, kyverno/policies/agent-own-node.yaml), RBAC lets the
account create tokens for itself only (kyverno/rbac), and a token file whose claims name another node is
refused, not renewed. The first token is made by hand (kyverno/README.md); after that the agent keeps it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sco._fs import atomic_write
from sco._retry import jitter
from sco.agent.spool import CRITICAL, ROUTINE, Spool
from sco.schedulers.kube import KubeClient, KubeError, KubeUnreachable

log = logging.getLogger("sco.agent.kube.credential")

RENEW_AT = 0.8  # of the lifetime, as kubelet renews projected service-account tokens
MIN_SECONDS = 600  # the API server refuses expirationSeconds below 10 minutes
MAX_SECONDS = 1 << 32
RETRY_MIN_S = 5.0
RETRY_MAX_S = 60.0
WAIT_FOR_ENROLMENT_S = 1.0  # how often the token enrolment is writing is looked for at first boot
IDLE_CHECK_S = 30.0  # how often a token file that cannot be renewed (not a JWT) is looked at again


class NotRenewable(Exception):
    """The token file cannot be renewed by the agent (not a service-account JWT, another node's token)."""


def jwt_claims(token: str) -> dict[str, Any] | None:
    """The claims of a JWT, unverified (the API server verifies it); None if ``token`` is not one."""
    try:
        payload = token.strip().split(".")[1]
        doc = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (IndexError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


@dataclass(frozen=True)
class TokenInfo:
    namespace: str
    service_account: str
    issued_at: float
    expiry: float
    audiences: tuple[str, ...]
    bound_node: str | None

    @property
    def renew_at(self) -> float:
        return self.issued_at + RENEW_AT * (self.expiry - self.issued_at)

    @property
    def lifetime(self) -> int:
        return int(min(MAX_SECONDS, max(MIN_SECONDS, round(self.expiry - self.issued_at))))


def token_info(token: str, issued_fallback: float) -> TokenInfo:
    """What renewal needs from a service-account JWT; :class:`NotRenewable` says why not."""
    claims = jwt_claims(token)
    if claims is None:
        raise NotRenewable("the token is not a JWT (a static token): renew it by hand")
    sub = str(claims.get("sub", ""))
    parts = sub.split(":")
    if len(parts) != 4 or parts[:2] != ["system", "serviceaccount"]:
        raise NotRenewable(f"the token's subject {sub[:80]!r} is not a service account")
    exp = claims.get("exp")
    if not isinstance(exp, int | float) or isinstance(exp, bool):
        raise NotRenewable("the token has no exp: it does not expire, nothing to renew")
    iat = claims.get("iat")
    issued = float(iat) if isinstance(iat, int | float) and not isinstance(iat, bool) else issued_fallback
    warn = (claims.get("kubernetes.io") or {}).get("warnafter")
    if isinstance(warn, int | float) and not isinstance(warn, bool) and warn < exp:
        exp = warn  # an "extended" token: the API server warns about it from here on, so renew by this date
    aud = claims.get("aud") or []
    audiences = (aud,) if isinstance(aud, str) else tuple(str(a) for a in aud)
    node = ((claims.get("kubernetes.io") or {}).get("node") or {}).get("name")
    return TokenInfo(parts[2], parts[3], issued, float(exp), audiences, str(node) if node else None)


class TokenRenewer:
    """Keeps ``token_file`` holding a live token bound to ``node``; one asyncio task (:meth:`run`)."""

    def __init__(
        self,
        kube: KubeClient,
        token_file: Path,
        node: str,
        spool: Spool,
        *,
        clock: Callable[[], float] = time.time,
        timeout: float = 2.0,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.kube, self.token_file, self.node, self.spool = kube, Path(token_file), node, spool
        self.clock, self.timeout = clock, timeout
        self.on_change = on_change  # after a renewal, a failure or a refusal: the daemon rewrites scheduler.json
        self.info: TokenInfo | None = None
        self.problem: str | None = None  # why the token cannot be renewed, or the last renewal's failure
        self.renewals = 0
        self.failures = 0  # consecutive
        self.last_renewed_at: float | None = None
        self.waiting: Callable[[], bool] = lambda: False
        """True while first-boot enrolment has not written the token yet: its absence is awaited, said at info."""

    def state(self) -> dict[str, Any]:
        """For `sco-agent status` (scheduler.json) and the metrics."""
        i = self.info
        return {
            "renewal": {
                "service_account": f"{i.namespace}/{i.service_account}" if i else None,
                "bound_node": i.bound_node if i else None,
                "issued_at": i.issued_at if i else None,
                "renew_at": round(i.renew_at, 3) if i else None,
                "renewals": self.renewals,
                "failures": self.failures,
                "last_renewed_at": self.last_renewed_at,
                "problem": self.problem,
            }
        }

    def read(self) -> TokenInfo:
        try:
            token = self.token_file.read_text()
            mtime = self.token_file.stat().st_mtime
        except OSError as e:
            raise NotRenewable(f"{self.token_file}: {e.strerror or e}") from None
        info = token_info(token, mtime)
        if info.bound_node is not None and info.bound_node != self.node:
            # someone else's credential on this node: using it is wrong already; renewing it would keep it alive
            raise NotRenewable(f'the token is bound to node "{info.bound_node}", not this node "{self.node}"')
        return info

    async def renew(self, info: TokenInfo) -> TokenInfo:
        """One TokenRequest for the same account, bound to this node's Node object (its uid read now: a node
        deleted and recreated under the name is another object), written over the token file."""
        node = await self.kube.get_node(self.node, self.timeout)
        uid = str(node["metadata"]["uid"])
        token, exp = await self.kube.request_token(
            info.namespace,
            info.service_account,
            seconds=info.lifetime,
            audiences=list(info.audiences) or None,
            bound_node=(self.node, uid),
            timeout=self.timeout,
        )
        new = token_info(token, self.clock())
        if new.bound_node not in (None, self.node):
            raise KubeError(500, f'TokenRequest answered a token bound to node "{new.bound_node}"')
        # the answer's expirationTimestamp is authoritative (the server may shorten the lifetime)
        new = TokenInfo(new.namespace, new.service_account, new.issued_at, exp, new.audiences, new.bound_node)
        atomic_write(self.token_file, token.encode() + b"\n", mode=0o600, exact_mode=True)
        return new

    async def run(self, stop: asyncio.Event) -> None:
        said: str | None = None
        seen: tuple[str | None, int] = ("", -1)
        while not stop.is_set():
            wait = IDLE_CHECK_S
            try:
                info = self.read()
                self.info, said = info, None
                if self.failures == 0:
                    self.problem = None
                now = self.clock()
                if now >= info.renew_at:
                    new = await self.renew(info)
                    self.info, self.failures, self.problem = new, 0, None
                    self.renewals += 1
                    self.last_renewed_at = self.clock()
                    log.info("kubernetes token renewed: expires %.0f, renewal due %.0f", new.expiry, new.renew_at)
                    self.spool.append(
                        "credential.renewed",
                        ROUTINE,
                        service_account=f"{new.namespace}/{new.service_account}",
                        bound_node=self.node,
                        expiry=new.expiry,
                        renew_at=round(new.renew_at, 3),
                    )
                    if self.on_change is not None:
                        self.on_change()
                    continue
                wait = min(IDLE_CHECK_S, info.renew_at - now)
            except NotRenewable as e:
                self.info, self.problem = None, str(e)
                if self.waiting() and not self.token_file.exists():
                    # first boot: enrolment writes it; looked for again every few seconds meanwhile
                    wait = WAIT_FOR_ENROLMENT_S
                    if said != "waiting":
                        said = "waiting"
                        log.info("kubernetes token: waiting for enrolment to write %s", self.token_file)
                elif said != str(e):
                    said = str(e)
                    log.warning("kubernetes token: not renewed by the agent: %s", e)
                    self.spool.append("credential.not_renewable", ROUTINE, reason=str(e))
            except (KubeError, KubeUnreachable, OSError) as e:
                self.failures += 1
                self.problem = f"renewal failed: {e}"
                expiry = self.info.expiry if self.info else self.clock()
                left = expiry - self.clock()
                # sooner as the expiry nears, never a tight loop; after the expiry a person must act. Jittered:
                # a hall's tokens were issued together, so after an API outage their renewals would retry in step.
                wait = jitter(min(RETRY_MAX_S, max(RETRY_MIN_S, left / 10)))
                log.error("kubernetes token renewal failed (%d in a row, %.0f s left): %s", self.failures, left, e)
                self.spool.append(
                    "credential.renew_failed",
                    CRITICAL,
                    error=str(e)[:300],
                    failures=self.failures,
                    expires_in_s=round(left, 3),
                    retry_in_s=round(wait, 3),
                )
            if self.on_change is not None and (self.problem, self.failures) != seen:
                self.on_change()
            seen = (self.problem, self.failures)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.05, wait))
