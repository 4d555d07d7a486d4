"""Roles spark_decommission and kubelet_graceful_shutdown through real ansible-playbook runs (ansible-runner, local
connection, files under a temporary root): check mode, for real, again; then what they wrote is read back the
way Spark, kubelet and logind read it. Bad settings fail early with a message that says what to change."""

from __future__ import annotations

import configparser
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.spark_decommission import shipped_settings

ROOT = Path(__file__).resolve().parents[1]
CONTRACTS = ROOT / "src/sco/samples/local/contracts/spark/etl.yaml"


def play(tmp: Path, role: str, extravars: dict[str, Any], check: bool = False) -> Any:
    import ansible_runner

    pdd = tmp / f"runner-{len(list(tmp.glob('runner-*')))}"
    (pdd / "project").mkdir(parents=True)
    (pdd / "project" / "play.yml").write_text(
        yaml.safe_dump(
            [{"name": f"Role {role}", "hosts": "all", "gather_facts": False, "roles": [f"sco.orchestrator.{role}"]}]
        )
    )
    return ansible_runner.run(
        private_data_dir=str(pdd),
        playbook="play.yml",
        inventory={
            "all": {"hosts": {"node": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}
        },
        extravars=extravars,
        cmdline="--check --diff" if check else None,
        quiet=True,
        envvars={
            "ANSIBLE_COLLECTIONS_PATH": str(ROOT / "collections"),
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        },
    )


def failure(r: Any) -> str:
    return "\n".join(
        str(e["event_data"]["res"].get("msg", ""))
        for e in r.events
        if e.get("event") == "runner_on_failed" and "res" in e.get("event_data", {})
    )


def spark_conf(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            k, v = line.split(None, 1)
            out[k] = v.strip()
    return out


def test_spark_role_check_real_again(tmp_path: Path) -> None:
    conf = tmp_path / "etc-spark"
    ev = {
        "spark_decommission_conf_dir": str(conf),
        "spark_decommission_contract_file": str(CONTRACTS),
        "spark_decommission_contract": "etl-nightly",
        "spark_decommission_s3_endpoint": "https://rgw.hall.example:7480",
    }
    r = play(tmp_path, "spark_decommission", ev, check=True)
    assert r.rc == 0, r.stdout.read()
    assert r.stats["changed"].get("node", 0) > 0 and not conf.exists()  # check mode did nothing

    r = play(tmp_path, "spark_decommission", ev)
    assert r.rc == 0, r.stdout.read()
    s = spark_conf(conf / "spark-defaults.conf")
    # exactly the settings the real-Spark test runs with
    for k, v in shipped_settings().items():
        assert s[k] == v, k
    assert s["spark.storage.decommission.fallbackStorage.path"] == "s3a://spark-fallback/etl/"  # from the contract
    assert s["spark.hadoop.fs.s3a.endpoint"] == "https://rgw.hall.example:7480"
    assert s["spark.executor.decommission.forceKillTimeout"] == "90s"  # the contract's drain budget
    assert "NOTE: Spark does not clean this up by itself" in (conf / "spark-defaults.conf").read_text()
    pod = yaml.safe_load((conf / "executor-pod-template.yaml").read_text())
    assert pod["spec"]["terminationGracePeriodSeconds"] == 100  # 90 s budget + 10 s final write
    c = pod["spec"]["containers"][0]
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["/opt/decom.sh"]
    assert pod["spec"]["volumes"][0]["hostPath"] == {"path": "/run/sco", "type": "Directory"}
    assert s["spark.kubernetes.executor.podTemplateFile"] == str(conf / "executor-pod-template.yaml")

    r = play(tmp_path, "spark_decommission", ev)
    assert r.rc == 0 and r.stats["changed"].get("node", 0) == 0  # idempotent


def test_spark_role_refuses_bad_settings(tmp_path: Path) -> None:
    r = play(
        tmp_path,
        "spark_decommission",
        {
            "spark_decommission_conf_dir": str(tmp_path / "c"),
            "spark_decommission_drain_budget_seconds": 60,
            "spark_decommission_fallback_path": "/local/disk",
            "spark_decommission_s3_endpoint": "https://rgw:7480",
        },
    )
    assert r.rc != 0
    assert "s3a://BUCKET/PREFIX/" in failure(r) and '"/local/disk"' in failure(r)
    r = play(
        tmp_path,
        "spark_decommission",
        {
            "spark_decommission_conf_dir": str(tmp_path / "c"),
            "spark_decommission_contract_file": str(CONTRACTS),
            "spark_decommission_contract": "no-such-contract",
        },
    )
    assert r.rc != 0 and 'WorkloadContract named "no-such-contract"' in failure(r)
    assert not (tmp_path / "c").exists()


def test_kubelet_role_check_real_again(tmp_path: Path) -> None:
    ev = {
        "kubelet_graceful_shutdown_kubelet_config_dir": str(tmp_path / "kubelet.conf.d"),
        "kubelet_graceful_shutdown_logind_conf_dir": str(tmp_path / "logind.conf.d"),
    }
    r = play(tmp_path, "kubelet_graceful_shutdown", ev, check=True)
    assert r.rc == 0, r.stdout.read()
    assert not (tmp_path / "kubelet.conf.d").exists()
    r = play(tmp_path, "kubelet_graceful_shutdown", ev)
    assert r.rc == 0, r.stdout.read()
    kc = yaml.safe_load((tmp_path / "kubelet.conf.d/50-sco-graceful-shutdown.conf").read_text())
    assert kc["kind"] == "KubeletConfiguration" and kc["apiVersion"] == "kubelet.config.k8s.io/v1beta1"
    assert kc["shutdownGracePeriodByPodPriority"] == [
        {"priority": 0, "shutdownGracePeriodSeconds": 90},
        {"priority": 100000, "shutdownGracePeriodSeconds": 10},
        {"priority": 2000000000, "shutdownGracePeriodSeconds": 5},
    ]
    assert "shutdownGracePeriod" not in kc  # kubelet refuses both at once
    ini = configparser.ConfigParser()
    ini.read(tmp_path / "logind.conf.d/50-sco-inhibit-delay.conf")
    assert ini["Login"]["InhibitDelayMaxSec"] == "110"  # 105 s of kubelet periods + 5 s final write, <= 120 - 10
    r = play(tmp_path, "kubelet_graceful_shutdown", ev)
    assert r.rc == 0 and r.stats["changed"].get("node", 0) == 0


def test_kubelet_role_single_period_and_refusals(tmp_path: Path) -> None:
    ev = {
        "kubelet_graceful_shutdown_kubelet_config_dir": str(tmp_path / "k"),
        "kubelet_graceful_shutdown_logind_conf_dir": str(tmp_path / "l"),
        "kubelet_graceful_shutdown_by_pod_priority": [],
        "kubelet_graceful_shutdown_grace_period_seconds": 60,
        "kubelet_graceful_shutdown_grace_period_critical_pods_seconds": 10,
    }
    r = play(tmp_path, "kubelet_graceful_shutdown", ev)
    assert r.rc == 0, r.stdout.read()
    kc = yaml.safe_load((tmp_path / "k/50-sco-graceful-shutdown.conf").read_text())
    assert kc["shutdownGracePeriod"] == "60s" and kc["shutdownGracePeriodCriticalPods"] == "10s"
    # both forms at once, or more than the notice window allows: refused before anything changes
    bad = dict(ev, kubelet_graceful_shutdown_by_pod_priority=[{"priority": 0, "shutdownGracePeriodSeconds": 30}])
    r = play(tmp_path, "kubelet_graceful_shutdown", bad)
    assert r.rc != 0 and "kubelet refuses both" in failure(r)
    too_long = dict(ev, kubelet_graceful_shutdown_grace_period_seconds=200)
    r = play(tmp_path, "kubelet_graceful_shutdown", too_long)
    assert r.rc != 0 and "must fit the notice window less the margin (110 s)" in failure(r)
    assert kc == yaml.safe_load((tmp_path / "k/50-sco-graceful-shutdown.conf").read_text())
