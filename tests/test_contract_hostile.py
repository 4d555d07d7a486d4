"""The contract side under hostile input: absurd signed bundles (7), compiler hardening (7), notice keys in the hall
policy and the operator's commands (1), keygen and symlinks, the distributor's idle connections (8), and
``sco node bundle-status`` counting refused bundles (9)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from sco.agent.bundle_cache import BundleCache
from sco.contract.bundle import Bundle
from sco.contract.compiler import compile_repo
from sco.contract.signing import Keyring, PrivateKey, generate, sign, write_keypair
from sco.errors import BundleError, ContractError
from tests.conftest import SAMPLE, WriteFn, contract_yaml
from tests.harness import NatsServer, free_port, wait_for

SCO = [sys.executable, "-m", "sco.cli"]


def sco(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SCO, *map(str, args)], capture_output=True, text=True, timeout=60)


def problems(repo: Path) -> list[str]:
    with pytest.raises(ContractError) as e:
        compile_repo(repo)
    return e.value.lines()


# --- 7. a signed but absurd bundle -------------------------------------------------------------------------


def _mutate(payload: dict[str, Any], change: str) -> dict[str, Any]:
    p = json.loads(json.dumps(payload))
    c = p["contracts"][0]
    if change == "string budget":
        c["drainBudgetSeconds"] = "30"
    elif change == "negative budget":
        c["drainBudgetSeconds"] = -5
    elif change == "no selector":
        del c["selector"]
    elif change == "boolean tier":
        c["tier"] = True
    elif change == "zero poll":
        p["policy"]["metadataPollSeconds"] = 0
    elif change == "contracts not a list":
        p["contracts"] = {"a": 1}
    elif change == "bad notice key":
        p["policy"]["noticeKeys"] = [{"keyid": "00" * 8, "public": "11" * 32}]
    return p


CHANGES = {
    "string budget": "drainBudgetSeconds",
    "negative budget": "drainBudgetSeconds",
    "no selector": "selector",
    "boolean tier": "tier",
    "zero poll": "policy.metadataPollSeconds",
    "contracts not a list": "contracts",
    "bad notice key": "policy.noticeKeys[0]",
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_absurd_signed_bundle_is_refused_and_the_last_good_one_kept(
    tmp_path: Path, repo: Path, key: PrivateKey, change: str
) -> None:
    keyring = Keyring([key.public])
    good = compile_repo(repo, serial=1)
    cache = BundleCache(tmp_path / "cache", keyring)
    assert cache.offer(sign(good, [key])).outcome == "accepted"
    bad = sign(_mutate(compile_repo(repo, serial=2), change), [key])
    offer = cache.offer(bad)
    assert offer.outcome == "refused" and CHANGES[change] in offer.reason, offer.reason
    assert cache.bundle is not None and cache.bundle.serial == 1
    with pytest.raises(BundleError):
        Bundle.from_bytes(bad, keyring)
    # `sco contract verify` reports the same problem
    (tmp_path / "bad.json").write_bytes(bad)
    write_keypair(key, tmp_path / "k.key", tmp_path / "k.pub")
    p = sco("contract", "verify", tmp_path / "bad.json", "--trust", tmp_path / "k.pub")
    assert p.returncode == 3 and CHANGES[change] in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_a_directory_symlink_out_of_the_repository_is_refused(tmp_path: Path, repo: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "secret.yaml").write_text((SAMPLE / "hall.yaml").read_text())
    (repo / "contracts" / "more").symlink_to(outside, target_is_directory=True)
    (repo / "inside").symlink_to(repo / "contracts", target_is_directory=True)  # stays inside: fine, not twice
    with pytest.raises(ContractError) as e:
        compile_repo(repo)
    lines = e.value.lines()
    assert any("contracts/more" in x and "leaves the repository" in x for x in lines), lines
    assert len(lines) == 1, lines
    p = sco("contract", "check", repo)
    assert p.returncode == 13 and "contracts/more" in p.stderr and "leaves the repository" in p.stderr
    (repo / "loop-a").symlink_to(repo / "loop-b")  # a loop is named too, never a traceback
    (repo / "loop-b").symlink_to(repo / "loop-a")
    (repo / "dangling.yaml").symlink_to(tmp_path / "gone.yaml")
    p = sco("contract", "check", repo)
    assert p.returncode == 13 and "Traceback" not in p.stderr, p.stderr
    assert "loop-a: cannot read: a symlink loop" in p.stderr and "dangling.yaml: cannot read" in p.stderr, p.stderr


def test_compiler_refuses_duplicate_keys(repo: Path, write: WriteFn) -> None:
    text = contract_yaml("dup").replace(
        "  drainBudgetSeconds: 30\n", "  drainBudgetSeconds: 30\n  drainBudgetSeconds: 5\n"
    )
    write("contracts/dup.yaml", text)
    lines = problems(repo)
    assert any("contracts/dup.yaml" in line and "duplicate key 'drainBudgetSeconds'" in line for line in lines), lines


@pytest.mark.parametrize(
    ("field", "value"),
    [("drainBudgetSeconds", "true"), ("finalWriteSeconds", "false"), ("tier", "true"), ("drainBudgetSeconds", "30.5")],
)
def test_compiler_refuses_booleans_and_fractions_where_integers_are_meant(
    repo: Path, write: WriteFn, field: str, value: str
) -> None:
    write("contracts/b.yaml", contract_yaml("boolish", **{field: value}))
    assert any("contracts/b.yaml: spec." + field in line for line in problems(repo)), problems(repo)


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ("noticeWindowSeconds: 120", "noticeWindowSeconds: 999999"),
        ("metadataPollSeconds: 5", "metadataPollSeconds: 100000"),
        ("bundleRefreshSeconds: 60", "bundleRefreshSeconds: 1"),
        ("noticeWindowSeconds: 120", "noticeWindowSeconds: 3"),
    ],
)
def test_compiler_refuses_absurd_windows(repo: Path, line: str, field: str) -> None:
    hall = (repo / "hall.yaml").read_text()
    assert line in hall
    (repo / "hall.yaml").write_text(hall.replace(line, field))
    name = field.split(":")[0]
    assert any(f"hall.yaml: spec.{name}" in x for x in problems(repo)), problems(repo)


def test_compiler_refuses_oversized_files_and_symlinks_out_of_the_repository(
    tmp_path: Path, repo: Path, write: WriteFn
) -> None:
    write("contracts/big.yaml", contract_yaml("big") + "# " + "x" * (2 << 20) + "\n")
    outside = tmp_path / "outside.yaml"
    outside.write_text(contract_yaml("secret"))
    (repo / "contracts" / "link.yaml").symlink_to(outside)
    lines = problems(repo)
    assert any("contracts/big.yaml" in x and "bytes, more than" in x for x in lines), lines
    assert any("contracts/link.yaml" in x and "leaves the repository" in x for x in lines), lines


def test_notice_keys_in_the_hall_policy(repo: Path) -> None:
    from sco.contract.notice import notice_keyring

    k = generate()
    public = bytes(k.signing_key.verify_key).hex()
    hall = (repo / "hall.yaml").read_text()
    (repo / "hall.yaml").write_text(hall + f"  noticeKeys:\n    - {{keyid: '{k.keyid}', public: '{public}'}}\n")
    payload = compile_repo(repo)
    assert payload["policy"]["noticeKeys"] == [{"keyid": k.keyid, "public": public}]
    assert notice_keyring(payload["policy"]).keyids == [k.keyid]
    (repo / "hall.yaml").write_text(hall + f"  noticeKeys:\n    - {{keyid: '{'0' * 16}', public: '{public}'}}\n")
    assert any("keyid does not match" in x for x in problems(repo))


def test_keygen_for_notices_and_notice_send_dry_run(tmp_path: Path) -> None:
    from sco.contract.notice import verify_notice
    from sco.contract.signing import load_public

    p = sco("keygen", "--out-dir", tmp_path, "--name", "notice", "--for", "notice")
    assert p.returncode == 0 and "noticeKeys" in p.stdout, p.stderr
    pub = load_public(tmp_path / "notice.pub")
    assert f"keyid: '{pub.keyid}'" in p.stdout
    nowhere = f"nats://127.0.0.1:{free_port()}"
    p = sco(
        "notice", "send", "--hall", "h", "--node", "n-1", "--signing-key", tmp_path / "notice.key", "--nats", nowhere
    )
    assert p.returncode == 6 and "cannot connect" in p.stderr and "Traceback" not in p.stderr, p.stderr
    q = sco(
        "notice", "send", "--dry-run", "--hall", "h", "--node", "n-1", "--in", "90", "--id", "x",
        "--signing-key", tmp_path / "notice.key",
    )  # fmt: skip
    doc = verify_notice(q.stdout.strip().encode(), Keyring([pub]))
    assert doc["node"] == "n-1" and doc["id"] == "x" and 89 < doc["terminateAt"] - doc["issuedAt"] <= 90


def test_keygen_refuses_to_write_through_a_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    out = tmp_path / "keys"
    out.mkdir()
    (out / "k.pub").symlink_to(victim)
    p = sco("keygen", "--out-dir", out, "--name", "k")
    assert p.returncode == 4 and "symlink" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert victim.read_text() == "precious\n" and not (out / "k.key").exists()
    (out / "d.key").symlink_to(tmp_path / "dangling")
    assert sco("keygen", "--out-dir", out, "--name", "d").returncode == 4
    assert not (tmp_path / "dangling").exists()


# --- 8. the distributor bounds idle connections -------------------------------------------------------------


def test_distributor_bounds_idle_connections(tmp_path: Path) -> None:
    from sco.contract.distributor import DistributorServer

    srv = DistributorServer(tmp_path / "root", ("127.0.0.1", 0))
    srv.idle_timeout = 1.0
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    before = threading.active_count()
    socks = []
    try:
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", port))
            socks.append(s)
        time.sleep(0.5)
        assert threading.active_count() - before <= 256  # 300 idle connections do not take 300 threads
        # and idle ones are closed: their threads end, and a real request gets through again
        wait_for(lambda: threading.active_count() - before <= 2, 15, "idle connections closed")
        with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
            c.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert c.recv(100).startswith(b"HTTP/1.1 200")
    finally:
        for s in socks:
            s.close()
        srv.shutdown()
        srv.server_close()


# --- 9. bundle-status counts refused bundles, not refresh attempts --------------------------------------------


def test_bundle_status_counts_refused_bundles_not_attempts(tmp_path: Path, repo: Path, key: PrivateKey) -> None:
    keyring = Keyring([key.public])
    cache = BundleCache(tmp_path / "cache", keyring)
    assert cache.offer(sign(compile_repo(repo, serial=2), [key])).outcome == "accepted"
    old_a = sign(compile_repo(repo, serial=1), [key])  # a rollback
    forged_b = sign(compile_repo(repo, serial=3), [generate()])  # an untrusted signer
    for raw in (old_a, old_a, forged_b, old_a):  # refreshes: the same bad bundles seen again
        assert cache.offer(raw).outcome == "refused"
    assert cache.status()["refused"] == 2
    write_keypair(key, tmp_path / "k.key", tmp_path / "k.pub")
    p = sco("node", "bundle-status", "--cache-dir", tmp_path / "cache", "--trust", tmp_path / "k.pub")
    assert json.loads(p.stdout)["refused"] == 2


def test_events_create_stream_command(tmp_path: Path) -> None:
    import asyncio

    from tests.harness import stream_events

    srv = NatsServer(tmp_path / "nats").start()
    try:
        for word in ("created", "updated"):  # idempotent
            p = sco("events", "create-stream", "--nats", srv.url)
            assert p.returncode == 0 and word in p.stdout, p.stderr
        assert asyncio.run(stream_events(srv.url)) == []
    finally:
        srv.stop()
    assert os.path.exists(tmp_path / "nats")
