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
Published from the control host with the control side's credential through the official ``kubernetes`` client (the
control extra installs it there); the node agent, which never publishes, keeps its lean client (``sco._http``).
"""

from __future__ import annotations

import json
import os
import ssl
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sco.contract.bundle import Bundle
from sco.errors import BundleError, ConfigError, RollbackError, ScoError
from sco.schedulers.kube import TOKEN_REREAD_S

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
    """GET/POST/PUT of one ConfigMap through the official Kubernetes client (``kubernetes.client.CoreV1Api``).

    Every call has a deadline (``_request_timeout``: ``timeout / 4`` to connect, ``timeout`` to read; a refused
    connection is tried again three times within the connect budget, so a call takes about ``timeout`` at most to
    connect and ``timeout`` to answer). The bound token file is read again as client-go and the agent read it: every
    minute, before a call once the file changed (its inode, mtime and size), and at once after a 401, with the call
    sent again once. https trusts ``ca_file``, or the system store without one.
    """

    def __init__(
        self,
        url: str,
        *,
        token_file: Path | None = None,
        ca_file: Path | None = None,
        timeout: float = 10.0,
        token_reread_s: float = TOKEN_REREAD_S,
    ) -> None:
        from kubernetes import client as k8s  # the control extra; a manifest written with -o needs none of it
        from urllib3.util.retry import Retry

        self.url = url.rstrip("/")
        self.timeout = timeout
        self.token_file = Path(token_file) if token_file is not None else None
        self._token_reread_s = token_reread_s
        self._token_read_at = -1e18
        self._token_sig: tuple[int, int, int, int] | None = None
        cfg = k8s.Configuration()
        cfg.host = self.url
        if self.url.startswith("https:") and ca_file:
            try:
                ssl.create_default_context(cafile=str(ca_file))
            except (OSError, ssl.SSLError) as e:
                raise ConfigError(f"{ca_file}: {e}") from None
            cfg.ssl_ca_cert = str(ca_file)
        # (without ssl_ca_cert urllib3 loads the system store, as this command always has trusted)
        # only connecting is tried again (a refused or timed-out connect): a write the server may have seen is not
        cfg.retries = Retry(total=3, connect=3, read=0, status=0, other=0, redirect=0, backoff_factor=0.1)
        self._token = ""
        if self.token_file is not None:
            try:
                self.token_file.read_text()
            except OSError as e:
                raise ConfigError(f"{token_file}: cannot read the token: {e.strerror}") from None
            cfg.api_key_prefix = {"authorization": "Bearer"}
            cfg.refresh_api_key_hook = self._refresh_token  # type: ignore[assignment]  # typed as None upstream
            self._refresh_token(cfg, force=True)
        self._cfg = cfg
        self.api = k8s.CoreV1Api(k8s.ApiClient(cfg))

    def _refresh_token(self, cfg: Any, force: bool = False) -> None:
        """Called by the client before every request (``refresh_api_key_hook``)."""
        assert self.token_file is not None
        now = time.monotonic()
        try:
            st = os.stat(self.token_file)
            sig: tuple[int, int, int, int] | None = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            sig = None
        if not force and sig == self._token_sig and now - self._token_read_at < self._token_reread_s:
            return
        self._token_read_at = now
        try:
            token = self.token_file.read_text().strip()
        except OSError:
            return  # keep the last token; the API's 401 will say what is wrong
        if token:  # (empty: caught between a truncate and a write; read again next time)
            self._token_sig, self._token = sig, token
            cfg.api_key = {"authorization": token}

    def _call(self, verb: str, fn: Any, *args: Any) -> tuple[int, Obj]:
        """One call of the official client, (status, body as a dict) whatever the status; an API that does not
        answer, or TLS the CA does not vouch for, is KubePublishError."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError, MaxRetryError
        from urllib3.exceptions import SSLError as Urllib3SSLError

        for attempt in (0, 1):
            try:
                r = fn(*args, _preload_content=False, _request_timeout=(self.timeout / 4, self.timeout))
                return r.status, _body(r.data)
            except ApiException as e:
                if e.status == 0:  # the client's own word for a TLS failure it caught itself
                    raise KubePublishError(f"{self.url}: TLS: {' '.join(str(e.reason).split())}") from None
                if e.status == 401 and attempt == 0 and self.token_file is not None:
                    self._refresh_token(self._cfg, force=True)  # a rotated token: read the file again, once
                    continue
                return int(e.status), _body(e.body)
            except MaxRetryError as e:
                if isinstance(e.reason, Urllib3SSLError):
                    raise KubePublishError(f"{self.url}: TLS: {e.reason}") from None
                raise KubePublishError(f"{self.url}: the Kubernetes API did not answer ({verb}): {e.reason}") from None
            except HTTPError as e:  # a read timeout, a connection reset mid-answer
                raise KubePublishError(f"{self.url}: the Kubernetes API did not answer ({verb}): {e}") from None
        raise AssertionError("unreachable")  # the loop returns or raises

    def get(self, namespace: str, name: str) -> Obj | None:
        status, body = self._call("read", self.api.read_namespaced_config_map, name, namespace)
        if status == 404:
            return None
        if status != 200:
            raise _failed("read", namespace, name, status, body)
        return body

    def create(self, cm: Obj) -> Obj:
        md = cm["metadata"]
        status, body = self._call("create", self.api.create_namespaced_config_map, md["namespace"], cm)
        if status not in (200, 201):
            raise _failed("create", md["namespace"], md["name"], status, body)
        return body

    def replace(self, cm: Obj) -> tuple[int, Obj]:
        md = cm["metadata"]
        return self._call("replace", self.api.replace_namespaced_config_map, md["name"], md["namespace"], cm)


def _body(raw: Any) -> Obj:
    """The API's answer as a dict; anything else (a proxy's page) as its first 200 characters."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes | bytearray) else str(raw or "")
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    return data if isinstance(data, dict) else {"message": text[:200]}


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
