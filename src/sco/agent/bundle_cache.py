"""The node's on-disk bundle cache and the fetcher that keeps it fresh.

- The cache holds the last good bundle and reports its age. A bundle past its signed ``expiresAt`` is never taken
  up; the one the node holds stays when it expires (its budgets drain the work already here: a node is never left
  without them), reported as expired (``sco_agent_bundle_expired``, ``sco-agent status``) until a fresh one comes.
- A new bundle replaces it only if it verifies against the node's keyring and is not a rollback;
  otherwise the old one stays and the reason is recorded in ``state.json``.
- Replacement is atomic (``sco._fs.atomic_write``): a crash mid-write leaves the old bundle.
- The fetcher does a conditional GET (If-None-Match) every ``bundle_refresh_seconds`` (60 s) on the agent's one
  HTTP client (``sco._http``, standard library only: the agent's memory budget), one deadline for the whole
  exchange.
"""

from __future__ import annotations

import hashlib
import json
import ssl
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sco import _http
from sco._fs import atomic_write, remove_stale_temps
from sco._tls import TlsSettingError, client_context
from sco.contract.bundle import Bundle, Succession, successor
from sco.contract.signing import Keyring
from sco.errors import BundleError, FetchError

BUNDLE_FILE = "bundle.json"
STATE_FILE = "state.json"


@dataclass
class CacheState:
    serial: int | None = None
    sha256: str | None = None
    accepted_at: float | None = None
    etag: str | None = None
    last_check_at: float | None = None
    last_outcome: str | None = None
    last_error: str | None = None
    refused: int = 0  # distinct bundles refused (the same bad bundle fetched again is not counted again)
    refused_digests: list[str] = field(default_factory=list)  # sha256 of the last refused bundles
    history: list[dict[str, Any]] = field(default_factory=list)  # last few refusals, newest last


@dataclass(frozen=True)
class Offer:
    outcome: str  # "accepted" | "unchanged" | "refused" (bad bundle) | "error" (could not fetch)
    serial: int | None
    reason: str = ""


class BundleCache:
    """``<dir>/bundle.json`` (the last good signed bundle) and ``<dir>/state.json`` (bookkeeping)."""

    def __init__(
        self, directory: Path, keyring: Keyring, clock: Callable[[], float] = time.time, hall: str | None = None
    ) -> None:
        self.dir = Path(directory)
        self.keyring = keyring
        self.clock = clock
        self.hall = hall  # the node's hall (agent.toml), which a launch key's delegation must name
        self.dir.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(self.dir, BUNDLE_FILE)
        remove_stale_temps(self.dir, STATE_FILE)
        self.state = self._read_state()
        self.bundle: Bundle | None = None
        self._load()

    @property
    def bundle_path(self) -> Path:
        return self.dir / BUNDLE_FILE

    def _read_state(self) -> CacheState:
        try:
            data = json.loads((self.dir / STATE_FILE).read_text())
            return CacheState(**data)
        except (FileNotFoundError, ValueError, TypeError):
            return CacheState()

    def _write_state(self) -> None:
        atomic_write(self.dir / STATE_FILE, (json.dumps(asdict(self.state), sort_keys=True) + "\n").encode())

    def _load(self) -> None:
        try:
            raw = self.bundle_path.read_bytes()
        except FileNotFoundError:
            return
        try:
            self.bundle = Bundle.from_bytes(raw, self.keyring, str(self.bundle_path), delegated=True)
        except BundleError as e:
            # Never silently trust a cache that no longer verifies (key removed, disk damage).
            self._refuse(f"cached bundle does not verify: {'; '.join(e.lines())}", raw=raw)
            return
        if self.bundle.delegation is not None and self.state.sha256 != self.bundle.verified.sha256:
            # a new instance's first bundle (cloud-init wrote it), signed by the launch key: its delegation must be
            # in force now and for this hall. Once taken up it stays across restarts, expired or not, as any bundle.
            why = self.bundle.first_take_problem(self.clock(), self.hall)
            if why:
                self.bundle = None
                self._refuse(f"cached bundle refused: {why}", raw=raw)
                return
        if self.state.serial != self.bundle.serial:
            # e.g. written by cloud-init at first boot; accepted now.
            self.state.serial = self.bundle.serial
            self.state.sha256 = self.bundle.verified.sha256
            self.state.accepted_at = self.clock()
            self._write_state()

    def _refuse(self, reason: str, outcome: str = "refused", raw: bytes | None = None) -> Offer:
        """Keep the current bundle and record why; ``outcome`` is "refused" (bad bundle) or "error"."""
        digest = hashlib.sha256(raw).hexdigest() if raw is not None else None
        if outcome == "refused" and (digest is None or digest not in self.state.refused_digests):
            self.state.refused += 1
            if digest is not None:
                self.state.refused_digests = [*self.state.refused_digests[-15:], digest]
        self.state.last_outcome = outcome
        self.state.last_error = reason
        self.state.history = [*self.state.history[-9:], {"at": self.clock(), "reason": reason}]
        self._write_state()
        return Offer(outcome, self.bundle.serial if self.bundle else None, reason)

    def offer(self, raw: bytes, source: str = "bundle", etag: str | None = None) -> Offer:
        """Consider ``raw`` as the next bundle: accept it atomically, or keep the old one and say why."""
        self.state.last_check_at = self.clock()
        try:
            new = Bundle.from_bytes(raw, self.keyring, source, delegated=True)
            verdict = successor(self.bundle, new, self.clock())
            why = new.first_take_problem(self.clock(), self.hall) if new.delegation is not None else None
            if why:
                raise BundleError(why)
        except BundleError as e:
            return self._refuse("; ".join(e.lines()), raw=raw)
        if verdict is Succession.REPLACE:
            atomic_write(self.bundle_path, raw)
            self.bundle = new
            self.state.serial, self.state.sha256 = new.serial, new.verified.sha256
            self.state.accepted_at = self.clock()
            outcome = "accepted"
        else:
            outcome = "unchanged"
        self.state.etag = etag
        self.state.last_outcome, self.state.last_error = outcome, None
        self._write_state()
        return Offer(outcome, self.bundle.serial if self.bundle else None)

    def status(self) -> dict[str, Any]:
        now = self.clock()
        b = self.bundle
        return {
            "hall": b.hall if b else None,
            "serial": b.serial if b else None,
            "contracts": len(b.contracts) if b else 0,
            "subset": bool(b and b.subset_of),
            "issued_age_s": round(now - b.issued_at, 1) if b and b.issued_at is not None else None,
            "expires_in_s": round(b.expires_at - now, 1) if b and b.expires_at is not None else None,
            "expired": bool(b and b.expired(now)),
            "cached_age_s": round(now - self.state.accepted_at, 1) if self.state.accepted_at else None,
            "last_check_age_s": round(now - self.state.last_check_at, 1) if self.state.last_check_at else None,
            "last_outcome": self.state.last_outcome,
            "last_error": self.state.last_error,
            "refused": self.state.refused,
        }


DEFAULT_MAX_BYTES = 32 << 20  # the largest bundle measured (10,000 contracts) is ~4 MiB
DEFAULT_DEADLINE_S = 30.0


class ResponseRefused(FetchError):
    """The distributor's answer was too large or too slow: refused, the last good bundle stays."""


def http_get(
    url: str,
    etag: str | None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    deadline_s: float = DEFAULT_DEADLINE_S,
    ssl_context: ssl.SSLContext | None = None,
) -> tuple[int, bytes, str | None]:
    """A conditional GET on the agent's one HTTP client (``sco._http``): (status, body, etag). ``deadline_s``
    bounds the whole exchange, connect to last byte (a peer sending one byte a second, with or without
    ``Connection: close``, is cut off at it); ``max_bytes`` the body, checked against Content-Length before
    reading and while reading; the URL's query string is sent as given. ``ssl_context``: an https URL's (the
    distributor's certificate checked against the hall's CA); None: the system's trust store."""
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https"):
        raise FetchError(f"{url}: only http and https URLs are supported")
    try:
        r = _http.get(
            url,
            deadline_s=deadline_s,
            max_body=max_bytes,
            headers={"If-None-Match": etag} if etag else None,
            ssl_context=ssl_context,
        )
    except _http.HttpTimeout:
        raise ResponseRefused(f"{url}: refused response: not complete within the {deadline_s:g} s deadline") from None
    except _http.HttpTooLarge:
        raise ResponseRefused(f"{url}: refused response: body exceeds the {max_bytes} byte cap") from None
    except _http.HttpError as e:
        raise FetchError(f"{url}: {e}") from None
    return r.status, r.body, r.headers.get("etag")


class BundleFetcher:
    """One refresh: conditional GET, verify, offer to the cache. Never raises on a bad bundle."""

    def __init__(
        self,
        cache: BundleCache,
        url: str,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        deadline_s: float = DEFAULT_DEADLINE_S,
        ca_file: str = "",
    ) -> None:
        """``ca_file``: the CA an https distributor's certificate must chain to (the hall's); "": the system's."""
        self.cache, self.url = cache, url
        self.max_bytes, self.deadline_s = max_bytes, deadline_s
        self.ca_file = ca_file
        self._ssl: ssl.SSLContext | None = None

    def _context(self) -> ssl.SSLContext | None:
        """The https context, made once (a CA file that cannot be read is a failed fetch, said as such)."""
        if not self.url.startswith("https:"):
            return None
        if self._ssl is None:
            try:
                self._ssl = client_context(self.ca_file)
            except TlsSettingError as e:
                raise FetchError(f"{self.url}: {e}") from None
        return self._ssl

    def refresh(self) -> Offer:
        try:
            status, body, etag = http_get(
                self.url,
                self.cache.state.etag,
                max_bytes=self.max_bytes,
                deadline_s=self.deadline_s,
                ssl_context=self._context(),
            )
        except FetchError as e:
            self.cache.state.last_check_at = self.cache.clock()
            return self.cache._refuse(f"fetch failed: {e}", outcome="error")
        if status == 304:
            self.cache.state.last_check_at = self.cache.clock()
            self.cache.state.last_outcome, self.cache.state.last_error = "unchanged", None
            self.cache._write_state()
            return Offer("unchanged", self.cache.bundle.serial if self.cache.bundle else None)
        if status != 200:
            self.cache.state.last_check_at = self.cache.clock()
            return self.cache._refuse(f"fetch failed: {self.url}: HTTP {status}", outcome="error")
        return self.cache.offer(body, source=self.url, etag=etag)
