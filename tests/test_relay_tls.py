"""The notice relay's TLS: real nats-servers configured as role notice_relay configures them.

Clients: a relay serves TLS only, so a plaintext client is refused, a client that trusts another CA refuses the relay,
and a client with the hall's CA (sco._nats) connects. Routes: a cluster's relays route to each other over TLS, each
showing a certificate the hall's CA signed; a relay with a certificate from another CA, a relay routing in plaintext
(the old password in its route URL) and a bare TLS connection without a certificate all fail to join. The role's
own template (static mode) renders the same: TLS for clients and routes, no password anywhere."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from sco import _nats
from sco.provider import relay_identity as ri
from tests.harness import BIN, free_port, wait_for
from tests.relays import HALL, RENDER, ROLE, Pki, RoleRelay, relay_refusal, run_playbook


def routes(monitor: int) -> int:
    """The servers this one has routes to (nats-server pools several connections per peer)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/routez", timeout=3) as r:
        return len({x.get("remote_name") or x["remote_id"] for x in json.loads(r.read()).get("routes") or []})


def operator_relay(
    tmp: Path, keys: ri.HallKeys, name: str, *, tls: ri.RelayTls | None, cluster: ri.Cluster | None = None,
    port: int | None = None, monitor: int | None = None,
) -> tuple[RoleRelay, int]:  # fmt: skip
    """A relay in operator mode (relay_identity.server_config, as the role renders it) started under ``tmp/name``."""
    d = tmp / name
    d.mkdir(parents=True)
    port, monitor = port or free_port(), monitor or free_port()
    conf = d / "nats.conf"
    conf.write_text(
        ri.server_config(
            keys, resolver_dir=d / "resolver", store_dir=d / "js", listen="127.0.0.1", port=port, monitor_port=monitor,
            server_name=name, cluster=cluster, tls=tls,
        )
    )  # fmt: skip
    check = subprocess.run([str(BIN / "nats-server"), "-t", "-c", str(conf)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    return RoleRelay(d, conf, port).start(), monitor


def test_a_relay_refuses_plaintext_and_clients_check_its_certificate(tmp_path: Path) -> None:
    keys = ri.HallKeys.ensure(tmp_path / "keys", HALL)
    pki, stranger = Pki(tmp_path / "pki"), Pki(tmp_path / "other-ca")
    relay, _ = operator_relay(tmp_path, keys, "r1", tls=pki.relay_tls())
    try:
        admin = ri.NKey.generate("user")
        creds = tmp_path / "admin.creds"
        creds.write_text(ri.creds(ri.stream_admin_user_jwt(keys, admin.public), admin.seed))
        # plaintext: the relay asks for TLS and nats-py without a context refuses to go on in the clear
        plain = asyncio.run(relay_refusal(relay.url, user_credentials=str(creds)))
        assert plain != "connected"
        # a client that trusts another CA refuses the relay's certificate before it sends its identity
        wrong = asyncio.run(relay_refusal(relay.url, user_credentials=str(creds), **stranger.client()))
        assert "certificate verify failed" in wrong, wrong
        # the hall's CA, through the one connect helper (sco._nats), as every SCO client connects
        assert asyncio.run(relay_refusal(relay.url, user_credentials=str(creds), **pki.client())) == "connected"

        async def via_helper() -> bool:
            auth = _nats.auth_options(creds_file=str(creds), ca_file=str(pki.ca))
            nc = await _nats.connect(relay.url, auth=auth, deadline_s=5)
            ok = bool(nc.is_connected)
            await nc.close()
            return ok

        assert asyncio.run(via_helper())
    finally:
        relay.stop()


def test_a_raw_plaintext_client_gets_no_service(tmp_path: Path) -> None:
    """A client that ignores the server's INFO and speaks the protocol in the clear (CONNECT, PING) gets no PONG:
    the relay waits for a TLS handshake and drops it."""
    keys = ri.HallKeys.ensure(tmp_path / "keys", HALL)
    relay, _ = operator_relay(tmp_path, keys, "r1", tls=Pki(tmp_path / "pki").relay_tls())
    try:
        with socket.create_connection(("127.0.0.1", relay.port), 3) as s:
            s.settimeout(3)
            info = s.recv(4096)
            assert b'"tls_required":true' in info, info
            s.sendall(b'CONNECT {"verbose":false,"tls_required":false}\r\nPING\r\n')
            seen = b""
            try:
                while chunk := s.recv(4096):
                    seen += chunk
            except (TimeoutError, ConnectionResetError):
                pass
            assert b"PONG" not in seen, seen
    finally:
        relay.stop()


def cluster_of(pki: Pki, ports: list[int], name: str) -> ri.Cluster:
    return ri.Cluster(
        name=HALL, listen=f"127.0.0.1:{ports[0]}", routes=[f"127.0.0.1:{p}" for p in ports], tls=pki.relay_tls(name)
    )


def test_routes_are_authenticated_by_certificate(tmp_path: Path) -> None:
    keys = ri.HallKeys.ensure(tmp_path / "keys", HALL)
    pki, stranger = Pki(tmp_path / "pki"), Pki(tmp_path / "other-ca")
    c1, c2 = free_port(), free_port()
    r1, m1 = operator_relay(tmp_path, keys, "r1", tls=pki.relay_tls("r1"), cluster=cluster_of(pki, [c1, c2], "r1"))
    r2, m2 = operator_relay(tmp_path, keys, "r2", tls=pki.relay_tls("r2"), cluster=cluster_of(pki, [c2, c1], "r2"))
    started: list[RoleRelay] = [r1, r2]
    try:
        for conf in (r1.conf, r2.conf):
            text = conf.read_text()
            assert "password" not in text and "authorization" not in text.split("cluster {")[1]
            assert "verify: true" in text.split("cluster {")[1]
        wait_for(lambda: routes(m1) == 1 and routes(m2) == 1, 20, "the two relays' route")

        # a relay whose certificate another CA signed (it trusts the hall's CA, so only its own certificate is wrong)
        cx = free_port()
        foreign = ri.Cluster(
            name=HALL, listen=f"127.0.0.1:{cx}", routes=[f"127.0.0.1:{cx}", f"127.0.0.1:{c1}"],
            tls=ri.RelayTls(*map(str, stranger.issue("intruder")), str(pki.ca)),
        )  # fmt: skip
        intruder, mx = operator_relay(tmp_path, keys, "intruder", tls=None, cluster=foreign)
        started.append(intruder)
        # a relay routing in plaintext, the old shared password in its route URL
        cp, plain_port = free_port(), free_port()
        plain_conf = tmp_path / "plain.conf"
        plain_conf.write_text(
            f'server_name: "plain"\nlisten: "127.0.0.1:{plain_port}"\n'
            f'cluster {{\n  name: "{HALL}"\n  listen: "127.0.0.1:{cp}"\n'
            f'  routes: ["nats-route://sco-route:guessed0password0@127.0.0.1:{c1}"]\n}}\n'
        )
        (tmp_path / "plain").mkdir()
        plain = RoleRelay(tmp_path / "plain", plain_conf, plain_port)
        plain.start()
        started.append(plain)
        time.sleep(4)  # several route attempts (nats-server retries a route every second)
        assert routes(m1) == 1 and routes(m2) == 1 and routes(mx) == 0
        log = (tmp_path / "r1" / "nats.log").read_text()
        assert "TLS route handshake error" in log or "tls: " in log, log[-3000:]

        # a bare TLS connection to the route port, trusting the hall's CA but showing no certificate: refused
        ctx = ssl.create_default_context(cafile=str(pki.ca))
        with socket.create_connection(("127.0.0.1", c1), 3) as s:
            s.settimeout(3)
            s.recv(4096)  # the route's INFO, in the clear, before the handshake
            with pytest.raises((ssl.SSLError, ConnectionResetError, TimeoutError)), ctx.wrap_socket(
                s, server_hostname="127.0.0.1"
            ) as t:  # fmt: skip
                t.sendall(b"PING\r\n")
                assert t.recv(4096) != b"", "the route port served a client without a certificate"
    finally:
        for r in started:
            r.stop()


def render(tmp: Path, name: str, pki: Pki, extra: dict[str, Any]) -> tuple[Path, int, int]:
    tls_dir = tmp / f"{name}-tls"
    tls_dir.mkdir()
    crt, key = pki.issue(name)
    (tls_dir / "relay.crt").write_bytes(crt.read_bytes())
    (tls_dir / "relay.key").write_bytes(key.read_bytes())
    (tls_dir / "ca.crt").write_bytes(pki.ca.read_bytes())
    port, monitor = free_port(), free_port()
    out = tmp / f"{name}.conf"
    r = run_playbook(
        tmp, RENDER,
        {"role": str(ROLE), "out": str(out), "notice_relay_hall": HALL, "notice_relay_nodes": ["a"],
         "notice_relay_credentials_dir": str(tmp / "credentials"), "notice_relay_listen": "127.0.0.1",
         "notice_relay_port": port, "notice_relay_monitor_port": monitor, "notice_relay_store_dir": str(tmp / name),
         "notice_relay_server_name": name, "notice_relay_tls_member_dir": str(tls_dir), **extra},
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    return out, port, monitor


def test_the_roles_template_serves_tls_and_routes_by_certificate(tmp_path: Path) -> None:
    pki = Pki(tmp_path / "pki")
    c1, c2 = free_port(), free_port()
    peers = [f"127.0.0.1:{c1}", f"127.0.0.1:{c2}"]
    confs = [
        render(tmp_path, "s1", pki, {"notice_relay_cluster_peers": peers, "notice_relay_cluster_port": c1}),
        render(tmp_path, "s2", pki, {"notice_relay_cluster_peers": peers, "notice_relay_cluster_port": c2}),
    ]
    started = []
    try:
        for conf, port, _ in confs:
            text = conf.read_text()
            assert "password" not in text and "sco-route" not in text, text
            assert "nats-route://127.0.0.1:" in text
            started.append(RoleRelay(conf.parent, conf, port).start())
        wait_for(lambda: all(routes(m) == 1 for _, _, m in confs), 20, "the role's relays' route")
        creds = tmp_path / "credentials"
        seed = {"nkeys_seed": str(creds / "node-a.nk")}
        url = started[0].url
        assert asyncio.run(relay_refusal(url, **seed)) != "connected"
        assert asyncio.run(relay_refusal(url, **seed, **pki.client())) == "connected"
    finally:
        for r in started:
            r.stop()


def test_a_launched_instances_user_data_carries_the_relays_ca(tmp_path: Path) -> None:
    """An instance the control loop launches is in no inventory: its user-data gives it the relays' CA (and agent.env
    names it), so its agent checks the relay before it enrols or sends anything."""
    import yaml

    from sco.contract.bundle import Bundle
    from sco.contract.compiler import compile_repo
    from sco.contract.signing import Keyring, generate, sign
    from sco.contract.userdata import RELAY_CA_PATH, render
    from sco.errors import ConfigError
    from tests.conftest import SAMPLE

    key = generate()
    bundle = Bundle.from_bytes(sign(compile_repo(SAMPLE), [key]), Keyring([key.public]))
    ca = Pki(tmp_path / "pki").ca.read_text()
    doc = yaml.safe_load(render(bundle, [key], [key.public], node_env={"SCO_AGENT_HALL": HALL}, relay_ca=ca))
    files = {f["path"]: f for f in doc["write_files"]}
    assert files[RELAY_CA_PATH]["content"] == ca and files[RELAY_CA_PATH]["permissions"] == "0644"
    assert f"SCO_AGENT_NATS_CA_FILE={RELAY_CA_PATH}\n" in files["/etc/sco/agent.env"]["content"]
    # the operator's own setting wins; something that is not a certificate is refused
    mine = render(bundle, [key], [key.public], node_env={"SCO_AGENT_NATS_CA_FILE": "/opt/ca.pem"}, relay_ca=ca)
    assert "SCO_AGENT_NATS_CA_FILE=/opt/ca.pem\n" in yaml.safe_load(mine)["write_files"][-1]["content"]
    with pytest.raises(ConfigError, match="relay CA: not a PEM certificate"):
        render(bundle, [key], [key.public], relay_ca="not a certificate")


TRUST = """
- name: What a hall's relay clients are given to trust (role hall's and role control_loop's own variables)
  hosts: localhost
  gather_facts: false
  vars_files: ["{{ roles }}/hall/defaults/main.yml", "{{ roles }}/control_loop/defaults/main.yml",
               "{{ roles }}/control_loop/vars/main.yml"]
  tasks:
    - name: The agents' CA text (node_agent_nats_ca)
      ansible.builtin.copy: {content: "{{ node_agent_nats_ca | trim }}\n", dest: "{{ out }}/agent-ca.crt", mode: "0644"}
    - name: The control host's, which the instances it launches get in their user-data
      ansible.builtin.copy: {content: "{{ _control_loop_nats_ca_pem }}", dest: "{{ out }}/control-ca.crt", mode: "0644"}
"""


def test_during_a_ca_rotation_clients_trust_both_cas(tmp_path: Path) -> None:
    """RUNBOOK's CA rotation: between re-signing the relays (step 3) and dropping the old CA (step 4) the relays show
    certificates of the new CA while clients were given the old one. With notice_relay_tls_trust_extra, the CA text
    the agents, the control host and (through it) launched instances get holds both, so none refuses a relay."""
    keys = ri.HallKeys.ensure(tmp_path / "keys", HALL)
    old, new = Pki(tmp_path / "old-ca"), Pki(tmp_path / "new-ca")
    out = tmp_path / "given"
    out.mkdir()
    roles = ROLE.parent

    def given(extra: list[str]) -> tuple[Path, Path]:
        r = run_playbook(tmp_path, TRUST, {
            "roles": str(roles), "out": str(out), "sco_relay_url": "nats://127.0.0.1:4222",
            "sco_relay_ca_file": str(old.ca), "control_loop_nats_ca_src": str(old.ca),
            "notice_relay_tls_trust_extra": extra})  # fmt: skip
        assert r.returncode == 0, r.stdout + r.stderr
        return out / "agent-ca.crt", out / "control-ca.crt"

    relay, _ = operator_relay(tmp_path, keys, "r1", tls=new.relay_tls())  # re-signed by the new CA (step 3)
    try:
        admin = ri.NKey.generate("user")
        creds = tmp_path / "admin.creds"
        creds.write_text(ri.creds(ri.stream_admin_user_jwt(keys, admin.public), admin.seed))

        def connect(ca: Path) -> str:
            return asyncio.run(relay_refusal(relay.url, user_credentials=str(creds), tls=_nats.tls_context(str(ca))))

        # before: only the old CA given, the relay's new certificate refused (what the RUNBOOK warned of)
        agent_ca, control_ca = given([])
        assert agent_ca.read_text().count("BEGIN CERTIFICATE") == 1
        assert "certificate verify failed" in connect(agent_ca)
        # with the new CA as the extra one: both CAs, one after the other, and the relay accepted by each client
        agent_ca, control_ca = given([str(new.ca)])
        for ca in (agent_ca, control_ca):
            text = ca.read_text()
            assert text.count("BEGIN CERTIFICATE") == 2, text
            assert old.ca.read_text().strip() in text and new.ca.read_text().strip() in text
            assert connect(ca) == "connected"
    finally:
        relay.stop()
