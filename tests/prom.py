"""Prometheus in the tests: scraping an exposition, parsing its samples, promtool's check, and Debian's real
node_exporter and prometheus binaries (the NodeExporter harness runs the first over a textfile directory)."""

from __future__ import annotations

import json
import os
import pwd
import re
import shlex
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from tests.harness import BIN, free_port, wait_for

ROOT = Path(__file__).resolve().parents[1]
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
# the hall's alerting and recording rules, as role monitoring installs them
RULES = ROOT / "collections/ansible_collections/sco/orchestrator/roles/monitoring/files/sco.rules.yml"


SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def scrape(url: str, timeout: float = 5) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return str(r.read().decode())


def samples(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            m = SAMPLE.match(line)
            assert m, f"not an exposition line: {line!r}"
            out[(m.group(1) + (m.group(2) or ""))] = float(m.group(3))
    return out


def promtool_check(text: str) -> None:
    p = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0 and not p.stdout.strip() and not p.stderr.strip(), p.stdout + p.stderr


PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


NODE_EXPORTER = shutil.which("prometheus-node-exporter") or "/usr/bin/prometheus-node-exporter"


class NodeExporter:
    """Debian's node_exporter (1.5), its textfile collector only, serving ``directory``'s *.prom files on loopback.

    A series two files both carry is not a failed scrape there: the first file's (by name) is served, the later
    copy dropped, the error logged ("was collected before with the same name and label values") and counted in
    ``promhttp_metric_handler_errors_total{cause="gathering"}`` (seen from the next scrape on: the counter is
    gathered before the failing gather increments it); ``node_textfile_scrape_error`` stays 0."""

    def __init__(self, directory: Path, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/metrics"
        self.log = open(root / "node_exporter.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                NODE_EXPORTER,
                f"--web.listen-address=127.0.0.1:{self.port}",
                f"--collector.textfile.directory={directory}",
                "--collector.disable-defaults",  # the host's own collectors: nothing the tests read
                "--collector.textfile",
                "--web.disable-exporter-metrics",
            ],
            stdout=self.log,
            stderr=self.log,
        )
        try:
            wait_for(self._listening, 15, "node_exporter listening", interval=0.1)
        except BaseException:
            self.stop()
            raise

    def logtext(self) -> str:
        return Path(self.log.name).read_text()

    def _listening(self) -> bool:
        assert self.proc.poll() is None, self.logtext()[-3000:]
        try:
            with urllib.request.urlopen(self.url, timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


class MonitoringDeployment:
    """The files the roles deployed under ``root``, and node_exporter and Prometheus started from them."""

    def __init__(
        self, root: Path, ports: tuple[int, int] | None = None, flags: tuple[str, ...] = (), **more: Any
    ) -> None:
        """``more``: other variables of the roles (tests/test_enrolment.py's file_sd of launched agents); ``flags``:
        ansible-playbook's (``--tags``)."""
        self.root = root
        self.textfile = root / "textfile"
        # a run again over the same root gives the first run's ports (node_exporter's, Prometheus's)
        self.ne_port, self.prom_port = ports or (free_port(), free_port())
        ev = {
            "ansible_python_interpreter": sys.executable, "roles_dir": str(ROLES), "out": str(root),
            "monitoring_manage_packages": False, "monitoring_services_enabled": False,
            "monitoring_rules_dir": str(root / "rules"), "monitoring_promtool": str(PROMTOOL),
            "monitoring_rules_owner": str(os.getuid()), "monitoring_rules_group": str(os.getgid()),
            "monitoring_node_exporter_textfile_dir": str(self.textfile),
            "monitoring_node_exporter_port": self.ne_port,
            "monitoring_node_exporter_args_file": str(root / "default-node-exporter"),
            # its TLS files (a hall's: tests/test_node_exporter_tls.py) and the hall's CA Prometheus reads, under root
            "monitoring_node_exporter_web_config": str(root / "node-exporter-web.yml"),
            "monitoring_node_exporter_tls_host_dir": str(root / "node-exporter-tls"),
            "monitoring_node_exporter_user": pwd.getpwuid(os.getuid()).pw_name,
            "monitoring_tls_ca_dest": str(root / "sco-ca.crt"),
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
            [str(BIN / "ansible-playbook"), "-i", "localhost,", "-c", "local", str(book), "-e", json.dumps(ev), *flags],
            capture_output=True, text=True, timeout=300, env=env,
        )  # fmt: skip
        assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
        self.output = p.stdout
        self.unit = root / "sco-control-loop.service"
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> MonitoringDeployment:
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


ROLES = ROOT / "collections/ansible_collections/sco/orchestrator/roles"


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
