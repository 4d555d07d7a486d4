"""Ed25519 keys, keyrings, and the signed-bundle envelope.

This module is on the node agent's import path, so it uses only pynacl and the standard library.

A bundle file is two lines::

    canonical({"format": "sco-bundle/v1", "payloadBytes": N, "payloadSha256": "<64 hex>",
               "signatures": [{"keyid": "<16 hex>", "sig": "<128 lowercase hex>"}, ...]}) + b"\\n"
    canonical(payload) + b"\\n"

Each signature covers ``b"sco-bundle-v1\\0" + sha256(payload bytes)``, so verifying a 4 MB bundle costs
one hash and one Ed25519 check, without parsing the payload. The header must be canonical (re-encoding it
gives the same bytes) and signatures are decoded strictly, so changing any byte of the file, not only of
the payload, makes verification fail.
Several signatures allow key rotation: sign with the new and the old key while nodes trust either.

**Delegation** (a launch subset signed on the control host): the signed payload may carry ``delegation``::

    "delegation": {"cert": {"type": "sco-launch-delegation/v1", "hall": H, "keyid": K, "public": "<64 hex>",
                            "scope": "launch-subset", "serial": N, "issuedAt": T0, "expiresAt": T1},
                   "signatures": [{"keyid": "<a trusted root key>", "sig": "..."}]}

The hall's root key (trusted by nodes, kept on the controller) signs the certificate, over
``b"sco-delegation-v1\0" + sha256(canonical(cert))`` (another domain than a bundle's: no signature of one can be
taken for the other); the bundle's signatures are by the delegated (online, "launch") key K, which no node trusts
by itself. It is looked at only when no signature is by a trusted key, so a root-signed bundle is verified as
before, without parsing its payload. The header stays exactly N's (docs/UPGRADE.md rule 1): a reader of a release
before delegation finds a bundle signed by a key it does not trust and refuses it. What the delegated key may sign (a
launch subset of hall H, issued and expiring inside [T0, T1]) is checked by ``sco.contract.bundle``; when a node
takes it up (only as its first bundle), by ``successor`` and the node's cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey, VerifyKey

from sco.contract import canonical
from sco.errors import BundleError, KeyFileError, SignatureError, UntrustedKeyError

FORMAT = "sco-bundle/v1"
_DOMAIN = b"sco-bundle-v1\x00"
DELEGATION_TYPE = "sco-launch-delegation/v1"
_DELEGATION_DOMAIN = b"sco-delegation-v1\x00"
DELEGATION_SCOPES = ("launch-subset",)  # what a launch key may sign: the subsets of new instances' user-data


def key_id(verify_key: VerifyKey) -> str:
    """Short, stable name of a public key: the first 16 hex digits of its SHA-256."""
    return hashlib.sha256(bytes(verify_key)).hexdigest()[:16]


@dataclass(frozen=True)
class PrivateKey:
    keyid: str
    signing_key: SigningKey

    @property
    def public(self) -> PublicKey:
        return PublicKey(self.keyid, self.signing_key.verify_key)


@dataclass(frozen=True)
class PublicKey:
    keyid: str
    verify_key: VerifyKey


def generate() -> PrivateKey:
    sk = SigningKey.generate()
    return PrivateKey(key_id(sk.verify_key), sk)


def _write_new(path: Path, text: str, mode: int) -> None:
    # O_EXCL | O_NOFOLLOW: never through a symlink someone planted, never over an existing file.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def write_keypair(key: PrivateKey, private_path: Path, public_path: Path) -> None:
    """Write a new key pair; refuses to overwrite an existing file or to write through a symlink."""
    for p, what in ((private_path, "a private key"), (public_path, "a public key")):
        if os.path.islink(p):
            raise KeyFileError(f"{p}: is a symlink; refusing to write {what} through it")
        if p.exists():
            raise KeyFileError(f"{p}: exists; refusing to overwrite {what}")
    priv = {"type": "ed25519-private", "keyid": key.keyid, "seed": bytes(key.signing_key).hex()}
    try:
        _write_new(private_path, json.dumps(priv) + "\n", 0o600)
        _write_new(public_path, public_key_text(key.public), 0o644)
    except FileExistsError as e:  # appeared in between: someone races us
        raise KeyFileError(f"{e.filename}: appeared while writing; refusing to overwrite it") from None


def public_key_text(key: PublicKey) -> str:
    """The contents of a ``.pub`` file."""
    return json.dumps({"type": "ed25519-public", "keyid": key.keyid, "public": bytes(key.verify_key).hex()}) + "\n"


MAX_KEY_FILE_BYTES = 64 << 10  # a key file is ~140 bytes: a larger one is refused before it is read


def _read_small_json(path: Path, what: str) -> Any:
    """The JSON in a small file (a key, a delegation), ``what`` naming it in the errors."""
    try:
        # O_NONBLOCK and the checks before reading: a FIFO or /dev/zero named *.pub hung check-config and run
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise KeyFileError(f"{path}: not a {what} (not a regular file)")
            if st.st_size > MAX_KEY_FILE_BYTES:
                raise KeyFileError(f"{path}: not a {what} ({st.st_size} bytes)")
            return json.loads(f.read(MAX_KEY_FILE_BYTES + 1).decode())
    except FileNotFoundError:
        raise KeyFileError(f"{path}: no such {what}") from None
    except (OSError, ValueError) as e:
        raise KeyFileError(f"{path}: not a {what} ({e})") from None


def _read_key_json(path: Path, kind: str) -> dict[str, Any]:
    data = _read_small_json(path, "key file")
    if not isinstance(data, dict) or data.get("type") != kind:
        raise KeyFileError(f"{path}: type: expected {kind!r}")
    return data


def _hex(path: Path, data: dict[str, Any], field: str, size: int) -> bytes:
    value = data.get(field)
    try:
        raw = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != size:
        raise KeyFileError(f"{path}: {field}: expected {size * 2} hex digits")
    return raw


def load_private(path: Path) -> PrivateKey:
    data = _read_key_json(path, "ed25519-private")
    if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(f"{path}: private key is readable by group or others (chmod 600 it)")
    sk = SigningKey(_hex(path, data, "seed", 32))
    if data.get("keyid") != key_id(sk.verify_key):
        raise KeyFileError(f"{path}: keyid: does not match the key")
    return PrivateKey(key_id(sk.verify_key), sk)


def load_public(path: Path) -> PublicKey:
    data = _read_key_json(path, "ed25519-public")
    vk = VerifyKey(_hex(path, data, "public", 32))
    if data.get("keyid") != key_id(vk):
        raise KeyFileError(f"{path}: keyid: does not match the key")
    return PublicKey(key_id(vk), vk)


class Keyring:
    """The set of public keys a verifier trusts, by key id."""

    def __init__(self, keys: Iterable[PublicKey] = ()) -> None:
        self._keys: dict[str, VerifyKey] = {k.keyid: k.verify_key for k in keys}

    @classmethod
    def from_files(cls, paths: Iterable[Path]) -> Keyring:
        return cls(load_public(Path(p)) for p in paths)

    @classmethod
    def from_dir(cls, directory: Path) -> Keyring:
        return cls.from_files(sorted(directory.glob("*.pub")))

    def __contains__(self, keyid: object) -> bool:
        return keyid in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def keyids(self) -> list[str]:
        return sorted(self._keys)

    def get(self, keyid: str) -> VerifyKey | None:
        return self._keys.get(keyid)


def _message(payload_sha256: bytes) -> bytes:
    return _DOMAIN + payload_sha256


def sign(payload: dict[str, Any], keys: Iterable[PrivateKey], delegation: Delegation | None = None) -> bytes:
    """The bytes of a bundle file: ``payload`` signed by every key in ``keys``; with ``delegation``, by its launch
    key alone (the certificate goes in the header)."""
    keys = list(keys)
    if delegation is not None:
        if [k.keyid for k in keys] != [delegation.keyid]:
            raise ValueError(f"a bundle under delegation is signed by its launch key {delegation.keyid} alone")
        payload = {**payload, "delegation": delegation.document}
    body = canonical.dumps(payload)
    digest = hashlib.sha256(body).digest()
    sigs = sorted(
        ({"keyid": k.keyid, "sig": k.signing_key.sign(_message(digest)).signature.hex()} for k in keys),
        key=lambda s: s["keyid"],
    )
    if not sigs:
        raise ValueError("at least one signing key is needed")
    header = {"format": FORMAT, "payloadSha256": digest.hex(), "payloadBytes": len(body), "signatures": sigs}
    return canonical.dumps(header) + b"\n" + body + b"\n"


class Verified:
    """A bundle whose header is canonical, whose payload matches its digest, signed by a trusted key.

    The payload is parsed on first use: checking authenticity needs only a hash of its bytes.
    """

    def __init__(
        self, raw: bytes, payload_bytes: memoryview, keyid: str, where: str, delegation: Delegation | None = None
    ) -> None:
        self.raw = raw
        self.keyid = keyid  # the key whose signature was checked: a trusted one, or the delegation's launch key
        self.where = where
        self.delegation = delegation  # None: signed by a trusted (root) key itself
        self._payload_bytes = payload_bytes
        self._payload: dict[str, Any] | None = None

    @property
    def sha256(self) -> str:
        """Of the whole file, for logs and state."""
        return hashlib.sha256(self.raw).hexdigest()

    @property
    def payload(self) -> dict[str, Any]:
        if self._payload is None:
            try:
                value = canonical.loads(bytes(self._payload_bytes))
            except ValueError as e:  # signed, yet not JSON: the signer is broken, not the transport
                raise BundleError(f"{self.where}: payload: not JSON: {e}") from None
            if not isinstance(value, dict):
                raise BundleError(f"{self.where}: payload: expected an object")
            self._payload = value
        return self._payload


_HEADER_KEYS = {"format", "payloadSha256", "payloadBytes", "signatures"}


def verify(raw: bytes, keyring: Keyring, where: str = "bundle", *, delegated: bool = False) -> Verified:
    """Check ``raw`` is a well-formed bundle signed by a key in ``keyring``; raise BundleError if not.
    ``delegated``: or signed by a launch key under a delegation a key in ``keyring`` signed (only a node agent's
    cache takes such a bundle, as a new instance's first; every other reader refuses it)."""
    nl = raw.find(b"\n")
    if nl < 0:
        raise BundleError(f"{where}: not a bundle (no header line)")
    head = raw[:nl]
    try:
        header = canonical.loads(head)
    except (UnicodeDecodeError, ValueError) as e:
        raise BundleError(f"{where}: not a bundle: header: {e}") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise BundleError(f"{where}: format: expected {FORMAT!r}")
    if set(header) != _HEADER_KEYS:
        raise BundleError(f"{where}: header: expected exactly {', '.join(sorted(_HEADER_KEYS))}")
    if canonical.dumps(header) != head:
        raise BundleError(f"{where}: header: not in canonical form (the bytes were altered)")
    size, digest_hex, sigs = header["payloadBytes"], header["payloadSha256"], header["signatures"]
    if not isinstance(size, int) or len(raw) != nl + 1 + size + 1 or raw[-1:] != b"\n":
        raise BundleError(f"{where}: payloadBytes: the payload is not {size} bytes followed by a newline")
    body = memoryview(raw)[nl + 1 : nl + 1 + size]
    digest = hashlib.sha256(body).digest()
    if digest.hex() != digest_hex:
        raise BundleError(f"{where}: payloadSha256: does not match the payload (the bytes were altered)")
    try:
        return Verified(raw, body, check_signatures(sigs, keyring, _message(digest), "bundle"), where)
    except SignatureCheckError as e:
        cls = {"forged": SignatureError, "untrusted": UntrustedKeyError}.get(e.kind, BundleError)
        if e.kind != "untrusted":
            raise cls(f"{where}: {e.detail}") from None
        untrusted = e
    # no trusted key signed it: it may be a launch subset, signed by a launch key a trusted root vouches for
    doc = _payload_delegation(body)
    if doc is None:
        raise UntrustedKeyError(f"{where}: {untrusted.detail}")
    if not delegated:
        raise UntrustedKeyError(
            f"{where}: {untrusted.detail}; a launch key's bundle under delegation is taken by a node agent only,"
            " as a new instance's first bundle"
        )
    delegation = Delegation.verify(doc, keyring, f"{where}: delegation")
    try:
        keyid = check_signatures(sigs, Keyring([delegation.public]), _message(digest), "bundle")
    except SignatureCheckError as e:
        cls = {"forged": SignatureError, "untrusted": UntrustedKeyError}.get(e.kind, BundleError)
        if e.kind == "untrusted":
            raise cls(f"{where}: not signed by the launch key {delegation.keyid} its delegation names") from None
        raise cls(f"{where}: {e.detail}") from None
    return Verified(raw, body, keyid, where, delegation)


def _payload_delegation(body: memoryview) -> object:
    """The payload's ``delegation`` (None when the payload has none or is not a JSON object)."""
    try:
        value = canonical.loads(bytes(body))
    except (UnicodeDecodeError, ValueError):
        return None
    return value.get("delegation") if isinstance(value, dict) else None


_HEX16_CHARS = set("0123456789abcdef")
_CERT_KEYS = {"type", "hall", "keyid", "public", "scope", "serial", "issuedAt", "expiresAt"}
MAX_DELEGATION_SERIAL = 2**53 - 1


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class Delegation:
    """A hall root key's certificate for an online launch key: which key, for which hall, what it may sign, from
    when to when. ``document`` is the certificate with its signatures, as a bundle's header carries it."""

    hall: str
    keyid: str
    public: PublicKey
    scope: str
    serial: int
    issued_at: int
    expires_at: int
    issuer: str  # the root key id whose signature was checked ("" before checking, as made by ``delegate``)
    document: dict[str, Any]

    def expired(self, now: float) -> bool:
        return now >= self.expires_at

    @classmethod
    def parse(cls, doc: object, where: str = "delegation") -> tuple[Delegation, bytes]:
        """The certificate's fields checked for type and range (not its signature); with the message its
        signatures cover."""
        if not isinstance(doc, dict) or set(doc) != {"cert", "signatures"}:
            raise BundleError(f"{where}: expected exactly cert and signatures")
        cert = doc["cert"]
        if not isinstance(cert, dict) or set(cert) != _CERT_KEYS:
            raise BundleError(f"{where}: cert: expected exactly {', '.join(sorted(_CERT_KEYS))}")
        if cert["type"] != DELEGATION_TYPE:
            raise BundleError(f"{where}: cert.type: expected {DELEGATION_TYPE!r}")
        if cert["scope"] not in DELEGATION_SCOPES:
            raise BundleError(f"{where}: cert.scope: expected one of {', '.join(DELEGATION_SCOPES)}")
        hall, keyid, public = cert["hall"], cert["keyid"], cert["public"]
        if not isinstance(hall, str) or not hall:
            raise BundleError(f"{where}: cert.hall: expected the hall's name")
        hex_ok = isinstance(public, str) and len(public) == 64 and set(public) <= _HEX16_CHARS
        raw_pub = bytes.fromhex(public) if hex_ok else b""
        if len(raw_pub) != 32 or not isinstance(keyid, str) or keyid != key_id(VerifyKey(raw_pub)):
            raise BundleError(f"{where}: cert: expected keyid and public (lowercase hex) of one Ed25519 key")
        for f in ("serial", "issuedAt", "expiresAt"):
            if not _is_int(cert[f]) or not 1 <= cert[f] <= MAX_DELEGATION_SERIAL:
                raise BundleError(f"{where}: cert.{f}: expected a positive integer")
        if cert["expiresAt"] <= cert["issuedAt"]:
            raise BundleError(f"{where}: cert.expiresAt: must be after issuedAt")
        d = cls(hall, keyid, PublicKey(keyid, VerifyKey(raw_pub)), cert["scope"], cert["serial"], cert["issuedAt"],
                cert["expiresAt"], "", doc)  # fmt: skip
        return d, _DELEGATION_DOMAIN + hashlib.sha256(canonical.dumps(cert)).digest()

    @classmethod
    def verify(cls, doc: object, keyring: Keyring, where: str = "delegation") -> Delegation:
        """A delegation whose certificate a key in ``keyring`` (the nodes' trusted roots) signed."""
        d, message = cls.parse(doc, where)
        try:
            issuer = check_signatures(d.document["signatures"], keyring, message, "delegation", max_signatures=4)
        except SignatureCheckError as e:
            cls_ = {"forged": SignatureError, "untrusted": UntrustedKeyError}.get(e.kind, BundleError)
            raise cls_(f"{where} of launch key {d.keyid}: {e.detail}") from None
        if issuer == d.keyid:
            raise BundleError(f"{where}: launch key {d.keyid} is itself a trusted root key (it delegates to nobody)")
        return dataclasses.replace(d, issuer=issuer)

    @classmethod
    def load(cls, path: Path, keyring: Keyring | None = None) -> Delegation:
        """A delegation file (``sco delegate``); checked against ``keyring`` when given."""
        doc = _read_small_json(path, "delegation file")
        try:
            return cls.verify(doc, keyring, str(path)) if keyring is not None else cls.parse(doc, str(path))[0]
        except BundleError as e:
            raise KeyFileError(str(e)) from None


def delegate(
    root: PrivateKey, launch: PublicKey, hall: str, *, issued_at: int, expires_at: int, serial: int,
    scope: str = "launch-subset",
) -> Delegation:  # fmt: skip
    """The root key's certificate for ``launch``: it may sign ``scope`` for ``hall`` from ``issued_at`` until
    ``expires_at`` (Unix seconds). ``serial`` orders a hall's delegations (a renewal or a rotation is the next)."""
    if root.keyid == launch.keyid:
        raise ValueError("the launch key must be another key than the root that delegates to it")
    cert = {
        "type": DELEGATION_TYPE, "hall": hall, "keyid": launch.keyid, "public": bytes(launch.verify_key).hex(),
        "scope": scope, "serial": serial, "issuedAt": issued_at, "expiresAt": expires_at,
    }  # fmt: skip
    message = _DELEGATION_DOMAIN + hashlib.sha256(canonical.dumps(cert)).digest()
    doc = {"cert": cert, "signatures": [{"keyid": root.keyid, "sig": root.signing_key.sign(message).signature.hex()}]}
    d, _ = Delegation.parse(doc)
    return dataclasses.replace(d, issuer=root.keyid)


def delegation_text(d: Delegation) -> str:
    """The contents of a delegation file."""
    return json.dumps(d.document, sort_keys=True) + "\n"


class SignatureCheckError(Exception):
    """Why a signature list does not vouch for a message: ``kind`` is "malformed", "forged" or "untrusted"."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind, self.detail = kind, detail


def check_signatures(sigs: object, keyring: Keyring, message: bytes, what: str, max_signatures: int = 16) -> str:
    """The one signature check of bundles and notices: ``sigs`` is a list of objects of exactly ``keyid`` and
    ``sig`` (strings; ``sig`` 128 lowercase hex digits), and the first one by a key in ``keyring`` must verify
    ``message``. Returns that key id; raises :class:`SignatureCheckError`. Signatures by keys not trusted are
    skipped (key rotation), but only well-formed ones."""
    if not isinstance(sigs, list) or not sigs:
        raise SignatureCheckError("malformed", "signatures: expected a non-empty list")
    if len(sigs) > max_signatures:
        raise SignatureCheckError("malformed", f"signatures: {len(sigs)}, more than {max_signatures}")
    seen_ids: list[str] = []
    for i, s in enumerate(sigs):
        if not isinstance(s, dict) or set(s) != {"keyid", "sig"}:
            raise SignatureCheckError("malformed", f"signatures[{i}]: expected exactly keyid and sig")
        keyid, sig_hex = s["keyid"], s["sig"]
        if not isinstance(keyid, str) or not isinstance(sig_hex, str):
            raise SignatureCheckError("malformed", f"signatures[{i}]: keyid and sig must be strings")
        seen_ids.append(keyid[:16])
        vk = keyring.get(keyid)
        if vk is None:
            continue
        try:
            sig = bytes.fromhex(sig_hex)
        except ValueError:
            sig = b""
        if len(sig) != 64 or sig.hex() != sig_hex:
            raise SignatureCheckError("forged", f"signatures[{i}].sig: expected 128 lowercase hex digits")
        try:
            vk.verify(message, sig)
        except BadSignatureError:
            raise SignatureCheckError(
                "forged", f"signatures[{i}]: signature by key {keyid} does not match the {what} (tampered?)"
            ) from None
        return keyid
    raise SignatureCheckError(
        "untrusted",
        f"signed by {', '.join(seen_ids)}, none of which is trusted "
        f"(trusted {what} keys: {', '.join(keyring.keyids) or 'none'})",
    )
