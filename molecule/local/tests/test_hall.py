"""What the converged local hall does (molecule scenario local: every part of inventories/local on one test host):
the checks every hall shares (molecule/shared/verify.py), and the fleet state and control loop the example hall
scenarios do not deploy, against the demo's embedded PostgreSQL that prepare.yml started on the host's loopback."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "shared"))
import verify  # molecule/shared/verify.py

from sco.contract.signing import Delegation, Keyring, PrivateKey, load_private
from sco.state.db import migrations

SC = verify.Scenario("local")
HOST = "sco-local"
HALL = "local"


def test_agent_unit_enabled_and_hardened() -> None:
    verify.check_agent_unit(SC.host(HOST))


def test_agent_config_passes_check_config_with_the_nodes_own_credentials() -> None:
    verify.check_agent_config(SC, SC.host(HOST), HOST, HALL, "kubernetes", "nats://127.0.0.1:4222")


def test_a_bundle_signed_by_a_removed_key_is_refused() -> None:
    verify.check_removed_key_refused(SC, SC.host(HOST), HOST)


def test_relay_unit_and_config() -> None:
    verify.check_relay_unit_and_config(SC.host(HOST), verify.operator_mode(SC))


@pytest.fixture(scope="module")
def relay_post() -> Iterator[str]:
    with verify.relay_running(SC.host(HOST)) as post:
        yield post


def test_relay_creates_the_event_stream_once(relay_post: str) -> None:
    verify.check_stream_created_once(SC.host(HOST), relay_post)


def test_node_credentials_reach_only_the_nodes_own_subjects(relay_post: str) -> None:
    assert SC.host(HOST).run(relay_post).rc == 0  # the stream exists whatever ran first
    # the other node need not exist: the node's allow-list names its own subjects only
    verify.check_node_credentials_reach_only_their_own_subjects(SC, HOST, HALL, HOST, "spot-other")


def test_distributor_publishes_and_serves_the_signed_bundle() -> None:
    verify.check_distributor_serves_the_signed_bundle(SC, HOST, HALL)


# The DSN as a program reads it from an env file (systemd's EnvironmentFile or a shell's `.`), then the schema.
_SCHEMA = """
import json, shlex, sys, psycopg
line = next(ln for ln in open(sys.argv[1]) if ln.startswith('SCO_DB_DSN='))
dsn = ' '.join(shlex.split(line.split('=', 1)[1]))
with psycopg.connect(dsn) as c:
    print(json.dumps({
        'versions': [v for (v,) in c.execute('SELECT version FROM schema_migration ORDER BY version')],
        'user': c.execute('SELECT current_user').fetchone()[0],
        'owner': c.execute("SELECT tableowner FROM pg_tables WHERE tablename = 'schema_migration'").fetchone()[0],
    }))
"""


@pytest.mark.parametrize("env_file", ["/etc/sco/fleet-state.env", "/etc/sco/control-loop.env"])
def test_fleet_state_migrated_on_the_demos_postgresql_and_reached_with_the_written_dsn(env_file: str) -> None:
    """fleet_state made SCO's role and database on 127.0.0.1:5433 and applied every migration as that role; the
    DSN it wrote, and the one control_loop's unit reads, both reach it."""
    h = SC.host(HOST)
    assert h.file(env_file).mode == 0o600
    out = h.run(f"/opt/sco/bin/python -c {_quote(_SCHEMA)} {env_file}")
    assert out.rc == 0, out.stderr
    got = json.loads(out.stdout)
    assert got == {"versions": [m.version for m in migrations()], "user": "sco", "owner": "sco"}
    assert "port=5433" in h.file(env_file).content_string
    pending = h.run("set -a; . /etc/sco/fleet-state.env; /opt/sco/bin/sco db migrate --check")
    assert pending.rc == 0 and pending.stdout.strip() == "fleet state up to date", pending.stdout + pending.stderr


def test_control_loop_laid_out_with_its_timer_enabled() -> None:
    h = SC.host(HOST)
    lines = verify.unit_text(h, "sco-control-loop.service").splitlines()
    for line in ("NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes",
                 "ReadWritePaths=/var/lib/sco-control-loop /var/lib/prometheus/node-exporter",
                 "Environment=SCO_METRICS_TEXTFILE_DIR=/var/lib/prometheus/node-exporter",
                 "EnvironmentFile=/etc/sco/control-loop.env"):  # fmt: skip
        assert line in lines, line
    assert verify.exec_line(h, "sco-control-loop.service", "ExecStart").startswith(
        f"/opt/sco/bin/sco-control-loop --private-data-dir /var/lib/sco-control-loop --hall {HALL} "
    )
    link = h.file("/etc/systemd/system/timers.target.wants/sco-control-loop.timer")
    assert link.is_symlink and link.linked_to == "/etc/systemd/system/sco-control-loop.timer"
    assert h.run("systemctl is-enabled sco-control-loop.timer").stdout.strip() == "enabled"
    extra = yaml.safe_load(h.file("/var/lib/sco-control-loop/env/extravars").content_string)
    # the local inventory's settings, with the bundle the distributor publishes on this host
    assert extra["sco_hall"] == HALL and extra["sco_pools"][0]["name"] == "local-spot"
    assert extra["sco_bundle"] == f"/var/lib/sco-distributor/{HALL}/bundle.json"
    assert h.file(extra["sco_bundle"]).exists
    assert h.file("/var/lib/sco-control-loop/project/control_loop.yml").exists


def test_the_control_host_holds_the_launch_key_and_its_delegation_never_the_root_key() -> None:
    """Issue 29 (one key signed everything): after site.yml the control host has the launch key (the loop's user's
    alone) and the root's delegation for it, which its runs sign with; the root key stays on the controller and no
    file of the host's holds its seed."""
    h = SC.host(HOST)
    root = load_private(SC.work / "keys" / "hall.key")
    launch = load_private(SC.work / "keys" / "launch.key")
    key = h.file("/etc/sco/control-loop/launch.key")
    assert key.exists and key.user == "sco-control" and key.mode == 0o600
    assert load_private_text(key.content_string).keyid == launch.keyid
    extra = yaml.safe_load(h.file("/var/lib/sco-control-loop/env/extravars").content_string)
    assert extra["sco_signing_keys"] == ["/etc/sco/control-loop/launch.key"]
    assert extra["sco_launch_delegation"] == "/etc/sco/control-loop/launch.delegation"
    d = Delegation.verify(json.loads(h.file(extra["sco_launch_delegation"]).content_string), Keyring([root.public]))
    assert (d.keyid, d.hall, d.issuer) == (launch.keyid, HALL, root.keyid)
    seed = bytes(root.signing_key).hex()
    # every directory a deployment writes to (the product's venv too); no device, FIFO or socket is read
    found = h.run(
        "dirs=$(for d in /etc /var/lib /opt /root /home /srv /tmp /var/tmp; do [ -d $d ] && echo $d; done);"
        f" timeout 300 grep -rlsF -D skip {seed} $dirs; echo rc=$?"
    )
    assert found.stdout.strip() == "rc=1", found.stdout  # grep's 1: no file holds it


def load_private_text(text: str) -> PrivateKey:
    from nacl.signing import SigningKey

    from sco.contract.signing import key_id

    sk = SigningKey(bytes.fromhex(json.loads(text)["seed"]))
    return PrivateKey(key_id(sk.verify_key), sk)


def _quote(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"


def test_converged_from_the_collection_installed_offline_into_a_fresh_venv() -> None:
    """prepare.yml's controller: a venv with ansible-core and the product only, and the collection with its
    dependencies installed from `make collection`'s artifacts (converge ran this venv and these collections)."""
    import subprocess

    controller = SC.work.with_name("local-controller")
    tree = controller / "collections" / "ansible_collections"
    for ns, name in (("sco", "orchestrator"), ("community", "postgresql"), ("kubernetes", "core")):
        assert (tree / ns / name / "MANIFEST.json").is_file(), (ns, name)
    assert (tree / "sco" / "orchestrator" / "playbooks" / "site.yml").is_file()
    venv = controller / "venv"
    frozen = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "list", "--format=json"],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout  # fmt: skip
    names = {p["name"].lower() for p in json.loads(frozen)}
    assert {"ansible-core", "spot-capacity-orchestrator"} <= names
    assert not names & {"ansible", "molecule", "ansible-lint", "pytest"}, names  # nothing of the checkout's venv
    # the keys and the bundle went to the hall's state directory, not next to any inventory
    assert (SC.work / "keys" / "hall.key").is_file() and (SC.work / "build").is_dir()


def test_monitoring_reads_the_control_loops_textfiles_and_loads_the_rules() -> None:
    """Role monitoring on the control host: node_exporter's textfile collector on the directory the loop's unit
    writes, Prometheus scraping it (job sco-control) with the SCO rules loaded, both checked by promtool."""
    h = SC.host(HOST)
    args = h.file("/etc/default/prometheus-node-exporter").content_string
    assert "--collector.textfile.directory=/var/lib/prometheus/node-exporter" in args
    assert h.file("/var/lib/prometheus/node-exporter").group == "sco-control"
    conf = h.file("/etc/prometheus/prometheus.yml").content_string
    assert "job_name: sco-control" in conf and "/etc/prometheus/rules.d/*.yml" in conf
    check = h.run("promtool check config /etc/prometheus/prometheus.yml")
    assert check.rc == 0 and "SUCCESS" in check.stdout + check.stderr, check.stdout + check.stderr
    # node_exporter over TLS (sco_metrics_tls): its web configuration on the command line, the key its user's alone,
    # job sco-control over https against the hall's CA
    assert "--web.config.file=/etc/prometheus/node-exporter-web.yml" in args
    key = h.file("/etc/prometheus/node-exporter-tls/node-exporter.key")
    assert key.user == "prometheus" and key.mode == 0o600
    assert h.file("/etc/prometheus/node-exporter-tls").mode == 0o700
    job = next(j for j in yaml.safe_load(conf)["scrape_configs"] if j["job_name"] == "sco-control")
    assert job["scheme"] == "https" and job["tls_config"] == {"ca_file": "/etc/prometheus/sco-ca.crt"}, job


def test_the_contracts_configmap_publisher_is_installed() -> None:
    """A hall whose loop reads Kubernetes keeps the Kyverno policies' ConfigMap in step with its bundle."""
    h = SC.host(HOST)
    assert verify.exec_line(h, "sco-contracts-configmap.service", "ExecStart").startswith(
        "/opt/sco/bin/sco contract publish-configmap --url https://127.0.0.1:8470/v1/halls/"
    )
    link = h.file("/etc/systemd/system/multi-user.target.wants/sco-contracts-configmap.service")
    assert link.is_symlink
