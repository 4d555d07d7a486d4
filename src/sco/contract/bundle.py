"""A verified bundle as the node agent, the admission glue and the control plane read it.

Lean on purpose (standard library only beyond ``signing``): the agent imports it.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any

from sco.contract import canonical
from sco.contract.signing import Keyring, Verified, verify
from sco.errors import BundleError, RollbackError


def content_digest(hall: str, policy: dict[str, Any], contracts: list[dict[str, Any]]) -> str:
    """Digest of what a bundle says, independent of serial, issue time and signatures."""
    body = {"hall": hall, "policy": policy, "contracts": contracts}
    return hashlib.sha256(canonical.dumps(body)).hexdigest()


@dataclass(frozen=True)
class Budget:
    """What a workload may spend once a notice arrives."""

    contract: str
    drain_seconds: int
    final_write_seconds: int
    tier: int
    checkpoint_mode: str
    signal: str


class Bundle:
    """Read-only view of a verified bundle payload."""

    def __init__(self, verified: Verified) -> None:
        self.verified = verified
        p = verified.payload
        try:
            self.hall: str = p["hall"]
            self.serial: int = int(p["serial"])
            self.content_digest: str = p["contentDigest"]
            self.policy: dict[str, Any] = p["policy"]
            self.contracts: dict[str, dict[str, Any]] = {c["name"]: c for c in p["contracts"]}
        except (KeyError, TypeError, ValueError) as e:
            raise BundleError(f"bundle payload: missing or bad field {e}") from None
        self.issued_at: int | None = p.get("issuedAt")
        self.subset_of: str | None = p.get("subsetOf")

    @classmethod
    def from_bytes(cls, raw: bytes, keyring: Keyring, where: str = "bundle") -> Bundle:
        return cls(verify(raw, keyring, where))

    @property
    def raw(self) -> bytes:
        return self.verified.raw

    def budget(self, contract: str) -> Budget | None:
        c = self.contracts.get(contract)
        if c is None:
            return None
        ck = c.get("checkpoint", {})
        return Budget(
            contract,
            int(c["drainBudgetSeconds"]),
            int(c.get("finalWriteSeconds", 0)),
            int(c["tier"]),
            str(ck.get("mode", "none")),
            str(ck.get("signal", "USR1")),
        )

    def age_seconds(self, now: float | None = None) -> float | None:
        """Seconds since the bundle was issued (None when it carries no issue time). Bundles never expire."""
        if self.issued_at is None:
            return None
        return (time.time() if now is None else now) - self.issued_at


class Succession(Enum):
    REPLACE = "replace"
    UNCHANGED = "unchanged"


def successor(cached: Bundle | None, new: Bundle) -> Succession:
    """May ``new`` replace ``cached``? Raises RollbackError/BundleError when it must be refused."""
    if cached is None:
        return Succession.REPLACE
    if new.hall != cached.hall:
        raise BundleError(f"bundle is for hall {new.hall!r}, this node is in hall {cached.hall!r}")
    if new.serial < cached.serial:
        raise RollbackError(f"serial {new.serial} is lower than the cached serial {cached.serial} (rollback)")
    if new.serial > cached.serial:
        return Succession.REPLACE
    if new.content_digest == cached.content_digest or new.subset_of == cached.content_digest:
        return Succession.UNCHANGED
    if cached.subset_of == new.content_digest:
        return Succession.REPLACE  # the full bundle of which the launch subset was cut
    raise RollbackError(f"serial {new.serial} reused with different content (refused)")


def peek_payload(raw: bytes) -> dict[str, Any] | None:
    """The payload of a bundle file without verifying it, or None (for picking the next serial only)."""
    try:
        payload = json.loads(raw.split(b"\n", 2)[1])
        return payload if isinstance(payload, dict) else None
    except (ValueError, IndexError):
        return None


def subset_payload(
    bundle: Bundle, *, schedulers: list[str] | None = None, names: list[str] | None = None
) -> dict[str, Any]:
    """The part of ``bundle`` a new node needs from its first second: policy and the chosen contracts.

    Same serial as the full bundle; ``subsetOf`` names the full bundle's content so the node's fetcher
    accepts the full bundle at the same serial later (and nothing else at that serial).
    """
    chosen = [
        c
        for c in bundle.verified.payload["contracts"]
        if (not schedulers or c["scheduler"] in schedulers) and (not names or c["name"] in names)
    ]
    if names:
        missing = sorted(set(names) - {c["name"] for c in chosen})
        if missing:
            raise BundleError(f"contracts not in bundle serial {bundle.serial}: {', '.join(missing)}")
    payload = dict(bundle.verified.payload)
    payload["contracts"] = chosen
    payload["subsetOf"] = bundle.content_digest
    payload["contentDigest"] = content_digest(bundle.hall, bundle.policy, chosen)
    return payload
