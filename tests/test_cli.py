"""The ``sco`` command as a platform engineer runs it: real processes, exit codes, one line per problem."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sco.contract.compiler import compile_repo
from sco.errors import ConfigError
from tests.cli_run import SCO, no_traceback, one_line_error, sco
from tests.conftest import SAMPLE, contract_yaml
from tests.harness import free_port


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    d = tmp_path / "keys"
    assert sco("keygen", "--out-dir", d, "--name", "old").returncode == 0
    assert sco("keygen", "--out-dir", d, "--name", "new").returncode == 0
    return d


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


@pytest.mark.parametrize("name", ["../evil", "sub/k", "/tmp/abs", "..", ".", "", "a\nb", "a\x00b"])
def test_keygen_name_must_be_a_plain_file_name(tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "keys"
    if "\x00" in name:  # argv cannot carry a NUL: ask the command's own entry point
        from sco.cli import main

        assert main(["keygen", "--out-dir", str(out), "--name", name]) == 5
        assert "--name" in capsys.readouterr().err
    else:
        one_line_error(sco("keygen", "--out-dir", out, "--name", name), 5, "--name")
    written = [x for x in tmp_path.rglob("*") if x.is_file()]
    assert written == [], written  # nothing outside --out-dir, nothing inside either


@pytest.mark.parametrize("name", ["a\x85b", "a\x9bb", "a\u2028b"])
def test_keygen_refuses_unprintable_names(tmp_path: Path, name: str) -> None:
    p = sco("keygen", "--out-dir", tmp_path, "--name", name)
    one_line_error(p, 5, "--name")
    assert "\x85" not in p.stderr and "\x9b" not in p.stderr and "\u2028" not in p.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "url",
    [
        "http://d:8470\nSCO_AGENT_NATS_URL=nats://evil:4222",
        "http://d:8470\rX=1",
        "http://d :8470",
        "http://d:8470/\tx",
        "ftp://d:8470",
        "d:8470",
        "http://",
    ],
)
def test_user_data_refuses_a_distributor_url_that_is_not_one_http_url(
    tmp_path: Path, signed: tuple[Path, Path, Path], url: str
) -> None:
    b, key, pub = signed
    out = tmp_path / "user-data.yaml"
    p = sco(
        "contract", "user-data", b, "--trust", pub, "--signing-key", key, "--distributor-url", url, "-o", out
    )  # fmt: skip
    one_line_error(p, 5, "--distributor-url")
    assert not out.exists()


def test_user_data_env_lines_carry_no_control_characters(signed: tuple[Path, Path, Path]) -> None:
    """The renderer refuses what would add lines to agent.env, whoever calls it (the acquire step too)."""
    from sco.contract.bundle import Bundle
    from sco.contract.signing import Keyring, load_private, load_public
    from sco.contract.userdata import render

    b, key, pub = signed
    bundle = Bundle.from_bytes(b.read_bytes(), Keyring([load_public(pub)]), str(b))
    k = load_private(key)
    ok = render(bundle, [k], [k.public], node_env={"SCO_AGENT_HALL": "local", "SCO_NODE": "spot-1"})
    assert "SCO_NODE=spot-1" in ok
    for env in ({"SCO_NODE": "a\nSCO_AGENT_NATS_URL=x"}, {"SCO NODE": "a"}, {"X=Y": "a"}, {"": "a"}):
        with pytest.raises(ConfigError) as e:
            render(bundle, [k], [k.public], node_env=env)
        assert "node environment" in str(e.value)


# ids fixed: a time-based id differs between pytest-xdist workers, which then refuse the collection
@pytest.mark.parametrize(
    "value", [str(10**15), str(int(time.time()) + 3 * 86400), "-1"], ids=["ms", "in-3-days", "negative"]
)
def test_compile_refuses_an_absurd_issued_at(tmp_path: Path, signed: tuple[Path, Path, Path], value: str) -> None:
    _b, key, _pub = signed
    out = tmp_path / "b2.json"
    p = sco("contract", "compile", SAMPLE, "-o", out, "--signing-key", key, "--issued-at", value)
    one_line_error(p, 5, "--issued-at", value)
    assert not out.exists()
    env = {**os.environ, "SOURCE_DATE_EPOCH": value}
    p = sco("contract", "compile", SAMPLE, "-o", out, "--signing-key", key, env=env)
    one_line_error(p, 5, "$SOURCE_DATE_EPOCH")
    # the collection's contract_bundle module calls compile_repo with its issued_at option
    with pytest.raises(ConfigError) as e:
        compile_repo(SAMPLE, issued_at=int(value))
    assert "issued_at" in str(e.value)


def test_serve_refuses_a_root_that_does_not_exist(tmp_path: Path) -> None:
    p = sco("contract", "serve", "--root", tmp_path / "nope", "--listen", "127.0.0.1:0", timeout=20)
    one_line_error(p, 5, "--root", str(tmp_path / "nope"))
    f = tmp_path / "a-file"
    f.write_text("x")
    p = sco("contract", "serve", "--root", f, "--listen", "127.0.0.1:0", timeout=20)
    one_line_error(p, 5, "--root", "not a directory")


def test_serve_refuses_an_empty_root(tmp_path: Path) -> None:
    p = sco("contract", "serve", "--root", "", "--listen", "127.0.0.1:0", timeout=20)
    one_line_error(p, 5, "--root")
    env = {**os.environ, "SCO_DISTRIBUTOR_ROOT": ""}
    p = sco("contract", "serve", "--listen", "127.0.0.1:0", env=env, timeout=20)
    one_line_error(p, 5, "--root", "SCO_DISTRIBUTOR_ROOT")


def test_nats_connect_refused_names_the_server_and_why(tmp_path: Path) -> None:
    nowhere = f"nats://127.0.0.1:{free_port()}"
    p = sco("events", "create-stream", "--nats", nowhere)
    one_line_error(p, 6, nowhere, "connection refused")
    assert "TimeoutError" not in p.stderr
    assert sco("keygen", "--out-dir", tmp_path, "--name", "n", "--for", "notice").returncode == 0
    p = sco("notice", "send", "--hall", "h", "--node", "n-1", "--signing-key", tmp_path / "n.key", "--nats", nowhere)
    one_line_error(p, 6, nowhere, "connection refused")
    for bad in ("", "http://127.0.0.1:4222"):  # not a relay at all: a configuration error
        one_line_error(sco("events", "create-stream", "--nats", bad), 5, "--nats")


def test_nats_connect_to_a_silent_server_says_timed_out() -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:  # accept and say nothing: a server that never sends INFO
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    url = f"nats://127.0.0.1:{srv.getsockname()[1]}"
    try:
        p = sco("events", "create-stream", "--nats", url)
        one_line_error(p, 6, url, "timed out")
        assert "TimeoutError: \n" not in p.stderr + "\n"
    finally:
        stop.set()
        t.join()
        for c in held:
            c.close()
        srv.close()


def test_a_malformed_nats_port_is_a_configuration_error() -> None:
    for bad in ("nats://127.0.0.1:abc", "nats://127.0.0.1:99999", "nats://:4222"):
        p = sco("events", "create-stream", "--nats", bad)
        one_line_error(p, 5, "--nats")


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
    assert p.returncode == 13  # contracts (2 is argparse's usage error)
    lines = p.stderr.strip().splitlines()
    assert lines == [
        "sco: error: contracts/worse.yaml: spec.tier: Input should be 1, 2 or 3",
    ]  # shape errors first; feasibility is checked once every file is valid
    (repo / "contracts" / "worse.yaml").unlink()
    p = sco("contract", "compile", repo, "-o", tmp_path / "b3.json", "--signing-key", keys / "old.key")
    assert p.returncode == 13 and "contracts/more.yaml: spec.drainBudgetSeconds: drain budget 200 s" in p.stderr
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
    assert p.returncode == 13 and "nope: not a directory" in p.stderr
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
    # `make demo` runs the test-support distribution's entry point (sco-devkit, not in the runtime wheel)
    demo = Path(sys.executable).parent / "sco-demo"
    p = subprocess.run([str(demo)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "node.tainted" in p.stdout and "drain.drained" in p.stdout
    assert "node: refused" in p.stdout and p.stdout.rstrip().endswith("before the deadline: ok")
    # The demo creates the events stream and the events reach it; an unsigned notice is refused
    assert "spooled events in JetStream stream SCO_EVENTS" in p.stdout
    assert "an unsigned notice from anyone on the relay: refused (unsigned)" in p.stdout


def test_demo_refuses_to_wipe_a_directory_it_did_not_make(tmp_path: Path) -> None:
    """`sco-demo --workdir DIR` replaces DIR: only when a previous demo made it (found trying `--workdir ~`)."""
    mine = tmp_path / "home"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work\n")
    demo = Path(sys.executable).parent / "sco-demo"
    p = subprocess.run([str(demo), "--workdir", str(mine)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 5 and "not a previous demo's directory" in p.stderr, p.stdout + p.stderr
    assert (mine / "thesis.tex").read_text() == "years of work\n"


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
