"""The control loop as a deployment lays it out: role control_loop applied through ansible-runner into a test
directory (its unit's ExecStart and environment read back, checked by systemd-analyze), and one run of that
command with its summary line parsed."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


BIN = Path(sys.executable).parent


CONTRACTS = """apiVersion: sco.dev/v1
kind: WorkloadContract
metadata: {name: web}
spec:
  scheduler: kubernetes
  selector: {namespace: web}
  tier: 3
  drainBudgetSeconds: 6
  finalWriteSeconds: 2
  checkpoint: {mode: none}
  requeue: {policy: always}
  fallback: {onDemand: true, spendCapPerHour: "4.00"}
---
apiVersion: sco.dev/v1
kind: WorkloadContract
metadata: {name: guarded}
spec:
  scheduler: kubernetes
  selector: {namespace: guarded}
  tier: 2
  drainBudgetSeconds: 3
  checkpoint: {mode: none}
  requeue: {policy: always}
---
apiVersion: sco.dev/v1
kind: WorkloadContract
metadata: {name: genomics-ckpt}
spec:
  scheduler: slurm
  selector: {account: genomics, partitions: [spot]}
  tier: 3
  drainBudgetSeconds: 6
  finalWriteSeconds: 2
  checkpoint: {mode: signal, signal: USR1, ackSocket: false}
  requeue: {policy: always}
---
apiVersion: sco.dev/v1
kind: WorkloadContract
metadata: {name: climate-sims}
spec:
  scheduler: slurm
  selector: {account: climate}
  tier: 2
  drainBudgetSeconds: 4
  checkpoint: {mode: signal, signal: USR1}
  requeue: {policy: on-checkpoint}
"""


ROLE_PLAY = """
- name: Lay out the control loop
  hosts: localhost
  connection: local
  gather_facts: false
  roles:
    - role: sco.orchestrator.control_loop
"""


def lay_out(tmp: Path, extravars: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """Apply the role (as a deployment would) and return the unit's ExecStart argv and its environment."""
    import ansible_runner

    pdd = tmp / "deploy"
    (pdd / "project").mkdir(parents=True)
    (tmp / "units").mkdir()  # /etc/systemd/system on a real host
    (pdd / "project" / "play.yml").write_text(ROLE_PLAY)
    r = ansible_runner.run(
        private_data_dir=str(pdd),
        playbook="play.yml",
        # the ConfigMap publisher is tested on its own (test_configmap_unit)
        # sco_hall: what site.yml always has (role hall's defaults, which the role depends on, are made from it)
        extravars={
            "control_loop_configmap_enabled": False,
            "sco_hall": extravars.get("control_loop_hall", "local"),
            **extravars,
            "ansible_python_interpreter": sys.executable,
        },
        envvars={"ANSIBLE_COLLECTIONS_PATH": str(ROOT / "collections"), "PATH": f"{BIN}:{os.environ['PATH']}"},
        quiet=True,
    )
    assert r.rc == 0, r.stdout.read()
    unit = (tmp / "units" / "sco-control-loop.service").read_text()
    exec_start = next(line.split("=", 1)[1] for line in unit.splitlines() if line.startswith("ExecStart="))
    env_file = next(line.split("=", 1)[1] for line in unit.splitlines() if line.startswith("EnvironmentFile="))
    env = dict(line.split("=", 1) for line in Path(env_file).read_text().splitlines() if "=" in line)
    timer = (tmp / "units" / "sco-control-loop.timer").read_text()
    assert "OnUnitInactiveSec=2min" in timer
    # systemd-analyze verify exits 0 even for a bad unit: what it says is the verdict
    v = subprocess.run(
        ["systemd-analyze", "verify", "./sco-control-loop.service", "./sco-control-loop.timer"],
        cwd=tmp / "units",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert v.stderr.strip() == "", v.stderr
    return shlex.split(exec_start), env


def run_loop(argv: list[str], env: dict[str, str]) -> tuple[int, dict[str, Any], str]:
    p = subprocess.run(argv, capture_output=True, text=True, timeout=600, env={**os.environ, **env})
    summary: dict[str, Any] = {}
    for line in p.stdout.splitlines():
        if line.startswith('{"control_loop_summary"'):
            summary = json.loads(line)["control_loop_summary"]
    return p.returncode, summary, p.stdout + p.stderr
