"""Uninstall: the converged local hall removed by sco.orchestrator.uninstall over real SSH, run again
(nothing changes), data kept; installed again; removed keeping the data and then with sco_purge_data (the database
dropped though the venv is gone), and run again. The tests run in file order, each on
what the one before left.

The hall has a control host, so its relay runs in operator mode (creds files, no nkey seed files; the enrolment
service) and the agent as its own user, sco-agent; the relay serves TLS (the hall's CA). What "nothing left" checks
(the lists below): the units (files, drop-ins, wants links), the files and directories the roles wrote (the relay's
certificate, key and CAs, and the hall's CA given to the agent and the control loop, among them), no SCO file in
node_exporter's textfile directory (which is kept, as monitoring's data), the venv and its wheelhouse, the system
users and groups the roles made (the checkpoint socket's group among them: kept with the users until the purge), no
process running from them and no listening socket on the hall's ports; data kept, then purged: the
agent's spool and bundle cache, the relay's JetStream store, the distributor's published bundle, the control loop's
runner directory, and SCO's database and role on the embedded PostgreSQL. (Prometheus's TSDB is left out: Prometheus
never ran here.)

The test host runs no systemd (molecule/README.md): the units were installed and enabled, never started, so the
roles' stop-before-remove step (systemd_service stopped) is not exercised here; the process and port checks hold
what the roles leave, not a stop."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "shared"))
import verify  # molecule/shared/verify.py

SC = verify.Scenario("hall-uninstall")
HOST = "sco-local"
REPO = Path(__file__).resolve().parents[3]
BIN = Path(sys.executable).parent

UNITS = [
    "sco-agent.service", "sco-distributor.service", "sco-nats.service", "sco-control-loop.service",
    "sco-control-loop.timer", "sco-contracts-configmap.service", "sco-unit-failed@.service", "sco-enrol.service",
]  # fmt: skip
WANTS = [
    "multi-user.target.wants/sco-agent.service", "multi-user.target.wants/sco-distributor.service",
    "multi-user.target.wants/sco-nats.service", "multi-user.target.wants/sco-contracts-configmap.service",
    "timers.target.wants/sco-control-loop.timer", "multi-user.target.wants/prometheus.service",
    "multi-user.target.wants/prometheus-node-exporter.service", "multi-user.target.wants/sco-enrol.service",
]  # fmt: skip
# configuration, credentials, binaries the roles wrote (never data). The relay is in operator mode (the hall has a
# control host): the agent and the control loop get creds files, no nkey seed files; the enrolment service its
# environment and relay keys; the agent's own user its polkit rule (a Kubernetes node)
FILES = [
    "/etc/sco/agent.toml", "/etc/sco/trusted", "/etc/sco/nats.creds", "/etc/sco/distributor-trusted",
    "/etc/sco/control-loop-trusted",
    "/etc/sco/contracts-configmap", "/etc/sco/control-loop.env", "/etc/sco/control-loop-nats.creds",
    "/etc/sco/enrol.env", "/etc/sco/enrol", "/etc/polkit-1/rules.d/60-sco-agent.rules",
    "/etc/sco/fleet-state.env", "/etc/sco-nats", "/usr/local/bin/nats-server", "/usr/local/lib/sco",
    "/opt/sco", "/opt/sco-wheelhouse", "/etc/prometheus/rules.d/sco.rules.yml", "/etc/prometheus/sco-scrape.yml",
    "/etc/prometheus/prometheus.yml", "/etc/default/prometheus", "/etc/default/prometheus-node-exporter",
    "/usr/bin/prometheus", "/usr/bin/prometheus-node-exporter",
    "/etc/kubernetes/kubelet.conf.d/50-sco-graceful-shutdown.conf",
    "/etc/systemd/logind.conf.d/50-sco-inhibit-delay.conf",
    # the relay serves TLS (N+1's default): the agent's and the control loop's copy of the hall's CA, the relay's
    # certificate, key and CA (under /etc/sco-nats too, named for the premise check), and the certificates' expiry
    # for node_exporter (in its textfile directory, which is kept as monitoring's data: SCO's files in it are not)
    "/etc/sco/relay-ca.crt", "/etc/sco-nats/tls", "/var/lib/prometheus/node-exporter/sco_relay_certificates.prom",
    # the distributor serves TLS and the agent its /metrics: their certificates, keys, the CA given to their clients
    # (agent, control loop, Prometheus) and the certificates' expiry
    "/etc/sco/distributor-tls", "/etc/sco/distributor-ca.crt", "/etc/sco/metrics-tls", "/etc/prometheus/sco-ca.crt",
    "/var/lib/prometheus/node-exporter/sco_distributor_certificates.prom",
    "/var/lib/prometheus/node-exporter/sco_agent_certificates.prom",
    # node_exporter serves TLS (sco_metrics_tls): its web configuration, its certificate and key, their expiry
    "/etc/prometheus/node-exporter-web.yml", "/etc/prometheus/node-exporter-tls",
    "/var/lib/prometheus/node-exporter/sco_node_exporter_certificates.prom",
    # the collection the control loop runs from (role control_loop copies it; it was left after uninstall and purge)
    "/usr/share/ansible/collections/ansible_collections/sco",
]  # fmt: skip
DATA = [
    "/var/lib/sco/spool", "/var/lib/sco-distributor/local/bundle.json", "/var/lib/sco-control-loop/project",
    "/var/lib/sco-nats",
]  # fmt: skip
# system users the roles made; the ones owning kept data stay until the purge
USERS = ["sco-agent", "sco-control", "sco-nats"]
# their groups, the checkpoint socket's (the workloads' users are its members, pods name its gid) and the one that may
# read the distributor's key (kept with the users until the purge)
GROUPS = ["sco-agent", "sco-control", "sco-nats", "sco-checkpoint", "sco-distributor"]
TEXTFILES = "/var/lib/prometheus/node-exporter"
PORTS = [4222, 8222, 8470, 8471, 8472, 9090, 9100, 9469]
PROCESSES = ["/opt/sco/", "nats-server", "prometheus"]


def uninstall(*extra: str, playbook: str = "sco.orchestrator.uninstall") -> dict[str, int]:
    """ansible-playbook sco.orchestrator.uninstall (or another) over the scenario's inventory, as a platform team
    runs it; the host's recap counts."""
    env = dict(os.environ)  # molecule's: its ansible.cfg, the scenario's SSH control path directory
    env["PATH"] = f"{BIN}:{env['PATH']}"
    env.setdefault("ANSIBLE_COLLECTIONS_PATH", str(REPO / "collections"))
    env.setdefault("ANSIBLE_HOST_KEY_CHECKING", "false")
    env.setdefault("MOLECULE_PROJECT_DIRECTORY", str(REPO))
    out = subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", str(SC.inventory.parent), playbook, *extra],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    recap = out.stdout.split("PLAY RECAP", 1)[1]
    m = re.search(rf"{HOST}\s*:\s*ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", recap)
    assert m, recap
    return {"ok": int(m[1]), "changed": int(m[2]), "unreachable": int(m[3]), "failed": int(m[4])}


def exists(h: Any, path: str) -> bool:
    return bool(h.run(f"test -e {path} -o -L {path}").rc == 0)


def users(h: Any) -> list[str]:
    return [u for u in USERS if h.run(f"getent passwd {u}").rc == 0]


def groups(h: Any) -> list[str]:
    return [g for g in GROUPS if h.run(f"getent group {g}").rc == 0]


def sco_textfiles(h: Any) -> list[str]:
    """SCO's files in node_exporter's textfile directory (node_exporter would serve them stale)."""
    return h.run(f"ls -A {TEXTFILES} 2>/dev/null | grep '^\\.\\?sco_' || true").stdout.split()


def left_running(h: Any) -> list[str]:
    """Command lines of the test host's processes (those in its network namespace: ps in the chroot would list the
    whole machine's) that run from what the roles installed."""
    pids = subprocess.run(["ip", "netns", "pids", f"scom-{SC.name}-{HOST}"], capture_output=True, text=True).stdout
    out = []
    for pid in pids.split():
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # ended meanwhile
        if any(x in args for x in PROCESSES):
            out.append(args)
    return out


def listening(h: Any) -> list[int]:
    ss = SC.in_netns(HOST, "ss", "-Htlnu").stdout
    return [p for p in PORTS if re.search(rf":{p}\s", ss)]


def fleet_state_on_postgres() -> dict[str, bool]:
    """SCO's database and role on the embedded PostgreSQL (trust for postgres on loopback, as the demo starts it)."""
    q = (
        "import psycopg, json; c = psycopg.connect('host=127.0.0.1 port=5433 user=postgres dbname=postgres', "
        "connect_timeout=10); print(json.dumps({"
        "'db': bool(c.execute(\"SELECT 1 FROM pg_database WHERE datname = 'sco_fleet'\").fetchone()), "
        "'role': bool(c.execute(\"SELECT 1 FROM pg_roles WHERE rolname = 'sco'\").fetchone())}))"
    )
    out = SC.in_netns(HOST, sys.executable, "-c", q)
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


def test_the_converged_hall_has_what_uninstall_must_remove() -> None:
    """The checks below would see each thing: it is there after converge (the agent run once by its unit's command
    line, so its spool exists, as on a node that ran)."""
    h = SC.host(HOST)
    assert h.run("timeout -s INT 4 /opt/sco/bin/sco-agent run --config /etc/sco/agent.toml").rc in (0, 124, 130)
    missing = [u for u in UNITS if not exists(h, f"/etc/systemd/system/{u}")]
    missing += [w for w in WANTS if not exists(h, f"/etc/systemd/system/{w}")]
    missing += [f for f in FILES + DATA if not exists(h, f)]
    assert missing == []
    # operator mode writes no nkey seed files (a check of FILES' premise: they are not where nothing could be left)
    assert [f for f in ["/etc/sco/nats.nk", "/etc/sco/control-loop-nats.nk"] if exists(h, f)] == []
    assert users(h) == USERS and groups(h) == GROUPS
    assert fleet_state_on_postgres() == {"db": True, "role": True}


def test_uninstall_removes_the_services_and_keeps_the_data() -> None:
    recap = uninstall()
    assert recap["failed"] == 0 and recap["changed"] > 0
    h = SC.host(HOST)
    left = [u for u in UNITS if exists(h, f"/etc/systemd/system/{u}")]
    left += [u for u in UNITS if exists(h, f"/etc/systemd/system/{u}.d")]
    left += [w for w in WANTS if exists(h, f"/etc/systemd/system/{w}")]
    left += [f for f in FILES if exists(h, f)]
    assert left == []
    assert h.run("ls /etc/systemd/system | grep -i sco").stdout == ""
    assert sco_textfiles(h) == []
    assert left_running(h) == [] and listening(h) == []
    # the data, and the users owning what is kept
    assert [d for d in DATA if not exists(h, d)] == []
    assert users(h) == USERS and groups(h) == GROUPS
    assert fleet_state_on_postgres() == {"db": True, "role": True}


def test_uninstall_again_changes_nothing() -> None:
    recap = uninstall()
    assert recap["failed"] == 0 and recap["changed"] == 0, recap


def test_the_hall_installed_again_finds_its_kept_data() -> None:
    """site.yml on the uninstalled host: everything back, the kept data its own again (the distributor continues
    from the published bundle, the relay's store and the runner directory are their users' again)."""
    h = SC.host(HOST)
    bundle = "sha256sum /var/lib/sco-distributor/local/bundle.json"
    before = h.run(bundle).stdout
    # not monitoring: Debian's Prometheus packages the uninstall removed cannot come back on a host without network
    recap = uninstall("--skip-tags", "monitoring", playbook="sco.orchestrator.site")
    assert recap["failed"] == 0
    missing = [u for u in UNITS if not exists(h, f"/etc/systemd/system/{u}")]
    missing += [f for f in FILES + DATA if not exists(h, f) and "prometheus" not in f]
    assert missing == []
    owners = h.run("stat -c %U /var/lib/sco-nats /var/lib/sco-control-loop /var/lib/sco/spool").stdout.split()
    assert owners == ["sco-nats", "sco-control", "sco-agent"]
    # the same contracts, so the same bundle at the same serial (canonical bytes), not a new one from serial 1
    assert before and h.run(bundle).stdout == before


def test_uninstall_with_purge_removes_the_data_too() -> None:
    """An operator's natural order: uninstall keeping the data, and purge it later. The first run takes the venv with
    its last unit, and the purge then had no driver to drop the database with: it said so in a debug line, exited 0,
    and SCO's database and role (with its password) stayed on the server (review of issue 30). It now makes a
    driver of its own for the run."""
    h = SC.host(HOST)
    recap = uninstall()
    assert recap["failed"] == 0 and recap["changed"] > 0
    assert not exists(h, "/opt/sco") and fleet_state_on_postgres() == {"db": True, "role": True}
    recap = uninstall("-e", "sco_purge_data=true")
    assert recap["failed"] == 0 and recap["changed"] > 0
    assert [d for d in DATA if exists(h, d)] == []
    assert users(h) == [] and groups(h) == []
    assert fleet_state_on_postgres() == {"db": False, "role": False}
    # nothing of SCO's directories is left (the platform put nothing of its own under them on this host)
    assert [d for d in ["/etc/sco", "/var/lib/sco", "/opt/sco"] if exists(h, d)] == []
    assert left_running(h) == [] and listening(h) == []


def test_uninstall_with_purge_again_changes_nothing() -> None:
    recap = uninstall("-e", "sco_purge_data=true")
    assert recap["failed"] == 0 and recap["changed"] == 0, recap
