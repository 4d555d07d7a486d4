"""What a converged HA hall does (molecule scenario hall-ha): the hosts reach each other over the scenario's private
network by name, the checks every hall shares (molecule/shared/verify.py) on its nodes, relays and distributors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "shared"))
import hosts  # molecule/shared/hosts.py
import verify  # molecule/shared/verify.py

SC = verify.Scenario("hall-ha")
HALL = "hall-ha"
INFRA = ["ha-infra1", "ha-infra2", "ha-infra3"]
CONTROL = ["ha-ctl1", "ha-ctl2"]
NODES = ["ha-node1", "ha-node2"]
HOSTS = INFRA + CONTROL + NODES
ADDRESS = {h: v["ansible_host"] for h, v in yaml.safe_load(SC.inventory.read_text())["all"]["hosts"].items()}
# every relay of the cluster, so an agent fails over when one goes
RELAYS = ",".join(f"nats://{h}:4222" for h in INFRA)


@pytest.mark.parametrize("host", HOSTS)
def test_each_host_has_the_address_the_inventory_names(host: str) -> None:
    """create.yml gave each host its inventory address (the roles route relays and Patroni members to it)."""
    got = SC.host(host).run("ip -4 -o addr show eth0").stdout.split()
    assert got[got.index("inet") + 1] == f"{ADDRESS[host]}/24"
    assert ADDRESS[host].startswith(hosts.network_prefix(HALL) + ".")


@pytest.mark.parametrize("host", HOSTS)
def test_every_host_reaches_every_other_by_name(host: str) -> None:
    others = [h for h in HOSTS if h != host]
    got = SC.host(host).run(f"for h in {' '.join(others)}; do ping -c 1 -W 2 -q $h >/dev/null || echo $h; done")
    assert got.rc == 0 and got.stdout.split() == [], got.stdout + got.stderr


@pytest.mark.parametrize("node", NODES)
def test_agent_unit_enabled_and_hardened(node: str) -> None:
    verify.check_agent_unit(SC.host(node))


@pytest.mark.parametrize("node", NODES)
def test_agent_config_passes_check_config_with_the_nodes_own_credentials(node: str) -> None:
    verify.check_agent_config(SC, SC.host(node), node, HALL, "kubernetes", RELAYS)


@pytest.mark.parametrize("node", NODES)
def test_a_bundle_signed_by_a_removed_key_is_refused(node: str) -> None:
    verify.check_removed_key_refused(SC, SC.host(node), node)


@pytest.mark.parametrize("relay", INFRA)
def test_relay_unit_and_config(relay: str) -> None:
    verify.check_relay_unit_and_config(SC.host(relay), verify.operator_mode(SC))


@pytest.mark.parametrize("host", CONTROL)
def test_distributor_publishes_and_serves_the_signed_bundle(host: str) -> None:
    verify.check_distributor_serves_the_signed_bundle(SC, host, HALL)
