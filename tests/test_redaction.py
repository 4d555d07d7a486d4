"""Secrets never reach a message: a DSN's password (CLI, modules, driver messages) and NATS credentials in a URL
(the CLI, the agent's config check)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from sco.errors import ScoError
from tests.cli_run import one_line_error, run_module, sco
from tests.harness import free_port

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
    """The collection's modules open the fleet state through steps.open_store: their msg is the same text."""
    from sco.control.steps import open_store

    for dsn in SECRET_DSNS:
        with pytest.raises(ScoError) as e:
            open_store({"state_dsn": dsn})
        assert "S3" not in str(e.value) and "CRET" not in " ".join(e.value.lines()), e.value
        assert "/nonexist" in str(e.value)


@pytest.mark.parametrize("dsn", SECRET_DSNS[:3])
def test_a_module_failing_to_reach_the_fleet_state_prints_no_password(tmp_path: Path, dsn: str) -> None:
    for args, env in (({"hall": "local", "state_dsn": dsn}, {}), ({"hall": "local"}, {"SCO_DB_DSN": dsn})):
        out = run_module("demand", args, tmp_path, env)
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
