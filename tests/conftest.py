from __future__ import annotations

import contextlib
import fcntl
import getpass
import os
import shutil
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sco.contract.bundle import Bundle
from sco.contract.distributor import DistributorServer
from sco.contract.signing import Keyring, PrivateKey, generate
from sco.schedulers import slurm_admission
from sco_devkit.demo import sample_repo
from sco_devkit.devcluster.slurm import SlurmCluster
from sco_devkit.standins.kube_apiserver import KubeApiStandIn
from sco_devkit.standins.logind import LogindStandIn, PrivateBus
from tests.harness import AGENT_USER, NatsServer, PodCgroups, hall_bundle, outside_pytest_tmp, wait_for
from tests.slurm_hall import JOB, ROOT
from tests.testhosts import sweep_dead_hosts

# torch's dynamo registers a substitute for sys.intern when first imported; ansible-core's module_utils replace
# sys.intern with a patch object, after which that import fails (the DCP tests ran after Ansible tests in one
# session). Importing it before anything loads Ansible keeps both working.
with contextlib.suppress(ImportError):  # torch is installed by setup; without it the other tests still run
    import torch._dynamo  # noqa: F401

SAMPLE = sample_repo()

# With pytest-xdist (make unit PYTEST_JOBS=N): the tests of a session's OpenStack (~1.1 GiB, ~90 s to start) go to
# one of two groups, each on one worker, so two clouds start (each on free loopback ports of its own) and the
# longest chain of the suite is cut in two. The groups are balanced by measured time (make unit, --durations):
# ~700 s each. They are scheduled first (xdist hands each worker one unit at the start, in collection order), so
# they never queue behind each other on one worker; the rest spreads, test by test.
_CLOUD_FIXTURES = {"openstack_cloud", "blazar", "ironic"}
_CLOUD_GROUP = {
    "test_control_loop_e2e": "cloud-a",
    "test_reconcile": "cloud-a",
    "test_drill": "cloud-a",
    "test_provider_openstack": "cloud-b",
    "test_blazar_leases": "cloud-b",
    "test_reclaimer": "cloud-b",
    "test_openstack_policy": "cloud-b",
    "test_acquire_calls": "cloud-b",
}


# The other long tests (Ansible runs, Spark, training: 1-10 min each, measured by make unit's --durations) come next,
# so no worker picks one up near the end while the others sit idle (longest first shortens the run).
_HEAVY = {
    "test_role_fleet_state", "test_roles", "test_roles_spark_kubelet", "test_local_hall", "test_spark",
    "test_workload_dcp", "test_workload_dcp_kube",
}  # fmt: skip


# Modules that start one cluster for all their tests (a module fixture: Patroni with etcd): kept on one
# worker, so the cluster starts once, not once per worker that picks up one of their tests.
_ONE_WORKER = {"test_patroni"}

# Modules that run the notice_relay role on this machine: each run sets the one sco-nats user's home to its own test's
# store directory, so one module's run between another's two would make the second's idempotence check fail.
RELAY_ROLE_LOCK = "/var/tmp/.sco-tests-relay-role.lock"  # machine-wide: see relay_role_machine_lock
_RELAY_ROLE = {"test_drill_operator", "test_enrol_unit", "test_relay_operator_role", "test_relay_operator_cluster"}


def pytest_sessionstart(session: pytest.Session) -> None:
    # once per run, in the process that owns the base temp (xdist's controller, or the only one)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    # pytest's own temp root, as it names it; before pytest makes this run's directory, which removes old runs'
    # directories (those a dead host's mount held are renamed garbage-* and go next time)
    base = Path(os.environ.get("PYTEST_DEBUG_TEMPROOT") or tempfile.gettempdir()) / f"pytest-of-{getpass.getuser()}"
    for what in sweep_dead_hosts(base):
        print(f"conftest: let go of a dead run's test host: {what}")


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which turns the groups into node id suffixes
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # on the workers, where xdist reads the groups off the collected items (its own dist option says "no" there)
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    rank = {}
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        if _CLOUD_FIXTURES & set(getattr(item, "fixturenames", ())):
            group = _CLOUD_GROUP.get(module, "cloud-a")
            item.add_marker(pytest.mark.xdist_group(name=group))
            rank[item.nodeid] = 0 if group == "cloud-a" else 1
        elif "ceph" in getattr(item, "fixturenames", ()):
            # one Ceph cluster (~20 s to start, ~450 MiB) for every checkpoint-store test, not one per worker
            item.add_marker(pytest.mark.xdist_group(name="ceph"))
            rank[item.nodeid] = 2
        elif module in _ONE_WORKER:
            item.add_marker(pytest.mark.xdist_group(name=module))
            rank[item.nodeid] = 2
        elif module in _RELAY_ROLE:
            item.add_marker(pytest.mark.xdist_group(name="relay-role"))
            rank[item.nodeid] = 2
        elif module in _HEAVY:
            rank[item.nodeid] = 2
    items.sort(key=lambda i: rank.get(i.nodeid, 3))  # stable: each file's own order stays


@pytest.fixture
def key() -> PrivateKey:
    return generate()


@pytest.fixture
def keyring(key: PrivateKey) -> Keyring:
    return Keyring([key.public])


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A writable copy of the sample contract repository."""
    dst = tmp_path / "repo"
    shutil.copytree(SAMPLE, dst)
    return dst


WriteFn = Callable[[str, str], Path]


@pytest.fixture
def write(repo: Path) -> WriteFn:
    def _write(rel: str, text: str) -> Path:
        p = repo / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
        return p

    return _write


def contract_yaml(name: str, **spec_overrides: str) -> str:
    """A valid kubernetes contract; ``spec_overrides`` replace whole spec lines by key."""
    spec = {
        "scheduler": "kubernetes",
        "selector": "{namespace: " + name + "}",
        "tier": "3",
        "drainBudgetSeconds": "30",
        "finalWriteSeconds": "5",
        "checkpoint": "{mode: none}",
        "requeue": "{policy: always}",
    }
    spec.update(spec_overrides)
    body = "\n".join(f"  {k}: {v}" for k, v in spec.items())
    return f"apiVersion: sco.dev/v1\nkind: WorkloadContract\nmetadata:\n  name: {name}\nspec:\n{body}\n"


@pytest.fixture
def nats_server(tmp_path: Path):  # type: ignore[no-untyped-def]
    import asyncio

    from tests.harness import ensure_stream

    srv = NatsServer(tmp_path / "nats").start()
    asyncio.run(ensure_stream(srv.url))
    yield srv
    srv.stop()


@pytest.fixture
def kube():  # type: ignore[no-untyped-def]

    srv = KubeApiStandIn().start()
    yield srv
    srv.stop()


@pytest.fixture
def pod_cgroups():  # type: ignore[no-untyped-def]
    """Real cgroups named as kubelet names pods' (tests.harness.PodCgroups): a checkpoint client is a pod's by its
    cgroup; the agent is given ``pod_cgroups.root`` as kube_cgroup_root."""
    cg = PodCgroups()
    yield cg
    cg.close()


# --- fleet state and OpenStack (provider tests) ----------------------------------------------------------


@pytest.fixture(scope="session")
def postgres():  # type: ignore[no-untyped-def]
    """One embedded PostgreSQL for the session; each test gets its own database (fleet_db)."""
    from sco.state.embedded import EmbeddedPostgres

    pg = EmbeddedPostgres().start()
    yield pg
    pg.destroy()


@pytest.fixture
def fleet_dsn(postgres, request) -> str:  # type: ignore[no-untyped-def]
    """A fresh, migrated fleet-state database."""
    import re as _re

    from sco.state.db import connect, migrate

    name = "fleet_" + _re.sub(r"[^a-z0-9]", "_", request.node.name.lower())[:40] + "_" + os.urandom(3).hex()
    postgres.create_database(name)
    dsn = postgres.dsn(name)
    with connect(dsn) as c:
        migrate(c)
    return str(dsn)


@pytest.fixture(scope="session")
def openstack_cloud(tmp_path_factory):  # type: ignore[no-untyped-def]
    """Real Keystone, Placement, Glance and Nova on loopback, shared by every test that needs them (cold start
    ~1 min). $SCO_TEST_OPENSTACK may name the describe() JSON of a cloud a developer keeps running."""
    import json

    from sco_devkit.devcluster.openstack import OpenStackCloud

    if os.environ.get("SCO_TEST_OPENSTACK"):
        yield OpenStackCloud.attach(json.loads(Path(os.environ["SCO_TEST_OPENSTACK"]).read_text()))
        return
    cloud = OpenStackCloud(tmp_path_factory.mktemp("openstack"))
    try:
        cloud.start()
        yield cloud
    finally:
        cloud.stop()


@pytest.fixture(scope="session")
def blazar(openstack_cloud):  # type: ignore[no-untyped-def]
    """Blazar (API and manager, on MariaDB) added to the session's cloud the first time a test asks (~20 s)."""
    if "blazar-api" not in openstack_cloud.procs and not openstack_cloud.attached:
        openstack_cloud.start_blazar()
    return openstack_cloud


@pytest.fixture(scope="session")
def ironic(openstack_cloud):  # type: ignore[no-untyped-def]
    """Ironic (fake-hardware) and a nova-compute with the Ironic driver, added the first time a test asks."""
    if "ironic" not in openstack_cloud.procs and not openstack_cloud.attached:
        openstack_cloud.start_ironic()
    return openstack_cloud


@pytest.fixture
def signed(tmp_path: Path) -> tuple[Path, Path, Path]:
    """The sample hall's bundle (compiled and signed by the ``sco`` command), its key and public key."""
    from tests.cli_run import sco

    keys = tmp_path / "keys"
    assert sco("keygen", "--out-dir", keys, "--name", "k").returncode == 0
    b = tmp_path / "bundle.json"
    p = sco("contract", "compile", SAMPLE, "-o", b, "--signing-key", keys / "k.key", "--issued-at", "1764400000")
    assert p.returncode == 0, p.stderr
    return b, keys / "k.key", keys / "k.pub"


# --- the checkpoint store (Ceph RGW) -----------------------------------------------------------------------


@pytest.fixture(scope="session")
def ceph(tmp_path_factory):  # type: ignore[no-untyped-def]
    """One real one-node Ceph cluster with an RGW (bluestore on a file) for the session (~20 s cold): the DCP
    workload's checkpoint store. Tests provision their own bucket and user (role checkpoint_store's logic). Under
    xdist its tests share one worker (group "ceph" above), so one cluster starts, not one per worker."""
    from sco_devkit.devcluster.ceph import CephCluster

    c = CephCluster(tmp_path_factory.mktemp("ceph"))
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="session")
def node_wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The node's wheelhouse (tests/node_install.py), built once per session for every test that installs from it."""
    from tests.node_install import build_wheelhouse

    return build_wheelhouse(tmp_path_factory.mktemp("node-wheelhouse"))


@pytest.fixture(scope="session")
def node_venv(node_wheelhouse: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the node's install only (no extras), from the node wheelhouse, offline."""
    from tests.node_install import install_venv

    return install_venv(node_wheelhouse, tmp_path_factory.mktemp("node-venv") / "venv")


# --- a real Slurm cluster (slurmctld with the product's Lua plugins, slurmd n1..n3), one per module ---------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    root = outside_pytest_tmp(tmp_path_factory.mktemp("slurm-parent") / "slurm")
    key = generate()
    bundle = Bundle.from_bytes(hall_bundle(root, key), Keyring([key.public]))
    c = SlurmCluster(
        root,
        job_submit_lua=ROOT / "slurm_plugins" / "job_submit.lua",
        cli_filter_lua=ROOT / "slurm_plugins" / "cli_filter.lua",
        extra_conf="PartitionName=onprem Nodes=n3 MaxTime=INFINITE State=UP\n",
        # an agent running as its own user (SCO_TEST_AGENT_USER) is Slurm's privileged user, as a hall without
        # slurmdbd configures it (role node_agent's README)
        slurm_user=AGENT_USER or "root",
    )
    c.write_conf()
    admission = slurm_admission.render_lua(bundle.hall, bundle.serial, bundle.contracts, ["spot"])
    slurm_admission.write(root, admission, bundle.serial)
    c.start()
    (root / "jobs").mkdir(exist_ok=True)
    (root / "jobs" / "job.sh").write_text(JOB.format(jobs=root / "jobs"))
    yield c
    c.stop()


@pytest.fixture
def clean(cluster: SlurmCluster) -> Iterator[SlurmCluster]:
    yield cluster
    cluster.run("scancel", "--user=root", check=False)
    for n in cluster.nodes:
        cluster.run("scontrol", "update", f"nodename={n}", "state=RESUME", check=False)
    if cluster.ctld is None:
        cluster.restart_ctld()
    cluster.thaw_ctld()
    wait_for(lambda: all(s == "idle" for s in cluster.node_states().values()), 30, "idle nodes", 0.2)


@pytest.fixture
def bus() -> Iterator[PrivateBus]:
    b = PrivateBus().start()
    yield b
    b.stop()


@pytest.fixture
def logind(bus: PrivateBus) -> Iterator[LogindStandIn]:
    s = LogindStandIn(bus.address, inhibit_delay_max_s=8).start()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def own_user_agent_bin(node_wheelhouse: Path) -> Iterator[Path]:
    """sco-agent in a venv of the system Python, built from this checkout's node wheelhouse, where another user can
    run it (the test machine's own Python may sit under root's 0700 home): the agent as its own user."""
    import tempfile

    from tests.node_install import install_venv

    d = Path(tempfile.mkdtemp(prefix="sco-agent-user-venv-"))
    d.chmod(0o755)
    yield install_venv(node_wheelhouse, d / "venv", python="/usr/bin/python3") / "bin" / "sco-agent"
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module", autouse=True)
def relay_role_machine_lock(request: pytest.FixtureRequest) -> Iterator[None]:
    """The relay-role modules take a machine-wide lock for their whole run: their xdist group keeps them apart in
    one pytest run, but two checkouts on one machine (a fresh-clone CI run and a worktree) would each set the one
    sco-nats user's home and ports mid-run of the other. The second waits (an hour at most, as molecule's locks)."""
    module = request.module.__name__.rsplit(".", 1)[-1]
    if module not in _RELAY_ROLE:
        yield
        return
    with open(RELAY_ROLE_LOCK, "a") as f:
        end = time.monotonic() + 3600
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > end:
                    raise AssertionError(
                        "another checkout held /var/tmp/.sco-tests-relay-role.lock for an hour"
                    ) from None
                time.sleep(1.0)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="session", autouse=True)
def agent_as_its_own_user(request: pytest.FixtureRequest) -> None:
    """SCO_TEST_AGENT_USER set: every agent the tests start runs as that user (tests/harness.py), from that venv."""
    from tests import harness

    if harness.AGENT_USER:
        harness.AgentEnv.agent_bin = request.getfixturevalue("own_user_agent_bin")


@pytest.fixture
def distributor(tmp_path: Path) -> Iterator[DistributorServer]:
    """The real bundle distributor on a free loopback port, serving ``tmp_path/dist``."""
    srv = DistributorServer(tmp_path / "dist", ("127.0.0.1", 0))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()
