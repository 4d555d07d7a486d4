"""The hall's contracts as a ConfigMap, for Kubernetes admission (the Kyverno policies in ``kyverno/``).

Admission depends only on the contract layer (seed view 07): the distributor publishes the names and budgets of
the verified bundle into the cluster, and the policies read them there, so placement without a contract is
refused even when the control plane is down. The ConfigMap is flat ``string -> string`` so the policies' CEL
(standard library only) and JMESPath can read it without parsing:

- ``_hall``, ``_serial``, ``_digest``: which bundle this is (a lower serial is never published over a higher);
- ``_ns.<namespace>``: the Kubernetes/Spark contracts covering that namespace, for refusal messages;
- ``<contract>``: its scheduler (``kubernetes``, ``spark`` or ``slurm``), present for every contract;
- ``<contract>.namespace``, ``<contract>.match`` (``k=v,k=v``, sorted), ``<contract>.matchCount``,
  ``<contract>.grace`` (drain budget + final write, seconds): Kubernetes and Spark contracts only.

Contract names are DNS-1123 labels (no ``.`` or ``_``), so the derived keys never collide with a contract.
Published with the control side's credential on the Kubernetes credentials code the agent uses
(``sco.schedulers.kube``) and its HTTP client; not used by the agent itself.
"""

from __future__ import annotations

import asyncio
import ssl
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sco._http import Response
from sco.contract.bundle import Bundle
from sco.errors import BundleError, ConfigError, RollbackError, ScoError
from sco.schedulers.kube import Credentials, KubeClient, KubeConfigError, KubeCredentialError, KubeUnreachable

CONTRACT_LABEL = "sco.dev/contract"
RECLAIM_TAINT = "sco.dev/reclaim"
CAPACITY_LABEL = "sco.dev/capacity"
CAPACITY_RECLAIMABLE = "reclaimable"
DEFAULT_NAMESPACE = "sco-system"
DEFAULT_NAME = "sco-contracts"
# Kubernetes refuses a ConfigMap whose data exceeds 1 MiB (validation.MaxSecretSize applies to both).
MAX_DATA_BYTES = 1024 * 1024

Obj = dict[str, Any]


class KubePublishError(ScoError):
    """The ConfigMap could not be read or written in the cluster."""

    exit_code = 7


def configmap_data(bundle: Bundle) -> dict[str, str]:
    if bundle.subset_of:
        # A launch subset lacks most contracts: publishing it would refuse every other workload.
        raise BundleError(f"bundle serial {bundle.serial} is a launch subset: publish the hall's full bundle")
    data: dict[str, str] = {
        "_hall": bundle.hall,
        "_serial": str(bundle.serial),
        "_digest": bundle.content_digest,
    }
    by_ns: dict[str, list[str]] = {}
    for name, c in sorted(bundle.contracts.items()):
        data[name] = str(c["scheduler"])
        if c["scheduler"] not in ("kubernetes", "spark"):
            continue
        sel = c["selector"]
        match = sel.get("matchLabels") or {}
        data[f"{name}.namespace"] = str(sel["namespace"])
        data[f"{name}.match"] = ",".join(f"{k}={v}" for k, v in sorted(match.items()))
        data[f"{name}.matchCount"] = str(len(match))
        data[f"{name}.grace"] = str(int(c["drainBudgetSeconds"]) + int(c.get("finalWriteSeconds", 0)))
        by_ns.setdefault(str(sel["namespace"]), []).append(name)
    for ns, names in sorted(by_ns.items()):
        data[f"_ns.{ns}"] = ", ".join(names)
    size = sum(len(k.encode()) + len(v.encode()) for k, v in data.items())
    if size > MAX_DATA_BYTES:
        raise ConfigError(
            f"bundle serial {bundle.serial}: the contracts ConfigMap would hold {size} bytes, over Kubernetes' "
            f"1 MiB limit for a ConfigMap: split the hall or shorten contract names"
        )
    return data


def configmap(bundle: Bundle, namespace: str = DEFAULT_NAMESPACE, name: str = DEFAULT_NAME) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/managed-by": "sco", "sco.dev/hall": bundle.hall},
            "annotations": {"sco.dev/serial": str(bundle.serial)},
        },
        "data": configmap_data(bundle),
    }


@dataclass(frozen=True)
class PublishResult:
    outcome: str  # "created", "updated" or "unchanged"
    serial: int
    previous_serial: int | None


class KubeConfigMaps:
    """GET/POST/PUT of one ConfigMap over the Kubernetes API, on the agent's Kubernetes credentials code
    (``sco.schedulers.kube``: the token file read again every minute and after a 401, TLS with the given CA or
    the system store, a refused connection retried within the call's deadline) and its one HTTP client."""

    def __init__(
        self, url: str, *, token_file: Path | None = None, ca_file: Path | None = None, timeout: float = 10.0
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        if token_file is not None:
            try:
                Path(token_file).read_text()
            except OSError as e:
                raise ConfigError(f"{token_file}: cannot read the token: {e.strerror}") from None
        # https without a CA file trusts the system store, as this command always has
        self.creds = Credentials(self.url, token_file=token_file, ca_file=str(ca_file) if ca_file else "system")
        try:
            self.creds.ssl_context()
        except (KubeConfigError, OSError, ssl.SSLError) as e:
            raise ConfigError(f"{ca_file}: {e}") from None

    def _call(self, method: str, path: str, body: Obj | None = None) -> tuple[int, Obj]:
        async def call() -> Response:
            kube = KubeClient(self.creds, timeout=self.timeout, max_connections=1)
            try:
                return await kube.request(method, path, body)
            finally:
                await kube.close()

        try:
            r = asyncio.run(call())
        except KubeUnreachable as e:
            raise KubePublishError(f"{self.url}: the Kubernetes API did not answer: {e}") from None
        except KubeCredentialError as e:  # TLS: the CA does not vouch for the server
            raise KubePublishError(f"{self.url}: {e.message}") from None
        try:
            data = r.json()
        except ValueError:
            data = None
        if not isinstance(data, dict):
            data = {"message": r.body[:200].decode("utf-8", "replace")}
        return r.status, data

    def _path(self, namespace: str, name: str | None = None) -> str:
        q = urllib.parse.quote
        base = f"/api/v1/namespaces/{q(namespace)}/configmaps"
        return base if name is None else f"{base}/{q(name)}"

    def get(self, namespace: str, name: str) -> Obj | None:
        status, body = self._call("GET", self._path(namespace, name))
        if status == 404:
            return None
        if status != 200:
            raise _failed("read", namespace, name, status, body)
        return body

    def create(self, cm: Obj) -> Obj:
        md = cm["metadata"]
        status, body = self._call("POST", self._path(md["namespace"]), cm)
        if status not in (200, 201):
            raise _failed("create", md["namespace"], md["name"], status, body)
        return body

    def replace(self, cm: Obj) -> tuple[int, Obj]:
        md = cm["metadata"]
        return self._call("PUT", self._path(md["namespace"], md["name"]), cm)


def _failed(verb: str, namespace: str, name: str, status: int, body: Obj) -> KubePublishError:
    msg = str(body.get("message", ""))
    hint = ""
    if status in (401, 403):
        hint = f": the credential may not {verb} configmaps in namespace {namespace}"
    elif status == 404 and verb == "create":
        hint = f": create namespace {namespace} first (the kyverno_policies role does)"
    return KubePublishError(f"configmap {namespace}/{name}: {verb} failed: HTTP {status}: {msg}{hint}")


def publish(
    api: KubeConfigMaps, bundle: Bundle, namespace: str = DEFAULT_NAMESPACE, name: str = DEFAULT_NAME
) -> PublishResult:
    """Create or replace the ConfigMap; never over a higher serial; unchanged content is not rewritten."""
    want = configmap(bundle, namespace, name)
    for _ in range(5):
        have = api.get(namespace, name)
        if have is None:
            api.create(want)
            return PublishResult("created", bundle.serial, None)
        data = have.get("data") or {}
        prev: int | None = None
        try:
            prev = int(data["_serial"])
        except (KeyError, ValueError):
            prev = None  # not ours or damaged: replace it
        if prev is not None and prev > bundle.serial:
            raise RollbackError(
                f"configmap {namespace}/{name} holds serial {prev}, higher than bundle serial {bundle.serial} "
                "(rollback refused)"
            )
        if data == want["data"]:
            return PublishResult("unchanged", bundle.serial, prev)
        want["metadata"]["resourceVersion"] = have["metadata"]["resourceVersion"]
        status, body = api.replace(want)
        if status == 409:
            continue  # written meanwhile: read again (it may now hold a higher serial)
        if status != 200:
            raise _failed("replace", namespace, name, status, body)
        return PublishResult("updated", bundle.serial, prev)
    raise KubePublishError(f"configmap {namespace}/{name}: conflicting writes, gave up after 5 tries")
