"""A real Prometheus (Debian's) scrapes two agents (one drains, one overruns, against the
Kubernetes API stand-in and a real nats-server), a real control-loop run (``sco-control-loop``'s run_loop: the
fleet-state lock, ansible-runner, the collection's plan, arbitrate and reclaim modules on a real PostgreSQL, then
the agents' heartbeats read from the relay) through its textfiles, served by a real node_exporter (Debian's, its
textfile collector), and the distributor; every exposition passes `promtool check metrics`, and the shipped rules,
evaluated by that Prometheus, fire ScoDrainOverrun for the overrun only: nothing else fires or is pending (the
agents are heard, the loop ran, the relay is up)."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sco.control import metrics
from sco.control.runner import run_loop
from sco.state.fleet import FleetState, Pool
from sco_devkit.standins.kube_apiserver import KubeApiStandIn
from tests.harness import AgentEnv, NatsServer, add_pod, free_port, wait_for
from tests.prom import PROMETHEUS, RULES, NodeExporter, promtool_check, samples, scrape

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def node_exporter(tmp_path: Path) -> Iterator[NodeExporter]:
    """node_exporter over ``tmp_path / "textfile"`` (made here, empty until the test writes its files)."""
    textdir = tmp_path / "textfile"
    textdir.mkdir(exist_ok=True)
    ne = NodeExporter(textdir, tmp_path / "node_exporter")
    yield ne
    ne.stop()


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
    ok = AgentEnv(tmp_path / "ok", kube, nats_server, node="node-1", heartbeat_seconds=1)
    over = AgentEnv(tmp_path / "over", kube, nats_server, node="node-2", heartbeat_seconds=1)
    yield ok, over
    ok.stop()
    over.stop()


def target(url: str) -> str:
    return url.split("/")[2]


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
    - name: Plan
      sco.orchestrator.plan:
        demand: {demand: [{contract: web, units_milli: 4000}]}
        pools: "{{ pools }}"
      register: sco_plan
    - name: Arbitrate
      sco.orchestrator.arbitrate:
        plan: "{{ sco_plan }}"
        pools: "{{ pools }}"
        ceiling_per_hour: "10.00"
    - name: Reclaim
      sco.orchestrator.reclaim:
        nodes: []
        nats_url: "{{ nats_url }}"
"""


def control_loop_run(tmp: Path, agent: AgentEnv, nats: NatsServer, dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One sco-control-loop run as its unit makes it, with the agents' instances in the fleet state."""
    with FleetState(dsn) as fs:
        fs.ensure_pool(Pool("local", "spot", "m1.large", "img"))
        for slot, node in enumerate(("node-1", "node-2")):
            inst = fs.request("local", "spot", "s0", slot, node)
            fs.transition(inst.id, "active", "instance.active", server_id=f"srv-{node}")
    pdd = tmp / "runner"
    (pdd / "project").mkdir(parents=True)
    (pdd / "env").mkdir()
    (pdd / "project" / "control_loop.yml").write_text(LOOP_PLAY)
    pools = [{"name": "spot", "kind": "reclaimable", "flavor": "m1.large", "vcpus": 8, "ramMiB": 32768, "cap": 4}]
    extravars = {
        "bundle": str(agent.state / "bundle" / "bundle.json"), "trust_dir": str(agent.trust), "pools": pools,
        "nats_url": nats.url, "ansible_python_interpreter": sys.executable,
    }  # fmt: skip
    (pdd / "env" / "extravars").write_text(json.dumps(extravars))
    monkeypatch.setenv("ANSIBLE_COLLECTIONS_PATH", str(ROOT / "collections"))
    monkeypatch.setenv("SCO_NATS_URL", nats.url)  # the unit's reader of the heartbeats
    monkeypatch.setenv("SCO_DB_DSN", dsn)
    rc, summary = run_loop(pdd, "local", dsn)
    assert rc == 0, summary


def test_prometheus_scrapes_everything_and_the_overrun_alert_fires_for_the_overrun_only(
    tmp_path: Path, kube: KubeApiStandIn, agents: tuple[AgentEnv, AgentEnv], fleet_dsn: str,
    nats_server: NatsServer, node_exporter: NodeExporter, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    from sco.contract.distributor import DistributorServer
    from sco.provider.heartbeats import ensure_stream

    async def heartbeat_stream() -> None:  # the relay role's ExecStartPost makes it beside the events stream
        import nats

        nc = await nats.connect(nats_server.url)
        await ensure_stream(nc, "local")
        await nc.close()

    asyncio.run(heartbeat_stream())
    ok, over = agents
    add_pod(kube, "web", "quick", ok.node, prestop=0.2)
    add_pod(kube, "web", "stubborn", over.node, grace=30, prestop=60, shutdown=30)  # outlives any budget
    ok.start().wait_subscribed()
    over.start().wait_subscribed()
    for a in agents:
        wait_for(lambda a=a: "metrics on http" in a.logtext(), 10, "the metrics endpoint")
    time.sleep(1.5)  # a beat from each (every second once connected)
    # a control-loop run, writing its textfiles, from the real fleet state
    textdir = tmp_path / "textfile"  # node_exporter's --collector.textfile.directory
    monkeypatch.setenv(metrics.ENV, str(textdir))
    control_loop_run(tmp_path, ok, nats_server, fleet_dsn, monkeypatch)
    assert sorted(p.name for p in textdir.glob("*.prom")) == [
        "sco_control_arbitrate.prom", "sco_control_fleet.prom", "sco_control_loop.prom", "sco_control_plan.prom",
        "sco_control_reclaim.prom",
    ]  # fmt: skip
    dist_root = tmp_path / "dist"
    shutil.copytree(ok.state / "bundle", dist_root / "local")  # the hall's published bundle
    dist = DistributorServer(dist_root, ("127.0.0.1", 0))
    threading.Thread(target=dist.serve_forever, daemon=True).start()
    prom = Prometheus(
        tmp_path / "prom",
        {
            "sco-agent": [target(ok.metrics_url), target(over.metrics_url)],
            "sco-control": [target(node_exporter.url)],
            "sco-distributor": [target(dist.url + "/metrics")],
        },
    )
    try:

        def all_up() -> bool:
            r = prom.api("query", query="up")["result"]
            return len(r) == 4 and all(x["value"][1] == "1" for x in r)

        wait_for(all_up, 20, "every target scraped and up", interval=0.5)
        for url in (ok.metrics_url, over.metrics_url, node_exporter.url, dist.url + "/metrics"):
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

        def value(q: str) -> dict[str, float]:
            return {
                json.dumps(x["metric"], sort_keys=True): float(x["value"][1])
                for x in prom.api("query", query=q)["result"]
            }

        # the control-loop run: each step and the loop ok, the agents heard, the relay up, spend against authority
        ok_steps = value('sco_control_last_run_timestamp_seconds{result="ok",job="sco-control"}')
        assert sorted(json.loads(k)["step"] for k in ok_steps) == ["arbitrate", "loop", "plan", "reclaim"]
        assert list(value("sco_agents_silent").values()) == [0]
        assert list(value("sco_agent_heartbeats_nodes").values()) == [2]
        assert list(value("sco_relay_up").values()) == [1]
        # node_exporter read all five files and dropped nothing: a series in two files is not a failed scrape there
        # (up stays 1), only a logged, counted gathering error
        assert len(value('node_textfile_mtime_seconds{job="sco-control"}')) == 5
        assert list(value('node_textfile_scrape_error{job="sco-control"}').values()) == [0]
        gathering = 'promhttp_metric_handler_errors_total{job="sco-control",cause="gathering"}'
        assert list(value(gathering).values()) == [0]
        assert "was collected before" not in node_exporter.logtext()
        assert {json.loads(k)["state"]: v for k, v in value("sco_fleet_instances").items()} == {"active": 2}
        spend = value("sco_on_demand_authority_per_hour")
        assert spend and all(json.loads(k)["job"] == "sco-control" for k in spend)
        r = prom.api("query", query='sco_distributor_bundle_serial{hall="local"}')["result"]
        assert len(r) == 1 and float(r[0]["value"][1]) >= 1
        # every metric docs/METRICS.md lists is in Prometheus, but those with nothing to say in this hall
        documented = set(re.findall(r"^\| `(sco_[a-z_]+)`", (ROOT / "docs/METRICS.md").read_text(), re.M))
        have = {n.removesuffix("_bucket") for n in prom.api("label/__name__/values")}
        absent = {
            # no token file: the agents here reach the stand-in without a bearer token, so nothing expires or renews
            "sco_agent_credential_expiry_timestamp_seconds", "sco_agent_credential_renew_timestamp_seconds",
            "sco_agent_credential_renewal_failures",
            # by kind, once one is seen: a refusal here would fire ScoNoticesRefused (test_metrics_agent has one)
            "sco_agent_notice_refusals_total",
            # role fleet_state's certificates: the local hall's fleet state is the demo's embedded server, no TLS
            "sco_certificate_expiry_timestamp_seconds",
            # the enrolment service's (sco enrol serve): this hall's nodes are in the inventory, none enrols
            # (tests/test_enrolment.py scrapes them)
            "sco_enrol_issued_total", "sco_enrol_refused_total", "sco_enrol_refused_connections_total",
            "sco_enrol_revoked_total", "sco_enrol_revoke_failures_total", "sco_enrol_nodes_deleted_total",
            "sco_enrol_metrics_tls_handshake_failures_total",
        }  # fmt: skip
        assert documented - have == absent, documented - have
        rules = prom.api("rules")["groups"]
        assert all(rule["health"] == "ok" for g in rules for rule in g["rules"]), rules
    finally:
        prom.stop()
        dist.shutdown()
        dist.server_close()


def test_node_exporter_serves_one_family_across_files_and_drops_a_series_a_second_file_repeats(
    tmp_path: Path, node_exporter: NodeExporter
) -> None:
    """What sco.control.metrics keeps the hall-wide gauges in one file for: node_exporter 1.5 does not fail the
    scrape over a repeated series, it serves the first file's copy (by name, not the newest) and only logs."""
    textdir = tmp_path / "textfile"
    head = "# HELP x_seconds X.\n# TYPE x_seconds gauge\n"
    (textdir / "a.prom").write_text(head + 'x_seconds{step="a"} 1\n')
    (textdir / "b.prom").write_text(head + 'x_seconds{step="b"} 2\n')
    text = scrape(node_exporter.url)
    promtool_check(text)  # one family across the files
    assert text.count("# TYPE x_seconds") == 1
    s = samples(text)
    assert s['x_seconds{step="a"}'] == 1 and s['x_seconds{step="b"}'] == 2
    assert s['promhttp_metric_handler_errors_total{cause="gathering"}'] == 0
    (textdir / "c.prom").write_text(head + 'x_seconds{step="a"} 3\n')  # newer, written after a.prom
    s = samples(scrape(node_exporter.url))  # answered 200 all the same
    assert s['x_seconds{step="a"}'] == 1 and s['x_seconds{step="b"}'] == 2  # c.prom's copy dropped
    assert s[f'node_textfile_mtime_seconds{{file="{textdir / "c.prom"}"}}'] > 0  # the file was read
    assert s["node_textfile_scrape_error"] == 0  # reading it was no error: the clash is the registry's
    assert "was collected before with the same name and label values" in node_exporter.logtext()
    s = samples(scrape(node_exporter.url))  # the counter is gathered before the failing gather counts
    assert s['promhttp_metric_handler_errors_total{cause="gathering"}'] >= 1
    assert s['x_seconds{step="a"}'] == 1
