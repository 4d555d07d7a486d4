"""site.yml deploys the enrolment service. Role control_loop installs sco-enrol.service on the control hosts
of a hall whose relay is in operator mode (role hall maps control_loop_enrolment_enabled and the controller's
operator keys), and the loop's node_env names it (SCO_AGENT_ENROL_URL). This renders the role's unit from its
template with the role's defaults and vars and role hall's mapping, hands it exactly the files its LoadCredential=
lines name (the relay keys role notice_relay's tool made on the controller, the Kubernetes token), fills systemd's
${CREDENTIALS_DIRECTORY} and runs exactly its ExecStart, with the DSN its EnvironmentFile holds, against a real
PostgreSQL, the relay role notice_relay applied in operator mode (tests/test_relay_operator_role.py's) and the
Kubernetes API stand-in: a launched instance's enrolment is answered, the node hears its own notices on the
identity it got, its Kubernetes token is bound to its Node; the operator's own seed never reaches the unit. The
role's tasks (tasks/enrolment.yml) applied with their paths in the test's directory copy exactly the files the unit
loads, root's 0600, change nothing the second time and stop naming a key the controller lacks."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from sco.contract.enrolment import creds_text
from sco.control.acquirer import ENROL_TOKEN, ENROL_URL, Acquirer
from sco.errors import ConfigError
from sco.provider import relay_identity as ri
from sco.state.fleet import FleetState, Pool
from sco_devkit.standins.kube_apiserver import KubeApiStandIn
from tests.enrol_client import post, request
from tests.harness import free_port, make_tls, plaintext_answer, render_with_roles, wait_for
from tests.relays import HALL, Deployed, notices_reach

ROOT = Path(__file__).resolve().parents[1]
ROLES = ROOT / "collections/ansible_collections/sco/orchestrator/roles"
BIN = Path(sys.executable).parent
UNIT = "sco-enrol.service"

RENDER = """
- name: The enrolment service's unit, from role control_loop's template, defaults and vars and role hall's mapping
  hosts: localhost
  gather_facts: false
  vars_files:
    - "{{ roles_dir }}/hall/defaults/main.yml"
    - "{{ roles_dir }}/control_loop/defaults/main.yml"
    - "{{ roles_dir }}/control_loop/vars/main.yml"
  tasks:
    - name: Render
      ansible.builtin.template:
        src: "{{ roles_dir }}/control_loop/templates/sco-enrol.service.j2"
        dest: "{{ out }}/sco-enrol.service"
        mode: "0644"
      when: _control_loop_enrolment_on | bool
    - name: Say whether the role would install it, what it copies and what the loop's node_env is
      ansible.builtin.copy:
        content: >-
          {{ {'enabled': _control_loop_enrolment_on | bool, 'keys': control_loop_enrolment_relay_keys,
              'files': _control_loop_enrolment_key_files, 'node_env': _control_loop_extravars.sco_node_env,
              'enrol_ca': _control_loop_extravars.sco_enrol_ca_file_here}
             | to_json }}
        dest: "{{ out }}/facts.json"
        mode: "0644"
"""


def render(out: Path, **ev: object) -> dict[str, Any]:
    render_with_roles(out, RENDER, **ev)
    return dict(json.loads((out / "facts.json").read_text()))


def settings(unit: Path, key: str) -> list[str]:
    return [x.split("=", 1)[1] for x in unit.read_text().splitlines() if x.startswith(f"{key}=")]


def exec_start(unit: Path, creds: Path) -> list[str]:
    """ExecStart as systemd runs it: ${CREDENTIALS_DIRECTORY} filled, and the RuntimeDirectory= it makes (here
    ``run`` beside the credentials) in place of /run/<name>."""
    (line,) = settings(unit, "ExecStart")
    (runtime,) = settings(unit, "RuntimeDirectory")
    (creds.parent / "run").mkdir(exist_ok=True)
    line = line.replace(f"/run/{runtime}/", f"{creds.parent / 'run'}/")
    argv = shlex.split(line.replace("${CREDENTIALS_DIRECTORY}", str(creds)))
    assert argv[0] == "/opt/sco/bin/sco"  # the role's venv: the test's own venv runs the same command
    return [str(BIN / "sco"), *argv[1:]]


def load_credentials(unit: Path, creds: Path, host: dict[str, Path]) -> None:
    """What systemd does with the unit's LoadCredential=ID:PATH lines: PATH (here the file it stands for in
    ``host``) copied to ${CREDENTIALS_DIRECTORY}/ID."""
    creds.mkdir(mode=0o700)
    for entry in settings(unit, "LoadCredential"):
        name, path = entry.split(":", 1)
        shutil.copyfile(host[path], creds / name)
        (creds / name).chmod(0o400)


def exposure(unit: Path) -> float:
    p = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", str(unit)],
        capture_output=True, text=True, timeout=120, cwd=unit.parent,
    )  # fmt: skip
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", p.stdout + p.stderr)
    assert m, p.stdout + p.stderr
    return float(m.group(1))


def verify(unit: Path) -> str:
    """What ``systemd-analyze verify`` says of the unit (a stand-in for the venv's sco, which it looks for)."""
    where = unit.parent / "verify"
    (where / "venv" / "bin").mkdir(parents=True)
    sco = where / "venv" / "bin" / "sco"
    sco.write_text("#!/bin/sh\n")
    sco.chmod(0o755)
    (where / UNIT).write_text(unit.read_text().replace("/opt/sco/bin/sco ", f"{sco} "))
    failed = ROLES / "control_loop" / "files" / "sco-unit-failed@.service"
    (where / failed.name).write_text(failed.read_text())
    p = subprocess.run(
        ["systemd-analyze", "verify", f"./{UNIT}", f"./{failed.name}"],
        cwd=where, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return p.stderr.strip()  # verify exits 0 even for a bad unit: what it says is the verdict


def test_a_static_relay_gets_no_enrolment_service(tmp_path: Path) -> None:
    facts = render(
        tmp_path, sco_hall=HALL, sco_relay_url="nats://127.0.0.1:4222", control_loop_hall=HALL,
        control_loop_node_env={"SCO_AGENT_LOG_LEVEL": "debug"},
    )  # fmt: skip
    assert facts["enabled"] is False and not (tmp_path / UNIT).exists()
    assert facts["node_env"] == {"SCO_AGENT_LOG_LEVEL": "debug"}


def test_with_enrolment_tls_off_the_port_and_the_url_are_plain_http(tmp_path: Path) -> None:
    """sco_enrol_tls: false (images baked before the agent knew SCO_AGENT_ENROL_CA_FILE): http, no CA handed out."""
    facts = render(
        tmp_path, sco_hall=HALL, sco_relay_url="nats://127.0.0.1:4222", notice_relay_auth_mode="operator",
        sco_credentials_dir=str(tmp_path / "creds"), control_loop_hall=HALL, sco_enrol_tls=False,
    )  # fmt: skip
    assert facts["enabled"] is True and facts["enrol_ca"] == ""
    assert facts["node_env"][ENROL_URL] == "http://localhost:8471"
    text = (tmp_path / UNIT).read_text()
    assert " --tls-cert-file" not in text and " --metrics-tls-cert-file" in text


def test_the_roles_enrolment_service_answers_a_launched_instance(tmp_path: Path, fleet_dsn: str) -> None:
    relay = Deployed(tmp_path / "relay")
    relay.apply(["a"])  # the hall's operator keys on the controller, the relay's configuration
    kube = KubeApiStandIn().start()
    service_token, _ = kube.issue_token("sco-system", "sco-enrol")
    kube.add_serviceaccount("sco-system", "sco-agent")
    port, metrics_port = free_port(), free_port()
    proc: subprocess.Popen[bytes] | None = None
    state = FleetState(fleet_dsn)
    try:
        facts = render(
            tmp_path / "unit", sco_hall=HALL, sco_relay_url=relay.url, notice_relay_auth_mode="operator",
            sco_credentials_dir=str(relay.creds.parent), control_loop_hall=HALL,
            control_loop_kubernetes={"url": kube.url}, control_loop_enrolment_listen="127.0.0.1",
            control_loop_enrolment_port=port, control_loop_node_env={"SCO_AGENT_LOG_LEVEL": "debug"},
            control_loop_enrolment_metrics_port=metrics_port,
            # the hall's CA as the relay's role made it, and where the control host keeps its copy (here: that file)
            sco_relay_ca_file=str(relay.ca), _control_loop_nats_ca_file=str(relay.ca),
        )  # fmt: skip
        unit = tmp_path / "unit" / UNIT
        # the enrolment port over TLS (role hall's sco_enrol_tls, on by default): its answer carries the node's
        # Kubernetes token; every new instance's user-data carries the CA (the loop's copy of it here)
        url = f"https://localhost:{port}"  # ansible_host unset: the inventory name, here localhost
        assert facts["enrol_ca"] == "/etc/sco/enrol-ca.crt"
        assert facts["enabled"] is True and facts["keys"] == str(relay.creds / "operator")
        # where the agent serves metrics, so that it tells the service and Prometheus's file_sd lists it
        assert facts["node_env"] == {
            ENROL_URL: url,
            "SCO_AGENT_METRICS_LISTEN": "0.0.0.0:9469",
            "SCO_AGENT_LOG_LEVEL": "debug",
        }
        # the unit: its own dynamic user, the DSN from a root-only file, secrets as credentials only
        text = unit.read_text()
        assert "DynamicUser=yes" in text and settings(unit, "EnvironmentFile") == ["/etc/sco/enrol.env"]
        assert f"--nats-ca-file {relay.ca} " in text  # the relay serves TLS: its CA checks the relay admin's peer
        assert not re.search(r"\bS[OAU][A-Z2-7]{50,}", text) and "postgres" not in text
        assert exposure(unit) <= 3.0
        assert verify(unit) == ""
        # what the role copies (tasks/enrolment.yml: each of _control_loop_enrolment_key_files from the controller's
        # directory into /etc/sco/enrol/relay-keys, root's 0600) and the Kubernetes token file, as systemd loads them
        keys_dir = Path("/etc/sco/enrol/relay-keys")
        host = {str(keys_dir / f): relay.creds / "operator" / f for f in facts["files"]}
        (tmp_path / "enrol.token").write_text(service_token)
        host["/etc/sco/enrol.token"] = tmp_path / "enrol.token"
        # /metrics's certificate and key, as tasks/enrolment_tls.yml copies them (here a CA of the test's own)
        hall_ca, other_ca = make_tls(tmp_path / "hall-ca"), make_tls(tmp_path / "other-ca")
        host["/etc/sco/enrol/metrics-tls/metrics.crt"] = hall_ca[1]
        host["/etc/sco/enrol/metrics-tls/metrics.key"] = hall_ca[2]
        assert f"--metrics-listen 127.0.0.1:{metrics_port} --metrics-tls-cert-file" in text
        pair = (
            "--tls-cert-file ${CREDENTIALS_DIRECTORY}/metrics.crt --tls-key-file ${CREDENTIALS_DIRECTORY}/metrics.key"
        )
        assert f" {pair}" in text
        creds = tmp_path / "credentials"
        load_credentials(unit, creds, host)
        loaded = sorted(p.name for p in creds.iterdir())
        assert "operator.nk" not in loaded and "operator.pub" in loaded and "kube-token" in loaded, loaded
        # the operator's identity seed stays on the controller: nothing the unit gets starts with SO but its signer's
        signer = (relay.creds / "operator" / "operator-signer.nk").read_text()
        assert [p.name for p in creds.iterdir() if p.read_text().startswith("SO")] == ["operator-signer.nk"], signer

        relay.start()
        stream = subprocess.run(relay.unit("ExecStartPost"), capture_output=True, text=True, timeout=60)
        assert stream.returncode == 0, stream.stderr
        log = open(tmp_path / "enrol.log", "wb")  # noqa: SIM115
        # the EnvironmentFile's one line, as the role's task writes it (SCO_DB_DSN=<control_loop_state_dsn>)
        env = {**os.environ, "SCO_DB_DSN": fleet_dsn}
        proc = subprocess.Popen(exec_start(unit, creds), stdout=log, stderr=log, env=env)

        def up() -> bool:
            assert proc is not None and proc.poll() is None, (tmp_path / "enrol.log").read_text()[-2000:]
            ctx = ssl.create_default_context(cafile=str(hall_ca[0]))
            try:
                return urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", timeout=2, context=ctx).status == 200
            except OSError:
                return False

        wait_for(up, 60, "sco enrol serve, as the role's unit runs it")
        # its file_sd for role monitoring's Prometheus, in its RuntimeDirectory=, readable by all: no target yet
        sd = tmp_path / "run" / "agents.json"
        assert json.loads(sd.read_text()) == [] and sd.stat().st_mode & 0o777 == 0o644

        # the loop launches an instance with the node_env the role wrote: its agent.env holds a token of its own
        state.ensure_pool(Pool(HALL, "p", "m1.small", "img"))
        envs: dict[str, dict[str, str]] = {}

        def user_data(name: str, own: dict[str, str] | None = None) -> str:
            envs[name] = dict(own or {})
            return "#cloud-config\n"

        acquirer = Acquirer(None, state, user_data, enrol_url=facts["node_env"][ENROL_URL])
        node = f"{HALL}-p-e-0"
        inst = state.request(HALL, "p", "e", 0, node)
        acquirer._user_data(inst)
        server_id = str(uuid.uuid4())
        state.transition(inst.id, "launching", "launch.requested", server_id=server_id, name=node)
        kube.cluster.add_node(node)
        assert envs[node][ENROL_URL] == url

        # the agent's exchange at first boot (here on the loopback address the service listens on)
        key = ri.NKey.generate("user")
        enrol = f"https://127.0.0.1:{port}"
        status, body = post(enrol, request(node, server_id, envs[node][ENROL_TOKEN], key.public), ca=hall_ca[0])
        assert status == 200, body
        answer = json.loads(body)
        assert answer["kube_token"] and answer["kube_expires"] > 0
        issued = kube.issued[answer["kube_token"]]
        assert issued["node"] == node and issued["sa"] == ("sco-system", "sco-agent")
        # the identity it got speaks on the relay: its own notices reach it
        node_creds = tmp_path / "node.creds"
        node_creds.write_text(creds_text(answer["nats_user_jwt"], key.seed))
        got = asyncio.run(notices_reach(relay.url, relay.creds / "reclaimer.creds", {node: node_creds}))
        assert got == {node: [f"notice for {node}".encode()]}, got
        # the same token again is refused
        status, body = post(enrol, request(node, server_id, envs[node][ENROL_TOKEN], key.public), ca=hall_ca[0])
        assert status == 409, body

        # the enrolment port: a plaintext request or another CA's client gets nothing
        assert plaintext_answer(port, "/healthz") == b""
        status_or_error: Any
        try:
            status_or_error = post(enrol, request(node, server_id, "x" * 43, key.public), ca=other_ca[0])
        except urllib.error.URLError as err:
            status_or_error = str(err)
        assert "CERTIFICATE_VERIFY_FAILED" in str(status_or_error), status_or_error

        # /metrics on its own port, over TLS only, checked against the hall's CA (role monitoring's job sco-enrol);
        # a plaintext request or another CA's client gets nothing; the enrolment port answers it 404
        def scrape(ca: Path) -> str:
            ctx = ssl.create_default_context(cafile=str(ca))
            url = f"https://127.0.0.1:{metrics_port}/metrics"
            return urllib.request.urlopen(url, timeout=5, context=ctx).read().decode()

        assert re.search(r"^sco_enrol_issued_total 1$", scrape(hall_ca[0]), re.M)
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            scrape(other_ca[0])
        assert plaintext_answer(metrics_port, "/metrics") == b""
        with pytest.raises(urllib.error.HTTPError) as e:
            ctx = ssl.create_default_context(cafile=str(hall_ca[0]))
            urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", timeout=5, context=ctx)
        assert e.value.code == 404
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        state.close()
        relay.stop()
        kube.stop()


def test_the_service_reads_the_keys_it_is_given_and_makes_none(tmp_path: Path) -> None:
    # HallKeys.load: seeds for the four keys it signs with, public keys enough for the other three; nothing made
    made = ri.HallKeys.ensure(tmp_path / "controller", HALL)
    given = tmp_path / "given"
    given.mkdir()
    for name in ri.ISSUER_SEEDS:
        shutil.copyfile(tmp_path / "controller" / f"{name}.nk", given / f"{name}.nk")
    for name in ("operator", "notices", "events"):
        (given / f"{name}.pub").write_text(getattr(made, name).public + "\n")
    keys = ri.HallKeys.load(given, HALL)
    assert ri.operator_jwt(made) and keys.operator.seed == b""  # the operator's identity: public only
    assert ri.node_account_jwt(keys, "n", made.notices.public) == ri.node_account_jwt(made, "n", made.notices.public)
    (given / "node-issuer.nk").unlink()
    (given / "node-issuer.pub").write_text(made.node_issuer.public)  # a key it signs with: only its seed will do
    with pytest.raises(ConfigError, match=r"node-issuer\.nk: no such file"):
        ri.HallKeys.load(given, HALL)
    assert sorted(p.name for p in given.iterdir()) == sorted(
        [f"{n}.nk" for n in ri.ISSUER_SEEDS if n != "node-issuer"]
        + ["node-issuer.pub", "operator.pub"]
        + ["notices.pub", "events.pub"]
    )  # nothing made
    shutil.copyfile(tmp_path / "controller" / "node-issuer.nk", given / "node-issuer.nk")
    (given / "events.pub").write_text(made.operator.public)  # the operator's key where the events account's goes
    with pytest.raises(ConfigError, match=r"events\.pub: not a public key of kind account"):
        ri.HallKeys.load(given, HALL)


APPLY = """
- name: Role control_loop's enrolment tasks on this machine (its paths in the test's directory)
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Find out whether systemd runs here
      ansible.builtin.stat:
        path: /run/systemd/system
      register: _control_loop_systemd
    - name: The enrolment tasks
      ansible.builtin.include_role:
        name: sco.orchestrator.control_loop
        tasks_from: enrolment.yml
"""


def test_the_roles_tasks_copy_only_the_keys_the_unit_loads_and_change_nothing_the_second_time(tmp_path: Path) -> None:
    controller = tmp_path / "credentials" / "nats" / "operator"
    made = ri.HallKeys.ensure(controller, HALL)  # what sco-relay-operator.py issue leaves there
    for name in ("operator", "notices", "events"):
        (controller / f"{name}.pub").write_text(getattr(made, name).public + "\n")
    units = tmp_path / "units"
    # `systemctl enable` is skipped where its link exists (creates:): this machine's systemd is not touched
    (units / "multi-user.target.wants").mkdir(parents=True)
    (units / "multi-user.target.wants" / UNIT).touch()
    (tmp_path / "textfile").mkdir()  # role control_loop's metrics.yml makes it before
    (tmp_path / "play.yml").write_text(APPLY)
    ev = {
        "ansible_python_interpreter": sys.executable, "sco_hall": HALL, "sco_relay_url": "nats://127.0.0.1:4222",
        "notice_relay_auth_mode": "operator", "sco_credentials_dir": str(tmp_path / "credentials"),
        "control_loop_hall": HALL, "control_loop_state_dsn": "host=db.example dbname=sco password=secret",
        "control_loop_kubernetes": {"url": "https://k.example:6443"},
        "control_loop_enrolment_kube_token_file": str(tmp_path / "enrol.token"),
        # the role's own paths (vars/main.yml), here under the test's directory
        "_control_loop_enrolment_keys_dir": str(tmp_path / "keys"),
        "_control_loop_enrolment_env_file": str(tmp_path / "enrol.env"), "_control_loop_unit_dir": str(units),
        # the hall's CA and the certificates it signs on the controller (sco_state_dir/tls), /metrics's pair on the
        # host and its expiry's textfile, under the test's directory
        "sco_state_dir": str(tmp_path / "state"),
        "_control_loop_enrolment_metrics_tls_host_dir": str(tmp_path / "metrics-tls"),
        "control_loop_metrics_textfile_dir": str(tmp_path / "textfile"),
        "_control_loop_enrolment_ca_file": str(tmp_path / "enrol-ca.crt"),  # the loop's copy of the hall's CA
    }  # fmt: skip
    env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(ROOT / "collections"), "ANSIBLE_NOCOLOR": "1"}

    def apply() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(BIN / "ansible-playbook"), "-i", "localhost,", "-c", "local", "play.yml", "-e", json.dumps(ev)],
            capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
        )  # fmt: skip

    def changed(out: subprocess.CompletedProcess[str]) -> int:
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
        m = re.search(r"localhost\s+:\s+ok=\d+\s+changed=(\d+)", out.stdout)
        assert m, out.stdout[-3000:]
        return int(m.group(1))

    first = apply()
    assert changed(first) > 0 and "secret" not in first.stdout
    assert f"WARNING control_loop: {tmp_path / 'enrol.token'} is not on this host" in first.stdout
    keys = tmp_path / "keys"
    assert keys.stat().st_mode & 0o777 == 0o700
    assert sorted(p.name for p in keys.iterdir()) == sorted(
        [f"{n}.nk" for n in ri.ISSUER_SEEDS] + ["operator.pub", "notices.pub", "events.pub"]
    )  # the operator's own seed stays on the controller
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in [*keys.iterdir(), tmp_path / "enrol.env"])
    assert (tmp_path / "enrol.env").read_text() == "SCO_DB_DSN=host=db.example dbname=sco password=secret\n"
    unit = units / UNIT
    # every file the unit loads is one the role put there (or the token the role warned about)
    loaded = {e.split(":", 1)[1] for e in settings(unit, "LoadCredential")}
    tls = tmp_path / "metrics-tls"
    assert loaded == {str(keys / p.name) for p in keys.iterdir()} | {str(tmp_path / "enrol.token")} | {
        str(tls / "metrics.crt"),
        str(tls / "metrics.key"),
    }
    # /metrics's pair: signed on the controller by the hall's CA the role made under sco_state_dir, for this host's
    # names; root's 0600 copies; its expiry for ScoCertificateExpiring
    assert tls.stat().st_mode & 0o777 == 0o700
    assert all((tls / f).stat().st_mode & 0o777 == 0o600 for f in ("metrics.crt", "metrics.key"))
    ca = tmp_path / "state" / "tls" / "ca.crt"
    check = subprocess.run(
        ["openssl", "verify", "-CAfile", str(ca), "-verify_ip", "127.0.0.1", str(tls / "metrics.crt")],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr
    prom = (tmp_path / "textfile" / "sco_enrol_certificates.prom").read_text()
    labels = '{certificate="control_loop_enrolment_metrics",host="localhost"}'
    assert f"sco_certificate_expiry_timestamp_seconds{labels} " in prom, prom
    assert "--metrics-tls-cert-file ${CREDENTIALS_DIRECTORY}/metrics.crt" in unit.read_text()
    # the same pair on the enrolment port; the loop's copy of the CA it chains to (public: the loop's user reads it)
    assert "--tls-cert-file ${CREDENTIALS_DIRECTORY}/metrics.crt" in unit.read_text()
    loop_ca = tmp_path / "enrol-ca.crt"
    assert loop_ca.read_bytes() == ca.read_bytes() and loop_ca.stat().st_mode & 0o777 == 0o644
    assert changed(apply()) == 0
    # role kyverno_policies read the service's token back from the cluster onto the controller: installed from there,
    # root's 0600, the warning gone; nothing made by hand
    src = tmp_path / "credentials" / "kubernetes" / "enrol.token"
    src.parent.mkdir(mode=0o700)
    src.write_text("the-enrol-token\n")
    out = apply()
    assert changed(out) == 1 and "is not on this host" not in out.stdout and "the-enrol-token" not in out.stdout
    token = tmp_path / "enrol.token"
    assert token.read_text() == "the-enrol-token\n" and token.stat().st_mode & 0o777 == 0o600
    assert changed(apply()) == 0
    # a key notice_relay has not made yet: the run stops and names it
    (controller / "notices.pub").unlink()
    out = apply()
    assert out.returncode != 0 and f"needs notices.pub in {controller} on the controller" in out.stdout, out.stdout
