"""The ``sco`` command as a platform engineer runs it: real processes, exit codes, one line per problem."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import SAMPLE, contract_yaml

SCO = [sys.executable, "-m", "sco.cli"]


def sco(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SCO, *map(str, args)], capture_output=True, text=True, timeout=60, env=env)


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    d = tmp_path / "keys"
    assert sco("keygen", "--out-dir", d, "--name", "old").returncode == 0
    assert sco("keygen", "--out-dir", d, "--name", "new").returncode == 0
    return d


def no_traceback(p: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in p.stderr, p.stderr


def test_compile_verify_show(tmp_path: Path, keys: Path) -> None:
    b = tmp_path / "bundle.json"
    p = sco("contract", "compile", SAMPLE, "-o", b, "--signing-key", keys / "old.key", "--issued-at", "1700000000")
    assert p.returncode == 0, p.stderr
    assert "serial 1: 8 contracts" in p.stdout
    first = b.read_bytes()
    p = sco("contract", "compile", SAMPLE, "-o", b, "--signing-key", keys / "old.key", "--issued-at", "1700000000")
    assert "serial 1" in p.stdout and "(unchanged)" in p.stdout and b.read_bytes() == first
    p = sco("contract", "verify", b, "--trust", keys / "old.pub")
    assert p.returncode == 0 and "ok: hall local serial 1" in p.stdout
    p = sco("contract", "show", b, "--trust", keys / "old.pub")
    assert "genomics-align" in p.stdout and "account=genomics" in p.stdout
    p = sco("contract", "show", b, "--trust", keys / "old.pub", "--contract", "etl-nightly")
    assert '"decommission": true' in p.stdout


def test_tampered_untrusted_rolled_back_and_infeasible_fail_clearly(tmp_path: Path, keys: Path) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(SAMPLE, repo)
    b1, b2 = tmp_path / "b1.json", tmp_path / "b2.json"
    assert sco("contract", "compile", repo, "-o", b1, "--signing-key", keys / "old.key").returncode == 0
    (repo / "contracts" / "more.yaml").write_text(contract_yaml("more"))
    p = sco("contract", "compile", repo, "-o", b2, "--previous", b1, "--signing-key", keys / "old.key")
    assert p.returncode == 0 and "serial 2" in p.stdout

    tampered = tmp_path / "t.json"
    tampered.write_bytes(b1.read_bytes().replace(b'"drainBudgetSeconds":60', b'"drainBudgetSeconds":99', 1))
    p = sco("contract", "verify", tampered, "--trust", keys / "old.pub")
    assert p.returncode == 3 and p.stderr.count("\n") == 1 and "payloadSha256: does not match the payload" in p.stderr
    no_traceback(p)

    p = sco("contract", "verify", b1, "--trust", keys / "new.pub")
    assert p.returncode == 3 and "none of which is trusted" in p.stderr
    no_traceback(p)

    p = sco("contract", "verify", b1, "--trust", keys / "old.pub", "--cached", b2)
    assert p.returncode == 3 and "serial 1 is lower than the cached serial 2 (rollback)" in p.stderr
    no_traceback(p)

    (repo / "contracts" / "more.yaml").write_text(contract_yaml("more", drainBudgetSeconds="200"))
    (repo / "contracts" / "worse.yaml").write_text(contract_yaml("worse", tier="0"))
    p = sco("contract", "compile", repo, "-o", tmp_path / "b3.json", "--signing-key", keys / "old.key")
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert lines == [
        "sco: error: contracts/worse.yaml: spec.tier: Input should be 1, 2 or 3",
    ]  # shape errors first; feasibility is checked once every file is valid
    (repo / "contracts" / "worse.yaml").unlink()
    p = sco("contract", "compile", repo, "-o", tmp_path / "b3.json", "--signing-key", keys / "old.key")
    assert p.returncode == 2 and "contracts/more.yaml: spec.drainBudgetSeconds: drain budget 200 s" in p.stderr
    assert not (tmp_path / "b3.json").exists()
    no_traceback(p)


def test_rotation_with_two_signing_keys(tmp_path: Path, keys: Path) -> None:
    b = tmp_path / "b.json"
    p = sco(
        "contract",
        "compile",
        SAMPLE,
        "-o",
        b,
        "--signing-key",
        keys / "old.key",
        "--signing-key",
        keys / "new.key",
    )
    assert p.returncode == 0
    for pub in ("old.pub", "new.pub"):
        assert sco("contract", "verify", b, "--trust", keys / pub).returncode == 0


def test_bad_inputs(tmp_path: Path, keys: Path) -> None:
    p = sco("contract", "verify", tmp_path / "missing.json", "--trust", keys / "old.pub")
    assert p.returncode != 0 and "missing.json" in p.stderr
    no_traceback(p)
    p = sco("contract", "verify", tmp_path / "missing.json")
    assert p.returncode != 0 and "no trusted key" in p.stderr
    p = sco("contract", "compile", tmp_path / "nope", "-o", tmp_path / "b.json", "--signing-key", keys / "old.key")
    assert p.returncode == 2 and "nope: not a directory" in p.stderr
    p = sco("contract", "compile", SAMPLE, "-o", tmp_path / "b.json", "--signing-key", keys / "old.pub")
    assert p.returncode == 4 and "type: expected 'ed25519-private'" in p.stderr
    no_traceback(p)


def test_user_data_and_node_fetch(tmp_path: Path, keys: Path) -> None:
    b = tmp_path / "b.json"
    sco("contract", "compile", SAMPLE, "-o", b, "--signing-key", keys / "old.key")
    ud = tmp_path / "ud.yaml"
    p = sco(
        "contract",
        "user-data",
        b,
        "--trust",
        keys / "old.pub",
        "--signing-key",
        keys / "old.key",
        "--scheduler",
        "kubernetes",
        "--distributor-url",
        "http://127.0.0.1:8470",
        "-o",
        ud,
    )
    assert p.returncode == 0, p.stderr
    assert "SCO_AGENT_BUNDLE_URL=http://127.0.0.1:8470/v1/halls/local/bundle.json" in ud.read_text()
    assert "SCO_AGENT_HALL=local" in ud.read_text()
    p = sco(
        "contract",
        "user-data",
        b,
        "--trust",
        keys / "old.pub",
        "--signing-key",
        keys / "old.key",
        "--contract",
        "nope",
    )
    assert p.returncode == 3 and "contracts not in bundle serial 1: nope" in p.stderr

    root = tmp_path / "root"
    assert sco("contract", "publish", b, "--root", root, "--trust", keys / "old.pub").returncode == 0
    srv = subprocess.Popen(
        [*SCO, "contract", "serve", "--root", str(root), "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert srv.stdout is not None
        line = srv.stdout.readline()
        url = line.split(" at ", 1)[1].split("/v1/")[0] + "/v1/halls/local/bundle.json"
        cache = tmp_path / "cache"
        p = sco("node", "fetch-bundle", "--url", url, "--cache-dir", cache, "--trust", keys / "old.pub")
        assert p.returncode == 0 and '"outcome": "accepted"' in p.stdout
        p = sco("node", "bundle-status", "--cache-dir", cache, "--trust", keys / "old.pub")
        assert p.returncode == 0 and '"serial": 1' in p.stdout
        # the README's exit codes: a bundle refused (untrusted signer) is 3, a fetch that fails is 6
        p = sco("node", "fetch-bundle", "--url", url, "--cache-dir", tmp_path / "c2", "--trust", keys / "new.pub")
        assert p.returncode == 3 and '"outcome": "refused"' in p.stdout and "refused" in p.stderr, (p.stdout, p.stderr)
        p = sco("node", "fetch-bundle", "--url", url + ".missing", "--cache-dir", cache, "--trust", keys / "old.pub")
        assert p.returncode == 6 and '"outcome": "error"' in p.stdout and "HTTP 404" in p.stderr, (p.stdout, p.stderr)
    finally:
        srv.terminate()
        srv.wait(10)


def test_demo_runs() -> None:
    p = sco("demo")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "node.tainted" in p.stdout and "drain.drained" in p.stdout
    assert "node: refused" in p.stdout and p.stdout.rstrip().endswith("before the deadline: ok")
    # issue 8: the demo creates the events stream and the events reach it; an unsigned notice is refused
    assert "spooled events in JetStream stream SCO_EVENTS" in p.stdout
    assert "an unsigned notice from anyone on the relay: refused (unsigned)" in p.stdout


def test_io_errors_are_one_line_not_a_traceback(tmp_path: Path, keys: Path) -> None:
    """Found by review: an output path that cannot be written, a key dir that is a file, a closed stdout."""
    p = sco("contract", "compile", SAMPLE, "-o", tmp_path / "nonexist" / "b.json", "--signing-key", keys / "old.key")
    assert p.returncode != 0 and "nonexist" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    no_traceback(p)
    p = sco("contract", "compile", SAMPLE, "-o", tmp_path, "--signing-key", keys / "old.key")
    assert p.returncode != 0 and str(tmp_path) in p.stderr
    no_traceback(p)
    (tmp_path / "afile").write_text("x")
    p = sco("keygen", "--out-dir", tmp_path / "afile", "--name", "x")
    assert p.returncode != 0 and "afile" in p.stderr
    no_traceback(p)
    b = tmp_path / "b.json"
    assert sco("contract", "compile", SAMPLE, "-o", b, "--signing-key", keys / "old.key").returncode == 0
    shown = subprocess.run(
        f"{' '.join(SCO)} contract show {b} --trust {keys / 'old.pub'} | head -1",
        shell=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "Traceback" not in shown.stderr and "BrokenPipe" not in shown.stderr, shown.stderr
