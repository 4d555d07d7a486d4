"""Prometheus in the tests: scraping an exposition, parsing its samples, promtool's check, and Debian's real
node_exporter and prometheus binaries (the NodeExporter harness runs the first over a textfile directory)."""

from __future__ import annotations

import re
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

from tests.harness import free_port, wait_for

ROOT = Path(__file__).resolve().parents[1]
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
# the hall's alerting and recording rules, as role monitoring installs them
RULES = ROOT / "collections/ansible_collections/sco/orchestrator/roles/monitoring/files/sco.rules.yml"


SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
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
