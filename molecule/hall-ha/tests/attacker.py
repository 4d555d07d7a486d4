"""The attacker's tools: run inside a test host's network namespace (`ip netns exec NS python attacker.py`) with the
controller's venv, as test_attacker.py does from ha-attacker (a host on the hall's network in no inventory) and, for
the control runs, from an allowed host. Reads a JSON list of operations on stdin and prints one JSON list of what
each got; secrets come in on stdin, never on a command line (the process-argument sampler would see them).

Operations (``op``):
- ``http``: one request (``method``, ``url``, ``body``, ``auth`` [user, password], ``ca``: the CA to check the
  server with; none: the certificate is not checked, as an attacker would not) -> status and body, or the error;
- ``route``: the relay's cluster port at ``host``:``port``: its INFO in the clear if it sends one, then a TLS
  handshake showing ``cert``/``key`` (none: no certificate; ``self-signed``: one of a CA of the attacker's own)
  and a PING -> what came back or what refused it;
- ``nats_raw``: the client port spoken by hand (CONNECT with a creds file's JWT and signed nonce, PING), in the
  clear, ignoring the INFO's tls_required, or over TLS -> whether a PONG came;
- ``pg``: psycopg with ``dsn`` and ``password`` -> connected (and whether over TLS) or the error;
- ``cert``: a key and a certificate for ``name`` written in ``dir``, signed by ``ca_cert``/``ca_key`` (a CA's files
  on the controller) or, without them, self-signed (an intruder's own) -> their paths.

``attacker.py serve BIND PORT ROOT LOG [CERT KEY]`` is the fake distributor: ROOT's files over HTTP, or over HTTPS
with CERT and KEY, until killed; each connection and request a JSON line in LOG (the TLS handshake's outcome, the
request line and status, the server's error for what is not HTTP), the first line once it listens.
"""

from __future__ import annotations

import base64
import datetime
import functools
import http.client
import http.server
import json
import socket
import ssl
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

DEADLINE_S = 8.0


def _context(ca: str | None) -> ssl.SSLContext:
    if ca:
        return ssl.create_default_context(cafile=ca)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # the attacker checks nothing
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def http_op(o: dict[str, Any]) -> dict[str, Any]:
    u = urlsplit(o["url"])
    c: http.client.HTTPConnection
    if u.scheme == "https":
        c = http.client.HTTPSConnection(u.hostname or "", u.port, timeout=DEADLINE_S, context=_context(o.get("ca")))
    else:
        c = http.client.HTTPConnection(u.hostname or "", u.port, timeout=DEADLINE_S)
    headers = {"Content-Type": "application/json", **(o.get("headers") or {})}
    if o.get("auth"):
        user, password = o["auth"]
        headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    body = o.get("body")
    try:
        c.request(o["method"], u.path, body=None if body is None else json.dumps(body), headers=headers)
        r = c.getresponse()
        return {"status": r.status, "body": r.read().decode(errors="replace")[:2000]}
    except (OSError, http.client.HTTPException) as e:  # ssl.SSLError is an OSError
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        c.close()


def _certificate(d: Path, name: str, ca_cert: str | None = None, ca_key: str | None = None) -> tuple[str, str]:
    """A key and a server certificate for ``name`` in ``d``: signed by the CA ``ca_cert``/``ca_key``, or (without)
    self-signed, a CA that is not the hall's (an intruder's own)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer, signer, issuer_public = subject, key, key.public_key()
    if ca_cert and ca_key:
        ca = x509.load_pem_x509_certificate(Path(ca_cert).read_bytes())
        signer = serialization.load_pem_private_key(Path(ca_key).read_bytes(), None)  # type: ignore[assignment]
        issuer, issuer_public = ca.subject, ca.public_key()  # type: ignore[assignment]
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_public), critical=False)
        .sign(signer, hashes.SHA256())
    )  # fmt: skip
    d.mkdir(parents=True, exist_ok=True)
    crt, k = d / f"{name}.crt", d / f"{name}.key"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    k.touch(mode=0o600)
    k.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(crt), str(k)


def cert_op(o: dict[str, Any]) -> dict[str, Any]:
    crt, key = _certificate(Path(o["dir"]), o["name"], o.get("ca_cert"), o.get("ca_key"))
    return {"cert": crt, "key": key}


def route_op(o: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ctx = _context(None)
        cert, key = o.get("cert"), o.get("key")
        if cert == "self-signed":
            cert, key = _certificate(Path(tmp), "ha-infra1")
        if cert:
            ctx.load_cert_chain(cert, key)
        try:
            with socket.create_connection((o["host"], o["port"]), DEADLINE_S) as s:
                # a route port may send its INFO in the clear first, or wait for the handshake (TLS first): a
                # short look, never longer than the server waits for a handshake (2 s)
                s.settimeout(0.5)
                try:
                    info = s.recv(4096, socket.MSG_PEEK)
                except TimeoutError:
                    info = b""
                if info.startswith(b"INFO"):
                    s.recv(len(info))
                out["info"] = "in the clear, tls_required" if b'"tls_required":true' in info else "none (TLS first)"
                s.settimeout(DEADLINE_S)
                with ctx.wrap_socket(s, server_hostname=o["host"]) as t:
                    out["handshake"] = "done"
                    t.settimeout(3)
                    t.sendall(b"PING\r\n")
                    try:
                        got = t.recv(4096)
                        out["outcome"] = f"answered: {got[:200].decode(errors='replace')}" if got else "closed"
                    except TimeoutError:
                        out["outcome"] = "held open (no answer within 3 s)"
        except (OSError, ssl.SSLError) as e:
            out["outcome"] = f"refused: {type(e).__name__}: {e}"
    return out


def _connect_line(info: bytes, creds: str | None) -> bytes:
    """The CONNECT a client sends: with ``creds`` (a creds file) its user JWT and the INFO's nonce signed by its
    seed, as nats-py signs it."""
    opts: dict[str, Any] = {"verbose": False, "pedantic": False, "tls_required": False, "protocol": 1}
    if creds:
        import nkeys

        text = Path(creds).read_text()
        jwt = text.split("-----BEGIN NATS USER JWT-----")[1].split("------END NATS USER JWT------")[0].strip()
        seed = text.split("-----BEGIN USER NKEY SEED-----")[1].split("------END USER NKEY SEED------")[0].strip()
        nonce = json.loads(info.split(b" ", 1)[1])["nonce"] if b'"nonce"' in info else ""
        kp = nkeys.from_seed(bytearray(seed.encode()))
        opts.update(jwt=jwt, sig=base64.b64encode(kp.sign(nonce.encode())).decode())
    return b"CONNECT " + json.dumps(opts).encode() + b"\r\nPING\r\n"


def nats_raw_op(o: dict[str, Any]) -> dict[str, Any]:
    """The client port spoken by hand: its INFO, then CONNECT (with ``creds``: the user's JWT and signed nonce)
    and PING, in the clear or, with ``ca``, over TLS as a client upgrades after the INFO -> whether a PONG came."""
    try:
        with socket.create_connection((o["host"], o["port"]), DEADLINE_S) as s:
            s.settimeout(3)
            info = s.recv(4096)
            conn: socket.socket = s
            if o.get("ca"):
                conn = _context(o["ca"]).wrap_socket(s, server_hostname=o["host"])
                conn.settimeout(3)
            conn.sendall(_connect_line(info, o.get("creds")))
            seen = b""
            try:
                while chunk := conn.recv(4096):
                    seen += chunk
                    if b"PONG" in seen or b"-ERR" in seen:
                        break
            except (TimeoutError, ConnectionResetError, ssl.SSLError):
                pass
            return {
                "tls_required": b'"tls_required":true' in info,
                "pong": b"PONG" in seen,
                "seen": seen[:300].decode(errors="replace"),
            }
    except OSError as e:
        return {"error": f"{type(e).__name__}: {e}", "pong": False}


def pg_op(o: dict[str, Any]) -> dict[str, Any]:
    import psycopg

    try:
        with psycopg.connect(o["dsn"], password=o["password"], connect_timeout=int(DEADLINE_S)) as c:
            row = c.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetchone()
            return {"connected": True, "ssl": bool(row and row[0])}
    except psycopg.Error as e:
        return {"connected": False, "error": f"{type(e).__name__}: {str(e).strip()}"}


OPS = {"http": http_op, "route": route_op, "nats_raw": nats_raw_op, "pg": pg_op, "cert": cert_op}


class _FakeDistributor(http.server.SimpleHTTPRequestHandler):
    """A file server that notes each connection: its TLS handshake (done, or why not), its request and status, and
    the server's error for what is not HTTP (a TLS ClientHello sent to the plain port)."""

    timeout = 10  # a client that stalls is cut
    note: Any = None  # the LOG writer (one JSON line per event, shared by the connections' threads)

    def handle(self) -> None:
        if isinstance(self.connection, ssl.SSLSocket):
            try:
                self.connection.do_handshake()
            except (OSError, ssl.SSLError) as e:
                self.note(self.client_address[0], tls=f"failed: {type(e).__name__}: {e}")
                return
            self.note(self.client_address[0], tls="done")
        super().handle()

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        self.note(self.client_address[0], request=self.requestline[:200], status=int(code))

    def log_error(self, format: str, *args: Any) -> None:
        self.note(self.client_address[0], error=(format % args)[:300])


def serve(bind: str, port: int, root: str, log: str, cert: str = "", key: str = "") -> None:
    lock = threading.Lock()
    out = open(log, "a")  # noqa: SIM115 (open until the process is killed)

    def note(peer: str, **what: Any) -> None:
        with lock:
            out.write(json.dumps({"at": round(time.time(), 3), "peer": peer, **what}) + "\n")
            out.flush()

    _FakeDistributor.note = staticmethod(note)
    srv = http.server.ThreadingHTTPServer((bind, port), functools.partial(_FakeDistributor, directory=root))
    srv.daemon_threads = True
    if cert:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        # the handshake on the connection's thread (handle), where its failure is noted
        srv.socket = ctx.wrap_socket(srv.socket, server_side=True, do_handshake_on_connect=False)
    note("", serving="https" if cert else "http", listen=f"{bind}:{port}")
    srv.serve_forever()


def main() -> None:
    if sys.argv[1:2] == ["serve"]:
        bind, port, root, log, *tls = sys.argv[2:]
        serve(bind, int(port), root, log, *tls)
        return
    ops = json.load(sys.stdin)
    print(json.dumps([OPS[o["op"]](o) for o in ops]))


if __name__ == "__main__":
    main()
