from __future__ import annotations

import os
import shutil
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from sco.contract.signing import Keyring, PrivateKey, generate
from sco.demo import sample_repo

SAMPLE = sample_repo()


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

    from tests.harness import NatsServer, ensure_stream

    srv = NatsServer(tmp_path / "nats").start()
    asyncio.run(ensure_stream(srv.url))
    yield srv
    srv.stop()


@pytest.fixture
def kube():  # type: ignore[no-untyped-def]
    from sco.standins.kube_apiserver import KubeApiStandIn

    srv = KubeApiStandIn().start()
    yield srv
    srv.stop()


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

    from sco.devcluster.openstack import OpenStackCloud

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
