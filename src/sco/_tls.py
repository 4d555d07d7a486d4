"""TLS for SCO's own HTTP listeners (the distributor, the agent's and the enrolment service's ``/metrics``) and for
their clients: one place that makes the contexts.

A server's certificate and key are read again when either file changes (checked at most once a second, on a new
connection): a renewed certificate (role contract_distributor's, node_agent's) is served from the next handshake on,
without a restart that would cut a drain or a node's fetch. Standard library only (the agent imports it).
"""

from __future__ import annotations

import os
import ssl
import threading
import time

RECHECK_S = 1.0  # how often a new connection may look at the files again


class TlsSettingError(ValueError):
    """A TLS file that cannot be used (missing, unreadable, not a certificate or key, the pair not matching)."""


def client_context(ca_file: str | None) -> ssl.SSLContext:
    """A client's context: the server's certificate verified against ``ca_file`` (the hall's CA; None or "": the
    system's trust store) and its name checked, TLS 1.2 at least."""
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file or None)
    except (OSError, ssl.SSLError) as e:
        raise TlsSettingError(f"CA file {ca_file}: {getattr(e, 'strerror', None) or e}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


class ServerTls:
    """A server's context over a certificate (its chain) and key file, reloaded when either changes."""

    def __init__(self, cert_file: str, key_file: str) -> None:
        if not cert_file or not key_file:
            raise TlsSettingError("TLS needs both a certificate file and its key file")
        self.cert_file, self.key_file = cert_file, key_file
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self._lock = threading.Lock()
        self._stamp = self._files_stamp()
        self._load()
        self._checked = time.monotonic()
        self.reloads = 0
        self.reload_error = ""  # the last reload that failed (the previous pair is still served)

    def _files_stamp(self) -> tuple[tuple[int, int, int], ...]:
        out = []
        for f in (self.cert_file, self.key_file):
            try:
                st = os.stat(f)
            except OSError as e:
                raise TlsSettingError(f"{f}: {e.strerror or e}") from None
            out.append((st.st_ino, st.st_mtime_ns, st.st_size))
        return tuple(out)

    def _load(self) -> None:
        try:
            self.context.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as e:
            raise TlsSettingError(
                f"certificate {self.cert_file} and key {self.key_file}: {getattr(e, 'strerror', None) or e}"
            ) from None

    def refresh(self) -> None:
        """Load the files again if they changed (at most one look a second); a pair that fails to load keeps the
        one served before (a renewal caught between its two writes is taken at the next look)."""
        now = time.monotonic()
        if now - self._checked < RECHECK_S:
            return
        with self._lock:
            if now - self._checked < RECHECK_S:
                return
            self._checked = now
            try:
                stamp = self._files_stamp()
                if stamp == self._stamp:
                    return
                self._load()  # the context's new pair applies to every handshake from now on
            except TlsSettingError as e:
                self.reload_error = str(e)
                return
            self._stamp, self.reload_error = stamp, ""
            self.reloads += 1


__all__ = ["RECHECK_S", "ServerTls", "TlsSettingError", "client_context"]
