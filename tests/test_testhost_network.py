"""The private network of a molecule scenario's test hosts (molecule/shared/hosts.py create --network,
tests.testhosts.TestNetwork): hosts reach each other by name over it, hosts made without it keep only their
loopback, and destroy removes the bridge and the veths, also after a run that died before it could say which hosts
it made. Real network namespaces, real sshd hosts (needs root, as every test host does)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "molecule" / "shared"))
import hosts  # molecule/shared/hosts.py

from tests.testhosts import network_prefix


def _netns() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [ln.split()[0] for ln in out.splitlines() if ln.strip()]


def _links(ns: str | None = None) -> list[str]:
    argv = ["ip", "-o", "link", "show"] if ns is None else ["ip", "-n", ns, "-o", "link", "show"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return [ln.split(":")[1].strip().split("@")[0] for ln in out.splitlines()]


@pytest.fixture
def scenario() -> Iterator[str]:
    name = f"nettest{os.getpid()}"
    yield name
    hosts.destroy(name)


def test_hosts_on_a_scenario_network_reach_each_other_by_name(
    scenario: str, capsys: pytest.CaptureFixture[str]
) -> None:
    root_links = _links()
    hosts.create(scenario, ["h1", "h2", "h3"], network=True)
    said = json.loads(capsys.readouterr().out.splitlines()[-1])
    want = hosts.addresses(scenario, ["h1", "h2", "h3"])
    prefix = network_prefix(scenario)
    assert want == {"h1": f"{prefix}.11", "h2": f"{prefix}.12", "h3": f"{prefix}.13"}
    assert said["network"] == {"namespace": f"scomnet-{scenario}", "addresses": want}
    # nothing of it in the machine's own namespace
    assert _links() == root_links
    for name, other in (("h1", "h2"), ("h2", "h3"), ("h3", "h1")):
        h = hosts.test_host(scenario, name)
        got = h.ssh("ping", "-c", "1", "-W", "2", other, check=False)
        assert got.returncode == 0 and f"({want[other]})" in got.stdout, got.stdout + got.stderr
        own = h.ssh("ip", "-4", "-o", "addr", "show", "eth0").stdout
        assert f"inet {want[name]}/24" in own
        resolved = h.ssh("getent", "hosts", other).stdout.split()
        assert resolved == [want[other], other]
    # a real service over it: sshd answers on its loopback only, so listen on the address and connect by name
    h1, h2 = hosts.test_host(scenario, "h1"), hosts.test_host(scenario, "h2")
    server = subprocess.Popen(
        ["ip", "netns", "exec", h2.ns, "socat", "-u", f"TCP-LISTEN:7000,bind={want['h2']}", "STDOUT"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        sent = h1.ssh(f"python3 -c {shlex.quote(_SEND)} h2 7000")  # one string: ssh hands it to a shell
        assert sent.returncode == 0, sent.stderr
        assert server.communicate(timeout=10)[0] == "over the scenario's network\n"
    finally:
        server.kill()


_SEND = """
import socket, sys, time
for _ in range(50):
    try:
        s = socket.create_connection((sys.argv[1], int(sys.argv[2])), 2); break
    except OSError:
        time.sleep(0.1)
s.sendall(b"over the scenario's network\\n"); s.close()
"""


def test_hosts_without_a_network_keep_only_their_loopback(scenario: str) -> None:
    hosts.create(scenario, ["solo"])
    h = hosts.test_host(scenario, "solo")
    assert _links(h.ns) == ["lo"]
    assert f"scomnet-{scenario}" not in _netns()
    assert "sco test network" not in (h.root / "etc" / "hosts").read_text()


def test_destroy_removes_the_network_after_a_run_that_died(scenario: str) -> None:
    hosts.create(scenario, ["d1", "d2"], network=True)
    assert f"scomnet-{scenario}" in _netns()
    # a run killed before it could say which hosts it made
    (hosts.scenario_dir(scenario) / "hosts.json").unlink()
    hosts.destroy(scenario)
    left = [ns for ns in _netns() if scenario in ns]
    assert left == []
    assert not [ln for ln in _links() if ln.startswith("v") and scenario in ln]
    # and destroy again, with nothing there, is no error
    hosts.destroy(scenario)


def test_hosts_get_the_addresses_a_static_inventory_names(scenario: str) -> None:
    """create.yml passes NAME=ADDRESS (the inventory's ansible_host): Ansible's groups['all'] has no fixed order,
    so an address by position would put one host's services on another's address."""
    prefix = network_prefix(scenario)
    hosts.create(scenario, [f"g1={prefix}.201", "g2"], network=True)
    for name, want in (("g1", f"{prefix}.201"), ("g2", f"{prefix}.12")):
        own = hosts.test_host(scenario, name).ssh("ip", "-4", "-o", "addr", "show", "eth0").stdout
        assert f"inet {want}/24" in own, own
    got = hosts.test_host(scenario, "g2").ssh("ping", "-c", "1", "-W", "2", "g1", check=False)
    assert got.returncode == 0 and f"({prefix}.201)" in got.stdout, got.stdout + got.stderr


def test_an_address_outside_the_network_is_refused(scenario: str) -> None:
    with pytest.raises(ValueError, match=r"192\.0\.2\.7 is not a free address of 10\.231\."):
        hosts.create(scenario, ["b1=192.0.2.7"], network=True)
    with pytest.raises(SystemExit, match="NAME=ADDRESS needs --network"):
        hosts.create(scenario, [f"b1={network_prefix(scenario)}.20"])
