"""TLS on the distributor's link and on the agent's /metrics (no link in the clear).

A real agent (``sco-agent run``) fetches its bundle from a real distributor that serves TLS only, checking the
distributor's certificate against the hall's CA (agent.toml ``bundle_ca_file``); a distributor showing another
CA's certificate is refused and the node keeps its bundle, and the distributor's renewed certificate (files replaced)
is served from the next handshake without a restart. A plaintext client gets nothing from the TLS port: no HTTP
answer, no bundle, no metrics. ``sco node fetch-bundle`` (Slurm admission's and the ConfigMap publisher's path) the
same. The agent's /metrics likewise: served over TLS with its certificate, nothing in plaintext."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from sco._tls import ServerTls
from sco.contract.bundle import peek_payload
from sco.contract.compiler import compile_repo
from sco.contract.distributor import DistributorServer, publish
from sco.contract.signing import Keyring, PrivateKey, sign, write_keypair
from sco_devkit.standins.kube_apiserver import KubeApiStandIn
from tests.harness import BIN, AgentEnv, NatsServer, hall_bundle, make_tls, plaintext_answer, wait_for
from tests.prom import PROMTOOL, MonitoringDeployment, samples

HALL_PATH = "/v1/halls/local/bundle.json"


@pytest.fixture
def hall_ca(tmp_path: Path) -> tuple[Path, Path, Path]:
    """The hall's CA and a server certificate it signed for 127.0.0.1: (ca.crt, server.crt, server.key)."""
    return make_tls(tmp_path / "hall-ca")


@pytest.fixture
def other_ca(tmp_path: Path) -> tuple[Path, Path, Path]:
    """Another CA (not the hall's) and a certificate it signed for the same address."""
    return make_tls(tmp_path / "other-ca")


@pytest.fixture
def tls_distributor(tmp_path: Path, hall_ca: tuple[Path, Path, Path]) -> Iterator[DistributorServer]:
    """The real distributor serving TLS only, its certificate and key copied where a renewal replaces them."""
    d = tmp_path / "dist-tls"
    d.mkdir()
    shutil.copy(hall_ca[1], d / "server.crt")
    shutil.copy(hall_ca[2], d / "server.key")
    srv = DistributorServer(
        tmp_path / "dist", ("127.0.0.1", 0), tls=ServerTls(str(d / "server.crt"), str(d / "server.key"))
    )
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_the_agent_fetches_its_bundle_over_tls_checked_against_the_hall_ca(
    tmp_path: Path,
    kube: KubeApiStandIn,
    nats_server: NatsServer,
    tls_distributor: DistributorServer,
    hall_ca: tuple[Path, Path, Path],
    other_ca: tuple[Path, Path, Path],
) -> None:
    url = f"{tls_distributor.url}{HALL_PATH}"
    assert url.startswith("https://127.0.0.1:")
    ca = tmp_path / "agent-ca" / "ca.crt"
    ca.parent.mkdir()
    shutil.copy(hall_ca[0], ca)
    env = AgentEnv(
        tmp_path / "agent", kube, nats_server, bundle_url=url, bundle_ca_file=str(ca), bundle_refresh_seconds=1
    )
    repo, keyring = env.root / "repo", Keyring([env.key.public])
    first = compile_repo(repo)
    (env.state / "bundle" / "bundle.json").write_bytes(sign(first, [env.key]))  # as cloud-init writes it
    second = compile_repo(repo, previous=first, serial=2)
    publish(sign(second, [env.key]), tls_distributor.files.root, keyring)
    try:
        env.start()
        wait_for(lambda: any(e.get("serial") == 2 for e in env.of("bundle.accepted")), 15, "serial 2 over TLS", 0.2)
        assert not env.of("bundle.error"), env.of("bundle.error")

        # the distributor now shows another CA's certificate (the files replaced, as a renewal would): refused
        tls_dir = Path(tls_distributor.tls.cert_file).parent  # type: ignore[union-attr]
        shutil.copy(other_ca[1], tls_dir / "server.crt.new")
        shutil.copy(other_ca[2], tls_dir / "server.key")
        (tls_dir / "server.crt.new").replace(tls_dir / "server.crt")
        third = compile_repo(repo, previous=second, serial=3)
        publish(sign(third, [env.key]), tls_distributor.files.root, keyring)
        errors = wait_for(lambda: env.of("bundle.error"), 15, "the other CA's certificate refused", 0.2)
        assert "CERTIFICATE_VERIFY_FAILED" in errors[0]["reason"], errors
        time.sleep(2.5)  # two more refreshes: still serial 2
        assert not any(e.get("serial") == 3 for e in env.of("bundle.accepted"))
        assert (peek_payload((env.state / "bundle" / "bundle.json").read_bytes()) or {})["serial"] == 2

        # the hall's certificate again (a renewal): served from the next handshake, no restart
        shutil.copy(hall_ca[1], tls_dir / "server.crt.new")
        shutil.copy(hall_ca[2], tls_dir / "server.key")
        (tls_dir / "server.crt.new").replace(tls_dir / "server.crt")
        wait_for(
            lambda: any(e.get("serial") == 3 for e in env.of("bundle.accepted")), 15, "serial 3 after renewal", 0.2
        )
        assert tls_distributor.tls.reloads == 2  # type: ignore[union-attr]
    finally:
        env.stop()


def test_a_plaintext_client_gets_nothing_from_the_tls_distributor(
    tmp_path: Path, tls_distributor: DistributorServer, hall_ca: tuple[Path, Path, Path], key: PrivateKey
) -> None:
    trust = tmp_path / "trusted"
    trust.mkdir()
    write_keypair(key, tmp_path / "hall.key", trust / "hall.pub")
    raw = hall_bundle(tmp_path / "h", key)
    publish(raw, tls_distributor.files.root, Keyring([key.public]))
    port = tls_distributor.server_address[1]

    # a plaintext GET on the TLS port: no HTTP answer, not a byte of the bundle or the metrics
    for path in (HALL_PATH, "/metrics"):
        got = plaintext_answer(port, path)
        assert b"HTTP/" not in got and raw[:40] not in got and b"sco_distributor" not in got, got[:200]
    # the node's fetch command over plain http:// to the TLS port: a failed fetch (exit 6), nothing cached
    plain = f"http://127.0.0.1:{port}{HALL_PATH}"
    fetch = [str(BIN / "sco"), "node", "fetch-bundle", "--cache-dir", str(tmp_path / "c1"), "--trust-dir", str(trust)]
    p = subprocess.run([*fetch, "--url", plain], capture_output=True, text=True, timeout=60)
    assert p.returncode == 6 and '"outcome": "error"' in p.stdout, p.stdout + p.stderr
    assert not (tmp_path / "c1" / "bundle.json").exists()
    # https trusting another CA than the one that signed the distributor's certificate: refused, nothing cached
    other = make_tls(tmp_path / "another")[0]
    secure = f"https://127.0.0.1:{port}{HALL_PATH}"
    p = subprocess.run(
        [*fetch, "--url", secure, "--bundle-ca-file", str(other)], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 6 and "CERTIFICATE_VERIFY_FAILED" in p.stderr, p.stdout + p.stderr
    assert not (tmp_path / "c1" / "bundle.json").exists()
    # https against the hall's CA: the bundle, verified and cached
    p = subprocess.run(
        [*fetch, "--url", secure, "--bundle-ca-file", str(hall_ca[0])], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0 and '"outcome": "accepted"' in p.stdout, p.stdout + p.stderr
    assert (tmp_path / "c1" / "bundle.json").read_bytes() == raw
    # the refused handshakes are counted on the distributor's own /metrics (read over TLS)
    ctx = ssl.create_default_context(cafile=str(hall_ca[0]))
    with urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", timeout=5, context=ctx) as r:
        m = samples(r.read().decode())
    assert m["sco_distributor_tls_handshake_failures_total"] >= 3, m


def test_the_agents_metrics_over_tls_only(
    tmp_path: Path, kube: KubeApiStandIn, nats_server: NatsServer, hall_ca: tuple[Path, Path, Path]
) -> None:
    tls = tmp_path / "agent-tls"
    tls.mkdir()
    for src, name in ((hall_ca[1], "metrics.crt"), (hall_ca[2], "metrics.key")):
        shutil.copy(src, tls / name)
    env = AgentEnv(
        tmp_path / "agent",
        kube,
        nats_server,
        metrics_tls_cert_file=str(tls / "metrics.crt"),
        metrics_tls_key_file=str(tls / "metrics.key"),
    )
    assert env.metrics_url.startswith("https://")
    port = int(env.metrics_url.rsplit(":", 1)[1].split("/")[0])
    try:
        env.start()
        ctx = ssl.create_default_context(cafile=str(hall_ca[0]))

        def scrape_tls() -> str:
            with urllib.request.urlopen(env.metrics_url, timeout=5, context=ctx) as r:
                return str(r.read().decode())

        text = wait_for(lambda: _or_none(scrape_tls), 15, "the agent's metrics over TLS", 0.2)
        assert "sco_agent_bundle_serial" in text
        got = plaintext_answer(port, "/metrics")
        assert b"HTTP/" not in got and b"sco_agent" not in got, got[:200]
        other = ssl.create_default_context(cafile=str(make_tls(tmp_path / "another")[0]))
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            urllib.request.urlopen(env.metrics_url, timeout=5, context=other)
        assert "sco_agent_bundle_serial" in scrape_tls()  # still serving after both
    finally:
        env.stop()


def _or_none(f: Callable[[], str]) -> str | None:
    try:
        return f()
    except OSError:
        return None


def test_prometheus_scrapes_the_distributor_and_an_agent_over_tls_with_the_roles_config(
    tmp_path: Path,
    kube: KubeApiStandIn,
    nats_server: NatsServer,
    tls_distributor: DistributorServer,
    hall_ca: tuple[Path, Path, Path],
) -> None:
    """Debian's Prometheus, run from the configuration role monitoring renders with the hall's TLS on (jobs
    sco-distributor and sco-agent over https, the hall's CA as tls_config.ca_file; `promtool check config` passes
    on it), scrapes the TLS distributor and a real agent's TLS /metrics: both up."""
    tls = tmp_path / "agent-tls"
    tls.mkdir()
    for src, name in ((hall_ca[1], "metrics.crt"), (hall_ca[2], "metrics.key")):
        shutil.copy(src, tls / name)
    env = AgentEnv(
        tmp_path / "agent", kube, nats_server,
        metrics_tls_cert_file=str(tls / "metrics.crt"), metrics_tls_key_file=str(tls / "metrics.key"),
    )  # fmt: skip
    agent_target = env.metrics_url.removeprefix("https://").removesuffix("/metrics")
    dist_target = f"127.0.0.1:{tls_distributor.server_address[1]}"
    root = tmp_path / "monitoring"
    d = MonitoringDeployment(
        root,
        monitoring_distributor_targets=[dist_target], monitoring_agent_targets=[agent_target],
        monitoring_distributor_tls=True, monitoring_agent_tls=True,
        monitoring_tls_ca=hall_ca[0].read_text(), monitoring_tls_ca_dest=str(root / "sco-ca.crt"),
    )  # fmt: skip
    try:
        config = yaml.safe_load((root / "prometheus.yml").read_text())
        jobs = {j["job_name"]: j for j in config["scrape_configs"]}
        for job in ("sco-distributor", "sco-agent"):
            assert jobs[job]["scheme"] == "https" and jobs[job]["tls_config"] == {"ca_file": str(root / "sco-ca.crt")}
        assert (root / "sco-ca.crt").read_text().strip() == hall_ca[0].read_text().strip()
        # node_exporter serves TLS with monitoring_node_exporter_tls (off here: tests/test_node_exporter_tls.py)
        assert jobs["sco-control"].get("scheme", "http") == "http"
        check = subprocess.run(
            [PROMTOOL, "check", "config", str(root / "prometheus.yml")], capture_output=True, text=True, timeout=60
        )
        assert check.returncode == 0, check.stdout + check.stderr
        env.start()
        d.start()
        for job in ("sco-distributor", "sco-agent"):
            up = f'up{{job="{job}"}} == 1'
            wait_for(lambda q=up: d.api("query", query=q)["result"], 30, f"{job} up over TLS", 0.5)  # type: ignore[misc]
        served = d.api("query", query="sco_distributor_tls_handshake_failures_total")["result"]
        assert [r["metric"]["job"] for r in served] == ["sco-distributor"], served
    finally:
        d.stop()
        env.stop()


def test_a_launched_instances_user_data_carries_the_distributors_ca(tmp_path: Path, key: PrivateKey) -> None:
    """An instance the control loop launches is in no inventory: its user-data gives it the distributor's CA (and
    agent.env names it as SCO_AGENT_BUNDLE_CA_FILE), so its first fetch already checks the distributor."""
    from sco.contract.bundle import Bundle
    from sco.contract.userdata import DISTRIBUTOR_CA_PATH, render
    from sco.errors import ConfigError
    from tests.conftest import SAMPLE

    bundle = Bundle.from_bytes(sign(compile_repo(SAMPLE), [key]), Keyring([key.public]))
    ca = make_tls(tmp_path / "pki")[0].read_text()
    doc = yaml.safe_load(render(bundle, [key], [key.public], node_env={"SCO_AGENT_HALL": "x"}, distributor_ca=ca))
    files = {f["path"]: f for f in doc["write_files"]}
    assert files[DISTRIBUTOR_CA_PATH]["content"] == ca and files[DISTRIBUTOR_CA_PATH]["permissions"] == "0644"
    assert f"SCO_AGENT_BUNDLE_CA_FILE={DISTRIBUTOR_CA_PATH}\n" in files["/etc/sco/agent.env"]["content"]
    # the environment the agent reads it from: a setting it knows
    from sco.agent.config import AgentConfig

    assert "bundle_ca_file" in AgentConfig.__dataclass_fields__
    with pytest.raises(ConfigError, match="distributor CA: not a PEM certificate"):
        render(bundle, [key], [key.public], distributor_ca="not a certificate")


TRUST = """
- name: What the distributor's clients and Prometheus are given to trust (role hall's mapping)
  hosts: localhost
  gather_facts: false
  vars_files: ["{{ roles }}/hall/defaults/main.yml"]
  tasks:
    - name: Each client's CA text
      ansible.builtin.copy: {content: "{{ item.value | trim }}\\n", dest: "{{ out }}/{{ item.key }}.crt", mode: "0644"}
      loop: "{{ {'agent': node_agent_distributor_ca, 'slurm': slurm_admission_bundle_ca,
                 'control': control_loop_distributor_ca, 'prometheus': monitoring_tls_ca} | dict2items }}"
"""


def test_during_a_ca_rotation_the_distributors_clients_trust_both_cas(tmp_path: Path) -> None:
    """RUNBOOK's CA rotation: with contract_distributor_tls_trust_extra, the CA text the agents, the Slurm
    controllers, the control hosts (and through them launched instances) and Prometheus get holds both CAs."""
    from tests.relays import run_playbook

    old, new = make_tls(tmp_path / "old")[0], make_tls(tmp_path / "new")[0]
    out = tmp_path / "given"
    out.mkdir()
    roles = Path(__file__).resolve().parents[1] / "collections/ansible_collections/sco/orchestrator/roles"
    for extra, count in (([], 1), ([str(new)], 2)):
        r = run_playbook(tmp_path, TRUST, {
            "roles": str(roles), "out": str(out), "sco_hall": "local", "sco_tls_ca_cert": str(old),
            "contract_distributor_tls_trust_extra": extra})  # fmt: skip
        assert r.returncode == 0, r.stdout + r.stderr
        for who in ("agent", "slurm", "control", "prometheus"):
            text = (out / f"{who}.crt").read_text()
            assert text.count("BEGIN CERTIFICATE") == count and old.read_text().strip() in text, (who, text)
            assert count == 1 or new.read_text().strip() in text


def test_a_client_that_never_finishes_its_handshake_holds_up_nobody(
    tmp_path: Path, hall_ca: tuple[Path, Path, Path]
) -> None:
    """The handshake runs on the connection's own thread under the header deadline: silent TCP connections (a TLS
    slowloris) neither stop the accepting thread from serving a node's GET at once nor stay open past the deadline."""
    srv = DistributorServer(
        tmp_path / "dist", ("127.0.0.1", 0), header_timeout=1.0, tls=ServerTls(str(hall_ca[1]), str(hall_ca[2]))
    )
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    silent = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(10)]
    try:
        ctx = ssl.create_default_context(cafile=str(hall_ca[0]))
        t0 = time.monotonic()
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", timeout=5, context=ctx) as r:
            assert r.read() == b"ok\n"
        assert time.monotonic() - t0 < 0.5
        for s in silent:  # cut at the header deadline: the server closes, the read returns
            s.settimeout(5)
            assert s.recv(1) == b""
        assert time.monotonic() - t0 < 4
        wait_for(lambda: srv.tls_handshake_failures >= 10, 5, "the cut handshakes counted")
    finally:
        for s in silent:
            s.close()
        srv.shutdown()
        srv.server_close()


def test_the_drill_reads_the_halls_bundle_over_tls_against_the_halls_ca(
    tmp_path: Path, tls_distributor: DistributorServer, hall_ca: tuple[Path, Path, Path], key: PrivateKey
) -> None:
    """`sco drill keys --bundle-url https://... --bundle-ca-file` (drill.yml passes the hall's CA): the hall's bundle
    read and its noticeKeys checked; without the CA (the system's store) the distributor is refused, named."""
    from sco.contract.signing import generate
    from sco.control.drill_run import DrillRelayError, find_keys

    notice = generate()
    write_keypair(notice, tmp_path / "notice.key", tmp_path / "notice.pub")
    write_keypair(key, tmp_path / "hall.key", tmp_path / "hall.pub")
    publish(hall_bundle(tmp_path / "h", key, notice), tls_distributor.files.root, Keyring([key.public]))
    url = f"{tls_distributor.url}{HALL_PATH}"
    found = find_keys([str(tmp_path / "notice.key")], False, url, [str(tmp_path / "hall.pub")], str(hall_ca[0]))
    assert [k["keyid"] for k in found] == [notice.keyid]
    with pytest.raises(DrillRelayError, match="CERTIFICATE_VERIFY_FAILED"):
        find_keys([str(tmp_path / "notice.key")], False, url, [str(tmp_path / "hall.pub")])
