"""Signed reclaim notices: the reclaimer signs, the node verifies with the keys its bundle's hall policy names.

On the node agent's import path: pynacl and the standard library only.

A signed notice is the notice object itself with one more member, ``signatures``::

    {"id": ..., "hall": ..., "node": ..., "terminateAt": ..., "issuedAt": ...,
     "signatures": [{"keyid": "<16 hex>", "sig": "<128 lowercase hex>"}]}

Each signature covers ``b"sco-notice-v1\\0" + sha256(body)`` where ``body`` is the object without
``signatures``, encoded with sorted keys, no whitespace, ASCII only and no NaN or infinity (times are
epoch seconds as numbers, which Python writes in their shortest round-trip form, or RFC 3339 strings).
The hall and node are inside the signed body, so a notice signed for one node cannot drain another.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from typing import Any

from sco.contract.signing import Keyring, PrivateKey, SignatureCheckError, check_signatures
from sco.errors import NoticeAuthError

_DOMAIN = b"sco-notice-v1\x00"
MAX_NOTICE_BYTES = 64 * 1024  # a notice is a few hundred bytes; anything far larger is not one


def _body(notice: dict[str, Any]) -> bytes:
    try:
        text = json.dumps(notice, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise NoticeAuthError("malformed", f"notice cannot be encoded: {e}") from None
    return text.encode("ascii")


def _message(notice: dict[str, Any]) -> bytes:
    return _DOMAIN + hashlib.sha256(_body(notice)).digest()


# A hall or node name as a literal part of the subject sco.notice.<hall>.<node>: no NATS wildcard (* >), no
# whitespace, never empty, so a notice can only ever reach the one node it names (the agents' own name rule).
_SUBJECT_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


def subject_name_problem(what: str, value: str) -> str | None:
    """Why ``value`` cannot be the hall or node of a notice subject, or None."""
    if not _SUBJECT_NAME.match(value) or len(value) > 253:
        return f"{what} {value!r}: expected a DNS-style name (a-z, 0-9, '-', '.'), as the node's agent is configured"
    return None


def sign_notice(notice: dict[str, Any], signing_keys: Iterable[PrivateKey]) -> bytes:
    """The bytes to publish on ``sco.notice.<hall>.<node>``: ``notice`` signed by every key given."""
    body = {k: v for k, v in notice.items() if k != "signatures"}
    message = _message(body)
    sigs = sorted(
        ({"keyid": k.keyid, "sig": k.signing_key.sign(message).signature.hex()} for k in signing_keys),
        key=lambda s: s["keyid"],
    )
    if not sigs:
        raise ValueError("at least one notice signing key is needed")
    return _body({**body, "signatures": sigs})


def verify_notice(raw: bytes, trusted_keys: Keyring, *, max_bytes: int = MAX_NOTICE_BYTES) -> dict[str, Any]:
    """The notice in ``raw`` (without its signatures) if a trusted key signed it; NoticeAuthError otherwise.

    Kinds: "malformed" (not a JSON object, too large), "unsigned" (no signatures), "untrusted" (no signature
    by a trusted key, or no notice key trusted at all), "forged" (a trusted key's signature does not match).
    """
    if len(raw) > max_bytes:
        raise NoticeAuthError("malformed", f"notice is {len(raw)} bytes, more than {max_bytes}")
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: nesting deeper than Python's stack
        raise NoticeAuthError("malformed", f"not JSON: {type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(doc, dict):
        raise NoticeAuthError("malformed", "expected a JSON object")
    sigs = doc.pop("signatures", None)
    if sigs is None or sigs == []:
        raise NoticeAuthError("unsigned", "notice carries no signature")
    if len(trusted_keys) == 0:
        raise NoticeAuthError("untrusted", "no notice key is trusted (the bundle's hall policy names none)")
    try:
        check_signatures(sigs, trusted_keys, _message(doc), "notice", max_signatures=8)
    except SignatureCheckError as e:
        raise NoticeAuthError(e.kind, e.detail) from None
    return doc


def notice_keyring(policy: dict[str, Any]) -> Keyring:
    """The notice keys a hall policy (as the bundle carries it) names; entries are checked by the bundle."""
    from nacl.signing import VerifyKey

    from sco.contract.signing import PublicKey, key_id

    keys = []
    for entry in policy.get("noticeKeys") or []:
        vk = VerifyKey(bytes.fromhex(entry["public"]))
        keys.append(PublicKey(key_id(vk), vk))
    return Keyring(keys)
