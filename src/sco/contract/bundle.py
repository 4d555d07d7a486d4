"""A verified bundle as the node agent, the admission glue and the control plane read it.

Lean on purpose (standard library only beyond ``signing``): the agent imports it.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeGuard

from sco.contract import canonical
from sco.contract.signing import Keyring, Verified, verify
from sco.errors import BundleError, Problem, RollbackError


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


_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_HEX16 = re.compile(r"^[0-9a-f]{16}$")
# The largest serial: the largest integer every JSON reader holds exactly (2^53 - 1). A serial past it (10^40,
# say) would lock out every later bundle on every node that accepted it, so it is refused, signed or not; a
# bundle a second would take 285 million years to reach it.
MAX_SERIAL = 2**53 - 1
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# What the node reads from the policy, with the ranges it accepts (the compiler enforces the same).
_POLICY_INTS = {
    "noticeWindowSeconds": (10, 3600),
    "safetyMarginSeconds": (0, 600),
    "firstActionSeconds": (1, 60),
    "schedulerApiTimeoutMs": (10, 60_000),
    "metadataPollSeconds": (1, 300),
    "bundleRefreshSeconds": (5, 86_400),
    "bundleLifetimeSeconds": (3600, 90 * 86_400),
}


def _int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def payload_problems(p: dict[str, Any]) -> list[str]:
    """Types and ranges of every field the node reads: a signed payload can still be absurd (a broken or
    hostile compiler), and a bad value must be refused here, not found mid-drain."""
    out: list[str] = []
    if not isinstance(p.get("hall"), str) or not _NAME.match(p["hall"]):
        out.append("hall: expected a DNS-style name")
    if not _int(p.get("serial")) or not 1 <= p["serial"] <= MAX_SERIAL:
        out.append(f"serial: expected an integer from 1 to {MAX_SERIAL} (2^53 - 1)")
    if not isinstance(p.get("contentDigest"), str) or not _HEX64.match(p["contentDigest"]):
        out.append("contentDigest: expected 64 hex digits")
    if "issuedAt" in p and not _int(p["issuedAt"]):
        out.append("issuedAt: expected an integer")
    if "expiresAt" in p and (not _int(p["expiresAt"]) or p["expiresAt"] < 1):
        out.append("expiresAt: expected Unix epoch seconds")
    elif _int(p.get("expiresAt")) and _int(p.get("issuedAt")) and p["expiresAt"] <= p["issuedAt"]:
        out.append("expiresAt: must be after issuedAt")
    if "subsetOf" in p and (not isinstance(p["subsetOf"], str) or not _HEX64.match(p["subsetOf"])):
        out.append("subsetOf: expected 64 hex digits")
    policy = p.get("policy")
    window = 120
    if not isinstance(policy, dict):
        out.append("policy: expected an object")
    else:
        for key, (lo, hi) in _POLICY_INTS.items():
            if key in policy and (not _int(policy[key]) or not lo <= policy[key] <= hi):
                out.append(f"policy.{key}: expected an integer from {lo} to {hi}, got {policy[key]!r}")
        if _int(policy.get("noticeWindowSeconds")):
            window = policy["noticeWindowSeconds"]
        margin = policy.get("safetyMarginSeconds", 10)
        if _int(margin) and margin >= window:
            out.append("policy.safetyMarginSeconds: must be below noticeWindowSeconds")
        keys = policy.get("noticeKeys", [])
        if not isinstance(keys, list) or len(keys) > 16:
            out.append("policy.noticeKeys: expected a list of up to 16 keys")
        else:
            for i, k in enumerate(keys):
                if (
                    not isinstance(k, dict)
                    or not isinstance(k.get("keyid"), str)
                    or not _HEX16.match(k["keyid"])
                    or not isinstance(k.get("public"), str)
                    or not _HEX64.match(k["public"])
                    or hashlib.sha256(bytes.fromhex(k["public"])).hexdigest()[:16] != k["keyid"]
                ):
                    out.append(f"policy.noticeKeys[{i}]: expected keyid and public (hex) of one Ed25519 key")
    contracts = p.get("contracts")
    if not isinstance(contracts, list):
        out.append("contracts: expected a list")
        return out
    names: set[str] = set()
    for i, c in enumerate(contracts):
        where = f"contracts[{i}]"
        if not isinstance(c, dict):
            out.append(f"{where}: expected an object")
            continue
        name = c.get("name")
        if not isinstance(name, str) or not _NAME.match(name) or len(name) > 63:
            out.append(f"{where}.name: expected a DNS-1123 label")
        elif name in names:
            out.append(f"{where}.name: {name!r} appears twice")
        else:
            names.add(name)
            where = f"contracts[{i}] ({name})"
        sched = c.get("scheduler")
        if sched not in ("kubernetes", "spark", "slurm"):
            out.append(f"{where}.scheduler: expected kubernetes, spark or slurm")
        sel = c.get("selector")
        if not isinstance(sel, dict):
            out.append(f"{where}.selector: missing or not an object")
        elif sched == "slurm":
            if not isinstance(sel.get("account"), str) or not sel["account"]:
                out.append(f"{where}.selector.account: expected a non-empty string")
            parts = sel.get("partitions", [])
            if not isinstance(parts, list) or not all(isinstance(x, str) for x in parts):
                out.append(f"{where}.selector.partitions: expected a list of strings")
        elif sched in ("kubernetes", "spark"):
            if not isinstance(sel.get("namespace"), str) or not sel["namespace"]:
                out.append(f"{where}.selector.namespace: expected a non-empty string")
            labels = sel.get("matchLabels", {})
            if not isinstance(labels, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
            ):
                out.append(f"{where}.selector.matchLabels: expected a map of strings")
        if c.get("tier") not in (1, 2, 3) or not _int(c.get("tier")):
            out.append(f"{where}.tier: expected 1, 2 or 3")
        budget = c.get("drainBudgetSeconds")
        if not _int(budget) or not 1 <= budget <= window:
            out.append(f"{where}.drainBudgetSeconds: expected an integer from 1 to {window}, got {budget!r}")
        final = c.get("finalWriteSeconds", 0)
        if not _int(final) or not 0 <= final <= window:
            out.append(f"{where}.finalWriteSeconds: expected an integer from 0 to {window}, got {final!r}")
        ck = c.get("checkpoint", {})
        if not isinstance(ck, dict):
            out.append(f"{where}.checkpoint: expected an object")
        else:
            if ck.get("mode", "none") not in ("signal", "none"):
                out.append(f"{where}.checkpoint.mode: expected signal or none")
            sig = ck.get("signal", "USR1")
            if not isinstance(sig, str) or not re.match(r"^[A-Z0-9]{1,12}$", sig):
                out.append(f"{where}.checkpoint.signal: expected a signal name such as USR1")
    return out


class Bundle:
    """Read-only view of a verified bundle payload."""

    def __init__(self, verified: Verified) -> None:
        self.verified = verified
        p = verified.payload
        problems = payload_problems(p)
        if problems:
            raise BundleError(
                f"{verified.where}: payload: {len(problems)} problem(s)",
                [Problem(verified.where, f"payload.{m.split(': ', 1)[0]}", m.split(": ", 1)[1]) for m in problems],
            )
        try:
            self.hall: str = p["hall"]
            self.serial: int = int(p["serial"])
            self.content_digest: str = p["contentDigest"]
            self.policy: dict[str, Any] = p["policy"]
            self.contracts: dict[str, dict[str, Any]] = {c["name"]: c for c in p["contracts"]}
        except (KeyError, TypeError, ValueError) as e:
            raise BundleError(f"bundle payload: missing or bad field {e}") from None
        self.issued_at: int | None = p.get("issuedAt")
        # signed with the rest: a stale mirror or a man in the middle cannot keep a node on this bundle past it
        self.expires_at: int | None = p.get("expiresAt")
        self.subset_of: str | None = p.get("subsetOf")
        self.delegation = verified.delegation
        if self.delegation is not None:
            self._check_delegated(verified.where)

    def _check_delegated(self, where: str) -> None:
        """What a launch key may sign, as its root's certificate says: a launch subset of its hall, issued and
        expiring inside the certificate's window (so a key past its delegation cannot sign one that outlives it)."""
        d = self.delegation
        assert d is not None
        who = f"{where}: launch key {d.keyid} (delegation serial {d.serial} by {d.issuer})"
        if self.hall != d.hall:
            raise BundleError(f"{who} is delegated for hall {d.hall!r}, the bundle is for hall {self.hall!r}")
        if d.scope == "launch-subset" and self.subset_of is None:
            raise BundleError(f"{who} may sign only launch subsets (subsetOf), not a full bundle")
        if self.issued_at is None or self.expires_at is None:
            raise BundleError(f"{who}: a delegated bundle must carry issuedAt and expiresAt")
        if not d.issued_at <= self.issued_at < d.expires_at:
            raise BundleError(
                f"{who}: bundle issued at {_utc(self.issued_at)}, outside its delegation"
                f" ({_utc(d.issued_at)} to {_utc(d.expires_at)})"
            )
        if self.expires_at > d.expires_at:
            raise BundleError(
                f"{who}: bundle expires at {_utc(self.expires_at)}, after its delegation ({_utc(d.expires_at)})"
            )

    def first_take_problem(self, now: float, hall: str | None = None) -> str | None:
        """Why a node that holds no bundle must not take this one up now (None: it may). A delegated bundle needs
        its delegation in force now and, when the node knows its hall, that hall."""
        d = self.delegation
        if d is None:
            return None
        who = f"launch key {d.keyid} (delegation serial {d.serial} by {d.issuer})"
        if d.expired(now):
            return f"{self.verified.where}: {who}: delegation expired at {_utc(d.expires_at)} (refused)"
        if now < d.issued_at:
            return f"{self.verified.where}: {who}: delegation not valid before {_utc(d.issued_at)} (refused)"
        if hall is not None and d.hall != hall:
            return f"{self.verified.where}: {who} is delegated for hall {d.hall!r}, this node is in hall {hall!r}"
        return None

    @classmethod
    def from_bytes(cls, raw: bytes, keyring: Keyring, where: str = "bundle", *, delegated: bool = False) -> Bundle:
        """``delegated``: a launch subset signed under a root's delegation is verified too (a node's cache only)."""
        return cls(verify(raw, keyring, where, delegated=delegated))

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
        """Seconds since the bundle was issued (None when it carries no issue time)."""
        if self.issued_at is None:
            return None
        return (time.time() if now is None else now) - self.issued_at

    def expired(self, now: float | None = None) -> bool:
        """Past its signed ``expiresAt``. A bundle of a release before expiry carries none and never expires."""
        return self.expires_at is not None and (time.time() if now is None else now) >= self.expires_at


class Succession(Enum):
    REPLACE = "replace"
    UNCHANGED = "unchanged"


# A signed bundle's freshness (its expiresAt), unless the hall policy sets bundleLifetimeSeconds. Nodes ask for a new
# bundle every 60 s, so the lifetime need not be short for a re-signed bundle to reach them within a minute; what it
# must cover is the time between re-signings plus an outage of the distributor. The signer re-dates an unchanged
# bundle once less than half is left: re-signing at least every 3.5 days keeps nodes at 3.5 days or more, so the
# distributor may be down over a long weekend; a stale mirror or a man in the middle holds a node back 7 days at
# most instead of for ever.
DEFAULT_BUNDLE_LIFETIME_S = 7 * 86_400


def bundle_lifetime_s(policy: Mapping[str, Any]) -> int:
    """How long a bundle signed now stays fresh: the hall policy's bundleLifetimeSeconds, else 7 days."""
    return int(policy.get("bundleLifetimeSeconds") or DEFAULT_BUNDLE_LIFETIME_S)


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def successor(cached: Bundle | None, new: Bundle, now: float | None = None) -> Succession:
    """May ``new`` replace ``cached``? Raises RollbackError/BundleError when it must be refused.

    Freshness: a bundle past its ``expiresAt`` is never taken up (what the node holds stays, and keeps its budgets);
    once the node holds a bundle that expires, one without an expiry (a compiler of an older release, or a replay of
    a bundle from before expiry) is older-dated and refused; at the same serial and content a later ``expiresAt``
    replaces the cached bundle (the hall's signer re-dated it), an earlier one changes nothing."""
    if new.delegation is not None:
        # a launch key signs only the first bundle of a new instance (its user-data): a node that holds one takes
        # only its root's bundles, so a stolen launch key cannot move the running fleet
        if cached is not None:
            raise BundleError(
                f"bundle serial {new.serial} is signed by launch key {new.delegation.keyid} under delegation: a node"
                " takes such a bundle only as its first (refused: this node holds one)"
            )
        why = new.first_take_problem(time.time() if now is None else now)
        if why:
            raise BundleError(why)
    if new.expired(now):
        raise BundleError(f"bundle serial {new.serial} expired at {_utc(new.expires_at or 0)} (stale copy refused)")
    if cached is None:
        return Succession.REPLACE
    if new.hall != cached.hall:
        raise BundleError(f"bundle is for hall {new.hall!r}, this node is in hall {cached.hall!r}")
    if new.serial < cached.serial:
        raise RollbackError(f"serial {new.serial} is lower than the cached serial {cached.serial} (rollback)")
    if cached.expires_at is not None and new.expires_at is None:
        raise RollbackError(
            f"serial {new.serial} carries no expiry and this node holds one that expires (older-dated, refused)"
        )
    if new.serial > cached.serial:
        return Succession.REPLACE
    if new.content_digest == cached.content_digest or new.subset_of == cached.content_digest:
        if new.expires_at is not None and (cached.expires_at is None or new.expires_at > cached.expires_at):
            return Succession.REPLACE  # re-dated: the same content, fresh for longer
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
    payload.pop("delegation", None)  # a subset is signed anew, by its own signer
    payload["contracts"] = chosen
    payload["subsetOf"] = bundle.content_digest
    payload["contentDigest"] = content_digest(bundle.hall, bundle.policy, chosen)
    return payload
