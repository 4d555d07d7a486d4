"""Agent pieces on their own: notices, budgets, the spool's crash safety and bound, config, sd_notify."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sco.agent import config as agent_config
from sco.agent.notices import NoticeBook, NoticeRefused, parse_metadata, parse_nats
from sco.agent.sdnotify import notify, watchdog_interval
from sco.agent.spool import CRITICAL, ROUTINE, Spool, read_events
from sco.errors import ConfigError

NOW = 1_800_000_000.0


def nats_notice(**kw: object) -> bytes:
    doc = {"id": "n1", "hall": "h", "node": "a", "terminateAt": NOW + 120, "issuedAt": NOW, **kw}
    return json.dumps(doc).encode()


def test_notice_parsing_and_refusals() -> None:
    n = parse_nats(nats_notice(), hall="h", node="a", now=NOW, window=120)
    assert (n.id, n.terminate_at, n.source) == ("n1", NOW + 120, "nats")
    from datetime import datetime

    t = datetime.fromisoformat("2027-01-15T08:00:00+00:00").timestamp()
    iso = parse_nats(
        nats_notice(terminateAt="2027-01-15T08:00:00Z", issuedAt="2027-01-15T07:58:00Z"),
        hall="h",
        node="a",
        now=t - 100,
        window=120,
    )
    assert iso.terminate_at - iso.issued_at == 120
    cases = {
        b"[1]": "malformed",
        b"\xff": "malformed",
        nats_notice(id=""): "malformed",
        nats_notice(node="b"): "foreign",
        nats_notice(hall="other"): "foreign",
        nats_notice(terminateAt="soon"): "malformed",
        nats_notice(terminateAt=True): "malformed",
        nats_notice(terminateAt=NOW + 10_000): "absurd",
        nats_notice(terminateAt=NOW - 500): "absurd",
        nats_notice(issuedAt=NOW + 3600): "absurd",
        nats_notice(terminateAt=NOW - 1, issuedAt=NOW): "absurd",
    }
    for raw, kind in cases.items():
        with pytest.raises(NoticeRefused) as e:
            parse_nats(raw, hall="h", node="a", now=NOW, window=120)
        assert e.value.kind == kind, raw


def test_metadata_notice() -> None:
    doc = {"uuid": "u", "name": "a", "meta": {}}
    assert parse_metadata(json.dumps(doc).encode(), hall="h", node="a", now=NOW, window=120) is None
    doc["meta"] = {"sco_reclaim_id": "m1", "sco_reclaim_at": str(NOW + 100)}
    n = parse_metadata(json.dumps(doc).encode(), hall="h", node="a", now=NOW, window=120)
    assert n is not None and n.terminate_at == NOW + 100 and n.source == "metadata"
    doc["name"] = "b"
    with pytest.raises(NoticeRefused, match="this node is 'a'"):
        parse_metadata(json.dumps(doc).encode(), hall="h", node="a", now=NOW, window=120)


def test_notice_book_dedup_and_earliest_wins() -> None:
    book = NoticeBook()
    a = parse_nats(nats_notice(), hall="h", node="a", now=NOW, window=120)
    assert book.offer(a) == "start"
    assert book.offer(a) == "duplicate"
    earlier = parse_nats(nats_notice(terminateAt=NOW + 60), hall="h", node="a", now=NOW, window=120)
    assert book.offer(earlier) == "earlier"
    assert book.offer(a) == "duplicate" and book.seen["n1"].terminate_at == NOW + 60


def test_spool_torn_tail_is_cut_and_counted(tmp_path: Path) -> None:
    s = Spool(tmp_path)
    for i in range(10):
        s.append("x", ROUTINE, i=i)
    s.close()
    with open(tmp_path / "events.spool", "ab") as f:
        f.write(b"\x00\x00\x01\x00half a record")
    s2 = Spool(tmp_path)
    assert s2.recovery.torn_bytes == 17 and s2.recovery.records == 10 and s2.last_seq == 10
    s2.append("after", CRITICAL)
    assert [e["seq"] for e in s2.events()] == list(range(1, 12))


_WRITER = """
import sys
from pathlib import Path
from sco.agent.spool import Spool, CRITICAL, ROUTINE
s = Spool(Path(sys.argv[1]), max_bytes=200_000)
print("ready", flush=True)
i = 0
while True:
    i += 1
    s.append("e", CRITICAL if i % 7 == 0 else ROUTINE, i=i, pad="p" * (i % 300))
"""


def test_spool_survives_kill9_at_random_moments(tmp_path: Path) -> None:
    rng = __import__("random").Random(3)
    last = 0
    for _ in range(10):
        p = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE)
        assert p.stdout is not None and p.stdout.readline() == b"ready\n"
        time.sleep(rng.uniform(0.02, 0.3))
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        s = Spool(tmp_path, max_bytes=200_000)  # recovery: at most the record being written is lost
        seqs = [e["seq"] for e in s.events()]
        assert seqs == sorted(seqs) and len(seqs) == len(set(seqs))
        assert s.last_seq >= last
        last = s.last_seq
        s.close()
    assert (tmp_path / "events.spool").stat().st_size <= 200_000


def test_spool_bound_drops_routine_before_critical_and_published_first(tmp_path: Path) -> None:
    s = Spool(tmp_path, max_bytes=65536)
    for i in range(100):
        s.append("drain.step", CRITICAL, i=i)
    for i in range(800):
        s.append("routine", ROUTINE, i=i, pad="r" * 60)
        if i == 100:
            s.mark_published(s.last_seq)
    assert s.size <= 65536
    events = list(s.events())
    assert len([e for e in events if e["type"] == "drain.step"]) == 100
    dropped = [e for e in events if e["type"] == "spool.dropped"]
    assert dropped and dropped[0]["routine"] > 0 and dropped[0]["critical_published"] == 0
    # the already-published routine events (the first 101) went before unpublished ones
    kept_routine = [e["i"] for e in events if e["type"] == "routine"]
    assert kept_routine and min(kept_routine) > 100
    s.close()
    assert [e["seq"] for e in read_events(tmp_path)] == [e["seq"] for e in events]


def test_config_lists_every_problem(tmp_path: Path) -> None:
    cfg = tmp_path / "agent.toml"
    cfg.write_text(
        '[agent]\nnode = "Bad Name"\nscheduler = "nomad"\nspool_max_bytes = "lots"\ncolour = 1\n'
        f'trust_dir = "{tmp_path}"\nnats_url = "http://x"\n[extra]\n'
    )
    with pytest.raises(ConfigError) as e:
        agent_config.load(cfg, env={})
    text = "\n".join(e.value.lines())
    for needle in (
        "agent.colour: unknown setting",
        "extra: unknown table",
        "agent.node: expected a DNS-style name",
        "agent.scheduler: expected kubernetes or slurm",
        "agent.spool_max_bytes: expected int",
        "agent.trust_dir",
        "agent.nats_url: 'http://x' is not a nats:// URL",
        "agent.hall",
    ):
        assert needle in text, needle
    (tmp_path / "k.pub").write_text("{}")
    good = agent_config.load(
        None,
        env={
            "SCO_AGENT_HALL": "h",
            "SCO_AGENT_NODE": "n",
            "SCO_AGENT_KUBE_URL": "http://127.0.0.1:1",
            "SCO_AGENT_TRUST_DIR": str(tmp_path),
            "SCO_AGENT_SPOOL_MAX_BYTES": "1048576",
        },
    )
    assert good.spool_max_bytes == 1048576 and good.node == "n"


def test_check_config_command(tmp_path: Path) -> None:
    cfg = tmp_path / "agent.toml"
    cfg.write_text('[agent]\nnode = "n1"\n')
    p = subprocess.run(
        [str(Path(sys.executable).parent / "sco-agent"), "check-config", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "SCO_AGENT_HALL": "h"},
    )
    assert p.returncode == 5 and "Traceback" not in p.stderr
    assert "agent.kube_url: the kubernetes scheduler needs" in p.stderr
    p = subprocess.run(
        [str(Path(sys.executable).parent / "sco-agent"), "sample-config"], capture_output=True, text=True, timeout=30
    )
    assert "[agent]" in p.stdout


def test_sd_notify_and_watchdog(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(tmp_path / "notify.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    srv.bind(path)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    assert notify("READY=1\nSTATUS=ok")
    assert srv.recv(100) == b"READY=1\nSTATUS=ok"
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert watchdog_interval() == 1.0
    monkeypatch.setenv("WATCHDOG_PID", "1")
    assert watchdog_interval() is None
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert notify("READY=1") is False
    srv.close()


@settings(max_examples=20, deadline=None)
@given(st.lists(st.sampled_from([ROUTINE, CRITICAL]), min_size=1, max_size=60))
def test_spool_round_trip(tmp_path_factory: pytest.TempPathFactory, prios: list[int]) -> None:
    d = tmp_path_factory.mktemp("spool")
    s = Spool(d)
    for i, p in enumerate(prios):
        s.append("e", p, i=i)
    s.close()
    assert [e["i"] for e in Spool(d).events()] == list(range(len(prios)))


def test_job_processes_from_cgroup_v1_and_v2_layouts(tmp_path: Path) -> None:
    from sco.agent.slurm.jobprocs import from_cgroups, job_processes

    me = os.getpid()
    v2 = tmp_path / "v2" / "system.slice" / "n1_slurmstepd.scope" / "job_42" / "step_batch" / "user" / "task_0"
    v2.mkdir(parents=True)
    (v2 / "cgroup.procs").write_text(f"{me}\n")
    other = tmp_path / "v2" / "system.slice" / "n2_slurmstepd.scope" / "job_43"
    other.mkdir(parents=True)
    (other / "cgroup.procs").write_text("1\n")
    assert from_cgroups("n1", tmp_path / "v2") == {42: {me}}  # another node's jobs are not ours
    v1 = tmp_path / "v1" / "freezer" / "slurm" / "uid_0" / "job_7" / "step_0"
    v1.mkdir(parents=True)
    (v1 / "cgroup.procs").write_text(f"{me}\n{me + 1}\n")
    assert from_cgroups("n1", tmp_path / "v1") == {7: {me, me + 1}}
    method, found = job_processes("n1", tmp_path / "no-spool", tmp_path / "v1")
    assert method == "cgroup" and found == {7: {me, me + 1}}
    assert job_processes("n1", tmp_path / "no-spool", tmp_path / "empty") == ("stepd-tree", {})
