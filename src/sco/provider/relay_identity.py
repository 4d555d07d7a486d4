"""Node identities on the notice relay, issued at run time: NATS decentralized authentication (operator mode).

A node the control loop launches is in no inventory, so the listed relay configuration (one account per node,
written by the notice_relay role) cannot know it. Here the relay trusts an operator instead, and learns each
node's account at run time from its full resolver: no restart, no reload, one request per node.

Trust, top down (every key an nkey, every claim a NATS JWT v2, signed Ed25519):

- the **operator**: its JWT names one signing key, which signs every account and account deletion (the identity
  key signs only the operator JWT, so it may stay offline), and the system account. Not "strict": strict would
  also forbid an account's identity key to sign its users, and the hall's accounts do sign theirs;
- the **hall's accounts**, signed by the operator's signing key: ``SYS`` (the user that pushes account JWTs),
  ``SCO_NOTICES`` (the reclaimers: the only publishers of notices) and ``SCO_EVENTS`` (JetStream, the readers,
  the stream tool), with the imports and exports of the listed configuration;
- **one account per node**, ``SCO_NODE_<node>``, created at enrolment: it imports its own notice subject from
  ``SCO_NOTICES`` and sends its own events and heartbeats into ``SCO_EVENTS``. Per-node accounts stay, because
  what isolates a node is not its allow-list (the server never checks a reply subject against it: a JetStream
  request or an event naming another node's notice subject as its reply is answered there) but the account:
  the answer lands in the sender's own account, where no other node listens. Only the operator's signing key
  creates accounts, so only this module declares imports, as only the role's template did;
- the node's **user**: its JWT names the node's public key (the seed never leaves the node) and is signed by the
  hall's node issuer, a *scoped* signing key of the node's account whose template holds that node's
  permissions. A scoped user carries no permissions of its own (the server refuses one that does), so the node's
  rights are what the operator-signed account says, whatever a user JWT might claim. The account's own identity
  key signs nothing: its seed is dropped at enrolment.

Revocation: a newer account JWT for the node with ``revocations {"*": now}``, no signing key, no import and a
connection limit of 0. When the relay stores it, it re-applies the account's claims at once: the node's
connected client is closed ("User Authentication Revoked") and every later attempt refused. The resolver keeps
the newer JWT (and its peers sync to it), so a relay that missed the push cannot revive the node, which an
account deletion (``forget``, ``allow_delete``) alone would risk; the pushed JWT is read back to confirm, since a
relay answers "jwt updated" even when it keeps an already newer one.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import re
import time
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nkeys  # type: ignore[import-untyped]  # no stubs, no py.typed

from sco import _nats
from sco._fs import atomic_write
from sco.contract.enrolment import creds_text
from sco.errors import ConfigError, ScoError

STREAM = "SCO_EVENTS"
HEARTBEAT_STREAM = "SCO_HEARTBEATS"
NOTICES_ACCOUNT = "SCO_NOTICES"
EVENTS_ACCOUNT = "SCO_EVENTS"
SYSTEM_ACCOUNT = "SYS"

CLAIMS_UPDATE = "$SYS.REQ.CLAIMS.UPDATE"
CLAIMS_DELETE = "$SYS.REQ.CLAIMS.DELETE"
CLAIMS_LOOKUP = "$SYS.REQ.ACCOUNT.{account}.CLAIMS.LOOKUP"
CLAIMS_PACK = "$SYS.REQ.CLAIMS.PACK"

_PREFIX = {
    "operator": nkeys.PREFIX_BYTE_OPERATOR,
    "account": nkeys.PREFIX_BYTE_ACCOUNT,
    "user": nkeys.PREFIX_BYTE_USER,
}
_NAME = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")
_NO_LIMITS: dict[str, Any] = {
    "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": True, "conn": -1, "leaf": -1,
}  # fmt: skip
_JETSTREAM: dict[str, Any] = {"mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}
_USER_LIMITS: dict[str, Any] = {"subs": -1, "data": -1, "payload": -1}


class RelayIdentityError(ScoError):
    """The relay refused or did not answer a push, a lookup or a deletion (or answered something else)."""

    exit_code = 12


# --- keys and tokens -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NKey:
    """An nkey: its public key, and its seed when this side may sign with it (never shown by repr)."""

    public: str
    seed: bytes = b""

    def __repr__(self) -> str:
        return f"NKey({self.public})"

    @classmethod
    def generate(cls, kind: str) -> NKey:
        """A new key of ``kind`` (operator, account, user)."""
        return cls.from_seed(bytes(nkeys.encode_seed(os.urandom(32), _PREFIX[kind])))

    @classmethod
    def from_seed(cls, seed: bytes) -> NKey:
        kp = nkeys.from_seed(bytearray(seed.strip()))
        try:
            return cls(public=bytes(kp.public_key).decode(), seed=seed.strip())
        finally:
            kp.wipe()

    def sign(self, data: bytes) -> bytes:
        if not self.seed:
            raise ConfigError(f"{self.public}: public key only, cannot sign")
        kp = nkeys.from_seed(bytearray(self.seed))
        try:
            return bytes(kp.sign(data))
        finally:
            kp.wipe()


def is_public_key(key: str, kind: str) -> bool:
    """Whether ``key`` is a well-formed public nkey of ``kind`` (prefix byte and CRC-16 checked)."""
    try:
        raw = base64.b32decode(key + "=" * (-len(key) % 8))
    except ValueError:
        return False
    body = raw[:-2]
    return len(raw) == 35 and body[0] == _PREFIX[kind] and nkeys.crc16(body) == int.from_bytes(raw[-2:], "little")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()


_HEADER = _b64(_json({"alg": "ed25519-nkey", "typ": "JWT"}))


def encode_jwt(
    signer: NKey, subject: str, nats: Mapping[str, Any], *, name: str = "", issued_at: int = 0, expires: int = 0
) -> str:
    """A NATS JWT v2 (header ``{"typ": "JWT", "alg": "ed25519-nkey"}``) of ``nats`` about ``subject``, signed by
    ``signer``. ``jti`` hashes the whole claims (the Go library hashes only the standard ones, so two JWTs of one
    account issued in the same second with other content share a jti, and a relay keeps the first)."""
    claims: dict[str, Any] = {"iat": issued_at or int(time.time()), "iss": signer.public, "sub": subject}
    if name:
        claims["name"] = name
    if expires:
        claims["exp"] = expires
    claims["nats"] = {**nats, "version": 2}
    claims["jti"] = base64.b32encode(hashlib.new("sha512_256", _json(claims)).digest()).decode().rstrip("=")
    payload = _b64(_json(claims))
    signature = signer.sign(f"{_HEADER}.{payload}".encode())
    return f"{_HEADER}.{payload}.{_b64(signature)}"


def decode_jwt(token: str) -> dict[str, Any]:
    """The claims of ``token``, unverified (the relay verifies; this is for reading back what was issued)."""
    try:
        payload = token.split(".")[1]
        return dict(json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))))
    except (IndexError, ValueError) as e:
        raise ConfigError(f"not a JWT: {e}") from e


def creds(user_jwt: str, seed: bytes) -> str:
    """A standard ``.creds`` file's text (as ``nsc`` writes it; nats-py's ``user_credentials``, the agent's
    ``nats_creds_file``). Assembled where the seed is: on the node (``sco.contract.enrolment``)."""
    return creds_text(user_jwt, seed)


# --- the hall's keys -------------------------------------------------------------------------------------------

_KEY_KINDS = {
    "operator": "operator",
    "operator-signer": "operator",
    "system": "account",
    "notices": "account",
    "events": "account",
    "node-issuer": "account",
    "system-admin": "user",
}
ISSUER_SEEDS = ("operator-signer", "system", "system-admin", "node-issuer")
"""The keys the enrolment service signs with: accounts (the operator's signing key), the issuer's own user (the
system account's key and the admin user's), node users (the node issuer). The other three it needs public only."""


@dataclass(frozen=True)
class HallKeys:
    """Everything the hall's issuer signs with. ``node_issuer`` is the scoped signing key of every node account;
    ``system_admin`` the system account's user that pushes account JWTs."""

    hall: str
    operator: NKey
    operator_signer: NKey
    system: NKey
    notices: NKey
    events: NKey
    node_issuer: NKey
    system_admin: NKey
    stream: str = STREAM
    heartbeat_stream: str = HEARTBEAT_STREAM

    @classmethod
    def generate(cls, hall: str) -> HallKeys:
        _check_name("hall", hall)
        return cls._of(hall, {name: NKey.generate(kind) for name, kind in _KEY_KINDS.items()})

    @classmethod
    def _of(cls, hall: str, k: Mapping[str, NKey]) -> HallKeys:
        return cls(
            hall=hall, operator=k["operator"], operator_signer=k["operator-signer"], system=k["system"],
            notices=k["notices"], events=k["events"], node_issuer=k["node-issuer"], system_admin=k["system-admin"],
        )  # fmt: skip

    @classmethod
    def ensure(cls, directory: Path, hall: str) -> HallKeys:
        """The hall's keys from ``directory`` (``<name>.nk``, 0600), each created on first use: as the role's
        nkey lookup does, a second run changes nothing."""
        _check_name("hall", hall)
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        keys: dict[str, NKey] = {}
        for name, kind in _KEY_KINDS.items():
            path = directory / f"{name}.nk"
            if not path.exists():
                atomic_write(path, NKey.generate(kind).seed + b"\n", mode=0o600)
            try:
                keys[name] = NKey.from_seed(path.read_bytes())
            except Exception as e:  # nkeys' ErrInvalidSeed and friends, nacl's refusal
                raise ConfigError(f"{path}: not an nkey seed ({type(e).__name__})") from e
        return cls._of(hall, keys)

    @classmethod
    def load(cls, directory: Path, hall: str) -> HallKeys:
        """The hall's keys as the enrolment service holds them, from ``directory``: ``<name>.nk`` (a seed) or, for
        a key it never signs with (the operator's identity, the notices and events accounts), ``<name>.pub`` (its
        public key) instead. Nothing is made: a missing or wrong file is an error naming it (keys made here would
        sign identities no relay trusts)."""
        _check_name("hall", hall)
        keys: dict[str, NKey] = {}
        for name, kind in _KEY_KINDS.items():
            seed, public = directory / f"{name}.nk", directory / f"{name}.pub"
            try:
                if seed.exists():
                    keys[name] = NKey.from_seed(seed.read_bytes())
                    if not is_public_key(keys[name].public, kind):
                        raise ConfigError(f"{seed}: not a seed of kind {kind}")
                elif name not in ISSUER_SEEDS and public.exists():
                    text = public.read_text().strip()
                    if not is_public_key(text, kind):
                        raise ConfigError(f"{public}: not a public key of kind {kind}")
                    keys[name] = NKey(public=text)
                else:
                    also = "" if name in ISSUER_SEEDS else f" or {public.name}"
                    raise ConfigError(f"{seed}{also}: no such file (the hall's relay keys, operator mode)")
            except ConfigError:
                raise
            except Exception as e:  # nkeys' ErrInvalidSeed and friends, nacl's refusal, a file unreadable
                raise ConfigError(f"{seed}: not an nkey seed ({type(e).__name__})") from e
        return cls._of(hall, keys)


def _check_name(what: str, name: str) -> None:
    if not _NAME.fullmatch(name):
        raise ConfigError(f"{what} {name!r}: letters, digits, '-', '_' and inner dots only (a NATS subject's tokens)")


# --- permissions, as the notice_relay role's template grants them ----------------------------------------------


def node_inbox(hall: str, node: str) -> str:
    """Where node ``node`` takes replies (the agent's ``inbox_prefix``): dots made '_', one token each."""
    return f"_INBOX.{hall.replace('.', '_')}.{node.replace('.', '_')}"


def _node_publishes(keys: HallKeys) -> list[str]:
    return [f"sco.events.{keys.hall}"] + ([f"sco.heartbeat.{keys.hall}"] if keys.heartbeat_stream else [])


def _read_events(keys: HallKeys, durable: str) -> list[str]:
    st = keys.stream
    return [
        "$JS.API.INFO", f"$JS.API.STREAM.INFO.{st}", f"$JS.API.CONSUMER.INFO.{st}.{durable}",
        f"$JS.API.CONSUMER.DURABLE.CREATE.{st}.{durable}", f"$JS.API.CONSUMER.CREATE.{st}.{durable}",
        f"$JS.API.CONSUMER.CREATE.{st}.{durable}.>", f"$JS.API.CONSUMER.MSG.NEXT.{st}.{durable}",
        f"$JS.ACK.{st}.{durable}.>",
    ]  # fmt: skip


def _read_heartbeats(keys: HallKeys) -> list[str]:
    hs = keys.heartbeat_stream
    if not hs:
        return []
    return [
        f"$JS.API.STREAM.INFO.{hs}", f"$JS.API.CONSUMER.CREATE.{hs}.>", f"$JS.API.CONSUMER.MSG.NEXT.{hs}.>",
        f"$JS.API.CONSUMER.DELETE.{hs}.>",
    ]  # fmt: skip


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _reclaimer_js(keys: HallKeys) -> list[str]:
    return _unique(_read_events(keys, f"sco-reclaimer-{keys.hall}") + _read_heartbeats(keys))


def _permissions(pub: Sequence[str], sub: Sequence[str]) -> dict[str, Any]:
    return {"pub": {"allow": list(pub)}, "sub": {"allow": list(sub)}, **_USER_LIMITS}


def node_permissions(keys: HallKeys, node: str) -> dict[str, Any]:
    """Node ``node``'s rights: subscribe to its own notices and its own inbox, publish its own events (and
    heartbeats)."""
    return _permissions(
        [f"{p}.{node}" for p in _node_publishes(keys)],
        [f"sco.notice.{keys.hall}.{node}", f"{node_inbox(keys.hall, node)}.>"],
    )


# --- claims -----------------------------------------------------------------------------------------------------


def operator_jwt(keys: HallKeys) -> str:
    return encode_jwt(
        keys.operator, keys.operator.public,
        {"type": "operator", "signing_keys": [keys.operator_signer.public], "system_account": keys.system.public},
        name=f"sco-{keys.hall}",
    )  # fmt: skip


def _account(keys: HallKeys, account: str, name: str, nats: Mapping[str, Any], issued_at: int = 0) -> str:
    return encode_jwt(keys.operator_signer, account, {"type": "account", **nats}, name=name, issued_at=issued_at)


def system_account_jwt(keys: HallKeys) -> str:
    return _account(keys, keys.system.public, SYSTEM_ACCOUNT, {"limits": _NO_LIMITS})


def _export(subject: str, kind: str, **more: Any) -> dict[str, Any]:
    return {"name": subject, "subject": subject, "type": kind, **more}


def _import(subject: str, kind: str, account: str) -> dict[str, Any]:
    return {"name": subject, "subject": subject, "type": kind, "account": account}


def notices_account_jwt(keys: HallKeys) -> str:
    """The reclaimers' account: the notices (exported; each node account imports its own subject) and, imported
    from ``SCO_EVENTS``, the JetStream API of their consumer, the events and ``_INBOX.>``."""
    h = keys.hall
    imports = [_import(s, "service", keys.events.public) for s in _reclaimer_js(keys)]
    imports += [_import(s, "stream", keys.events.public) for s in (f"sco.events.{h}.>", "_INBOX.>")]
    nats = {"limits": _NO_LIMITS, "exports": [_export(f"sco.notice.{h}.>", "stream")], "imports": imports}
    return _account(keys, keys.notices.public, NOTICES_ACCOUNT, nats)


def events_account_jwt(keys: HallKeys) -> str:
    """JetStream's account: every node's events and heartbeats exported as services (a node account imports its
    own subject), and the reclaimers' JetStream API, events and inbox exported for ``SCO_NOTICES``. An export
    names no account here: only the operator's signing key creates accounts, and only this module writes their
    imports (a listed configuration's ``accounts: [...]`` restricts the same set of importers)."""
    exports = [_export(f"{p}.>", "service") for p in _node_publishes(keys)]
    exports += [
        _export(s, "service", **({"response_type": "Stream"} if ".MSG.NEXT." in s else {})) for s in _reclaimer_js(keys)
    ]
    exports += [_export(s, "stream") for s in (f"sco.events.{keys.hall}.>", "_INBOX.>")]
    nats = {"limits": {**_NO_LIMITS, **_JETSTREAM}, "exports": exports}
    return _account(keys, keys.events.public, EVENTS_ACCOUNT, nats)


def hall_account_jwts(keys: HallKeys) -> dict[str, str]:
    """Account public key -> JWT of the system account and the hall's two accounts (the server config preloads
    them; pushing them again updates a running relay)."""
    return {
        keys.system.public: system_account_jwt(keys),
        keys.notices.public: notices_account_jwt(keys),
        keys.events.public: events_account_jwt(keys),
    }


def user_jwt(
    account: NKey, user: str, name: str, permissions: Mapping[str, Any], *, issued_at: int = 0, expires: int = 0
) -> str:
    """A user of a hall account, signed by the account's own key, with its permissions."""
    return encode_jwt(account, user, {"type": "user", **permissions}, name=name, issued_at=issued_at, expires=expires)


def reclaimer_user_jwt(keys: HallKeys, user: str, name: str = "reclaimer") -> str:
    """A reclaimer (``SCO_NOTICES``): publishes notices and reads the events through its durable consumer."""
    return user_jwt(
        keys.notices, user, name,
        _permissions([f"sco.notice.{keys.hall}.>", *_reclaimer_js(keys)], [f"sco.events.{keys.hall}.>", "_INBOX.>"]),
    )  # fmt: skip


def reader_user_jwt(keys: HallKeys, user: str, name: str = "control") -> str:
    """A reader (``SCO_EVENTS``): the hall's events through one durable consumer named ``name``, heartbeats."""
    pub = _unique(_read_events(keys, name) + _read_heartbeats(keys))
    return user_jwt(keys.events, user, name, _permissions(pub, [f"sco.events.{keys.hall}.>", "_INBOX.>"]))


def stream_admin_user_jwt(keys: HallKeys, user: str, name: str = "relay-admin") -> str:
    """The stream tool (``SCO_EVENTS``): JetStream's API only."""
    return user_jwt(keys.events, user, name, _permissions(["$JS.API.>"], ["_INBOX.>"]))


def system_admin_user_jwt(keys: HallKeys) -> str:
    """The issuer's own user in the system account: account JWT pushes, lookups and deletions only."""
    return user_jwt(
        keys.system, keys.system_admin.public, "sco-identity-issuer",
        _permissions([CLAIMS_UPDATE, CLAIMS_DELETE, CLAIMS_LOOKUP.format(account="*")], ["_INBOX.>"]),
    )  # fmt: skip


def sync_user_jwt(keys: HallKeys, user: str, name: str = "relay-sync") -> str:
    """A relay's own user in the system account, for its catch-up before it starts: asks a peer for every account
    JWT it holds (``$SYS.REQ.CLAIMS.PACK``) and nothing else. It cannot push, delete or sign anything: an account
    JWT is good only with the operator's signature, and a relay keeps the newer of two."""
    return user_jwt(keys.system, user, name, _permissions([CLAIMS_PACK], ["_INBOX.>"]))


@dataclass(frozen=True)
class NodeIdentity:
    """One enrolment of a node: its account (a fresh key per enrolment), its user (the node's public key), when
    it was issued, and the two JWTs. What to keep to revoke it later (the JWTs can be minted again)."""

    node: str
    account: str
    user: str
    issued_at: int
    account_jwt: str
    user_jwt: str


def node_account_jwt(keys: HallKeys, node: str, account: str, *, issued_at: int = 0, revoked_at: int = 0) -> str:
    """Node ``node``'s account: its notice subject imported, its events (and heartbeats) sent to ``SCO_EVENTS``,
    the node issuer as its only signing key, scoped to the node's permissions. ``revoked_at``: the account after
    revocation (every user issued up to then revoked, no signer, no import, no connection)."""
    _check_name("node", node)
    name = f"SCO_NODE_{node}"
    if revoked_at:
        revoked = {"limits": {**_NO_LIMITS, "conn": 0, "leaf": 0}, "revocations": {"*": revoked_at}}
        return _account(keys, account, name, revoked, issued_at=max(issued_at, revoked_at))
    imports = [_import(f"sco.notice.{keys.hall}.{node}", "stream", keys.notices.public)]
    imports += [_import(f"{p}.{node}", "service", keys.events.public) for p in _node_publishes(keys)]
    scope = {
        "kind": "user_scope", "key": keys.node_issuer.public, "role": "node",
        "template": node_permissions(keys, node), "description": f"node {node} of hall {keys.hall}",
    }  # fmt: skip
    nats: dict[str, Any] = {"limits": {**_NO_LIMITS, "leaf": 0}, "imports": imports, "signing_keys": [scope]}
    return _account(keys, account, name, nats, issued_at=issued_at)


def enrol(keys: HallKeys, node: str, node_user: str, *, expires: int = 0, now: int = 0) -> NodeIdentity:
    """A new identity for node ``node``, whose public key (``U...``) is ``node_user``: a fresh account and a
    scoped user JWT (no permissions of its own). Nothing is sent: push ``identity.account_jwt`` to the relay."""
    _check_name("node", node)
    if not is_public_key(node_user, "user"):
        raise ConfigError(f"node {node}: {node_user!r} is not a user public key (U...)")
    issued_at = now or int(time.time())
    account = NKey.generate("account").public  # its seed is dropped: the operator signs it, the issuer its user
    user = encode_jwt(
        keys.node_issuer, node_user, {"type": "user", "issuer_account": account},
        name=f"node-{node}", issued_at=issued_at, expires=expires,
    )  # fmt: skip
    return NodeIdentity(
        node=node, account=account, user=node_user, issued_at=issued_at,
        account_jwt=node_account_jwt(keys, node, account, issued_at=issued_at), user_jwt=user,
    )  # fmt: skip


def revoked_account_jwt(keys: HallKeys, identity: NodeIdentity, *, now: int = 0) -> str:
    """The node's account JWT after revocation, never older than the one it replaces (a relay keeps the newer)."""
    revoked_at = max(now or int(time.time()), identity.issued_at)
    return node_account_jwt(keys, identity.node, identity.account, issued_at=identity.issued_at, revoked_at=revoked_at)


def delete_request_jwt(keys: HallKeys, accounts: Sequence[str]) -> str:
    """A request to delete ``accounts`` from a full resolver (``allow_delete``): self-signed by the operator's
    signing key."""
    signer = keys.operator_signer
    return encode_jwt(signer, signer.public, {"type": "generic", "accounts": list(accounts)})


# --- the relay's configuration ---------------------------------------------------------------------------------

_ROUTE = re.compile(r"[A-Za-z0-9.:\[\]-]+:[0-9]+")
_TLS_TIMEOUT_S = 2  # a TLS handshake's deadline, clients' and routes'


@dataclass(frozen=True)
class RelayTls:
    """The relay's TLS: its certificate and key (signed by the hall's CA, naming every address it is reached at)
    and the CA it trusts. Clients must speak TLS (a plaintext connection is refused) and check the relay's
    certificate against the CA; routes present the relay's certificate and must be shown one the CA signed."""

    cert_file: str
    key_file: str
    ca_file: str

    def __post_init__(self) -> None:
        for name in ("cert_file", "key_file", "ca_file"):
            value = getattr(self, name)
            if not value or '"' in value or "\n" in value:
                raise ConfigError(f"relay TLS: {name} {value!r} must be a path (no quotes, no newline)")

    def block(self, indent: str, *, verify: bool) -> str:
        """A ``tls {}`` block; ``verify``: the other side must present a certificate the CA signed (routes)."""
        inner = indent + "  "
        return (
            f'{indent}tls {{\n{inner}cert_file: "{self.cert_file}"\n{inner}key_file: "{self.key_file}"\n'
            f'{inner}ca_file: "{self.ca_file}"\n{inner}timeout: {_TLS_TIMEOUT_S}\n'
            f"{inner + 'verify: true' + chr(10) if verify else ''}{indent}}}\n"
        )


@dataclass(frozen=True)
class Cluster:
    """One relay's place in the hall's NATS cluster: every relay routes to every other (``routes``, host:port; a
    route to itself is dropped by the server) over TLS, and a route is let in only with a certificate the hall's CA
    signed (``tls``, verify): no shared secret, nothing in a route's URL, and nothing without such a certificate joins
    to read or inject the hall's traffic. The system account's traffic crosses the routes like any other:
    an account JWT pushed to one relay reaches every relay's full resolver at once. A relay that was down (or cut
    off) when a JWT was pushed does not learn it from its peers: the resolver's own sync (``interval``) asks a
    queue group that the asking server itself answers first (nats-server 2.15: seen here, the revoked node still
    admitted by the restarted relay minutes later), so the role's unit has the relay catch up before it starts
    (``sco-relay-catchup.py``, as the ``relay-sync`` user: ``sync_user_jwt``)."""

    name: str
    listen: str
    routes: Sequence[str]
    tls: RelayTls

    def __post_init__(self) -> None:
        _check_name("cluster", self.name)
        for route in [self.listen, *self.routes]:
            if not _ROUTE.fullmatch(route):
                raise ConfigError(f"cluster {self.name}: {route!r} is not host:port")
        if len(self.routes) < 2:
            raise ConfigError(f"cluster {self.name}: {len(self.routes)} route(s); list every relay, two or more")
        if not isinstance(self.tls, RelayTls):
            raise ConfigError(f"cluster {self.name}: routes need the relay's TLS (a RelayTls)")

    def block(self) -> str:
        """The ``cluster {}`` block (no secret: routes prove themselves by certificate)."""
        routes = "".join(f'    "nats-route://{r}"\n' for r in self.routes)
        return (
            f'cluster {{\n  name: "{self.name}"\n  listen: "{self.listen}"\n'
            f"{self.tls.block('  ', verify=True)}"
            # clients get every relay's URL from the roles; the addresses a server sees on its own interfaces may
            # not be reachable for them
            f"  no_advertise: true\n  routes: [\n{routes}  ]\n}}\n\n"
        )


def server_config(
    keys: HallKeys,
    *,
    resolver_dir: Path,
    store_dir: Path,
    listen: str = "0.0.0.0",
    port: int = 4222,
    monitor_port: int = 8222,
    server_name: str = "",
    max_accounts: int = 100_000,
    max_memory_store: str = "64M",
    max_file_store: str = "1G",
    cluster: Cluster | None = None,
    tls: RelayTls | None = None,
) -> str:
    """nats-server.conf in operator mode for the hall: the operator JWT, the system account, a full resolver
    (the relay stores every pushed account JWT in ``resolver_dir`` and keeps it across restarts;
    ``allow_delete`` lets ``forget`` remove one) with the hall's accounts preloaded. ``tls``: clients over TLS
    only (the role's default; a ``cluster`` takes its routes' TLS from it). Holds no secret (the key stays in its
    file)."""
    if cluster and tls is None:
        tls = cluster.tls
    preload = "\n".join(f"  {pub}: {jwt}" for pub, jwt in hall_account_jwts(keys).items())
    name = server_name or f"{keys.hall}-relay"
    return (
        f"# Notice relay of hall {keys.hall}, operator mode: accounts are pushed at run time "
        f"(sco.provider.relay_identity)\n"
        f'server_name: "{name}"\nlisten: "{listen}:{port}"\nhttp: "127.0.0.1:{monitor_port}"\nmax_payload: 1MB\n\n'
        f'jetstream {{\n  store_dir: "{store_dir}"\n  max_memory_store: {max_memory_store}\n'
        f"  max_file_store: {max_file_store}\n}}\n\n"
        f"{tls.block('', verify=False) + chr(10) if tls else ''}"
        f"{cluster.block() if cluster else ''}"
        f"operator: {operator_jwt(keys)}\nsystem_account: {keys.system.public}\n\n"
        f'resolver {{\n  type: full\n  dir: "{resolver_dir}"\n  allow_delete: true\n  interval: "2m"\n'
        f'  timeout: "1.9s"\n  limit: {max_accounts}\n}}\n\n'
        f"resolver_preload {{\n{preload}\n}}\n"
    )


# --- pushing to a running relay --------------------------------------------------------------------------------


class RelayAdmin:
    """The issuer's connection to the relay's system account. Every request has a deadline (``timeout``)."""

    def __init__(self, nc: Any, timeout: float) -> None:
        self.nc = nc
        self.timeout = timeout

    @classmethod
    async def connect(
        cls, servers: str | Sequence[str], keys: HallKeys, timeout: float = 5.0, tls_ca_file: str | None = None
    ) -> RelayAdmin:
        """Connect as the system account's admin user, from the keys (no creds file on disk); ``tls_ca_file``: the
        hall's CA, which the relay's certificate must chain to."""
        token = system_admin_user_jwt(keys).encode()
        admin = keys.system_admin

        def signature(nonce: str) -> bytes:
            return base64.b64encode(admin.sign(nonce.encode()))

        async def quiet(e: Exception) -> None:  # the failure is raised below, once
            pass

        urls = [servers] if isinstance(servers, str) else list(servers)
        try:
            nc = await _nats.connect(
                urls, auth={"user_jwt_cb": lambda: token, "signature_cb": signature}, deadline_s=timeout * 2,
                connect_timeout=timeout, error_cb=quiet, tls_ca_file=tls_ca_file,
            )  # fmt: skip
        except Exception as e:
            what = str(e) or type(e).__name__
            raise RelayIdentityError(f"relay {', '.join(urls)}: cannot connect as the issuer: {what}") from e
        return cls(nc, timeout)

    async def close(self) -> None:
        await self.nc.close()

    async def _request(self, subject: str, payload: bytes) -> dict[str, Any]:
        try:
            msg = await self.nc.request(subject, payload, timeout=self.timeout)
            return dict(json.loads(msg.data))
        except Exception as e:
            raise RelayIdentityError(f"{subject}: no answer within {self.timeout} s ({e or type(e).__name__})") from e

    async def push(self, account_jwt: str) -> str:
        """Store ``account_jwt`` on the relay (``$SYS.REQ.CLAIMS.UPDATE``); returns the relay's message."""
        answer = await self._request(CLAIMS_UPDATE, account_jwt.encode())
        if "error" in answer or "data" not in answer:
            err = answer.get("error") or answer
            raise RelayIdentityError(f"account {decode_jwt(account_jwt).get('name')}: relay refused: {err}")
        return str(answer["data"].get("message", ""))

    async def push_many(self, account_jwts: Iterable[str], concurrency: int = 128) -> int:
        """Push every JWT, ``concurrency`` requests in flight; returns how many; the first refusal is raised."""
        gate = asyncio.Semaphore(concurrency)

        async def one(token: str) -> None:
            async with gate:
                await self.push(token)

        tokens = list(account_jwts)
        await _gather([one(t) for t in tokens])
        return len(tokens)

    async def lookup(self, account: str) -> str:
        """The account JWT the relay holds for ``account`` ("" if none)."""
        try:
            msg = await self.nc.request(CLAIMS_LOOKUP.format(account=account), b"", timeout=self.timeout)
        except Exception as e:
            raise RelayIdentityError(f"account {account}: lookup unanswered within {self.timeout} s ({e!r})") from e
        return bytes(msg.data).decode()

    async def forget(self, keys: HallKeys, accounts: Sequence[str]) -> str:
        """Delete ``accounts`` from the relay's resolver (``$SYS.REQ.CLAIMS.DELETE``, ``allow_delete``): its
        clients are closed. For accounts already revoked, to keep the resolver's directory bounded."""
        answer = await self._request(CLAIMS_DELETE, delete_request_jwt(keys, accounts).encode())
        if "error" in answer or "data" not in answer:
            raise RelayIdentityError(f"deleting {len(accounts)} account(s): relay refused: {answer.get('error')}")
        return str(answer["data"].get("message", ""))


async def _gather(steps: Sequence[Awaitable[None]]) -> None:
    results = await asyncio.gather(*steps, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r


async def issue(admin: RelayAdmin, keys: HallKeys, node: str, node_user: str, *, expires: int = 0) -> NodeIdentity:
    """Enrol node ``node`` (public key ``node_user``) and push its account: once this returns, the node can
    connect with its user JWT and its own seed."""
    identity = enrol(keys, node, node_user, expires=expires)
    await admin.push(identity.account_jwt)
    return identity


async def revoke(admin: RelayAdmin, keys: HallKeys, identity: NodeIdentity) -> None:
    """Revoke ``identity`` on the running relay: push its revoked account JWT and read it back (the relay answers
    "jwt updated" even when it keeps a newer one). Its connected client is closed when the relay stores it."""
    token = revoked_account_jwt(keys, identity)
    await admin.push(token)
    held = await admin.lookup(identity.account)
    if held != token and "revocations" not in decode_jwt(held).get("nats", {}):
        raise RelayIdentityError(f"node {identity.node}: the relay kept an account JWT without the revocation")
