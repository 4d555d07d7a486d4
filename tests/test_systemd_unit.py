"""The agent's systemd unit: valid for systemd-analyze, notify-type with a watchdog, limits and hardening."""

from __future__ import annotations

import configparser
import subprocess
from pathlib import Path

UNIT = Path(__file__).resolve().parents[1] / "agent" / "sco-agent.service"


def unit() -> configparser.ConfigParser:
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.optionxform = str  # type: ignore[assignment,method-assign]
    cp.read(UNIT)
    return cp


def test_unit_settings() -> None:
    s = unit()["Service"]
    assert s["Type"] == "notify" and s["Restart"] == "on-failure" and s["WatchdogSec"] == "30s"
    assert s["MemoryMax"] == "64M" and s["MemoryHigh"] == "40M"
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "RestrictSUIDSGID", "LockPersonality"):
        assert s[key] == "yes", key
    assert s["ProtectSystem"] == "strict" and s["ReadWritePaths"] == "/var/lib/sco"
    assert "kubelet.service" in unit()["Unit"]["Before"]


def test_runs_as_its_own_user_without_capabilities() -> None:
    """Not root, no capability (role node_agent's drop-in gives a Slurm node CAP_KILL), cgroups
    read-only, and no StateDirectory= (with User= systemd would chown the whole of /var/lib/sco, which holds the
    distributor's and the control loop's data on a small hall)."""
    s = unit()["Service"]
    assert s["User"] == "sco-agent" and s["Group"] == "sco-agent"
    assert s["CapabilityBoundingSet"] == "" and s["AmbientCapabilities"] == ""
    assert s["ProtectControlGroups"] == "yes"
    assert "StateDirectory" not in s and s["RuntimeDirectory"] == "sco"


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    # ExecStart must name an existing executable for verify; point it at a stand-in path in the copy.
    exe = tmp_path / "sco-agent"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    text = UNIT.read_text().replace("/usr/bin/sco-agent", str(exe))
    copy = tmp_path / "sco-agent.service"
    copy.write_text(text)
    p = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=60)
    # verify exits 0 even for a bad unit: judge by what it says about this file
    bad = [line for line in p.stderr.splitlines() if "sco-agent.service" in line]
    assert not bad, p.stderr
