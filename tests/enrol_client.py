"""The node's side of the enrolment exchange in the tests: a request body and a POST to the service's /v1/enrol."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.relays import HALL


def post(url: str, doc: Any, raw: bytes | None = None, ca: Path | None = None) -> tuple[int, bytes]:
    """``ca``: the CA an https service's certificate must chain to."""
    data = raw if raw is not None else json.dumps(doc).encode()
    req = urllib.request.Request(f"{url}/v1/enrol", data=data, headers={"Content-Type": "application/json"})
    ctx = ssl.create_default_context(cafile=str(ca)) if ca else None
    try:
        with urllib.request.urlopen(req, timeout=30, context=ctx) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def request(node: str, server_id: str, token: str, public: str) -> dict[str, str]:
    return {"hall": HALL, "node": node, "instance_id": server_id, "token": token, "nkey_public": public}
