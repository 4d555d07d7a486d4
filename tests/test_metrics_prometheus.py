"""Issue 18's done-when: a real Prometheus (Debian's) scrapes two agents (one drains, one overruns, against the
Kubernetes API stand-in and a real nats-server), a control-loop step's textfile and the distributor, every
exposition passes `promtool check metrics`, and the shipped rules, evaluated by that Prometheus, fire
ScoDrainOverrun for the overrun only."""

from __future__ import annotations

import http.server
import json
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sco.control import loop, metrics
from sco_devkit.standins.kube_apiserver import KubeApiStandIn
from tests.harness import AgentEnv, NatsServer, add_pod, free_port, wait_for
from tests.test_alert_rules import RULES
from tests.test_metrics_agent import promtool_check, scrape

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


class TextfileServer(http.server.ThreadingHTTPServer):
    """Serves the textfile directory's *.prom files as one exposition, as node_exporter's collector would."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = "".join(p.read_text() for p in sorted(outer.directory.glob("*.prom"))).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), H)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/metrics"


class Prometheus:
    def __init__(self, root: Path, jobs: dict[str, list[str]]) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": targets}]} for job, targets in jobs.items()
            ],
        }
        (root / "prometheus.yml").write_text(json.dumps(cfg))  # JSON is YAML
        self.log = open(root / "prometheus.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={root / 'prometheus.yml'}",
                f"--storage.tsdb.path={root / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
            ],
            stdout=self.log,
            stderr=self.log,
        )
        wait_for(self._ready, 30, "prometheus ready", interval=0.2)

    def _ready(self) -> bool:
        assert self.proc.poll() is None, Path(self.log.name).read_text()[-3000:]
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def api(self, path: str, **query: str) -> Any:
        q = f"?{urllib.parse.urlencode(query)}" if query else ""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}{q}", timeout=5) as r:
            doc = json.loads(r.read())
        assert doc["status"] == "success", doc
        return doc["data"]

    def alerts(self, state: str = "firing") -> list[dict[str, Any]]:
        return [a for a in self.api("alerts")["alerts"] if a["state"] == state]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.log.close()


@pytest.fixture
def agents(tmp_path: Path, kube: KubeApiStandIn, nats_server: NatsServer) -> Iterator[tuple[AgentEnv, AgentEnv]]:
    ok = AgentEnv(tmp_path / "ok", kube, nats_server, node="node-1")
    over = AgentEnv(tmp_path / "over", kube, nats_server, node="node-2")
    yield ok, over
    ok.stop()
    over.stop()


def target(url: str) -> str:
    return url.split("/")[2]


def test_prometheus_scrapes_everything_and_the_overrun_alert_fires_for_the_overrun_only(
    tmp_path: Path, kube: KubeApiStandIn, agents: tuple[AgentEnv, AgentEnv], fleet_dsn: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    from sco.contract.distributor import DistributorServer

    ok, over = agents
    add_pod(kube, "web", "quick", ok.node, prestop=0.2)
    add_pod(kube, "web", "stubborn", over.node, grace=30, prestop=60, shutdown=30)  # outlives any budget
    ok.start().wait_subscribed()
    over.start().wait_subscribed()
    for a in agents:
        wait_for(lambda a=a: "metrics on http" in a.logtext(), 10, "the metrics endpoint")
    # a control-loop step run, writing its textfile, from the real fleet state
    textdir = tmp_path / "textfile"
    textdir.mkdir()
    monkeypatch.setenv(metrics.ENV, str(textdir))
    loop.run("reclaim", {"hall": "local", "state_dsn": fleet_dsn, "nodes": []}, check=False)
    text_srv = TextfileServer(textdir)
    dist_root = tmp_path / "dist"
    shutil.copytree(ok.state / "bundle", dist_root / "local")  # the hall's published bundle
    dist = DistributorServer(dist_root, ("127.0.0.1", 0))
    threading.Thread(target=dist.serve_forever, daemon=True).start()
    prom = Prometheus(
        tmp_path / "prom",
        {
            "sco-agent": [target(ok.metrics_url), target(over.metrics_url)],
            "sco-control": [target(text_srv.url)],
            "sco-distributor": [target(dist.url + "/metrics")],
        },
    )
    try:

        def all_up() -> bool:
            r = prom.api("query", query="up")["result"]
            return len(r) == 4 and all(x["value"][1] == "1" for x in r)

        wait_for(all_up, 20, "every target scraped and up", interval=0.5)
        for url in (ok.metrics_url, over.metrics_url, text_srv.url, dist.url + "/metrics"):
            promtool_check(scrape(url))
        time.sleep(2)  # a few samples at 0 before the drains: increase() sees the step
        ok.send(ok.notice("p-ok", 20))
        over.send(over.notice("p-over", 8))
        assert ok.outcome(20)["type"] == "drain.drained"
        assert over.outcome(15)["type"] == "drain.overrun"

        def overrun_alerts() -> list[dict[str, Any]]:
            return [a for a in prom.alerts() if a["labels"]["alertname"] == "ScoDrainOverrun"]

        fired = wait_for(overrun_alerts, 20, "ScoDrainOverrun firing", interval=0.5)
        time.sleep(3)  # rules keep being evaluated: the drained node must still not be among them
        fired = overrun_alerts()
        assert [(a["labels"]["instance"], a["labels"]["outcome"]) for a in fired] == [
            (target(over.metrics_url), "overrun")
        ]
        assert {a["labels"]["alertname"] for a in prom.alerts() + prom.alerts("pending")} == {"ScoDrainOverrun"}
        # and the drain that went well is in Prometheus too, by instance, with its duration
        r = prom.api("query", query='sco_agent_drains_total{outcome="drained"} > 0')["result"]
        assert [x["metric"]["instance"] for x in r] == [target(ok.metrics_url)]
        r = prom.api("query", query="sco_agent_drain_duration_seconds_count")["result"]
        assert sorted(x["value"][1] for x in r) == ["1", "1"]
        r = prom.api("query", query='sco_control_last_run_timestamp_seconds{step="reclaim",result="ok"}')["result"]
        assert len(r) == 1 and r[0]["metric"]["job"] == "sco-control"
        r = prom.api("query", query='sco_distributor_bundle_serial{hall="local"}')["result"]
        assert len(r) == 1 and float(r[0]["value"][1]) >= 1
        rules = prom.api("rules")["groups"]
        assert all(rule["health"] == "ok" for g in rules for rule in g["rules"]), rules
    finally:
        prom.stop()
        text_srv.shutdown()
        dist.shutdown()
        dist.server_close()
