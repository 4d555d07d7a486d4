"""The local hall's inventory (the embedded hall of `make demo`) against what the demo actually runs: the fleet
state the site playbook points at is the embedded PostgreSQL that `sco db migrate --embedded` starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sco.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def local_var(name: str) -> str:
    """A variable as the site playbook resolves it for the local hall's host (inventory + playbook group_vars)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env["PATH"] = f"{BIN}:{env['PATH']}"
    out = subprocess.run(
        [str(BIN / "ansible"), "-i", "inventories/local", "--playbook-dir", "playbooks", "-m", "debug", "-a",
         f"var={name}", "-o", "localhost"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return str(json.loads(out.stdout.split("=>", 1)[1])[name])


def test_fleet_state_is_the_demos_embedded_postgresql() -> None:
    embedded = build_parser().parse_args(["db", "migrate", "--embedded", "/nonexistent"])
    assert local_var("fleet_state_port") == str(embedded.port)
    # the embedded server listens on 127.0.0.1 only (not ::1, which `localhost` may resolve to first)
    assert local_var("fleet_state_host") == "127.0.0.1"
