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
"""

from __future__ import annotations

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


def _read_key_json(path: Path, kind: str) -> dict[str, Any]:
    try:
        # O_NONBLOCK and the checks before reading: a FIFO or /dev/zero named *.pub hung check-config and run
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise KeyFileError(f"{path}: not a key file (not a regular file)")
            if st.st_size > MAX_KEY_FILE_BYTES:
                raise KeyFileError(f"{path}: not a key file ({st.st_size} bytes)")
            data = json.loads(f.read(MAX_KEY_FILE_BYTES + 1).decode())
    except FileNotFoundError:
        raise KeyFileError(f"{path}: no such key file") from None
    except (OSError, ValueError) as e:
        raise KeyFileError(f"{path}: not a key file ({e})") from None
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


def sign(payload: dict[str, Any], keys: Iterable[PrivateKey]) -> bytes:
    """The bytes of a bundle file: ``payload`` signed by every key in ``keys``."""
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

    def __init__(self, raw: bytes, payload_bytes: memoryview, keyid: str, where: str) -> None:
        self.raw = raw
        self.keyid = keyid  # the trusted key whose signature was checked
        self.where = where
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


def verify(raw: bytes, keyring: Keyring, where: str = "bundle") -> Verified:
    """Check ``raw`` is a well-formed bundle signed by a key in ``keyring``; raise BundleError if not."""
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
        keyid = check_signatures(sigs, keyring, _message(digest), "bundle")
    except SignatureCheckError as e:
        cls = {"forged": SignatureError, "untrusted": UntrustedKeyError}.get(e.kind, BundleError)
        raise cls(f"{where}: {e.detail}") from None
    return Verified(raw, body, keyid, where)


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
