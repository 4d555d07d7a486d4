"""The few Kubernetes API calls the node agent makes, on the lean HTTP client (no official client: memory).

Follows core/v1 and policy/v1 as the official client would send them; tests run it against the API stand-in.
"""

from __future__ import annotations

import asyncio
import ssl
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sco._http import AsyncHttpClient, HttpError, HttpTimeout

Obj = dict[str, Any]


class KubeError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class KubeUnreachable(Exception):
    """The API server did not answer within the timeout (or refused the connection)."""


@dataclass(frozen=True)
class EvictResult:
    status: int  # 201/200 accepted, 429 blocked by a PDB, 404 gone, other: error
    message: str

    @property
    def accepted(self) -> bool:
        return self.status in (200, 201)


def _message(body: bytes) -> str:
    import json

    try:
        obj = json.loads(body)
        msg = str(obj.get("message", ""))
        causes = (obj.get("details") or {}).get("causes") or []
        return "; ".join([msg, *(str(c.get("message", "")) for c in causes)]).strip("; ")
    except (ValueError, AttributeError):
        return body[:200].decode("utf-8", "replace")


class KubeClient:
    def __init__(
        self,
        url: str,
        *,
        token_file: Path | None = None,
        ca_file: Path | None = None,
        timeout: float = 0.8,
        max_connections: int = 16,
    ) -> None:
        headers = {}
        if token_file is not None:
            headers["Authorization"] = f"Bearer {Path(token_file).read_text().strip()}"
        ctx = ssl.create_default_context(cafile=str(ca_file)) if ca_file else None
        self.http = AsyncHttpClient(
            url, timeout=timeout, max_connections=max_connections, headers=headers, ssl_context=ctx
        )

    async def close(self) -> None:
        await self.http.close()

    async def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        query: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> tuple[int, bytes, Any]:
        try:
            r = await self.http.request(method, path, body, content_type=content_type, query=query, timeout=timeout)
        except HttpTimeout as e:
            raise KubeUnreachable(str(e)) from None
        except HttpError as e:
            raise KubeUnreachable(str(e)) from None
        try:
            data = r.json()
        except ValueError:
            data = None
        return r.status, r.body, data

    async def _ok(self, method: str, path: str, body: Any = None, **kw: Any) -> Obj:
        status, raw, data = await self._call(method, path, body, **kw)
        if status >= 300 or not isinstance(data, dict):
            raise KubeError(status, _message(raw))
        return data

    async def get_node(self, name: str) -> Obj:
        return await self._ok("GET", f"/api/v1/nodes/{urllib.parse.quote(name)}")

    async def taint_node(self, name: str, key: str, value: str, effect: str = "NoSchedule") -> Obj:
        """Add (or keep) the taint and mark the node unschedulable; read-modify-write on resourceVersion."""
        for _ in range(5):
            node = await self.get_node(name)
            taints = [t for t in node.get("spec", {}).get("taints") or [] if t.get("key") != key]
            taints.append({"key": key, "value": value, "effect": effect})
            patch = {
                "metadata": {"resourceVersion": node["metadata"]["resourceVersion"]},
                "spec": {"taints": taints, "unschedulable": True},
            }
            status, raw, data = await self._call(
                "PATCH",
                f"/api/v1/nodes/{urllib.parse.quote(name)}",
                patch,
                content_type="application/merge-patch+json",
            )
            if status == 409:
                continue  # somebody else changed the node: read again
            if status >= 300 or not isinstance(data, dict):
                raise KubeError(status, _message(raw))
            return data
        raise KubeError(409, f"node {name}: conflicting updates, gave up after 5 tries")

    async def pods_on_node(self, node: str) -> list[Obj]:
        data = await self._ok("GET", "/api/v1/pods", query={"fieldSelector": f"spec.nodeName={node}"})
        return list(data.get("items") or [])

    async def evict(self, ns: str, name: str, grace: int) -> EvictResult:
        body = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": ns},
            "deleteOptions": {"gracePeriodSeconds": int(grace)},
        }
        q = urllib.parse.quote
        status, raw, _ = await self._call("POST", f"/api/v1/namespaces/{q(ns)}/pods/{q(name)}/eviction", body)
        return EvictResult(status, "" if status in (200, 201) else _message(raw))

    async def delete_pod(self, ns: str, name: str, grace: int) -> EvictResult:
        q = urllib.parse.quote
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": int(grace)}
        status, raw, _ = await self._call("DELETE", f"/api/v1/namespaces/{q(ns)}/pods/{q(name)}", body)
        return EvictResult(status, "" if status < 300 else _message(raw))


async def sleep_until(loop_time: float) -> None:
    await asyncio.sleep(max(0.0, loop_time - asyncio.get_running_loop().time()))
