"""The ConfigMap publisher on the Kubernetes credentials code the agent uses: a rotated bound token
is read again after a 401 (it read the file once, then failed every write with 401 until restarted), and https
needs a CA that vouches for the server (else the system store, as before)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sco.contract.bundle import Bundle
from sco.contract.compiler import compile_repo
from sco.contract.signing import Keyring, PrivateKey, sign
from sco.schedulers.kube_contracts import KubeConfigMaps, KubePublishError, publish
from sco_devkit.standins.kube_apiserver import Identity, KubeApiStandIn
from tests.harness import make_tls, sample_repo


@pytest.fixture
def authed() -> Iterator[KubeApiStandIn]:
    srv = KubeApiStandIn(tokens={"new-token": Identity("system:serviceaccount:sco-system:publisher")}).start()
    yield srv
    srv.stop()


def _bundle(key: PrivateKey, keyring: Keyring, serial: int) -> Bundle:
    return Bundle.from_bytes(sign(compile_repo(sample_repo(), serial=serial), [key]), keyring)


def test_a_rotated_token_is_read_again_after_a_401(
    tmp_path: Path, authed: KubeApiStandIn, key: PrivateKey, keyring: Keyring
) -> None:
    token = tmp_path / "token"
    token.write_text("old-token\n")  # expired: the kubelet rotates the file
    api = KubeConfigMaps(authed.url, token_file=token)
    with pytest.raises(KubePublishError, match="HTTP 401"):
        publish(api, _bundle(key, keyring, 1))
    token.write_text("new-token\n")
    assert publish(api, _bundle(key, keyring, 2)).outcome == "created"


def test_https_with_a_ca_that_does_not_vouch_is_refused_by_name(
    tmp_path: Path, key: PrivateKey, keyring: Keyring
) -> None:
    ca, cert, keyfile = make_tls(tmp_path / "tls")
    other_ca, _, _ = make_tls(tmp_path / "other")
    srv = KubeApiStandIn(tls=(str(cert), str(keyfile))).start()
    try:
        with pytest.raises(KubePublishError, match="TLS"):
            publish(KubeConfigMaps(srv.url, ca_file=other_ca, timeout=3), _bundle(key, keyring, 1))
        assert publish(KubeConfigMaps(srv.url, ca_file=ca, timeout=3), _bundle(key, keyring, 1)).outcome == "created"
    finally:
        srv.stop()
