"""What a converged Kubernetes hall does (molecule scenario hall-a): the checks of molecule/shared/verify.py on
the relay host and both nodes, over SSH (testinfra) and with real clients from inside the relay's namespace."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "shared"))
import verify  # molecule/shared/verify.py

SC = verify.Scenario("hall-a")
NODES = ["spot-k1", "spot-k2"]


@pytest.mark.parametrize("node", NODES)
def test_agent_unit_enabled_and_hardened(node: str) -> None:
    verify.check_agent_unit(SC.host(node))


@pytest.mark.parametrize("node", NODES)
def test_agent_config_passes_check_config_with_the_nodes_own_credentials(node: str) -> None:
    verify.check_agent_config(SC, SC.host(node), node, "hall-a", "kubernetes", "nats://127.0.0.1:4222")


@pytest.mark.parametrize("node", NODES)
def test_a_bundle_signed_by_a_removed_key_is_refused(node: str) -> None:
    verify.check_removed_key_refused(SC, SC.host(node), node)


def test_relay_unit_and_config() -> None:
    verify.check_relay_unit_and_config(SC.host("relay"), verify.operator_mode(SC))


@pytest.fixture(scope="module")
def relay_post() -> Iterator[str]:
    with verify.relay_running(SC.host("relay")) as post:
        yield post


def test_relay_creates_the_event_stream_once(relay_post: str) -> None:
    verify.check_stream_created_once(SC.host("relay"), relay_post)


def test_node_credentials_reach_only_the_nodes_own_subjects(relay_post: str) -> None:
    assert SC.host("relay").run(relay_post).rc == 0  # the stream exists whatever ran first
    verify.check_node_credentials_reach_only_their_own_subjects(SC, "relay", "hall-a", "spot-k1", "spot-k2")


def test_distributor_publishes_and_serves_the_signed_bundle() -> None:
    verify.check_distributor_serves_the_signed_bundle(SC, "relay", "hall-a")
