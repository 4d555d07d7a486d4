"""The control loop's alerts in a hall as the collection deploys it. Role monitoring renders
node_exporter's and Prometheus's command lines (Debian's units run ``$ARGS`` from them), Prometheus's configuration
and the rules; role control_loop's unit gives the loop the textfile directory (Environment=, ReadWritePaths=). A
real node_exporter and a real Prometheus run from exactly those files, and real ``sco-control-loop`` runs
(run_loop: the fleet-state lock, ansible-runner, the collection's modules) write their textfiles where the unit
says: ScoControlLoopFailed fires while the loop fails (the Kubernetes API it reads is unreachable) and clears
when it recovers; ScoControlLoopStale fires for a loop whose last run is 16 minutes old."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sco.control.runner import run_loop
from sco_devkit.standins.kube_apiserver import KubeApiStandIn
from tests.harness import free_port, wait_for
from tests.prom import NODE_EXPORTER, PROMETHEUS

ROOT = Path(__file__).resolve().parents[1]
ROLES = ROOT / "collections/ansible_collections/sco/orchestrator/roles"
BIN = Path(sys.executable).parent
PROMTOOL = Path(shutil.which("promtool") or "/usr/bin/promtool")

DEPLOY = """
- name: The monitoring files of a control host (no packages, no services; the test runs them)
  hosts: localhost
  gather_facts: false
  roles:
    - role: sco.orchestrator.monitoring
- name: The control loop's unit, rendered from the role's template with its defaults
  hosts: localhost
  gather_facts: false
  vars_files: ["{{ roles_dir }}/control_loop/defaults/main.yml", "{{ roles_dir }}/control_loop/vars/main.yml"]
  tasks:
    - name: Render
      ansible.builtin.template:
        src: "{{ roles_dir }}/control_loop/templates/sco-control-loop.service.j2"
        dest: "{{ out }}/sco-control-loop.service"
        mode: "0644"
"""


def args_of(env_file: Path) -> list[str]:
    """The command line a Debian unit runs: ``$ARGS`` of its EnvironmentFile, as systemd splits it."""
    line = next(x for x in env_file.read_text().splitlines() if x.startswith("ARGS="))
    return shlex.split(shlex.split(line.removeprefix("ARGS="))[0])


def unit_setting(unit: Path, key: str) -> list[str]:
    return [x.split("=", 1)[1] for x in unit.read_text().splitlines() if x.startswith(f"{key}=")]


class Deployed:
    """The files the roles deployed under ``root``, and node_exporter and Prometheus started from them."""

    def __init__(self, root: Path, **more: Any) -> None:
        """``more``: other variables of the roles (tests/test_enrolment.py's file_sd of launched agents)."""
        self.root = root
        self.textfile = root / "textfile"
        self.ne_port, self.prom_port = free_port(), free_port()
        ev = {
            "ansible_python_interpreter": sys.executable, "roles_dir": str(ROLES), "out": str(root),
            "monitoring_manage_packages": False, "monitoring_services_enabled": False,
            "monitoring_rules_dir": str(root / "rules"), "monitoring_promtool": str(PROMTOOL),
            "monitoring_rules_owner": str(os.getuid()), "monitoring_rules_group": str(os.getgid()),
            "monitoring_node_exporter_textfile_dir": str(self.textfile),
            "monitoring_node_exporter_port": self.ne_port,
            "monitoring_node_exporter_args_file": str(root / "default-node-exporter"),
            # only the host's textfile collector: the machine's own collectors say nothing here
            "monitoring_node_exporter_extra_args": ["--collector.disable-defaults", "--collector.textfile"],
            "monitoring_control_targets": [f"127.0.0.1:{self.ne_port}"],
            "monitoring_scrape_file": str(root / "sco-scrape.yml"),
            "monitoring_prometheus_config": str(root / "prometheus.yml"),
            "monitoring_prometheus_args_file": str(root / "default-prometheus"),
            "monitoring_prometheus_listen": f"127.0.0.1:{self.prom_port}",
            "monitoring_scrape_interval": "1s", "monitoring_evaluation_interval": "1s",
            "control_loop_hall": "local", "control_loop_metrics_textfile_dir": str(self.textfile),
            "monitoring_agent_file_sd": [],  # none here: the control loop's alerts only
            **more,
        }  # fmt: skip
        book = root / "deploy.yml"
        root.mkdir(parents=True, exist_ok=True)
        book.write_text(DEPLOY)
        env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(ROOT / "collections"), "ANSIBLE_NOCOLOR": "1",
               "PATH": f"{BIN}:{os.environ['PATH']}"}  # fmt: skip
        p = subprocess.run(
            [str(BIN / "ansible-playbook"), "-i", "localhost,", "-c", "local", str(book), "-e", json.dumps(ev)],
            capture_output=True, text=True, timeout=300, env=env,
        )  # fmt: skip
        assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
        self.unit = root / "sco-control-loop.service"
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> Deployed:
        log = open(self.root / "node_exporter.log", "wb")  # noqa: SIM115
        self.procs.append(subprocess.Popen([NODE_EXPORTER, *args_of(self.root / "default-node-exporter")],
                                           stdout=log, stderr=log))  # fmt: skip
        # Debian's unit leaves the storage path at its default (/var/lib/prometheus/metrics2): the test's own
        log = open(self.root / "prometheus.log", "wb")  # noqa: SIM115
        cmd = [PROMETHEUS, *args_of(self.root / "default-prometheus"), f"--storage.tsdb.path={self.root / 'data'}"]
        self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=log))
        wait_for(self._ready, 30, "prometheus ready", interval=0.2)
        return self

    def _ready(self) -> bool:
        for p in self.procs:
            assert p.poll() is None, (self.root / "prometheus.log").read_text()[-3000:]
        try:
            return self.api("query", query='up{job="sco-control"} == 1')["result"] != []
        except OSError:
            return False

    def api(self, path: str, **query: str) -> Any:
        import urllib.parse
        import urllib.request

        q = f"?{urllib.parse.urlencode(query)}" if query else ""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.prom_port}/api/v1/{path}{q}", timeout=5) as r:
            doc = json.loads(r.read())
        assert doc["status"] == "success", doc
        return doc["data"]

    def alerts(self, name: str) -> list[dict[str, Any]]:
        return [a for a in self.api("alerts")["alerts"] if a["labels"]["alertname"] == name and a["state"] == "firing"]

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


@pytest.fixture
def deployed(tmp_path: Path) -> Iterator[Deployed]:
    d = Deployed(tmp_path / "deployed")
    yield d
    d.stop()


LOOP_PLAY = """
- name: SCO control loop (the steps that need no cloud)
  hosts: localhost
  connection: local
  gather_facts: false
  module_defaults:
    group/sco.orchestrator.control:
      hall: "{{ sco_hall }}"
      bundle: "{{ bundle }}"
      trust_dir: "{{ trust_dir }}"
      run_id: "{{ sco_run_id }}"
  tasks:
    - name: Read pending work from the schedulers
      sco.orchestrator.demand:
        kubernetes: "{{ kubernetes }}"
      register: sco_demand
    - name: Plan
      sco.orchestrator.plan:
        demand: "{{ sco_demand }}"
        pools: "{{ pools }}"
      register: sco_plan
"""


def test_the_control_loop_failed_alert_fires_in_a_deployed_hall_and_clears_when_the_loop_recovers(
    tmp_path: Path, deployed: Deployed, fleet_dsn: str, kube: KubeApiStandIn,
    signed: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    # the unit the role installs: the loop writes where node_exporter reads, and its sandbox lets it
    env = dict(x.split("=", 1) for x in unit_setting(deployed.unit, "Environment"))
    assert env["SCO_METRICS_TEXTFILE_DIR"] == str(deployed.textfile)
    assert str(deployed.textfile) in unit_setting(deployed.unit, "ReadWritePaths")[0].split()
    assert f"--collector.textfile.directory={deployed.textfile}" in args_of(deployed.root / "default-node-exporter")
    deployed.start()
    bundle, _, pub = signed
    trust = tmp_path / "trusted"
    trust.mkdir()
    (trust / pub.name).write_bytes(pub.read_bytes())
    pdd = tmp_path / "runner"
    (pdd / "project").mkdir(parents=True)
    (pdd / "env").mkdir()
    (pdd / "project" / "control_loop.yml").write_text(LOOP_PLAY)
    pools = [{"name": "spot", "kind": "reclaimable", "flavor": "m1.large", "vcpus": 8, "ramMiB": 32768, "cap": 4}]

    def run(kube_url: str) -> int:
        extravars = {"bundle": str(bundle), "trust_dir": str(trust), "pools": pools, "kubernetes": {"url": kube_url},
                     "ansible_python_interpreter": sys.executable}  # fmt: skip
        (pdd / "env" / "extravars").write_text(json.dumps(extravars))
        rc, _ = run_loop(pdd, "local", fleet_dsn)
        return rc

    monkeypatch.setenv("ANSIBLE_COLLECTIONS_PATH", str(ROOT / "collections"))
    monkeypatch.setenv("SCO_METRICS_TEXTFILE_DIR", env["SCO_METRICS_TEXTFILE_DIR"])
    # the API server the loop reads is away: the run fails, and says so where Prometheus looks
    assert run(f"http://127.0.0.1:{free_port()}") == 1

    def failed() -> set[str]:
        return {a["labels"]["step"] for a in deployed.alerts("ScoControlLoopFailed")}

    assert wait_for(lambda: failed() == {"demand", "loop"}, 20, "ScoControlLoopFailed for demand and the loop")
    assert deployed.alerts("ScoControlLoopStale") == []
    # it is back: the next run succeeds and the alert clears, for the loop and the step
    assert run(kube.url) == 0
    wait_for(lambda: failed() == set(), 20, "ScoControlLoopFailed cleared")
    r = deployed.api("query", query='sco_control_last_run_timestamp_seconds{step="loop"}')["result"]
    assert sorted(x["metric"]["result"] for x in r) == ["failed", "ok"]
    assert all(x["metric"]["job"] == "sco-control" for x in r)


def test_the_control_loop_stale_alert_fires_for_a_loop_that_stopped_running(deployed: Deployed) -> None:
    """The loop's last textfile is the one a run left 16 minutes ago (a stopped timer writes no other)."""
    import time

    from sco.control import metrics

    now = time.time()
    assert metrics.write_step("loop", "ok", now - 1000, now - 960, directory=str(deployed.textfile))
    deployed.start()
    stale = wait_for(lambda: deployed.alerts("ScoControlLoopStale"), 20, "ScoControlLoopStale firing")
    assert [a["labels"]["step"] for a in stale] == ["loop"]
    assert deployed.alerts("ScoControlLoopFailed") == []
