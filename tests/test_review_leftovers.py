"""Review findings left over (as a new user and as an attacker, against the real parts): each bad input is one
line naming what is wrong and where, the exit code the README gives it, and nothing written or lost."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from sco.contract.compiler import compile_repo
from sco.errors import ConfigError, ContractError
from tests.conftest import SAMPLE
from tests.harness import BIN, AgentEnv, NatsServer, add_pod, free_port

SCO = [sys.executable, "-m", "sco.cli"]


def sco(*args: str | Path, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SCO, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env)


def one_line_error(p: subprocess.CompletedProcess[str], code: int, *needles: str) -> None:
    assert "Traceback" not in p.stderr, p.stderr
    assert p.returncode == code, (p.returncode, p.stdout, p.stderr)
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("sco: error: "), p.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.fixture
def signed(tmp_path: Path) -> tuple[Path, Path, Path]:
    """The sample hall's bundle, its key and public key."""
    keys = tmp_path / "keys"
    assert sco("keygen", "--out-dir", keys, "--name", "k").returncode == 0
    b = tmp_path / "bundle.json"
    p = sco("contract", "compile", SAMPLE, "-o", b, "--signing-key", keys / "k.key", "--issued-at", "1764400000")
    assert p.returncode == 0, p.stderr
    return b, keys / "k.key", keys / "k.pub"


# --- 1. keygen --name is a file name, not a path ---------------------------------------------------------------


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


# --- 2. user-data --distributor-url -----------------------------------------------------------------------------


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


# --- 3. db migrate: bad DSN, a file for --embedded, and its own exit code ---------------------------------------


def test_db_migrate_garbage_dsn_is_one_line_exit_5() -> None:
    p = sco("db", "migrate", "--dsn", "garbage")
    one_line_error(p, 5, "--dsn", "connection string")
    p = sco("db", "migrate", "--dsn", "host=x password=hunter2 garbage")
    one_line_error(p, 5, "--dsn")
    assert "hunter2" not in p.stderr


def test_db_migrate_embedded_on_a_file_is_one_line(tmp_path: Path) -> None:
    f = tmp_path / "a-file"
    f.write_text("keep me\n")
    p = sco("db", "migrate", "--embedded", f)
    one_line_error(p, 1, str(f), "not a directory")
    assert f.read_text() == "keep me\n"


def test_fleet_state_unreachable_has_its_own_documented_exit_code() -> None:
    """7 is the Kubernetes API's in the README; the fleet state gets 11, and the README says so."""
    p = sco("db", "migrate", "--dsn", f"host=127.0.0.1 port={free_port()} user=x dbname=y connect_timeout=2")
    one_line_error(p, 11, "fleet state", "cannot connect")
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    assert "11 fleet state" in readme and "7 Kubernetes API" in readme


# --- 4. plan input bounds (the CLI and the collection's plan module share the parser) ----------------------------


def _plan_doc() -> dict[str, Any]:
    from tests.test_plan_cli import INPUT

    return json.loads(json.dumps(INPUT))


@pytest.mark.parametrize(
    ("path", "value", "needle"),
    [
        (("pools", 1, "cap"), 1_000_000_000, "pools.1.cap"),
        (("pools", 1, "vcpus"), True, "pools.1.vcpus"),
        (("pools", 1, "cap"), True, "pools.1.cap"),
        (("now",), math.nan, "now"),
        (("now",), math.inf, "now"),
        (("fleet", 0, "launchedAt"), math.nan, "fleet.0.launchedAt"),
        (("settings", "idleGraceSeconds"), math.inf, "settings.idleGraceSeconds"),
        (("reservations", 0, "instances"), True, "reservations.0.instances"),
        (("demand", "demand", 0, "units_milli"), True, "demand.demand.0.units_milli"),
    ],
)
def test_plan_refuses_absurd_numbers_naming_the_field(path: tuple[Any, ...], value: Any, needle: str) -> None:
    from sco.control.inputs import parse
    from sco.control.loop import _document

    doc = _plan_doc()
    target = doc
    for k in path[:-1]:
        target = target[k]
    target[path[-1]] = value
    with pytest.raises(ConfigError) as e:
        parse(doc, "plan.yaml")
    assert any(line.startswith(f"plan.yaml: {needle}:") for line in e.value.lines()), e.value.lines()
    # the collection's plan module reads its options through the same parser
    params = {k: doc.get(k) for k in ("pools", "settings", "reservations", "fleet", "demand", "now")}
    with pytest.raises(ConfigError) as e:
        _document(params, None, "local")
    assert any(needle in line for line in e.value.lines()), e.value.lines()


def test_plan_cli_refuses_nan_now_and_a_huge_cap(tmp_path: Path, signed: tuple[Path, Path, Path]) -> None:
    b, _key, pub = signed
    doc = tmp_path / "plan.yaml"
    text = yaml.safe_dump(_plan_doc()).replace("now: 1764400000", "now: .nan")
    assert "now: .nan" in text
    doc.write_text(text.replace("cap: 20", "cap: 1000000000", 1))
    p = sco("plan", "--input", doc, "--bundle", b, "--trust", pub)
    assert "Traceback" not in p.stderr and p.returncode == 5, p.stderr
    assert f"{doc}: now:" in p.stderr and f"{doc}: pools.1.cap:" in p.stderr, p.stderr


# --- 5. a directory symlink out of the contract repository -----------------------------------------------------


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
    assert p.returncode == 2 and "contracts/more" in p.stderr and "leaves the repository" in p.stderr
    (repo / "loop-a").symlink_to(repo / "loop-b")  # a loop is named too, never a traceback
    (repo / "loop-b").symlink_to(repo / "loop-a")
    (repo / "dangling.yaml").symlink_to(tmp_path / "gone.yaml")
    p = sco("contract", "check", repo)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "loop-a: cannot read: a symlink loop" in p.stderr and "dangling.yaml: cannot read" in p.stderr, p.stderr


# --- 6. --issued-at is bounded ----------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [str(10**15), str(int(time.time()) + 3 * 86400), "-1"])
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


# --- 7. serve --root must exist ---------------------------------------------------------------------------------


def test_serve_refuses_a_root_that_does_not_exist(tmp_path: Path) -> None:
    p = sco("contract", "serve", "--root", tmp_path / "nope", "--listen", "127.0.0.1:0", timeout=20)
    one_line_error(p, 5, "--root", str(tmp_path / "nope"))
    f = tmp_path / "a-file"
    f.write_text("x")
    p = sco("contract", "serve", "--root", f, "--listen", "127.0.0.1:0", timeout=20)
    one_line_error(p, 5, "--root", "not a directory")


# --- 8. agent configuration: empty node, unknown variables, no bundle -------------------------------------------


def _agent_config(tmp_path: Path) -> Path:
    (tmp_path / "trusted").mkdir(exist_ok=True)
    from sco.contract.signing import generate, write_keypair

    if not (tmp_path / "trusted" / "k.pub").exists():
        write_keypair(generate(), tmp_path / "k.key", tmp_path / "trusted" / "k.pub")
    cfg = tmp_path / "agent.toml"
    cfg.write_text(
        f'[agent]\nhall = "local"\nnode = "n1"\nkube_url = "http://127.0.0.1:1"\n'
        f'trust_dir = "{tmp_path / "trusted"}"\nstate_dir = "{tmp_path / "state"}"\n'
    )
    return cfg


def _agent(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SCO_AGENT_")}
    return subprocess.run(
        [str(BIN / "sco-agent"), *args], capture_output=True, text=True, timeout=30, env={**clean, **env}
    )


def test_agent_refuses_an_explicitly_empty_node(tmp_path: Path) -> None:
    cfg = _agent_config(tmp_path)
    p = _agent("check-config", "--config", str(cfg), env={"SCO_AGENT_NODE": ""})
    assert p.returncode == 5 and "Traceback" not in p.stderr, p.stdout + p.stderr
    assert "SCO_AGENT_NODE" in p.stderr and "empty" in p.stderr, p.stderr
    p = _agent("check-config", "--config", str(cfg), env={})
    assert p.returncode == 0 and "node n1" in p.stdout, p.stdout + p.stderr


def test_agent_warns_about_unknown_sco_agent_variables(tmp_path: Path) -> None:
    cfg = _agent_config(tmp_path)
    env = {"SCO_AGENT_NATSURL": "nats://relay:4222", "SCO_AGENT_CONFIG": str(cfg), "SCO_AGENT_HALL": "local"}
    p = _agent("check-config", env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    warn = [x for x in p.stderr.splitlines() if "SCO_AGENT_NATSURL" in x]
    assert len(warn) == 1 and "warning" in warn[0] and "unknown" in warn[0], p.stderr
    assert "SCO_AGENT_CONFIG" not in p.stderr and "SCO_AGENT_HALL" not in p.stderr


def test_agent_start_warns_about_unknown_variables_and_no_cached_bundle(
    tmp_path: Path, nats_server: NatsServer
) -> None:
    from sco.standins.kube_apiserver import KubeApiStandIn

    kube = KubeApiStandIn().start()
    env = AgentEnv(tmp_path / "a", kube, nats_server)
    (env.state / "bundle" / "bundle.json").unlink()  # cloud-init wrote none; no distributor yet
    os.environ["SCO_AGENT_NATSURL"] = "nats://typo:4222"
    try:
        env.start()
    finally:
        del os.environ["SCO_AGENT_NATSURL"]
    try:
        text = env.logtext()
        assert "SCO_AGENT_NATSURL" in text and "unknown" in text, text
        nob = [x for x in text.splitlines() if "no bundle" in x]
        assert len(nob) == 1 and nob[0].startswith("WARNING") and "refused" in nob[0], text
    finally:
        env.stop()
        kube.stop()


# --- 9. NATS connect failures say what failed, promptly ---------------------------------------------------------


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


# --- 10. a refused taint is recorded as refused, not as an unreachable API --------------------------------------


def test_a_taint_the_api_refuses_is_spooled_as_refused(tmp_path: Path, nats_server: NatsServer) -> None:
    from sco.standins.kube_apiserver import KubeApiStandIn

    kube = KubeApiStandIn().start()
    env = AgentEnv(tmp_path / "a", kube, nats_server)
    # a taint written before validation was this strict: the API validates the whole list on every update (422)
    kube.cluster.nodes[env.node]["spec"]["taints"] = [{"key": "bad key!", "effect": "NoSchedule"}]
    try:
        add_pod(kube, "web", "w-0", env.node, prestop=0.2)
        env.start().wait_subscribed()
        env.send(env.notice("refused-1", 10))
        out = env.outcome(12)
        assert out["type"] == "drain.overrun"  # never "drained" on an untainted node: the outcome is unchanged
        assert any("422" in r for r in out["reasons"]), out["reasons"]
        refused = env.of("scheduler.refused")
        assert refused and refused[0]["what"] == "taint" and refused[0]["status"] == 422, env.events()
        assert not env.of("scheduler.unreachable"), env.of("scheduler.unreachable")
        # `sco-agent events` prints it as it is
        p = subprocess.run(
            [str(BIN / "sco-agent"), "events", "--state-dir", str(env.state)], capture_output=True, text=True
        )
        assert '"scheduler.refused"' in p.stdout and '"status": 422' in p.stdout, p.stdout
    finally:
        env.stop()
        kube.stop()
