"""Role contract_distributor's TLS (tasks/tls.yml with the hall's CA, the unit's ExecStart), run by ansible-playbook
on this host into a test directory: the hall's CA is made on the controller, the distributor's certificate is signed
by it for the names nodes reach it at (the host of sco_distributor_url among them), deployed with its key, and its
expiry is written for node_exporter's textfile collector (ScoCertificateExpiring, `promtool check metrics`). Exactly
the rendered unit's ExecStart then serves HTTPS: the node's fetch command checks it against the CA the role made;
plain HTTP to it gets nothing. A second run changes nothing; a run inside the renewal margin re-signs the
certificate, which the running distributor serves from the next connection on (no restart)."""

from __future__ import annotations

import json
import os
import shlex
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from sco.contract.distributor import publish
from sco.contract.signing import Keyring, generate, write_keypair
from sco_devkit.devcluster.openstack import _listening
from tests.harness import free_port, hall_bundle, wait_for
from tests.prom import promtool_check, samples

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]
ROLES = REPO / "collections/ansible_collections/sco/orchestrator/roles"

PLAY = """
- name: The distributor's TLS, as role contract_distributor does it (the CA's and the certificate's files here)
  hosts: localhost
  gather_facts: false
  tasks:
    - name: TLS
      ansible.builtin.include_role:
        name: sco.orchestrator.contract_distributor
        tasks_from: tls.yml
        public: true  # the role's variables for the unit's template below
    - name: The unit
      ansible.builtin.template:
        src: "{{ roles_dir }}/contract_distributor/templates/sco-distributor.service.j2"
        dest: "{{ out }}/sco-distributor.service"
        mode: "0644"
"""


def converge(tmp: Path, port: int, **more: Any) -> subprocess.CompletedProcess[str]:
    inventory = tmp / "inventory.ini"
    inventory.write_text("[sco_control]\nlocalhost ansible_connection=local\n[sco_distributor]\nlocalhost\n")
    play = tmp / "play.yml"
    play.write_text(PLAY)
    ev = {
        "ansible_python_interpreter": sys.executable, "roles_dir": str(ROLES), "out": str(tmp),
        "sco_hall": "local", "sco_state_dir": str(tmp / "state"),
        "sco_distributor_url": f"https://dist.hall.example:{port}",
        "contract_distributor_hall": "local", "contract_distributor_root": str(tmp / "root"),
        "contract_distributor_listen": f"127.0.0.1:{port}",
        "contract_distributor_tls_member_dir": str(tmp / "host-tls"),
        "contract_distributor_tls_group": "root",  # (the role makes sco-distributor; this host's own group here)
        "contract_distributor_tls_textfile_dir": str(tmp / "textfile"),
        **more,
    }  # fmt: skip
    env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(REPO / "collections"), "ANSIBLE_NOCOLOR": "1",
           "PATH": f"{BIN}:{os.environ['PATH']}"}  # fmt: skip
    p = subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", str(inventory), str(play), "-e", json.dumps(ev)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    return p


def served_certificate(port: int, ca: Path) -> dict[str, Any]:
    ctx = ssl.create_default_context(cafile=str(ca))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s,
    ):
        return dict(s.getpeercert())  # type: ignore[arg-type]


def test_the_roles_certificate_serves_https_checked_against_the_halls_ca_and_renews(tmp_path: Path) -> None:
    port = free_port()
    first = converge(tmp_path, port)
    ca = tmp_path / "state" / "tls" / "ca.crt"
    made = tmp_path / "state" / "tls" / "distributor" / "localhost.crt"
    assert ca.is_file() and made.is_file()
    host = tmp_path / "host-tls"
    assert (host / "distributor.crt").read_bytes() == made.read_bytes()
    assert oct((host / "distributor.key").stat().st_mode & 0o777) == "0o640"
    assert ca.read_text().strip() in (host / "ca.crt").read_text()
    text = (tmp_path / "textfile" / "sco_distributor_certificates.prom").read_text()
    promtool_check(text)
    not_after = (
        subprocess.run(
            ["openssl", "x509", "-enddate", "-noout", "-in", str(made)], capture_output=True, text=True, check=True
        )
        .stdout.strip()
        .removeprefix("notAfter=")
    )
    expiry = samples(text)[
        'sco_certificate_expiry_timestamp_seconds{certificate="contract_distributor",host="localhost"}'
    ]
    assert abs(expiry - ssl.cert_time_to_seconds(not_after)) < 1, (expiry, not_after)
    assert "changed=0" not in first.stdout.split("PLAY RECAP")[1]

    unit = (tmp_path / "sco-distributor.service").read_text()
    assert "SupplementaryGroups=root" in unit
    line = next(x for x in unit.splitlines() if x.startswith("ExecStart=")).removeprefix("ExecStart=")
    argv = shlex.split(line)
    assert argv[0] == "/opt/sco/bin/sco" and "--tls-cert" in argv and "--tls-key" in argv
    key = generate()
    trust = tmp_path / "trusted"
    trust.mkdir()
    write_keypair(key, tmp_path / "hall.key", trust / "hall.pub")
    raw = hall_bundle(tmp_path / "h", key)
    publish(raw, tmp_path / "root", Keyring([key.public]))
    log = open(tmp_path / "distributor.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([str(BIN / "sco"), *argv[1:]], stdout=log, stderr=log)
    try:
        wait_for(lambda: _listening(port), 15, "the unit's distributor")
        names = served_certificate(port, ca)["subjectAltName"]
        assert ("DNS", "dist.hall.example") in names and ("IP Address", "127.0.0.1") in names, names
        fetch = [str(BIN / "sco"), "node", "fetch-bundle", "--trust-dir", str(trust)]
        url = f"https://127.0.0.1:{port}/v1/halls/local/bundle.json"
        p = subprocess.run(
            [*fetch, "--url", url, "--bundle-ca-file", str(ca), "--cache-dir", str(tmp_path / "c")],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert p.returncode == 0 and '"outcome": "accepted"' in p.stdout, p.stdout + p.stderr
        p = subprocess.run(
            [*fetch, "--url", url.replace("https:", "http:"), "--cache-dir", str(tmp_path / "c2")],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert p.returncode == 6 and not (tmp_path / "c2" / "bundle.json").exists(), p.stdout + p.stderr

        # again: nothing to do
        again = converge(tmp_path, port)
        assert "changed=0" in again.stdout.split("PLAY RECAP")[1], again.stdout[-3000:]

        # a run within the renewal margin (a 365-day certificate, renewed with more than 365 days left) re-signs it;
        # the running distributor shows the new one from the next connection on
        before = served_certificate(port, ca)["serialNumber"]
        converge(tmp_path, port, contract_distributor_tls_renew_days=400)
        assert (host / "distributor.crt").read_bytes() == made.read_bytes()
        time.sleep(1.2)  # the distributor looks at its files at most once a second
        wait_for(lambda: served_certificate(port, ca)["serialNumber"] != before, 10, "the renewed certificate served")
        assert proc.poll() is None  # no restart
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
