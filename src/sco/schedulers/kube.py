"""The few Kubernetes API calls the node agent makes, on the lean HTTP client (no official client: memory).

Follows core/v1 and policy/v1 as the official client would send them; tests run it against the API stand-in.

Credentials as client-go finds them: an explicit URL with a bearer-token file and a CA file; a kubeconfig
(current context: server, CA, token or token file, client certificate); or in-cluster discovery
(``KUBERNETES_SERVICE_HOST``/``PORT`` and the service account's ``token`` and ``ca.crt``). The token file is
read again every minute (as client-go's cached file token source does: bound tokens expire and the kubelet
rotates the file), at once after a 401, and before any request once the file changed (a stat of its inode,
mtime and size: a rotation that revokes the old token at the same moment costs no failed call; a request already
in flight with the old token is answered 401 once and sent again). With https a CA is
required; trusting the system store must be said explicitly (``ca_file="system"``). TLS failures and 401/403
are :class:`KubeCredentialError`, never "unreachable": retrying does not fix them, a person must.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import ssl
import tempfile
import time
import urllib.parse
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sco._document import load_document
from sco._http import AsyncHttpClient, HttpError, HttpTimeout, Response

Obj = dict[str, Any]
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# A watch the API server does not end by its timeoutSeconds (plus this) is cut: every stream has an end.
WATCH_GRACE_S = 30.0
TOKEN_REREAD_S = 60.0  # client-go's cached file token source re-reads at this period
LIST_PAGE = 500


class KubeError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class KubeCredentialError(KubeError):
    """401/403 or a TLS failure: the credential or the trust is wrong; retrying will not help."""


class KubeGone(KubeError):
    """410 Gone: the resourceVersion is too old (compacted); list again."""


class KubeUnreachable(Exception):
    """The API server did not answer within the timeout (or refused the connection)."""


class KubeConfigError(Exception):
    """The credential settings cannot work (no CA for https, an unreadable kubeconfig...)."""


@dataclass(frozen=True)
class EvictResult:
    status: int  # 201/200 accepted, 429 blocked by a PDB, 404 gone, 409 replaced (uid precondition), other: error
    message: str
    retry_after: float = 0.0

    @property
    def accepted(self) -> bool:
        return self.status in (200, 201)


def _message(body: bytes) -> str:
    try:
        obj = json.loads(body)
        msg = str(obj.get("message", ""))
        causes = (obj.get("details") or {}).get("causes") or []
        extra = [str(c.get("message", "")) for c in causes if str(c.get("message", "")) not in msg]
        return "; ".join([msg, *extra]).strip("; ")
    except (ValueError, AttributeError):
        return body[:200].decode("utf-8", "replace")


def _error(status: int, body: bytes) -> KubeError:
    msg = _message(body)
    if status in (401, 403):
        return KubeCredentialError(status, msg)
    if status == 410:
        return KubeGone(status, msg)
    return KubeError(status, msg)


@dataclass(frozen=True)
class Credentials:
    """Where to find the API server and how to prove who we are."""

    url: str
    token_file: Path | None = None
    token: str | None = None  # a literal token (kubeconfig ``token``)
    ca_file: str | None = None  # a path, or "system" for the system trust store
    cert_file: Path | None = None
    key_file: Path | None = None

    @classmethod
    def in_cluster(cls, env: dict[str, str] | None = None, sa_dir: Path = SERVICE_ACCOUNT_DIR) -> Credentials:
        env = dict(os.environ) if env is None else env
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise KubeConfigError("in-cluster: KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT must be set")
        for f in ("token", "ca.crt"):
            if not (sa_dir / f).is_file():
                raise KubeConfigError(f"in-cluster: {sa_dir / f}: no such file")
        h = f"[{host}]" if ":" in host else host
        return cls(f"https://{h}:{port}", token_file=sa_dir / "token", ca_file=str(sa_dir / "ca.crt"))

    @classmethod
    def from_kubeconfig(cls, path: Path, context: str | None = None) -> Credentials:
        """The current (or named) context of a kubeconfig: server, CA, token / tokenFile, client certificate."""
        where = str(path)
        doc = load_document(Path(path).read_bytes(), where, what="kubeconfig", error=KubeConfigError)
        try:
            name = context or doc["current-context"]
            ctx = next(c["context"] for c in doc["contexts"] if c["name"] == name)
            cluster = next(c["cluster"] for c in doc["clusters"] if c["name"] == ctx["cluster"])
            user: Obj = next((u["user"] for u in doc.get("users") or [] if u["name"] == ctx.get("user")), {}) or {}
        except (KeyError, StopIteration, TypeError) as e:
            raise KubeConfigError(f"{where}: no usable context ({e})") from None
        base = Path(path).parent

        def materialise(data_key: str, file_key: str, src: Obj, suffix: str) -> Path | None:
            if src.get(data_key):
                fd, tmp = tempfile.mkstemp(prefix="sco-kube-", suffix=suffix)
                with os.fdopen(fd, "wb") as f:
                    f.write(base64.b64decode(src[data_key]))
                return Path(tmp)
            if src.get(file_key):
                return base / str(src[file_key])
            return None

        ca = materialise("certificate-authority-data", "certificate-authority", cluster, ".crt")
        ca_file = str(ca) if ca else None
        if cluster.get("insecure-skip-tls-verify"):
            raise KubeConfigError(f"{where}: insecure-skip-tls-verify is refused: give the cluster's CA")
        return cls(
            str(cluster["server"]),
            token_file=(base / user["tokenFile"]) if user.get("tokenFile") else None,
            token=user.get("token"),
            ca_file=ca_file,
            cert_file=materialise("client-certificate-data", "client-certificate", user, ".crt"),
            key_file=materialise("client-key-data", "client-key", user, ".key"),
        )

    def ssl_context(self) -> ssl.SSLContext | None:
        if not self.url.startswith("https:"):
            return None
        if not self.ca_file:
            raise KubeConfigError(
                f"{self.url}: https needs the cluster's CA (a CA file, or 'system' to trust the system store)"
            )
        ctx = (
            ssl.create_default_context()
            if self.ca_file == "system"
            else ssl.create_default_context(cafile=self.ca_file)
        )
        if self.cert_file and self.key_file:
            ctx.load_cert_chain(str(self.cert_file), str(self.key_file))
        return ctx


class KubeClient:
    def __init__(
        self,
        url: str | Credentials,
        *,
        token_file: Path | None = None,
        ca_file: str | Path | None = None,
        timeout: float = 0.8,
        max_connections: int = 16,
        token_reread_s: float = TOKEN_REREAD_S,
    ) -> None:
        creds = (
            url
            if isinstance(url, Credentials)
            else Credentials(url, token_file=token_file, ca_file=str(ca_file) if ca_file else None)
        )
        self.creds = creds
        self.ssl = creds.ssl_context()
        # retry_refused: an API server restarting refuses connections for a moment; each call connects again
        # within its own timeout before the refusal counts (the agent's definition of silence, ARCHITECTURE.md)
        self.http = AsyncHttpClient(
            creds.url, timeout=timeout, max_connections=max_connections, ssl_context=self.ssl, retry_refused=True
        )
        self.hearing = self.http.hearing  # when the API server last said anything (responses, watch events)
        self.timeout = timeout
        self._token_reread_s = token_reread_s
        self._token_read_at = -1e18
        self._token_sig: tuple[int, int, int, int] | None = None
        self.token_changes = 0  # how many times a different token was read from the file (preflight again)
        self._refresh_token(force=True)

    # --- credentials -------------------------------------------------------------------------------

    def _refresh_token(self, force: bool = False) -> None:
        tf = self.creds.token_file
        if tf is None:
            if self.creds.token:
                self.http.headers["Authorization"] = f"Bearer {self.creds.token}"
            return
        now = time.monotonic()
        sig = self.token_file_signature()
        if not force and sig == self._token_sig and now - self._token_read_at < self._token_reread_s:
            return
        self._token_read_at = now
        try:
            token = Path(tf).read_text().strip()
        except OSError:
            return  # keep the last token; the API's 401 will say what is wrong
        if not token:
            return  # caught between a truncate and a write: keep the last token, read again next time
        self._token_sig = sig
        header = f"Bearer {token}"
        if self.http.headers.get("Authorization") not in (None, header):
            self.token_changes += 1
        self.http.headers["Authorization"] = header

    def token_file_signature(self) -> tuple[int, int, int, int] | None:
        """(device, inode, mtime in ns, size) of the token file (following symlinks, as kubelet's projected
        volume swaps a ``..data`` link): one stat before each request, so a token rotated and the old one
        revoked at once never costs a 401. None without a token file or when it cannot be stat'ed."""
        tf = self.creds.token_file
        if tf is None:
            return None
        try:
            st = os.stat(tf)
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)

    async def close(self) -> None:
        await self.http.close()

    async def _request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        query: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> Response:
        self._refresh_token()
        for attempt in (0, 1):
            try:
                r = await self.http.request(method, path, body, content_type=content_type, query=query, timeout=timeout)
            except HttpTimeout as e:
                raise KubeUnreachable(str(e)) from None
            except HttpError as e:
                if isinstance(e.__context__, ssl.SSLError) or "CERTIFICATE_VERIFY_FAILED" in str(e):
                    raise KubeCredentialError(0, f"TLS: {e}") from None
                raise KubeUnreachable(str(e)) from None
            if r.status == 401 and attempt == 0 and self.creds.token_file is not None:
                self._refresh_token(force=True)  # a rotated token: read the file again before giving up
                continue
            return r
        return r

    async def request(self, method: str, path: str, body: Any = None, **kw: Any) -> Response:
        """Any call, answered with its response whatever the status (401 retried once with the token read
        again); silence and TLS failures raise as for every call."""
        return await self._request(method, path, body, **kw)

    async def _ok(self, method: str, path: str, body: Any = None, **kw: Any) -> Obj:
        r = await self._request(method, path, body, **kw)
        try:
            data = r.json()
        except ValueError:
            data = None
        if r.status >= 300 or not isinstance(data, dict):
            raise _error(r.status, r.body)
        return data

    # --- nodes -------------------------------------------------------------------------------------

    async def get_node(self, name: str, timeout: float | None = None) -> Obj:
        return await self._ok("GET", f"/api/v1/nodes/{urllib.parse.quote(name)}", timeout=timeout)

    async def delete_node(self, name: str, uid: str, timeout: float | None = None) -> int:
        """DELETE the Node ``name`` only if it is still the object ``uid`` (DeleteOptions preconditions: another
        object registered under the name answers 409 and is left alone). The status: 200 deleted, 404 not there,
        409 another object; anything else raises."""
        body: Obj = {"kind": "DeleteOptions", "apiVersion": "v1", "preconditions": {"uid": uid}}
        r = await self._request("DELETE", f"/api/v1/nodes/{urllib.parse.quote(name)}", body, timeout=timeout)
        if r.status in (200, 202, 404, 409):
            return 200 if r.status == 202 else r.status
        raise _error(r.status, r.body)

    async def taint_node(
        self,
        name: str,
        key: str,
        value: str,
        effect: str = "NoSchedule",
        annotations: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> Obj:
        """Add (or keep) the taint, mark the node unschedulable, set the annotations. ``spec.taints`` is atomic:
        read-modify-write of the whole list on resourceVersion (409: read again)."""
        for _ in range(5):
            node = await self.get_node(name, timeout)
            taints = [t for t in node.get("spec", {}).get("taints") or [] if t.get("key") != key]
            taints.append({"key": key, "value": value, "effect": effect})
            md: Obj = {"resourceVersion": node["metadata"]["resourceVersion"]}
            if annotations:
                md["annotations"] = annotations
            patch = {"metadata": md, "spec": {"taints": taints, "unschedulable": True}}
            r = await self._request(
                "PATCH",
                f"/api/v1/nodes/{urllib.parse.quote(name)}",
                patch,
                content_type="application/merge-patch+json",
                timeout=timeout,
            )
            if r.status == 409:
                continue  # somebody else changed the node: read again
            if r.status >= 300:
                raise _error(r.status, r.body)
            return dict(r.json())
        raise KubeError(409, f"node {name}: conflicting updates, gave up after 5 tries")

    async def preflight(self, node: str, timeout: float = 2.0) -> list[str]:
        """What would stop a drain on ``node``: unknown node (404), a credential that may not read, patch
        (a server-side dry run) or list its pods (401/403), TLS. Empty when all is well."""
        q = urllib.parse.quote(node)
        try:
            try:
                current = await self.get_node(node, timeout)
            except KubeError as e:
                if e.status == 404:
                    return [f'node "{node}" is not known to the API server (404): set agent.node to its name there']
                raise
            r = await self._request(
                "PATCH",
                f"/api/v1/nodes/{q}",
                {"spec": {"unschedulable": bool(current.get("spec", {}).get("unschedulable"))}},
                content_type="application/merge-patch+json",
                query={"dryRun": "All"},
                timeout=timeout,
            )
            if r.status in (401, 403):
                return [f'the credential may not patch node "{node}" ({r.status}: {_message(r.body)})']
            if r.status >= 300:
                return [f'patching node "{node}" (dry run) failed: HTTP {r.status}: {_message(r.body)}']
            await self.list_pods(node, limit=1, timeout=timeout)
        except KubeCredentialError as e:
            what = "TLS" if e.status == 0 else f"{e.status}"
            return [f"the API server refused the credential ({what}): {e.message}"]
        except KubeError as e:
            return [f"the API server answered HTTP {e.status}: {e.message}"]
        except KubeUnreachable as e:
            return [f"the API server did not answer: {e}"]
        return []

    # --- pods --------------------------------------------------------------------------------------

    async def list_pods(
        self,
        node: str,
        *,
        resource_version: str | None = None,
        limit: int = LIST_PAGE,
        cont: str | None = None,
        timeout: float | None = None,
    ) -> tuple[list[Obj], str, str | None]:
        """One page of the pods bound to ``node``: (items, list resourceVersion, continue token)."""
        q = {"fieldSelector": f"spec.nodeName={node}", "limit": str(limit)}
        if resource_version is not None:
            q["resourceVersion"] = resource_version
        if cont:
            q["continue"] = cont
        data = await self._ok("GET", "/api/v1/pods", query=q, timeout=timeout)
        md = data.get("metadata") or {}
        return list(data.get("items") or []), str(md.get("resourceVersion", "")), md.get("continue") or None

    async def pods_on_node(self, node: str, timeout: float | None = None) -> tuple[list[Obj], str]:
        """Every pod bound to ``node`` (a consistent read, paged) and the resourceVersion to watch from."""
        items, rv, cont = await self.list_pods(node, timeout=timeout)
        while cont:
            more, _, cont = await self.list_pods(node, cont=cont, timeout=timeout)
            items += more
        return items, rv

    async def watch_pods(self, node: str, resource_version: str, timeout_s: int = 300) -> AsyncIterator[Obj]:
        """Watch events for the pods bound to ``node`` from ``resource_version`` (bookmarks included). An
        expired resourceVersion raises :class:`KubeGone`: list again. The stream has its own connection
        (``sco._http``'s stream: the head within the call's timeout, its header and record limits); the API
        server ends it after ``timeout_s``, and a stream that outlives that by WATCH_GRACE_S is cut."""
        self._refresh_token()
        query = {
            "watch": "true",
            "fieldSelector": f"spec.nodeName={node}",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout_s),
        }
        try:
            resp = await self.http.stream("GET", "/api/v1/pods", query=query, deadline=timeout_s + WATCH_GRACE_S)
        except HttpTimeout:
            raise KubeUnreachable(f"watch: no answer within {self.timeout} s") from None
        except HttpError as e:
            if isinstance(e.__context__, ssl.SSLError) or "CERTIFICATE_VERIFY_FAILED" in str(e):
                raise KubeCredentialError(0, f"TLS: {e}") from None
            raise KubeUnreachable(f"watch: {e}") from None
        async with resp:
            try:
                if resp.status != 200:
                    if resp.status == 401:
                        self._refresh_token(force=True)  # rotated: the next watch sends the new token
                    raise _error(resp.status, await resp.body())
                async for line in resp.records():
                    ev = json.loads(line)
                    if ev.get("type") == "ERROR":
                        st = ev.get("object") or {}
                        code = int(st.get("code") or 500)
                        raise (KubeGone if code == 410 else KubeError)(code, str(st.get("message", "")))
                    yield ev
            except (HttpError, ValueError) as e:
                raise KubeUnreachable(f"watch: {e}") from None

    async def request_token(
        self,
        ns: str,
        service_account: str,
        *,
        seconds: int,
        audiences: list[str] | None = None,
        bound_node: tuple[str, str] | None = None,
        timeout: float | None = None,
    ) -> tuple[str, float]:
        """TokenRequest (authentication.k8s.io/v1) for ``ns/service_account``, bound to the Node ``(name, uid)``:
        the token dies with that node object. (token, expiry as Unix time, from ``status.expirationTimestamp``:
        the server may issue a shorter lifetime than asked)."""
        spec: Obj = {"expirationSeconds": int(seconds)}
        if audiences:
            spec["audiences"] = list(audiences)
        if bound_node is not None:
            spec["boundObjectRef"] = {"kind": "Node", "apiVersion": "v1", "name": bound_node[0], "uid": bound_node[1]}
        q = urllib.parse.quote
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
        path = f"/api/v1/namespaces/{q(ns)}/serviceaccounts/{q(service_account)}/token"
        data = await self._ok("POST", path, body, timeout=timeout)
        st = data.get("status") or {}
        token, when = st.get("token"), st.get("expirationTimestamp")
        if not isinstance(token, str) or not token or not isinstance(when, str):
            raise KubeError(500, "TokenRequest: the answer holds no status.token and expirationTimestamp")
        from datetime import datetime

        try:
            exp = datetime.fromisoformat(when.replace("Z", "+00:00")).timestamp()
        except ValueError:
            raise KubeError(500, f"TokenRequest: expirationTimestamp {when[:40]!r} is not RFC 3339") from None
        return token, exp

    async def create_event(self, ns: str, event: Obj, timeout: float | None = None) -> Obj:
        """POST a core/v1 Event (``create events`` is all the credential needs for it)."""
        return await self._ok("POST", f"/api/v1/namespaces/{urllib.parse.quote(ns)}/events", event, timeout=timeout)

    async def evict(
        self, ns: str, name: str, grace: int, uid: str | None = None, timeout: float | None = None
    ) -> EvictResult:
        opts: Obj = {"gracePeriodSeconds": int(grace)}
        if uid:
            opts["preconditions"] = {"uid": uid}  # never the pod that replaced it under the same name
        body = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": ns},
            "deleteOptions": opts,
        }
        q = urllib.parse.quote
        r = await self._request("POST", f"/api/v1/namespaces/{q(ns)}/pods/{q(name)}/eviction", body, timeout=timeout)
        return _result(r)

    async def delete_pod(
        self, ns: str, name: str, grace: int, uid: str | None = None, timeout: float | None = None
    ) -> EvictResult:
        q = urllib.parse.quote
        body: Obj = {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": int(grace)}
        if uid:
            body["preconditions"] = {"uid": uid}
        r = await self._request("DELETE", f"/api/v1/namespaces/{q(ns)}/pods/{q(name)}", body, timeout=timeout)
        return _result(r)


def _result(r: Response) -> EvictResult:
    if r.status < 300:
        return EvictResult(r.status, "")
    try:
        retry = float(r.headers.get("retry-after", 0))
    except ValueError:
        retry = 0.0
    if r.status in (401, 403):
        raise KubeCredentialError(r.status, _message(r.body))
    return EvictResult(r.status, _message(r.body), retry)


async def sleep_until(loop_time: float) -> None:
    await asyncio.sleep(max(0.0, loop_time - asyncio.get_running_loop().time()))
