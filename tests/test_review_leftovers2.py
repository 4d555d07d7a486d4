"""Review findings, second round (an attacker's and a careless operator's inputs against the real parts): secrets
never reach an error message, foreign traffic on a notice subject is not a refusal per message, planning input and
inherited issue times are bounded, and the cheap cosmetic ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from sco.contract.compiler import compile_repo
from sco.errors import ConfigError, ScoError
from tests.conftest import SAMPLE
from tests.harness import free_port

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


# --- 1a. a DSN's password never reaches a message -----------------------------------------------------------------

# Each parses (libpq accepts spaces around "=", quoted values and backslash escapes) and fails to connect.
SECRET_DSNS = [
    "host=/nonexist password = S3CRET",
    "host=/nonexist password='S3 CRET'",
    r"host=/nonexist password=S3\ CRET",
    "host=/nonexist password = 'S3CRET' user = u",
]


@pytest.mark.parametrize("dsn", SECRET_DSNS)
def test_db_migrate_never_prints_the_password(dsn: str) -> None:
    p = sco("db", "migrate", "--dsn", dsn)
    one_line_error(p, 11, "fleet state", "/nonexist", "cannot connect")
    assert "S3" not in p.stderr and "CRET" not in p.stderr, p.stderr
    env = {**os.environ, "SCO_DB_DSN": dsn}
    p = sco("db", "migrate", env=env)
    one_line_error(p, 11, "/nonexist")
    assert "S3" not in p.stderr and "CRET" not in p.stderr, p.stderr


def test_a_uri_dsn_shows_host_port_dbname_user_only() -> None:
    port = free_port()
    p = sco("db", "migrate", "--dsn", f"postgresql://scouser:S3CRET@127.0.0.1:{port}/fleet?connect_timeout=2")
    one_line_error(p, 11, "127.0.0.1", str(port), "fleet", "scouser")
    assert "S3CRET" not in p.stderr and "connect_timeout" not in p.stderr, p.stderr


@pytest.mark.parametrize(
    "dsn",
    [
        "host=x password = S3 CRETX",  # "CRETX" is the token libpq complains about
        "host=x password='S3CRETX",  # unterminated quote
        "postgresql://u:S3CRETX@h/db?bogus=S3CRETX",
        "host=x S3CRETX",
    ],
)
def test_an_unparseable_dsn_prints_no_part_of_it(dsn: str) -> None:
    p = sco("db", "migrate", "--dsn", dsn)
    one_line_error(p, 5, "--dsn")
    assert "CRETX" not in p.stderr, p.stderr


def test_the_modules_path_redacts_too() -> None:
    """The collection's modules open the fleet state through loop.open_store: their msg is the same text."""
    from sco.control.loop import open_store

    for dsn in SECRET_DSNS:
        with pytest.raises(ScoError) as e:
            open_store({"state_dsn": dsn})
        assert "S3" not in str(e.value) and "CRET" not in " ".join(e.value.lines()), e.value
        assert "/nonexist" in str(e.value)


COLLECTION = Path(__file__).parent.parent / "collections"


def _run_module(name: str, args: dict[str, Any], tmp_path: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """A module of the collection as Ansible runs it (its args in a file), its JSON answer."""
    module = COLLECTION / f"ansible_collections/sco/orchestrator/plugins/modules/{name}.py"
    argf = tmp_path / f"{name}-args.json"
    argf.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": args}))
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(COLLECTION)}
    p = subprocess.run([sys.executable, str(module), str(argf)], capture_output=True, text=True, env=env, timeout=60)
    return dict(json.loads(p.stdout))


@pytest.mark.parametrize("dsn", SECRET_DSNS[:3])
def test_a_module_failing_to_reach_the_fleet_state_prints_no_password(tmp_path: Path, dsn: str) -> None:
    for args, env in (({"hall": "local", "state_dsn": dsn}, {}), ({"hall": "local"}, {"SCO_DB_DSN": dsn})):
        out = _run_module("demand", args, tmp_path, env)
        assert out.get("failed") is True and "/nonexist" in out["msg"], out
        assert "S3" not in json.dumps(out) and "CRET" not in json.dumps(out), out


def test_describe_dsn() -> None:
    from sco._redact import describe_dsn

    assert describe_dsn("host=db port=5433 dbname=sco user=sco password=pw sslmode=require") == (
        "host=db port=5433 dbname=sco user=sco"
    )
    assert describe_dsn("postgresql://u:pw@h1:5,h2:6/db") == "host=h1,h2 port=5,6 dbname=db user=u"
    assert describe_dsn("password=pw") == "(default host)"
    assert describe_dsn("host=x pass word") == "(an unparseable connection string)"


# --- 1b. NATS URLs with credentials ---------------------------------------------------------------------------------


def test_strip_userinfo() -> None:
    from sco._redact import strip_userinfo, strip_userinfo_in_text

    assert strip_userinfo("nats://user:SECRETPW@127.0.0.1:4222") == "nats://127.0.0.1:4222"
    assert strip_userinfo("nats://TOKEN@h:1, tls://u:p@x@h2:2/p?q") == "nats://h:1,tls://h2:2/p?q"
    assert strip_userinfo("u:pw@h:4222") == "h:4222"
    assert strip_userinfo("nats://h:4222") == "nats://h:4222"
    assert strip_userinfo("") == ""
    assert strip_userinfo_in_text("dial nats://u:pw@h:1 and tls://tok@h2:2/x failed") == (
        "dial nats://h:1 and tls://h2:2/x failed"
    )


def test_a_driver_message_echoing_the_password_is_scrubbed() -> None:
    from sco._redact import without_dsn_secrets

    assert without_dsn_secrets('bad value "S3 CRET" here', "host=x password='S3 CRET'") == 'bad value "***" here'
    assert without_dsn_secrets("as it was", "not a dsn") == "as it was"


def test_nats_credentials_in_the_url_are_never_printed(tmp_path: Path) -> None:
    nowhere = f"nats://user:SECRETPW@127.0.0.1:{free_port()}"
    p = sco("events", "create-stream", "--nats", nowhere)
    one_line_error(p, 6, "nats://127.0.0.1:", "connection refused")
    assert "SECRETPW" not in p.stderr and "user" not in p.stderr, p.stderr
    assert sco("keygen", "--out-dir", tmp_path, "--name", "n", "--for", "notice").returncode == 0
    p = sco("notice", "send", "--hall", "h", "--node", "n-1", "--signing-key", tmp_path / "n.key", "--nats", nowhere)
    one_line_error(p, 6, "nats://127.0.0.1:", "connection refused")
    assert "SECRETPW" not in p.stderr, p.stderr
    p = sco("events", "create-stream", "--nats", "http://user:SECRETPW@127.0.0.1:4222")  # refused before connecting
    one_line_error(p, 5, "--nats", "http://127.0.0.1:4222")
    assert "SECRETPW" not in p.stderr, p.stderr


def test_agent_config_never_prints_nats_credentials() -> None:
    from sco.agent.config import AgentConfig, check

    cfg = AgentConfig(hall="h", node="n", nats_url="http://user:SECRETPW@127.0.0.1:4222,nats://127.0.0.1:abc")
    lines = [str(x) for x in check(cfg) if x.field == "agent.nats_url"]
    assert len(lines) == 2, lines
    assert not any("SECRETPW" in x for x in lines), lines


# --- 3. planning input: the number of pools and the sum of their caps are bounded ----------------------------------


def _pool(i: int, cap: int) -> dict[str, Any]:
    return {"name": f"p{i}", "kind": "reclaimable", "flavor": "m1", "vcpus": 1, "ramMiB": 1024, "cap": cap}


@pytest.mark.parametrize(
    ("pools", "needle"),
    [
        ([_pool(i, 1) for i in range(1001)], "at most 1000 pools"),
        ([_pool(i, 10_000) for i in range(11)], "caps add up to 110000"),
    ],
)
def test_plan_bounds_pools_and_their_total_cap(pools: list[dict[str, Any]], needle: str) -> None:
    from sco.control.inputs import parse
    from sco.control.loop import _document

    with pytest.raises(ConfigError) as e:
        parse({"pools": pools, "now": 1_764_400_000}, "plan.yaml")
    lines = e.value.lines()
    assert any(x.startswith("plan.yaml: pools:") and needle in x for x in lines), lines
    with pytest.raises(ConfigError) as e:  # the collection's plan module reads its options through the same parser
        _document({"pools": pools, "now": 1_764_400_000}, None, "local")
    assert any("pools" in x and needle in x for x in e.value.lines()), e.value.lines()
    parse({"pools": pools[:10], "now": 1_764_400_000}, "plan.yaml")  # within both bounds: fine


# --- 4. an inherited issuedAt is checked too ------------------------------------------------------------------------


def test_an_inherited_issued_at_is_bounded_too() -> None:
    first = compile_repo(SAMPLE, issued_at=1_764_400_000)
    forged = {**first, "issuedAt": 1_764_400_000_000}  # milliseconds, from a bundle made before the bound
    with pytest.raises(ConfigError) as e:
        compile_repo(SAMPLE, previous=forged)
    assert "issuedAt 1764400000000" in str(e.value) and "previous bundle" in str(e.value), e.value
    for bad in ("yesterday", True, -5, 1.5):
        with pytest.raises(ConfigError):
            compile_repo(SAMPLE, previous={**first, "issuedAt": bad})
    assert compile_repo(SAMPLE, previous=first)["issuedAt"] == 1_764_400_000  # a sane one is still inherited
    fresh = compile_repo(SAMPLE, previous=forged, issued_at=1_764_400_100)  # an explicit one replaces it
    assert fresh["issuedAt"] == 1_764_400_100


def test_contract_bundle_module_fails_on_an_inherited_millisecond_issued_at(tmp_path: Path) -> None:
    from sco.contract.bundle import peek_payload
    from sco.contract.signing import generate, sign, write_keypair

    key = generate()
    write_keypair(key, tmp_path / "k.key", tmp_path / "k.pub")
    dest = tmp_path / "bundle.json"
    dest.write_bytes(sign({**compile_repo(SAMPLE, issued_at=1), "issuedAt": 1_764_400_000_000}, [key]))
    out = _run_module(
        "contract_bundle", {"repo": str(SAMPLE), "dest": str(dest), "signing_keys": [str(tmp_path / "k.key")]}, tmp_path
    )
    assert out.get("failed") is True and "1764400000000" in out["msg"], out
    assert (peek_payload(dest.read_bytes()) or {})["issuedAt"] == 1_764_400_000_000  # left as it was


# --- 5. cosmetic but cheap ------------------------------------------------------------------------------------------


def test_serve_refuses_an_empty_root(tmp_path: Path) -> None:
    p = sco("contract", "serve", "--root", "", "--listen", "127.0.0.1:0", timeout=20)
    one_line_error(p, 5, "--root")
    env = {**os.environ, "SCO_DISTRIBUTOR_ROOT": ""}
    p = sco("contract", "serve", "--listen", "127.0.0.1:0", env=env, timeout=20)
    one_line_error(p, 5, "--root", "SCO_DISTRIBUTOR_ROOT")


@pytest.mark.parametrize("name", ["a\x85b", "a\x9bb", "a\u2028b"])
def test_keygen_refuses_unprintable_names(tmp_path: Path, name: str) -> None:
    p = sco("keygen", "--out-dir", tmp_path, "--name", name)
    one_line_error(p, 5, "--name")
    assert "\x85" not in p.stderr and "\x9b" not in p.stderr and "\u2028" not in p.stderr
    assert not list(tmp_path.iterdir())


def test_a_malformed_nats_port_is_a_configuration_error() -> None:
    for bad in ("nats://127.0.0.1:abc", "nats://127.0.0.1:99999", "nats://:4222"):
        p = sco("events", "create-stream", "--nats", bad)
        one_line_error(p, 5, "--nats")


# --- 2. JetStream traffic routed onto a notice subject is foreign, not a refusal per message ------------------------


async def _route_jetstream_traffic_to(url: str, victim_subject: str, n: int) -> None:
    """What a node can do without publishing to another node's notice subject: publish its own events with that
    subject as the reply (JetStream sends the PubAck there), and create a push consumer delivering there."""
    import nats
    from nats.js.api import AckPolicy, ConsumerConfig

    nc = await nats.connect(url)
    try:
        for i in range(n):
            await nc.publish(f"sco.events.local.attacker.{i}", b"{}", reply=victim_subject)
        # the same message id twice: the second PubAck says "duplicate": true
        for _ in range(2):
            await nc.publish(
                "sco.events.local.attacker.dup", b"{}", reply=victim_subject, headers={"Nats-Msg-Id": "d1"}
            )
        await nc.flush()
        js = nc.jetstream()
        await js.add_consumer(
            "SCO_EVENTS",
            ConsumerConfig(
                durable_name="routed", deliver_subject=victim_subject, ack_policy=AckPolicy.EXPLICIT, ack_wait=30
            ),
        )
        await nc.flush()
    finally:
        await nc.close()


def test_jetstream_acks_and_deliveries_routed_to_a_notice_subject_are_foreign(tmp_path: Path, nats_server: Any) -> None:
    import asyncio

    from sco.standins.kube_apiserver import KubeApiStandIn
    from tests.harness import BIN, AgentEnv, wait_for

    kube = KubeApiStandIn().start()
    env = AgentEnv(tmp_path / "a", kube, nats_server)
    victim = f"sco.notice.local.{env.node}"
    try:
        env.start().wait_subscribed()
        asyncio.run(_route_jetstream_traffic_to(nats_server.url, victim, 60))
        # 62 PubAcks, then every stream message (62 and the agent's own) delivered with a $JS.ACK. reply
        wait_for(lambda: env.logtext().count("foreign traffic") >= 1, 15, "the foreign-traffic warning")
        env.send(env.notice("real-1", 30))  # the real channel still works beside the noise
        wait_for(lambda: env.of("notice.accepted"), 15, "the real notice")
        time.sleep(1)  # let the deliveries land: the assertion below is on what they left behind
    finally:
        env.stop()
        kube.stop()
    refused = env.of("notice.refused")
    assert not refused, refused[:3]
    foreign = env.of("notice.foreign_traffic")
    assert foreign, env.logtext()[-2000:]
    total = foreign[-1]["foreign_traffic_total"]  # brought up to date at stop
    assert total.get("jetstream-puback", 0) == 62, total
    assert total.get("jetstream-delivery", 0) >= 62, total
    assert len(foreign) <= 3, foreign  # a summary, not a record per message
    warnings = [x for x in env.logtext().splitlines() if "foreign traffic" in x]
    assert 1 <= len(warnings) <= 2, warnings
    p = subprocess.run(
        [str(BIN / "sco-agent"), "status", "--state-dir", str(env.state)], capture_output=True, text=True, timeout=30
    )
    assert p.returncode == 0, p.stderr
    notices = json.loads(p.stdout)["notices"]
    assert notices["foreign_traffic_total"] == total and notices["refused_total"] == {}, notices


def test_foreign_traffic_shapes() -> None:
    from sco.agent.notices import foreign_traffic

    assert foreign_traffic(b'{"stream":"SCO_EVENTS","seq":7}', "", None) == "jetstream-puback"
    assert foreign_traffic(b'{"stream":"S","seq":7,"duplicate":true,"domain":"d"}', "", None) == "jetstream-puback"
    ack = b'{"error":{"code":503,"description":"no responders"},"stream":"S","seq":0}'
    assert foreign_traffic(ack, "", None) == "jetstream-puback"
    assert foreign_traffic(b"x", "$JS.ACK.SCO_EVENTS.routed.1.2.3.4.5", None) == "jetstream-delivery"
    assert foreign_traffic(b"", "", {"Status": "100", "Description": "Idle Heartbeat"}) == "jetstream-delivery"
    # a notice, signed or not, or anything else, is for the notice path to judge
    assert foreign_traffic(b'{"stream":"S","seq":1,"terminateAt":5}', "", None) is None
    assert foreign_traffic(b'{"payload":{},"signatures":[]}', "", None) is None
    assert foreign_traffic(b"not json", "_INBOX.x", None) is None
    assert foreign_traffic(b'{"stream":"S","seq":"7"}', "", None) is None
