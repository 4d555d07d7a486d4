"""The shipped Prometheus rules (role sco.orchestrator.monitoring): promtool checks them and runs their
`promtool test rules` suite; every alert has cases and a runbook section; the role installs them validated."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

from tests.prom import RULES

ROOT = Path(__file__).resolve().parents[1]
ROLE = ROOT / "collections/ansible_collections/sco/orchestrator/roles/monitoring"
CASES = ROLE / "files/sco.rules.test.yml"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
ALERTS = {
    "ScoAgentDown",
    "ScoDrainOverrun",
    "ScoNoticesRefused",
    "ScoSpoolBacklogGrowing",
    "ScoBundleStale",
    "ScoBundleExpired",
    "ScoCredentialExpiring",
    "ScoCertificateExpiring",
    "ScoControlLoopFailed",
    "ScoControlLoopStale",
    "ScoReclaimDeletePendingPastDeadline",
    "ScoRelayDown",
    "ScoAgentsSilent",
    "ScoAgentHeartbeatsUnread",
}


def promtool(*args: str, cwd: Path = ROLE / "files") -> subprocess.CompletedProcess[str]:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60, cwd=cwd)


def alerts() -> set[str]:
    doc = yaml.safe_load(RULES.read_text())
    return {r["alert"] for g in doc["groups"] for r in g["rules"] if "alert" in r}


def test_promtool_checks_the_rules_and_passes_their_tests() -> None:
    p = promtool("check", "rules", str(RULES))
    assert p.returncode == 0, p.stdout + p.stderr
    p = promtool("test", "rules", CASES.name)
    assert p.returncode == 0 and "SUCCESS" in p.stdout, p.stdout + p.stderr


def test_every_alert_has_a_firing_and_a_silent_case_and_a_runbook_entry() -> None:
    assert alerts() == ALERTS
    cases = yaml.safe_load(CASES.read_text())["tests"]
    fires: set[str] = set()
    silent: set[str] = set()
    for t in cases:
        for a in t.get("alert_rule_test", []):
            (fires if a.get("exp_alerts") else silent).add(a["alertname"])
            # a firing case whose expected list leaves a series out proves that series silent too
            if a.get("exp_alerts") and len(t["input_series"]) > len(a["exp_alerts"]):
                silent.add(a["alertname"])
    assert fires == ALERTS and silent == ALERTS, (ALERTS - fires, ALERTS - silent)
    runbook = (ROOT / "docs/RUNBOOK.md").read_text()
    for a in ALERTS:
        assert f"## {a}" in runbook, a
        doc = yaml.safe_load(RULES.read_text())
        rule = next(r for g in doc["groups"] for r in g["rules"] if r.get("alert") == a)
        assert rule["annotations"]["runbook_url"] == f"docs/RUNBOOK.md#{a.lower()}"


def test_the_suite_catches_a_broken_rule(tmp_path: Path) -> None:
    """The cases are not vacuous: an overrun alert that also fires for drained drains fails them."""
    (tmp_path / "sco.rules.yml").write_text(RULES.read_text().replace('outcome=~"overrun|error"', 'outcome=~".+"'))
    shutil.copy(CASES, tmp_path / CASES.name)
    p = promtool("test", "rules", CASES.name, cwd=tmp_path)
    assert p.returncode != 0 and "ScoDrainOverrun" in p.stdout + p.stderr, p.stdout + p.stderr


def test_the_role_installs_the_rules_only_if_promtool_accepts_them(tmp_path: Path) -> None:
    """One playbook run (CI time): the rules installed where promtool passes them, then the same role with a
    validator that refuses (as promtool refuses a broken file) fails and installs nothing."""
    import os
    import sys

    def play(rules_dir: Path, promtool_cmd: str) -> str:
        return (
            "- hosts: localhost\n  gather_facts: false\n  vars:\n"
            f"    ansible_python_interpreter: {sys.executable}\n"
            "  roles:\n    - role: sco.orchestrator.monitoring\n"
            f"      monitoring_rules_dir: {rules_dir}\n      monitoring_promtool: {promtool_cmd}\n"
            f'      monitoring_rules_owner: "{os.getuid()}"\n      monitoring_rules_group: "{os.getgid()}"\n'
            # the rules and the scrape file only (test_metrics_deployed renders node_exporter's and Prometheus's)
            "      monitoring_node_exporter_enabled: false\n      monitoring_prometheus_enabled: false\n"
            f"      monitoring_manage_packages: false\n      monitoring_scrape_file: {rules_dir}.scrape.yml\n"
        )

    book = tmp_path / "play.yml"
    book.write_text(play(tmp_path / "rules", PROMTOOL) + play(tmp_path / "refused", "/bin/false"))
    env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(ROOT / "collections"), "ANSIBLE_NOCOLOR": "1"}
    r = subprocess.run(
        [str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,", "-c", "local", str(book)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert (tmp_path / "rules/sco.rules.yml").read_text() == RULES.read_text(), r.stdout[-3000:]
    assert r.returncode != 0 and "failed to validate" in r.stdout, r.stdout[-3000:]
    assert not (tmp_path / "refused/sco.rules.yml").exists()
