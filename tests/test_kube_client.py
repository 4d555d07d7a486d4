"""The agent's lean Kubernetes client against the stand-in: credentials as client-go finds them (explicit,
kubeconfig, in-cluster), token rotation, TLS trust, paged lists and the watch."""

from __future__ import annotations

import asyncio
import base64
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from sco.schedulers.kube import Credentials, KubeClient, KubeConfigError, KubeCredentialError, KubeGone
from sco_devkit.standins.kube_apiserver import Identity, KubeApiStandIn
from tests.harness import add_pod, make_tls


@pytest.fixture
def tls_kube(tmp_path: Path) -> Iterator[tuple[KubeApiStandIn, Path]]:
    ca, crt, key = make_tls(tmp_path / "tls")
    srv = KubeApiStandIn(tokens={"tok-1": Identity("system:node:n1")}, tls=(str(crt), str(key))).start()
    srv.cluster.add_node("n1")
    yield srv, ca
    srv.stop()


def _get(creds: Credentials, **kw: float) -> dict:  # type: ignore[type-arg]
    async def go() -> dict:  # type: ignore[type-arg]
        kube = KubeClient(creds, **kw)
        try:
            return await kube.get_node("n1")
        finally:
            await kube.close()

    return asyncio.run(go())


def test_kubeconfig_with_inline_ca_and_token_file(tls_kube, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    srv, ca = tls_kube
    (tmp_path / "tok").write_text("tok-1\n")
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "spot",
        "contexts": [{"name": "spot", "context": {"cluster": "hall", "user": "agent"}}],
        "clusters": [
            {
                "name": "hall",
                "cluster": {
                    "server": srv.url,
                    "certificate-authority-data": base64.b64encode(ca.read_bytes()).decode(),
                },
            }
        ],
        "users": [{"name": "agent", "user": {"tokenFile": "tok"}}],
    }
    import yaml

    (tmp_path / "kubeconfig").write_text(yaml.safe_dump(doc))
    creds = Credentials.from_kubeconfig(tmp_path / "kubeconfig")
    assert creds.url == srv.url and creds.token_file == tmp_path / "tok"
    assert _get(creds)["metadata"]["name"] == "n1"
    doc["clusters"][0]["cluster"] = {"server": srv.url, "insecure-skip-tls-verify": True}
    (tmp_path / "kubeconfig").write_text(json.dumps(doc))
    with pytest.raises(KubeConfigError, match="insecure-skip-tls-verify"):
        Credentials.from_kubeconfig(tmp_path / "kubeconfig")


def test_in_cluster_discovery(tls_kube, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    srv, ca = tls_kube
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("tok-1")
    (sa / "ca.crt").write_bytes(ca.read_bytes())
    host, port = srv.server_address[:2]
    creds = Credentials.in_cluster({"KUBERNETES_SERVICE_HOST": str(host), "KUBERNETES_SERVICE_PORT": str(port)}, sa)
    assert creds.url == srv.url
    assert _get(creds)["metadata"]["name"] == "n1"
    with pytest.raises(KubeConfigError, match="KUBERNETES_SERVICE_HOST"):
        Credentials.in_cluster({}, sa)


def test_https_without_a_ca_is_refused_and_a_wrong_ca_is_a_credential_error(tls_kube, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    srv, _ = tls_kube
    with pytest.raises(KubeConfigError, match="system"):
        KubeClient(Credentials(srv.url))
    other, _, _ = make_tls(tmp_path / "other")
    (tmp_path / "tok").write_text("tok-1")
    with pytest.raises(KubeCredentialError) as e:
        _get(Credentials(srv.url, token_file=tmp_path / "tok", ca_file=str(other)))
    assert "certificate" in str(e.value).lower()
    with pytest.raises(KubeCredentialError) as e:  # the system store does not know the test CA either
        _get(Credentials(srv.url, token_file=tmp_path / "tok", ca_file="system"))


def test_token_file_is_read_again_after_a_minute_or_a_401(tls_kube, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    srv, ca = tls_kube
    tok = tmp_path / "tok"
    tok.write_text("tok-1")

    async def go() -> None:
        kube = KubeClient(Credentials(srv.url, token_file=tok, ca_file=str(ca)), token_reread_s=0.2)
        try:
            await kube.get_node("n1")
            tok.write_text("tok-2")  # rotated: both work for a while, as with bound tokens
            srv.tokens = {"tok-1": Identity("system:node:n1"), "tok-2": Identity("system:node:n1")}
            await asyncio.sleep(0.3)
            await kube.get_node("n1")
            assert kube.http.headers["Authorization"] == "Bearer tok-2"  # the periodic re-read
            srv.tokens = {"tok-3": Identity("system:node:n1")}
            st = tok.stat()
            tok.write_text("tok-3")  # same inode and size; the mtime put back: the stat cannot see the change
            os.utime(tok, ns=(st.st_atime_ns, st.st_mtime_ns))
            await kube.get_node("n1")  # 401, read again, retried once
            assert len(srv.unauthorized) == 1
            srv.tokens = {}
            with pytest.raises(KubeCredentialError) as e:
                await kube.get_node("n1")
            assert e.value.status == 401
        finally:
            await kube.close()

    asyncio.run(go())


def test_a_rotation_that_revokes_the_old_token_costs_no_401(tls_kube, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The file is stat'ed before each request: a new token is used on the very next call, long before the
    minute's re-read, whether written in place or renamed over the file (kubelet swaps a symlink)."""
    srv, ca = tls_kube
    tok = tmp_path / "tok"
    tok.write_text("tok-1")

    async def go() -> None:
        kube = KubeClient(Credentials(srv.url, token_file=tok, ca_file=str(ca)), token_reread_s=3600)
        try:
            await kube.get_node("n1")
            tok.write_text("tok-2b")  # in place, same inode
            srv.tokens["tok-2b"] = Identity("system:node:n1")
            srv.revoke("tok-1")
            await kube.get_node("n1")
            new = tmp_path / "tok.new"
            new.write_text("tok-3")
            srv.tokens["tok-3"] = Identity("system:node:n1")
            os.replace(new, tok)  # atomic: a new inode
            srv.revoke("tok-2b")
            await kube.list_pods("n1")
            _, rv = await kube.pods_on_node("n1")
            srv.tokens["tok-4"] = Identity("system:node:n1")
            tok.write_text("tok-4")
            srv.revoke("tok-3")
            async for _ in kube.watch_pods("n1", rv, timeout_s=1):
                pass  # the watch's own connection sends the new token too (an ERROR event would raise)
            assert kube.token_changes == 3
        finally:
            await kube.close()

    asyncio.run(go())
    assert srv.unauthorized == []
    assert [a["user"] for a in srv.authenticated] == ["system:node:n1"] * len(srv.authenticated)
    assert len({a["token"] for a in srv.authenticated}) == 4


def test_paged_list_and_watch_with_410(tmp_path: Path) -> None:
    srv = KubeApiStandIn().start()
    try:
        for i in range(7):
            add_pod(srv, "a", f"p{i}", "n1", prestop=30)

        async def go() -> None:
            kube = KubeClient(srv.url)
            try:
                items, rv, cont = await kube.list_pods("n1", limit=3)
                assert len(items) == 3 and cont
                every, rv = await kube.pods_on_node("n1")
                assert [p["metadata"]["name"] for p in every] == [f"p{i}" for i in range(7)]
                srv.cluster.delete_pod("a", "p0", 5)
                seen = []
                async for ev in kube.watch_pods("n1", rv, timeout_s=2):
                    seen.append((ev["type"], ev["object"]["metadata"]["name"]))
                    break
                assert seen == [("MODIFIED", "p0")]
                srv.cluster.compact()
                with pytest.raises(KubeGone):
                    async for _ in kube.watch_pods("n1", rv, timeout_s=2):
                        pass
            finally:
                await kube.close()

        asyncio.run(go())
    finally:
        srv.stop()
