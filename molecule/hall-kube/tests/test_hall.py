"""What a converged Kubernetes hall does (molecule scenario hall-kube): checked on the test hosts over SSH (testinfra)
and with real clients from inside the relay host's network namespace. Without systemd as PID 1 the units cannot be
started, so each check runs the unit's own command lines."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import testinfra

SCENARIO = "hall-kube"
WORK = Path("/var/tmp/sco-molecule") / SCENARIO
INVENTORY = Path(__file__).resolve().parents[1] / "inventory" / "hosts.yml"
SHARED = Path(__file__).resolve().parents[2] / "shared"
NODES = ["spot-k1", "spot-k2"]
HARDENING = [
    "NoNewPrivileges=yes",
    "ProtectSystem=strict",
    "ProtectHome=yes",
    "PrivateTmp=yes",
    "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6",
    "SystemCallFilter=@system-service",
]


def get(name: str) -> Any:
    return testinfra.get_host(f"ansible://{name}", ansible_inventory=str(INVENTORY))


def in_netns(host: str, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", "netns", "exec", f"scom-{SCENARIO}-{host}", *argv], capture_output=True, text=True, timeout=timeout
    )


def unit_checks(h: Any, unit: str, extra: list[str]) -> None:
    text = h.file(f"/etc/systemd/system/{unit}").content_string
    for line in HARDENING + extra:
        assert line in text.splitlines() or any(ln.startswith(line) for ln in text.splitlines()), (unit, line)
    link = h.file(f"/etc/systemd/system/multi-user.target.wants/{unit}")
    assert link.is_symlink and link.linked_to == f"/etc/systemd/system/{unit}"
    assert h.run(f"systemctl is-enabled {unit}").stdout.strip() == "enabled"


@pytest.mark.parametrize("node", NODES)
def test_agent_unit_enabled_and_hardened(node: str) -> None:
    h = get(node)
    unit_checks(h, "sco-agent.service", ["MemoryMax=64M", "CPUQuota=20%", "CapabilityBoundingSet=CAP_KILL"])
    dropin = h.file("/etc/systemd/system/sco-agent.service.d/10-ansible.conf").content_string
    assert "ExecStart=/opt/sco/bin/sco-agent run --config /etc/sco/agent.toml" in dropin


@pytest.mark.parametrize("node", NODES)
def test_agent_config_passes_check_config_with_the_nodes_own_credentials(node: str) -> None:
    h = get(node)
    out = h.run("/opt/sco/bin/sco-agent check-config --config /etc/sco/agent.toml")
    assert out.rc == 0, out.stderr
    assert f"node {node}, hall local, kubernetes" in out.stdout
    cfg = h.file("/etc/sco/agent.toml")
    assert cfg.mode == 0o640
    password = (WORK / "credentials" / "nats" / f"node-{node}").read_text().strip()
    # the node's own relay identity: the one the relay's allow-lists (test below) were written for
    for line in ('nats_url = "nats://127.0.0.1:4222"', f'nats_user = "node-{node}"', f'nats_password = "{password}"'):
        assert line in cfg.content_string.splitlines(), line
    pkgs = h.run("/opt/sco/bin/python -m pip list --format=freeze").stdout
    assert "spot-capacity-orchestrator==0.1.0" in pkgs


@pytest.mark.parametrize("node", NODES)
def test_a_bundle_signed_by_a_removed_key_is_refused(node: str) -> None:
    """prepare.yml left retired.pub trusted, as a previous run would have; site.yml's list has only hall.pub."""
    h = get(node)
    assert h.run("ls /etc/sco/trusted").stdout.split() == ["hall.pub"]
    root = WORK / "hosts" / node / "root"
    repo = Path(__file__).resolve().parents[3] / "src" / "sco" / "samples" / "local"
    for name, key in (("by-retired", WORK / "retired" / "retired.key"), ("by-hall", WORK / "keys" / "hall.key")):
        subprocess.run(
            [sys.executable, "-m", "sco.cli", "contract", "compile", str(repo), "-o", str(root / f"{name}.json"),
             "--signing-key", str(key), "--issued-at", "1"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
    refused = h.run("/opt/sco/bin/sco contract verify /root/by-retired.json --trust-dir /etc/sco/trusted")
    assert refused.rc == 3, refused.stderr
    accepted = h.run("/opt/sco/bin/sco contract verify /root/by-hall.json --trust-dir /etc/sco/trusted")
    assert accepted.rc == 0, accepted.stderr


def test_relay_unit_and_config() -> None:
    h = get("relay")
    unit_checks(h, "sco-nats.service", ["User=sco-nats", "CapabilityBoundingSet="])
    checked = h.run("/usr/local/bin/nats-server -t -c /etc/sco-nats/nats-server.conf")
    assert checked.rc == 0, checked.stderr
    conf = h.file("/etc/sco-nats/nats-server.conf")
    assert conf.mode == 0o640 and conf.group == "sco-nats"
    assert h.file("/etc/sco-nats/admin.password").mode == 0o600


@pytest.fixture(scope="module")
def relay_running() -> Any:
    """nats-server started as the unit would (its user, its config), then the unit's ExecStartPost."""
    h = get("relay")
    h.run("pkill -x nats-server || true")
    started = h.run(
        "setsid runuser -u sco-nats -- /usr/local/bin/nats-server -c /etc/sco-nats/nats-server.conf "
        "> /var/log/sco-nats.log 2>&1 < /dev/null & echo started"
    )
    assert started.rc == 0, started.stderr
    unit = h.file("/etc/systemd/system/sco-nats.service").content_string
    post = next(ln for ln in unit.splitlines() if ln.startswith("ExecStartPost=+")).removeprefix("ExecStartPost=+")
    yield h, post
    h.run("pkill -x nats-server || true")


def test_relay_creates_the_event_stream_once(relay_running: Any) -> None:
    h, post = relay_running
    first = h.run(post)
    assert first.rc == 0, first.stderr + h.run("cat /var/log/sco-nats.log").stdout
    assert json.loads(first.stdout) == {"stream": "SCO_EVENTS", "action": "created"}
    again = h.run(post)
    assert json.loads(again.stdout)["action"] == "unchanged"


def test_node_credentials_reach_only_the_nodes_own_subjects(relay_running: Any) -> None:
    h, post = relay_running
    assert h.run(post).rc == 0  # the stream exists whatever ran first
    probe = in_netns(
        "relay", sys.executable, str(SHARED / "natsprobe.py"), "--credentials", str(WORK / "credentials" / "nats"),
        "--hall", "local", "--node", "spot-k1", "--other", "spot-k2",
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr
    r = json.loads(probe.stdout)

    def refused(bucket: str, what: str, subject: str) -> bool:
        return any(f'permissions violation for {what} to "{subject}"' in e.lower() for e in r[bucket])

    assert r["node_subscribes_own_notices"] == [], r
    assert refused("node_subscribes_other_notices", "subscription", "sco.notice.local.spot-k2"), r
    assert refused("node_subscribes_all_notices", "subscription", "sco.notice.local.>"), r
    assert refused("node_publishes_notice", "publish", "sco.notice.local.spot-k2"), r
    assert refused("node_subscribes_all_inboxes", "subscription", "_INBOX.>"), r
    assert r["reclaimer_publishes_notice"] == [] and r["node_received"] == '{"id": "probe"}', r
    assert refused("reader_publishes_notice", "publish", "sco.notice.local.spot-k1"), r
    assert r["node_publishes_own_event"]["stream"] == "SCO_EVENTS", r
    assert refused("node_publishes_other_event", "publish", "sco.events.local.spot-k2"), r


def test_distributor_publishes_and_serves_the_signed_bundle() -> None:
    h = get("relay")
    unit_checks(h, "sco-distributor.service", ["DynamicUser=yes"])
    verify = h.run(
        "/opt/sco/bin/sco contract verify /var/lib/sco/distributor/local/bundle.json --trust-dir "
        "/etc/sco/distributor-trusted"
    )
    assert verify.rc == 0, verify.stderr
    unit = h.file("/etc/systemd/system/sco-distributor.service").content_string
    serve = next(ln for ln in unit.splitlines() if ln.startswith("ExecStart=")).removeprefix("ExecStart=")
    assert "--listen 0.0.0.0:8470" in serve
    h.run(f"setsid {serve} > /var/log/sco-distributor.log 2>&1 < /dev/null &")
    url = "http://127.0.0.1:8470/v1/halls/local/bundle.json"
    fetch = (
        "import sys, urllib.request, urllib.error\n"
        "for i in range(50):\n"
        "    try:\n"
        f"        r = urllib.request.urlopen('{url}', timeout=2); break\n"
        "    except OSError:\n"
        "        import time; time.sleep(0.2)\n"
        "etag = r.headers['ETag']; body = r.read()\n"
        f"req = urllib.request.Request('{url}', headers={{'If-None-Match': etag}})\n"
        "try:\n"
        "    urllib.request.urlopen(req, timeout=2); print('no-304')\n"
        "except urllib.error.HTTPError as e:\n"
        "    print(r.status, len(body), e.code)\n"
    )
    try:
        out = in_netns("relay", sys.executable, "-c", fetch)
        published = (WORK / "hosts" / "relay" / "var/lib/sco/distributor/local/bundle.json").read_bytes()
        assert out.stdout.split() == ["200", str(len(published)), "304"], out.stderr
    finally:
        h.run("pkill -f 'sco contract serve' || true")
    time.sleep(0.1)
