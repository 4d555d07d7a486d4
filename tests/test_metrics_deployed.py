"""The control loop's alerts in a hall as the collection deploys it. Role monitoring renders
node_exporter's and Prometheus's command lines (Debian's units run ``$ARGS`` from them), Prometheus's configuration
and the rules; role control_loop's unit gives the loop the textfile directory (Environment=, ReadWritePaths=). A
real node_exporter and a real Prometheus run from exactly those files, and real ``sco-control-loop`` runs
(run_loop: the fleet-state lock, ansible-runner, the collection's modules) write their textfiles where the unit
says: ScoControlLoopFailed fires while the loop fails (the Kubernetes API it reads is unreachable) and clears
when it recovers; ScoControlLoopStale fires for a loop whose last run is 16 minutes old."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sco.control.runner import run_loop
from sco_devkit.standins.kube_apiserver import KubeApiStandIn
from tests.harness import free_port, wait_for
from tests.prom import MonitoringDeployment, args_of

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PROMTOOL = Path(shutil.which("promtool") or "/usr/bin/promtool")


def unit_setting(unit: Path, key: str) -> list[str]:
    return [x.split("=", 1)[1] for x in unit.read_text().splitlines() if x.startswith(f"{key}=")]


@pytest.fixture
def deployed(tmp_path: Path) -> Iterator[MonitoringDeployment]:
    d = MonitoringDeployment(tmp_path / "deployed")
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
    tmp_path: Path, deployed: MonitoringDeployment, fleet_dsn: str, kube: KubeApiStandIn,
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


def test_the_control_loop_stale_alert_fires_for_a_loop_that_stopped_running(deployed: MonitoringDeployment) -> None:
    """The loop's last textfile is the one a run left 16 minutes ago (a stopped timer writes no other)."""
    import time

    from sco.control import metrics

    now = time.time()
    assert metrics.write_step("loop", "ok", now - 1000, now - 960, directory=str(deployed.textfile))
    deployed.start()
    stale = wait_for(lambda: deployed.alerts("ScoControlLoopStale"), 20, "ScoControlLoopStale firing")
    assert [a["labels"]["step"] for a in stale] == ["loop"]
    assert deployed.alerts("ScoControlLoopFailed") == []
