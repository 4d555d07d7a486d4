"""`sco contract publish-configmap`: the bundle's contracts into the cluster, through the stand-in's real HTTP API.

The official ``kubernetes`` client reads the result back (a shape the real API would not serve fails there).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from sco.cli import main
from sco.contract.bundle import Bundle, subset_payload
from sco.contract.compiler import compile_repo
from sco.contract.signing import Keyring, PrivateKey, sign, write_keypair
from sco.schedulers.kube_contracts import KubeConfigMaps, configmap_data, publish
from sco_devkit.standins.kube_apiserver import KubeApiStandIn
from tests.harness import sample_repo


@pytest.fixture
def kube() -> Iterator[KubeApiStandIn]:
    srv = KubeApiStandIn().start()
    yield srv
    srv.stop()


def _bundle(key: PrivateKey, serial: int | None = None) -> bytes:
    return sign(compile_repo(sample_repo(), serial=serial), [key])


def test_data_names_every_contract_and_budget(key: PrivateKey, keyring: Keyring) -> None:
    b = Bundle.from_bytes(_bundle(key), keyring)
    data = configmap_data(b)
    assert data["_serial"] == str(b.serial) and data["_hall"] == "local"
    assert data["ci-runners"] == "kubernetes" and data["etl-nightly"] == "spark" and data["genomics-align"] == "slurm"
    assert data["ci-runners.namespace"] == "ci"
    assert data["ci-runners.match"] == "role=runner" and data["ci-runners.matchCount"] == "1"
    assert data["pytorch-training.match"] == "" and data["pytorch-training.matchCount"] == "0"
    assert data["pytorch-training.grace"] == "100"  # drain 75 + final write 25
    assert data["_ns.ci"] == "ci-cache-warmers, ci-runners"
    assert "genomics-align.namespace" not in data  # Slurm contracts carry no Kubernetes selector


def test_a_launch_subset_is_never_published(key: PrivateKey, keyring: Keyring) -> None:
    full = Bundle.from_bytes(_bundle(key), keyring)
    sub = Bundle.from_bytes(sign(subset_payload(full, schedulers=["slurm"]), [key]), keyring)
    with pytest.raises(Exception, match="launch subset"):
        configmap_data(sub)


def test_publish_creates_then_keeps_then_updates_and_refuses_rollback(
    kube: KubeApiStandIn, key: PrivateKey, keyring: Keyring
) -> None:
    api = KubeConfigMaps(kube.url)
    b5 = Bundle.from_bytes(_bundle(key, serial=5), keyring)
    assert publish(api, b5).outcome == "created"
    assert publish(api, b5).outcome == "unchanged"
    writes = [a for a in kube.cluster.audit if a["kind"] == "ConfigMap"]
    assert len(writes) == 1  # unchanged content is not rewritten
    b6 = Bundle.from_bytes(_bundle(key, serial=6), keyring)
    r = publish(api, b6)
    assert (r.outcome, r.serial, r.previous_serial) == ("updated", 6, 5)
    with pytest.raises(Exception, match="rollback refused"):
        publish(api, b5)
    # Read back with the official client: a valid core/v1 ConfigMap holding serial 6.
    cfg = client.Configuration()
    cfg.host = kube.url
    with client.ApiClient(cfg) as c:
        cm = client.CoreV1Api(c).read_namespaced_config_map("sco-contracts", "sco-system")
    assert cm.data["_serial"] == "6" and cm.metadata.labels["app.kubernetes.io/managed-by"] == "sco"


def test_cli_publishes_and_says_what_is_wrong(
    kube: KubeApiStandIn, key: PrivateKey, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_keypair(key, tmp_path / "k.key", tmp_path / "k.pub")
    bundle = tmp_path / "bundle.json"
    bundle.write_bytes(_bundle(key))
    trust = ["--trust", str(tmp_path / "k.pub")]
    assert main(["contract", "publish-configmap", str(bundle), *trust, "--kube-url", kube.url]) == 0
    assert json.loads(capsys.readouterr().out)["outcome"] == "created"
    assert kube.cluster.configmaps[("sco-system", "sco-contracts")]["data"]["ci-runners.grace"] == "20"
    # --output writes the manifest without touching the cluster
    out = tmp_path / "cm.json"
    assert main(["contract", "publish-configmap", str(bundle), *trust, "-o", str(out), "--namespace", "x"]) == 0
    assert json.loads(out.read_text())["metadata"]["namespace"] == "x"
    assert ("x", "sco-contracts") not in kube.cluster.configmaps
    # a tampered bundle is refused before anything is written
    raw = bundle.read_bytes().replace(b'"ci-runners"', b'"ci-runnerz"')
    bad = tmp_path / "bad.json"
    bad.write_bytes(raw)
    assert main(["contract", "publish-configmap", str(bad), *trust, "--kube-url", kube.url]) == 3
    assert "bad.json" in capsys.readouterr().err
    # an API that does not answer: a clear error, exit 7
    rc = main(["contract", "publish-configmap", str(bundle), *trust, "--kube-url", "http://127.0.0.1:9"])
    assert rc == 7
    assert "did not answer" in capsys.readouterr().err


@pytest.mark.parametrize("interval", ["0", "-1", "nan", "inf"])
def test_cli_refuses_a_watch_interval_out_of_bounds(
    kube: KubeApiStandIn, key: PrivateKey, tmp_path: Path, capsys: pytest.CaptureFixture[str], interval: str
) -> None:
    """--watch --interval 0 published to the API server in a busy loop (and nan or inf slept for ever): exit 5
    naming the flag, nothing sent (bad input is one clear line)."""
    write_keypair(key, tmp_path / "k.key", tmp_path / "k.pub")
    bundle = tmp_path / "bundle.json"
    bundle.write_bytes(_bundle(key))
    argv = ["contract", "publish-configmap", str(bundle), "--trust", str(tmp_path / "k.pub"), "--watch"]
    assert main([*argv, "--kube-url", kube.url, "--interval", interval]) == 5
    err = capsys.readouterr().err
    assert "--interval" in err and "expected 1 to 86400 seconds" in err, err
    assert ("sco-system", "sco-contracts") not in kube.cluster.configmaps


def test_standin_configmaps_follow_the_real_rules(kube: KubeApiStandIn) -> None:
    cfg = client.Configuration()
    cfg.host = kube.url
    with client.ApiClient(cfg) as c:
        core = client.CoreV1Api(c)
        made = core.create_namespaced_config_map("ns", client.V1ConfigMap(metadata={"name": "a"}, data={"k": "v"}))
        stale = made.metadata.resource_version
        made.data = {"k": "w"}
        core.replace_namespaced_config_map("a", "ns", made)
        made.metadata.resource_version = stale
        with pytest.raises(client.ApiException) as e:
            core.replace_namespaced_config_map("a", "ns", made)
        assert e.value.status == 409
        with pytest.raises(client.ApiException) as e:
            core.create_namespaced_config_map("ns", client.V1ConfigMap(metadata={"name": "b"}, data={"a/b": "v"}))
        assert e.value.status == 422
        assert [m.metadata.name for m in core.list_namespaced_config_map("ns").items] == ["a"]


def test_cli_publishes_what_the_distributor_serves(
    kube: KubeApiStandIn, key: PrivateKey, keyring: Keyring, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import threading

    from sco.contract.distributor import DistributorServer
    from sco.contract.distributor import publish as publish_bundle

    write_keypair(key, tmp_path / "k.key", tmp_path / "k.pub")
    root = tmp_path / "dist"
    publish_bundle(_bundle(key, serial=3), root, keyring)
    dist = DistributorServer(root, ("127.0.0.1", 0))
    threading.Thread(target=dist.serve_forever, daemon=True).start()
    try:
        argv = ["contract", "publish-configmap", "--url", f"{dist.url}/v1/halls/local/bundle.json"]
        argv += ["--cache-dir", str(tmp_path / "cache"), "--trust", str(tmp_path / "k.pub"), "--kube-url", kube.url]
        assert main(argv) == 0
        assert json.loads(capsys.readouterr().out) == {
            "configmap": "sco-system/sco-contracts",
            "outcome": "created",
            "serial": 3,
        }
        publish_bundle(_bundle(key, serial=4), root, keyring)
        assert main(argv) == 0
        assert json.loads(capsys.readouterr().out)["outcome"] == "updated"
        assert kube.cluster.configmaps[("sco-system", "sco-contracts")]["data"]["_serial"] == "4"
        # neither a file nor --url: a clear error
        assert main(["contract", "publish-configmap", "--trust", str(tmp_path / "k.pub")]) == 5
        assert "give a BUNDLE file or --url" in capsys.readouterr().err
    finally:
        dist.shutdown()
        dist.server_close()


def test_a_credential_that_may_not_write_configmaps_is_named(
    key: PrivateKey, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from sco_devkit.standins.kube_apiserver import Identity

    srv = KubeApiStandIn(tokens={"ro": Identity("viewer", deny=("create configmaps",))}).start()
    try:
        write_keypair(key, tmp_path / "k.key", tmp_path / "k.pub")
        (tmp_path / "bundle.json").write_bytes(_bundle(key))
        (tmp_path / "token").write_text("ro\n")
        argv = ["contract", "publish-configmap", str(tmp_path / "bundle.json"), "--trust", str(tmp_path / "k.pub")]
        argv += ["--kube-url", srv.url, "--token-file", str(tmp_path / "token")]
        assert main(argv) == 7
        err = capsys.readouterr().err
        assert "HTTP 403" in err and "the credential may not create configmaps in namespace sco-system" in err
        (tmp_path / "token").write_text("nobody\n")
        assert main(argv) == 7
        assert "HTTP 401" in capsys.readouterr().err
        assert main([*argv[:-1], str(tmp_path / "missing")]) == 5
        assert "missing: cannot read the token" in capsys.readouterr().err
        assert srv.cluster.configmaps == {}
    finally:
        srv.stop()
