"""sco-control-loop hands the playbook no secret that ansible-runner would write down: ansible-runner records the
environment of every run in ``artifacts/<id>/command``, so the DSN's password reaches the steps through a libpq
password file (PGPASSFILE, 0600, removed after the run), never through the environment. Real ansible-runner and
ansible-playbook, real PostgreSQL (the session's embedded server)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import psycopg
import pytest

from sco.control.runner import _secretless, run_loop

SECRET = "pw-9f3c:with\\colon"

PLAYBOOK = """
- name: What a step sees
  hosts: localhost
  connection: local
  gather_facts: false
  tasks:
    - name: The passfile is the run's own, 0600, and the DSN reaches the fleet state without a password in it
      ansible.builtin.command:
        argv:
          - "{{ ansible_playbook_python }}"
          - -c
          - |
            import json, os, stat, psycopg
            p = os.environ["PGPASSFILE"]
            mode = stat.S_IMODE(os.stat(p).st_mode)
            with psycopg.connect(os.environ["SCO_DB_DSN"]) as c:
                c.execute("SELECT 1")
            json.dump({"dsn": os.environ["SCO_DB_DSN"], "passfile": p, "mode": mode}, open(os.environ["SEEN"], "w"))
      changed_when: false
"""


def test_the_password_reaches_the_steps_through_a_passfile_and_no_runner_file_holds_it(
    fleet_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pdd = tmp_path / "runner"
    (pdd / "project").mkdir(parents=True)
    (pdd / "project" / "control_loop.yml").write_text(PLAYBOOK)
    seen = tmp_path / "seen.json"
    monkeypatch.setenv("SEEN", str(seen))
    dsn = f"{fleet_dsn} password='{SECRET.replace(chr(92), chr(92) * 2)}'"  # trust auth: the server ignores it
    monkeypatch.setenv("SCO_DB_DSN", dsn)  # as the unit's EnvironmentFile sets it
    rc, summary = run_loop(pdd, "secrets", dsn)
    assert rc == 0, summary
    got = json.loads(seen.read_text())
    assert "password" not in psycopg.conninfo.conninfo_to_dict(got["dsn"]) and got["mode"] == 0o600
    assert (
        psycopg.conninfo.conninfo_to_dict(got["dsn"])["dbname"]
        == psycopg.conninfo.conninfo_to_dict(fleet_dsn)["dbname"]
    )
    assert not Path(got["passfile"]).exists() and not Path(got["passfile"]).parent.exists()  # gone with the run
    leaks = [p for p in pdd.rglob("*") if p.is_file() and b"pw-9f3c" in p.read_bytes()]
    assert not leaks, leaks
    assert list(pdd.glob("artifacts/*/command"))  # the file that held it before


def test_the_passfile_line_escapes_what_libpq_reads_as_separators() -> None:
    with _secretless("host=db1,db2 port=5432,5432 dbname=sco user=sco:x password=a\\\\b:c") as (dsn, env):
        line = Path(env["PGPASSFILE"]).read_text()
        assert line == "*:*:*:sco\\:x:a\\\\b\\:c\n"
        assert "password" not in dsn and "db1,db2" in dsn
        assert os.stat(env["PGPASSFILE"]).st_mode & 0o077 == 0
    assert not Path(env["PGPASSFILE"]).exists()
    with _secretless("host=db dbname=sco") as (dsn, env):
        assert dsn == "host=db dbname=sco" and env == {}
