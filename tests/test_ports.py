"""Listener ports for tests and dev clusters come from outside the kernel's ephemeral range (which every outgoing
connection's source port is taken from), are free when handed out, and are never handed out twice by a process."""

from __future__ import annotations

import socket

import pytest

from sco_devkit import ports


def test_ports_are_free_distinct_and_below_the_ephemeral_range() -> None:
    ephemeral = ports._ephemeral()
    got = ports.free_ports(200)
    assert len(set(got)) == 200
    assert not [p for p in got if p in ephemeral]
    for p in got[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free when handed out


def test_a_port_someone_listens_on_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("0.0.0.0", ports.free_port()))
        held.listen()
        taken = held.getsockname()[1]
        draws = iter([taken, taken + 1])
        monkeypatch.setattr(ports._rng, "randrange", lambda lo, hi: next(draws))
        assert ports.free_port() == taken + 1  # the listener's port drawn first, and passed over
