"""Notice relays in the tests, as role notice_relay configures them: the role rendered and applied on this machine
(run_playbook), a relay from its own template (static per-node accounts: start_relay, RoleRelay; operator mode with a
full resolver: start_jwt_relay, JwtRelay, and the role applied in operator mode: Deployed), the identities the role
mints (agent_identity), and the probes the tests share: whether a relay lets a connection in (relay_refusal), which
stream subjects it holds, a node's acked event, a node hearing its notices, publishing until a notice arrives, and the
reply-subject attacks' size (ATTACKS) and their status line."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import socket
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats

from sco import __version__, _nats
from sco.provider import heartbeats
from sco.provider import relay_identity as ri
from tests.harness import BIN, AgentEnv, NatsServer, free_port, wait_for

REPO = Path(__file__).resolve().parents[1]


ROLE = REPO / "collections/ansible_collections/sco/orchestrator/roles/notice_relay"


RENDER = """
- name: Render the relay's configuration with the role's template
  hosts: localhost
  gather_facts: false
  vars_files: ["{{ role }}/defaults/main.yml", "{{ role }}/vars/main.yml"]
  tasks:
    - name: Render
      ansible.builtin.template:
        src: "{{ role }}/templates/nats-server.conf.j2"
        dest: "{{ out }}"
        mode: "0600"
"""


def run_playbook(
    tmp: Path, play: str | Path, extravars: dict[str, Any], *flags: str
) -> subprocess.CompletedProcess[str]:
    """Run a playbook file, or a playbook text written to a file first."""
    if isinstance(play, str):
        text, play = play, tmp / f"play-{len(list(tmp.glob('play-*')))}.yml"
        play.write_text(text)
    # the hall's state directory (keys, credentials, drill reports) in the test's own directory, never $HOME
    extravars = {"ansible_python_interpreter": sys.executable, "sco_state_dir": str(tmp), **extravars}
    env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(REPO / "collections"), "PATH": f"{BIN}:{os.environ['PATH']}"}
    return subprocess.run(
        [
            str(BIN / "ansible-playbook"),
            "-i",
            "localhost,",
            "-c",
            "local",
            str(play),
            "-e",
            json.dumps(extravars),
            *flags,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=int(os.environ.get("DRILL_PLAY_TIMEOUT", "300")),
        env=env,
    )


class RoleRelay(NatsServer):
    """nats-server started with the configuration the notice_relay role renders."""

    def __init__(self, workdir: Path, conf: Path, port: int) -> None:
        super().__init__(workdir, port)
        self.conf = conf

    def start(self) -> RoleRelay:
        self.proc = subprocess.Popen(
            [str(BIN / "nats-server"), "-c", str(self.conf)],
            stdout=subprocess.DEVNULL,
            stderr=open(self.dir / "nats.log", "ab"),  # noqa: SIM115
        )

        def up() -> bool:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return True
            except OSError:
                return False

        # a relay with JetStream starting beside two others under CI's four workers took past 10 s once (its store
        # recovery on a loaded disk): the test's own start, not a bound of the product
        wait_for(up, 30, "nats-server")
        return self


# The CA each test relay's certificate chains to, by client URL (the tests' clients connect over TLS, as SCO's do)
_CA_OF: dict[str, Path] = {}


def tls_for(url: str) -> dict[str, Any]:
    """nats.connect's TLS argument for a client of the test relay at ``url`` (its CA); {} for a relay without TLS."""
    cas = {_CA_OF[u] for u in _nats.servers_of(url) if u in _CA_OF}
    return {"tls": _nats.tls_context(str(cas.pop()))} if cas else {}


def ca_for(url: str) -> str | None:
    """The CA file of the test relay at ``url`` (sco._nats's tls_ca_file); None for a relay without TLS."""
    cas = {_CA_OF[u] for u in _nats.servers_of(url) if u in _CA_OF}
    return str(cas.pop()) if cas else None


def deploy_tls(pki: Pki, member_dir: Path, name: str = "relay") -> Path:
    """The relay's certificate, key and CA where the role's template points (notice_relay_tls_member_dir)."""
    member_dir.mkdir(parents=True, exist_ok=True)
    crt, key = pki.issue(name)
    for src, dest in ((crt, "relay.crt"), (key, "relay.key"), (pki.ca, "ca.crt")):
        (member_dir / dest).write_bytes(src.read_bytes())
    return member_dir


def start_relay(tmp_path: Path, nodes: list[str]) -> tuple[RoleRelay, Path]:
    """A relay for hall `local` with the role's users for `nodes`, the reclaimer and the control reader; TLS on,
    its certificate signed by the test's CA (``tmp_path/tls``, role hall's sco_tls_ca_cert), for 127.0.0.1."""
    creds = tmp_path / "credentials"
    port = free_port()
    conf = tmp_path / "nats.conf"
    pki = Pki(tmp_path / "tls")  # the hall's CA where role hall keeps it (sco_state_dir/tls)
    member = deploy_tls(pki, tmp_path / "relay-tls")
    r = run_playbook(
        tmp_path, RENDER,
        {"role": str(ROLE), "out": str(conf), "notice_relay_hall": "local", "notice_relay_nodes": nodes,
         "notice_relay_credentials_dir": str(creds), "notice_relay_listen": "127.0.0.1", "notice_relay_port": port,
         "notice_relay_monitor_port": free_port(), "notice_relay_store_dir": str(tmp_path / "js"),
         "notice_relay_tls_member_dir": str(member)},
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    srv = RoleRelay(tmp_path, conf, port).start()
    _CA_OF[srv.url] = pki.ca
    stream = subprocess.run(
        [sys.executable, str(ROLE / "files/sco-nats-stream.py"), "--server", srv.url,
         "--nkey-seed", str(creds / "relay-admin.nk"), "--hall", "local", "--ca-file", str(pki.ca)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert [json.loads(x) for x in stream.stdout.splitlines()] == [
        {"stream": "SCO_EVENTS", "action": "created"},
        {"stream": "SCO_HEARTBEATS", "action": "created"},
    ], stream.stderr
    return srv, creds


def as_user(creds: Path, user: str) -> dict[str, Any]:
    """nats.connect's arguments for relay user ``user``: its nkey seed, made by the role's lookup on rendering, and
    the TLS context trusting start_relay's CA."""
    ca = creds.parent / "tls" / "ca.crt"
    tls = {"tls": _nats.tls_context(str(ca))} if ca.exists() else {}
    return {"nkeys_seed": str(creds / f"{user}.nk"), **tls}


def agent_identity(creds: Path, node: str) -> dict[str, Any]:
    """agent.toml's relay identity of node ``node``, as the node_agent role writes it (the seed in a file), and the
    CA the relay's certificate chains to (nats_ca_file)."""
    ca = creds.parent / "tls" / "ca.crt"
    return {"nats_nkey_seed_file": str(creds / f"node-{node}.nk"), **({"nats_ca_file": str(ca)} if ca.exists() else {})}


HALL = "local"


@dataclass
class JwtRelay:
    """A relay in operator mode, its hall keys, and the hall users' creds files (reclaimer, control, relay-admin)."""

    srv: NatsServer
    keys: ri.HallKeys
    dir: Path
    conf: Path
    users: dict[str, Path] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.srv.url

    def creds_file(self, name: str, user_jwt: str, key: ri.NKey) -> Path:
        path = self.dir / f"{name}.creds"
        path.write_text(ri.creds(user_jwt, key.seed))
        path.chmod(0o600)
        return path

    def enrol(self, node: str) -> tuple[ri.NodeIdentity, Path]:
        """As the control loop would for a node it launched: the node makes its key (here), the issuer mints
        from the public half and pushes the account to the running relay; the node writes its creds."""
        key = ri.NKey.generate("user")

        async def issue() -> ri.NodeIdentity:
            admin = await ri.RelayAdmin.connect(self.url, self.keys, tls_ca_file=ca_for(self.url))
            try:
                return await ri.issue(admin, self.keys, node, key.public)
            finally:
                await admin.close()

        identity = asyncio.run(issue())
        return identity, self.creds_file(f"node-{node}", identity.user_jwt, key)


def start_jwt_relay(tmp_path: Path) -> JwtRelay:
    keys = ri.HallKeys.ensure(tmp_path / "hall-keys", HALL)
    port = free_port()
    conf = tmp_path / "nats-jwt.conf"
    pki = Pki(tmp_path / "pki")
    conf.write_text(
        ri.server_config(
            keys, resolver_dir=tmp_path / "resolver", store_dir=tmp_path / "js", listen="127.0.0.1", port=port,
            monitor_port=free_port(), tls=pki.relay_tls(),
        )
    )  # fmt: skip
    _CA_OF[f"nats://127.0.0.1:{port}"] = pki.ca
    check = subprocess.run([str(BIN / "nats-server"), "-t", "-c", str(conf)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    relay = JwtRelay(RoleRelay(tmp_path, conf, port).start(), keys, tmp_path, conf)
    for name, mint in (
        ("reclaimer", ri.reclaimer_user_jwt), ("control", ri.reader_user_jwt), ("relay-admin", ri.stream_admin_user_jwt)
    ):  # fmt: skip
        key = ri.NKey.generate("user")
        relay.users[name] = relay.creds_file(name, mint(keys, key.public), key)

    async def streams() -> None:  # what the role's stream tool makes, as relay-admin
        nc = await nats.connect(relay.url, user_credentials=str(relay.users["relay-admin"]), **tls_for(relay.url))
        try:
            await nc.jetstream(timeout=5).add_stream(
                name=ri.STREAM, subjects=[f"sco.events.{HALL}.>"], duplicate_window=120
            )
            assert await heartbeats.ensure_stream(nc, HALL) == "created"
        finally:
            await nc.close()

    asyncio.run(streams())
    return relay


async def publish_until(nc: Any, messages: list[tuple[str, bytes]], got: list[Any]) -> None:
    """Publish ``messages`` again every 0.5 s until ``got`` holds something (at most 10 s). The relay loads a node's
    account on its first connection and refreshes the notices account it imports from; on a loaded machine a
    message published during that refresh was seen lost (CI, 1 run in ~15 under load, the shadow subscription in
    place when looked at). The agent reads notices from the metadata service as well."""
    for _ in range(20):
        for subject, data in messages:
            await nc.publish(subject, data)
        await nc.flush(timeout=5)
        for _ in range(5):
            if got:
                return
            await asyncio.sleep(0.1)


async def relay_refusal(url: str, plaintext: bool = False, **auth: Any) -> str:
    """How the relay answers a connection with ``auth`` (over TLS with the relay's CA unless ``plaintext`` or
    ``auth`` has its own ``tls``): "connected" or its error."""
    if not plaintext and "tls" not in auth:
        auth = {**auth, **tls_for(url)}
    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    try:
        nc = await nats.connect(
            url, connect_timeout=3, max_reconnect_attempts=0, allow_reconnect=False, error_cb=on_error, **auth
        )
    except Exception as e:
        return errors[-1] if errors else str(e) or type(e).__name__
    await nc.close()
    return "connected"


async def stream_subjects(relay: JwtRelay) -> list[str]:
    nc = await nats.connect(relay.url, user_credentials=str(relay.users["relay-admin"]), **tls_for(relay.url))
    js = nc.jetstream(timeout=5)
    try:
        last = (await js.stream_info(ri.STREAM)).state.last_seq
        return [(await js.get_msg(ri.STREAM, seq)).subject for seq in range(1, last + 1)]
    finally:
        await nc.close()


ATTACKS = 200  # of each kind (17,300 in 10 s reached one agent before)


def status(agent: AgentEnv) -> dict[str, Any]:
    out = subprocess.run(
        [str(BIN / "sco-agent"), "status", "--state-dir", str(agent.state)], capture_output=True, timeout=30
    )
    return dict(json.loads(out.stdout))


class Deployed:
    """The role's files for one relay host under ``root``: /etc/sco-nats, the unit directory, the store, the
    stream tool, the nats-server binary; the controller's credentials directory beside them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.creds = root / "controller" / "nats"
        self.etc = root / "etc-sco-nats"
        self.units = root / "units"
        self.port, self.monitor = free_port(), free_port()
        self.venv = root / "venv"
        self.proc: subprocess.Popen[bytes] | None = None
        # the relay's venv (the stream tool's Python) is this one; pip must never run in it
        (self.venv / "bin").mkdir(parents=True)
        python = self.venv / "bin" / "python"
        python.write_text(
            f'#!/bin/sh\n[ "$1 $2" = "-m pip" ] && {{ echo "no pip here" >&2; exit 1; }}\nexec {BIN / "python"} "$@"\n'
        )
        python.chmod(0o755)
        self.units.mkdir()
        (root / "bin").mkdir()  # /usr/local/bin

    def vars(self, nodes: list[str]) -> dict[str, Any]:
        package = f"spot-capacity-orchestrator=={__version__}"
        return {
            "sco_hall": HALL, "notice_relay_auth_mode": "operator", "notice_relay_nodes": nodes,
            "notice_relay_credentials_dir": str(self.creds), "notice_relay_listen": "127.0.0.1",
            "notice_relay_port": self.port, "notice_relay_monitor_port": self.monitor,
            "notice_relay_store_dir": str(self.root / "store"), "notice_relay_server_binary": str(BIN / "nats-server"),
            "notice_relay_venv": str(self.venv), "notice_relay_package": package,
            "notice_relay_service_enabled": False,
            # the role's own paths (vars/main.yml), here under the test's directory
            "_notice_relay_conf_dir": str(self.etc), "_notice_relay_unit_dir": str(self.units),
            "_notice_relay_bin": str(self.root / "bin" / "nats-server"),
            "_notice_relay_stream_script": str(self.root / "lib" / "sco-nats-stream.py"),
            # the relay's certificate (the role makes it, signed by the hall's CA it makes under sco_state_dir/tls)
            "notice_relay_tls_member_dir": str(self.root / "relay-tls"), "notice_relay_tls_textfile_dir": "",
            # the venv is there already: node_agent's install steps (venv, pip) are done for it
            "node_agent_installs_done": [f"{self.venv} {package} "],
        }  # fmt: skip

    def apply(self, nodes: list[str]) -> subprocess.CompletedProcess[str]:
        out = run_playbook(self.root, OPERATOR_PLAY, self.vars(nodes))
        assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
        return out

    def unit(self, key: str) -> list[str]:
        """A setting of the unit the role installed, as systemd splits it ("-" and "+" prefixes dropped)."""
        text = (self.units / "sco-nats.service").read_text()
        (line,) = [x.split("=", 1)[1] for x in text.splitlines() if x.startswith(f"{key}=")]
        return shlex.split(line.lstrip("-+@!"))

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def ca(self) -> Path:
        """The hall's CA the role made on the controller (sco_state_dir/tls: run_playbook's sco_state_dir)."""
        return self.root / "tls" / "ca.crt"

    def start(self) -> None:
        _CA_OF[self.url] = self.ca
        log = open(self.root / "nats.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(self.unit("ExecStart"), stdout=subprocess.DEVNULL, stderr=log)

        def up() -> bool:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return True
            except OSError:
                return False

        wait_for(up, 15, "the relay")

    def varz(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor}/varz", timeout=3) as r:
            return dict(json.loads(r.read()))

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


async def notices_reach(url: str, reclaimer: Path, nodes: dict[str, Path]) -> dict[str, list[bytes]]:
    """Each node subscribes to its notice subject on its creds; the reclaimer publishes one notice per node."""
    got: dict[str, list[bytes]] = {n: [] for n in nodes}
    conns = []
    try:
        for node, creds in nodes.items():
            nc = await nats.connect(
                url, user_credentials=str(creds), inbox_prefix=ri.node_inbox(HALL, node), **tls_for(url)
            )
            conns.append(nc)

            async def take(msg: Any, node: str = node) -> None:
                got[node].append(msg.data)

            await nc.subscribe(f"sco.notice.{HALL}.{node}", cb=take)
            await nc.flush(timeout=5)
        rc = await nats.connect(url, user_credentials=str(reclaimer), **tls_for(url))
        conns.append(rc)
        for node in nodes:
            await rc.publish(f"sco.notice.{HALL}.{node}", f"notice for {node}".encode())
        await rc.flush(timeout=5)
        for _ in range(50):
            if all(got.values()):
                break
            await asyncio.sleep(0.1)
        return got
    finally:
        for c in conns:
            await c.close()


async def event_acked(url: str, creds: Path, node: str) -> int:
    """Node ``node`` puts an event into the hall's stream (JetStream's ack comes back on its own inbox)."""
    nc = await nats.connect(url, user_credentials=str(creds), inbox_prefix=ri.node_inbox(HALL, node), **tls_for(url))
    try:
        ack = await nc.jetstream(timeout=5).publish(f"sco.events.{HALL}.{node}", b'{"event": "test"}')
        return int(ack.seq)
    finally:
        await nc.close()


OPERATOR_PLAY = """
- name: The notice relay of hall local, operator mode, on this machine
  hosts: localhost
  gather_facts: false
  roles: [sco.orchestrator.notice_relay]
"""


# --- TLS: the hall's CA and the relays' certificates, as role notice_relay makes them (tasks/tls.yml) ----------


@dataclass
class Pki:
    """A CA (its certificate and key under ``dir``) and the certificates it signs; the relays' are for 127.0.0.1 and
    localhost (where the tests' relays listen), a server's and a client's (routes present them), as the role's."""

    dir: Path

    @property
    def ca(self) -> Path:
        return self.dir / "ca.crt"

    def __post_init__(self) -> None:
        import datetime

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        self.dir.mkdir(parents=True, exist_ok=True)
        if self.ca.exists():
            self._key = serialization.load_pem_private_key((self.dir / "ca.key").read_bytes(), None)
            self._cert = x509.load_pem_x509_certificate(self.ca.read_bytes())
            return
        key = ec.generate_private_key(ec.SECP384R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"test CA {self.dir.name}")])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
            .sign(key, hashes.SHA256())
        )  # fmt: skip
        (self.dir / "ca.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        self.ca.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        self._key, self._cert = key, cert

    def issue(self, name: str, sans: tuple[str, ...] = ("127.0.0.1", "localhost")) -> tuple[Path, Path]:
        """A key and a certificate for ``name`` (``<name>.crt``, ``<name>.key``), signed by this CA."""
        import datetime
        import ipaddress

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        alt: list[x509.GeneralName] = []
        for s in sans:
            try:
                alt.append(x509.IPAddress(ipaddress.ip_address(s)))
            except ValueError:
                alt.append(x509.DNSName(s))
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self._cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=7))
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(self._key, hashes.SHA256())
        )  # fmt: skip
        crt, pem = self.dir / f"{name}.crt", self.dir / f"{name}.key"
        pem.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        pem.chmod(0o600)
        crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return crt, pem

    def relay_tls(self, name: str = "relay") -> ri.RelayTls:
        """A relay's TLS (relay_identity.RelayTls): its certificate, signed here, and this CA."""
        crt, key = self.issue(name) if not (self.dir / f"{name}.crt").exists() else (
            self.dir / f"{name}.crt", self.dir / f"{name}.key")  # fmt: skip
        return ri.RelayTls(str(crt), str(key), str(self.ca))

    def client(self) -> dict[str, Any]:
        """nats.connect's TLS argument for a client that trusts this CA (as sco._nats makes it)."""
        return {"tls": _nats.tls_context(str(self.ca))}
