"""node_exporter's /metrics over TLS in a hall (TLS on every /metrics).

Role monitoring deploys Debian's node_exporter on the control hosts (job sco-control: the control loop's textfiles and
the hall's certificates' expiry). In a hall (sco_metrics_tls, the default) it serves TLS only through its web
configuration file (``--web.config.file``, ``tls_server_config``) with a certificate the hall's CA signs on the
controller (role fleet_state's tls_cert.yml, ``<sco_tls_dir>/node-exporter``), and Prometheus scrapes it with scheme
https and the hall's CA. Here the role runs with a hall and its state directory in the test's directory, and
Debian's real node_exporter (1.5) and Prometheus run from exactly the files the role wrote:

- Prometheus's sco-control target is up over TLS (``promtool check config`` accepts the rendered configuration);
- a client with the hall's CA reads the textfiles, one with another CA is refused, and a plaintext request gets no
  metrics (Go's answer: 400 "Client sent an HTTP request to an HTTPS server");
- the key is node_exporter's user's alone, the expiry is in the textfile for ScoCertificateExpiring;
- a run that finds the certificate within its renewal margin signs a new one, which the running node_exporter (the
  same process: it reads its web configuration and the pair again at every connection) serves from the next one;
  a run again changes nothing;
- ``sco_metrics_tls: false``: plain HTTP, scraped over http, the TLS files gone."""

from __future__ import annotations

import re
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.harness import make_tls, plaintext_answer, wait_for
from tests.prom import PROMTOOL, MonitoringDeployment, args_of, samples

CERT = "monitoring_node_exporter"


def hall(tmp_path: Path, **more: object) -> dict[str, object]:
    """A hall's variables (role hall's mapping: sco_metrics_tls on, the CA made under the state directory)."""
    return {"sco_hall": "local", "sco_state_dir": str(tmp_path / "state"), **more}


def changed(d: MonitoringDeployment) -> int:
    m = re.search(r"localhost\s+:\s+ok=\d+\s+changed=(\d+)", d.output)
    assert m, d.output[-3000:]
    return int(m.group(1))


def peer_certificate(port: int, ca: Path) -> bytes:
    """The certificate node_exporter shows a new connection (checked against ``ca``), DER."""
    ctx = ssl.create_default_context(cafile=str(ca))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s,
    ):
        der = s.getpeercert(binary_form=True)
    assert der
    return der


def pem_to_der(pem: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(pem.read_text())


def test_node_exporter_serves_tls_only_with_the_halls_certificate_renewed_without_a_restart(tmp_path: Path) -> None:
    root = tmp_path / "deployed"
    d = MonitoringDeployment(root, **hall(tmp_path))
    state_tls = tmp_path / "state" / "tls"
    ca = state_tls / "ca.crt"
    try:
        # what the role wrote: the flag, the web configuration naming the host's pair, Prometheus's job over https
        args = args_of(root / "default-node-exporter")
        assert f"--web.config.file={root / 'node-exporter-web.yml'}" in args, args
        assert f"--web.listen-address=:{d.ne_port}" in args, args
        web = yaml.safe_load((root / "node-exporter-web.yml").read_text())
        tls = root / "node-exporter-tls"
        pair = {"cert_file": str(tls / "node-exporter.crt"), "key_file": str(tls / "node-exporter.key")}
        assert web == {"tls_server_config": {**pair, "min_version": "TLS12"}}, web
        config = yaml.safe_load((root / "prometheus.yml").read_text())
        jobs = {j["job_name"]: j for j in config["scrape_configs"]}
        assert jobs["sco-control"]["scheme"] == "https", jobs["sco-control"]
        assert jobs["sco-control"]["tls_config"] == {"ca_file": str(root / "sco-ca.crt")}
        assert (root / "sco-ca.crt").read_text().strip() == ca.read_text().strip()
        cmd = [PROMTOOL, "check", "config", str(root / "prometheus.yml")]
        check = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr
        # the pair: signed by the hall's CA the role made on the "controller", for the host's names; the key its
        # user's alone (the test's user here, Debian's unit's prometheus in a hall)
        cmd = ["openssl", "verify", "-CAfile", str(ca), "-verify_ip", "127.0.0.1", str(tls / "node-exporter.crt")]
        verify = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        assert verify.returncode == 0, verify.stdout + verify.stderr
        assert tls.stat().st_mode & 0o777 == 0o700
        assert (tls / "node-exporter.key").stat().st_mode & 0o777 == 0o600
        assert (tls / "node-exporter.crt").read_bytes() == (state_tls / "node-exporter" / "localhost.crt").read_bytes()
        # the expiry for ScoCertificateExpiring, in the textfile node_exporter serves
        prom = (d.textfile / "sco_node_exporter_certificates.prom").read_text()
        series = f'sco_certificate_expiry_timestamp_seconds{{certificate="{CERT}",host="localhost"}}'
        expiry = samples(prom)[series]
        assert abs(expiry - (time.time() + 365 * 86400)) < 2 * 86400, prom

        # Debian's node_exporter and Prometheus from those files: start() waits for up{job="sco-control"} == 1
        t0 = time.monotonic()
        d.start()
        print(f"sco-control up over TLS {time.monotonic() - t0:.1f} s after start")
        url = f"https://127.0.0.1:{d.ne_port}/metrics"
        with urllib.request.urlopen(url, timeout=5, context=ssl.create_default_context(cafile=str(ca))) as r:
            assert r.status == 200
            assert samples(r.read().decode())[series] == expiry
        got = d.api("query", query=f'sco_certificate_expiry_timestamp_seconds{{certificate="{CERT}"}}')["result"]
        assert [(r["metric"]["job"], float(r["value"][1])) for r in got] == [("sco-control", expiry)], got
        # plaintext: no metrics (Go's http server answers a plaintext request on a TLS port with a fixed 400)
        answer = plaintext_answer(d.ne_port, "/metrics")
        assert answer.startswith(b"HTTP/1.0 400 Bad Request") and b"HTTPS server" in answer, answer[:200]
        assert b"sco_certificate" not in answer and b"node_" not in answer
        # another CA's client: refused
        other = ssl.create_default_context(cafile=str(make_tls(tmp_path / "other-ca")[0]))
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            urllib.request.urlopen(url, timeout=5, context=other)

        # a run that finds the certificate within its margin (here: always) signs a new one - the RUNBOOK's run,
        # `--tags monitoring` - and the same node_exporter process serves it from the next connection
        before = peer_certificate(d.ne_port, ca)
        assert before == pem_to_der(tls / "node-exporter.crt")
        exporter = d.procs[0]
        time.sleep(1.1)  # a new notBefore second: the renewed certificate differs in more than its serial
        again = MonitoringDeployment(root, ports=(d.ne_port, d.prom_port), flags=("--tags", "monitoring"),
                                     **hall(tmp_path, monitoring_node_exporter_tls_renew_days=400))  # fmt: skip
        assert changed(again) > 0
        renewed = pem_to_der(tls / "node-exporter.crt")
        assert renewed != before
        assert exporter.poll() is None
        assert peer_certificate(d.ne_port, ca) == renewed
        wait_for(lambda: d.api("query", query='up{job="sco-control"} == 1')["result"], 10, "still up", 0.5)
        # and a run with nothing to renew changes nothing
        assert changed(MonitoringDeployment(root, ports=(d.ne_port, d.prom_port), **hall(tmp_path))) == 0
    finally:
        d.stop()


def test_without_metrics_tls_node_exporter_serves_plain_http_and_its_tls_files_are_gone(tmp_path: Path) -> None:
    root = tmp_path / "deployed"
    first = MonitoringDeployment(root, **hall(tmp_path))
    assert (root / "node-exporter-web.yml").is_file()
    assert (first.textfile / "sco_node_exporter_certificates.prom").is_file()
    d = MonitoringDeployment(root, ports=(first.ne_port, first.prom_port), **hall(tmp_path, sco_metrics_tls=False))
    try:
        args = args_of(root / "default-node-exporter")
        assert not [a for a in args if a.startswith("--web.config.file")], args
        for gone in (root / "node-exporter-web.yml", root / "node-exporter-tls",
                     d.textfile / "sco_node_exporter_certificates.prom"):  # fmt: skip
            assert not gone.exists(), gone
        jobs = {j["job_name"]: j for j in yaml.safe_load((root / "prometheus.yml").read_text())["scrape_configs"]}
        assert "scheme" not in jobs["sco-control"] and "tls_config" not in jobs["sco-control"], jobs["sco-control"]
        d.start()  # sco-control up over plain http
        with urllib.request.urlopen(f"http://127.0.0.1:{d.ne_port}/metrics", timeout=5) as r:
            assert r.status == 200
    finally:
        d.stop()
