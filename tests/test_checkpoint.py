"""The checkpoint socket with real client processes (the Python client library in separate interpreters).

Budgets are a few seconds; outcomes are asserted against them (when a wait ended relative to a budget), never
as wall-clock limits.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sco.agent.checkpoint import CheckpointServer
from sco.agent.deadline import Deadline

BUDGETS = {"quick": 2.0, "slow": 6.0}


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    # Unix socket paths are limited to 107 bytes: pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="sco-ck-") as d:
        yield Path(d)


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, type_: str, **f: Any) -> None:
        self.events.append((type_, f))

    def of(self, type_: str) -> list[dict[str, Any]]:
        return [f for t, f in self.events if t == type_]


class Proc:
    """One workload process; its stdout lines are what it learnt."""

    def __init__(self, p: asyncio.subprocess.Process, name: str) -> None:
        self.p, self.name = p, name
        self.lines: list[dict[str, Any]] = []

    @classmethod
    async def start(cls, path: Path, name: str, mode: str, contract: str | None = None) -> Proc:
        argv = [sys.executable, "-m", "tests.checkpoint_workload", str(path), name, mode]
        if contract:
            argv.append(contract)
        p = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE)
        self = cls(p, name)
        asyncio.get_running_loop().create_task(self._pump())
        return self

    async def _pump(self) -> None:
        assert self.p.stdout is not None
        async for line in self.p.stdout:
            self.lines.append(json.loads(line))

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in self.lines if m["kind"] == kind]

    async def wait(self, kind: str, timeout: float = 20) -> dict[str, Any]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.of(kind):
                return self.of(kind)[0]
            await asyncio.sleep(0.02)
        raise AssertionError(f"{self.name}: no {kind!r} within {timeout} s; saw {self.lines}")

    async def stop(self) -> None:
        if self.p.returncode is None:
            self.p.kill()
        await self.p.wait()


async def _server(path: Path, rec: Recorder) -> CheckpointServer:
    srv = CheckpointServer(path, budget_for=BUDGETS.get, on_event=rec)
    await srv.start()
    return srv


def test_done_silent_and_disconnecting_clients(sock_dir: Path) -> None:
    """Four real client processes: one saves and answers done, one never answers, one exits at the notice, one
    asks for more time within its budget. The drain's wait ends when the silent one's budget does, not later,
    and every state is recorded."""

    async def main() -> None:
        rec = Recorder()
        path = sock_dir / "ck.sock"
        srv = await _server(path, rec)
        procs = [
            await Proc.start(path, "saver", "done:0.5", "slow"),
            await Proc.start(path, "mute", "silent", "quick"),
            await Proc.start(path, "quitter", "disconnect", "slow"),
            await Proc.start(path, "asker", "need:1.5:1", "slow"),
        ]
        try:
            for p in procs:
                await p.wait("registered")
            t0 = time.time()
            deadline = t0 + 15
            told = srv.start_notice("n-1", Deadline(deadline, 2, t0))
            assert told == 4
            for p in procs:
                n = await p.wait("notice")
                assert n["notice"] == "n-1" and n["deadline"] == pytest.approx(deadline, abs=1e-3)
            notices = {p.name: p.of("notice")[0] for p in procs}
            # each workload's own budget: min(notice + contract budget, deadline - margin)
            assert notices["mute"]["budget_end"] == pytest.approx(t0 + 2.0, abs=0.05)
            assert notices["saver"]["budget_end"] == pytest.approx(t0 + 6.0, abs=0.05)
            settled = await srv.wait_settled(until=deadline - 2)
            ended = time.time()
            states = {w.name: w.state for w in srv.workloads.values()}
            assert states == {"saver": "done", "mute": "silent", "quitter": "gone", "asker": "done"}
            assert settled.all_done and not settled.pending
            assert settled.counts == {"done": 2, "silent": 1, "gone": 1}
            # waited for the silent one's budget (2 s), not for the longest budget (6 s) nor the deadline
            assert ended >= t0 + 2.0 and ended < t0 + 6.0
            assert (await procs[3].wait("granted"))["until"] <= notices["asker"]["budget_end"]
            assert {f["workload"] for f in rec.of("checkpoint.done")} == {"saver", "asker"}
            assert [f["workload"] for f in rec.of("checkpoint.silent")] == ["mute"]
            assert [f["workload"] for f in rec.of("checkpoint.gone")] == ["quitter"]
            pids = {f["workload"]: f["pid"] for f in rec.of("checkpoint.registered")}
            assert pids["saver"] == procs[0].p.pid  # from SO_PEERCRED, not from the client
        finally:
            for p in procs:
                await p.stop()
            await srv.close()
        assert not path.exists()

    asyncio.run(main())


def test_all_done_moves_on_before_any_budget_ends(sock_dir: Path) -> None:
    async def main() -> None:
        rec = Recorder()
        path = sock_dir / "ck.sock"
        srv = await _server(path, rec)
        procs = [await Proc.start(path, f"w{i}", "done:0.2", "slow") for i in range(3)]
        try:
            for p in procs:
                await p.wait("registered")
            t0 = time.time()
            srv.start_notice("n-2", Deadline(t0 + 15, 2, t0))
            settled = await srv.wait_settled(until=t0 + 13)
            assert settled.all_done and settled.counts == {"done": 3}
            assert time.time() < t0 + BUDGETS["slow"]  # moved on without waiting out the 6 s budgets
        finally:
            for p in procs:
                await p.stop()
            await srv.close()

    asyncio.run(main())


def test_need_past_budget_refused_and_grant_without_done_ends_at_grant(sock_dir: Path) -> None:
    async def main() -> None:
        rec = Recorder()
        path = sock_dir / "ck.sock"
        srv = await _server(path, rec)
        greedy = await Proc.start(path, "greedy", "greedy:30", "quick")
        lazy = await Proc.start(path, "lazy", "needonly:1", "slow")
        try:
            await greedy.wait("registered")
            await lazy.wait("registered")
            t0 = time.time()
            srv.start_notice("n-3", Deadline(t0 + 15, 2, t0))
            refused = await greedy.wait("refused")
            assert refused["budget_end"] == pytest.approx(t0 + 2.0, abs=0.05)
            granted = await lazy.wait("granted")
            settled = await srv.wait_settled(until=t0 + 13)
            states = {w.name: w.state for w in srv.workloads.values()}
            # greedy answered done after the refusal; lazy got 1 s and never said done
            assert states == {"greedy": "done", "lazy": "silent"}
            assert time.time() >= granted["until"] and time.time() < t0 + BUDGETS["slow"]
            assert settled.counts == {"done": 1, "silent": 1}
            assert rec.of("checkpoint.need_refused")[0]["workload"] == "greedy"
        finally:
            await greedy.stop()
            await lazy.stop()
            await srv.close()

    asyncio.run(main())


def test_late_registration_and_earlier_deadline(sock_dir: Path) -> None:
    async def main() -> None:
        rec = Recorder()
        path = sock_dir / "ck.sock"
        srv = await _server(path, rec)
        early = await Proc.start(path, "early", "silent", "slow")
        late: Proc | None = None
        try:
            await early.wait("registered")
            t0 = time.time()
            deadline = Deadline(t0 + 15, 2, t0)
            srv.start_notice("n-4", deadline)
            await early.wait("notice")
            late = await Proc.start(path, "late", "done", "slow")
            n = await late.wait("notice")  # registered after the notice: told at once
            assert n["notice"] == "n-4"
            deadline.move_earlier(t0 + 5)
            srv.update_deadline()
            settled = await srv.wait_settled(until=t0 + 5)
            # the moved deadline cut early's budget to deadline - margin = t0 + 3
            (w_early,) = [w for w in srv.workloads.values() if w.name == "early"]
            assert w_early.budget_end == pytest.approx(t0 + 3, abs=0.05)
            assert time.time() < t0 + 5 and settled.counts == {"silent": 1, "done": 1}
        finally:
            await early.stop()
            if late:
                await late.stop()
            await srv.close()

    asyncio.run(main())


def _raw(path: Path) -> tuple[socket.socket, Any]:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    s.connect(str(path))
    return s, s.makefile("rb")


def test_bad_input_gets_clear_errors(sock_dir: Path) -> None:
    async def main() -> None:
        rec = Recorder()
        path = sock_dir / "ck.sock"
        srv = await _server(path, rec)

        def client() -> list[str]:
            s, f = _raw(path)
            errors = []
            for line in (
                b"not json\n",
                b"[1,2]\n",
                b'{"op":"done"}\n',
                b'{"op":"register"}\n',
                b'{"op":"register","workload":"x","v":2}\n',
                b'{"op":"register","workload":"ok"}\n',
                b'{"op":"register","workload":"again"}\n',
                b'{"op":"need","seconds":-1}\n',
                b'{"op":"frobnicate"}\n',
            ):
                s.sendall(line)
                reply = json.loads(f.readline())
                errors.append(reply.get("error") or reply["op"])
            s.sendall(b"x" * (70 * 1024) + b"\n")
            errors.append(json.loads(f.readline())["error"])
            errors.append(repr(f.readline()))  # closed after an overlong line
            s.close()
            return errors

        try:
            errors = await asyncio.to_thread(client)
        finally:
            await srv.close()
        assert errors[0].startswith("Expecting value")
        assert errors[1] == "expected a JSON object per line"
        assert errors[2] == "op 'done': register first"
        assert errors[3].startswith("workload: expected a non-empty string")
        assert errors[4] == "v: this agent speaks protocol version 1, not 2"
        assert errors[5] == "registered"
        assert errors[6] == "register: this connection is already registered as w-1"
        assert errors[7] == "need: there is no notice to answer"
        assert errors[8].startswith("op: unknown operation 'frobnicate'")
        assert errors[9] == "line longer than 65536 bytes; closing"
        assert errors[10] == "b''"
        # the one that registered and then left before any notice is forgotten, not waited for
        assert srv.workloads == {}

    asyncio.run(main())


def test_refuses_to_replace_a_live_socket_or_a_file(sock_dir: Path) -> None:
    async def main() -> None:
        path = sock_dir / "ck.sock"
        a = await _server(path, Recorder())
        try:
            with pytest.raises(FileExistsError, match="another process is listening"):
                await _server(path, Recorder())
        finally:
            await a.close()
        path.write_text("not a socket")
        with pytest.raises(FileExistsError, match="not a socket"):
            await _server(path, Recorder())
        path.unlink()
        # a stale socket (its listener gone) is replaced
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.close()
        b = await _server(path, Recorder())
        assert oct(path.stat().st_mode & 0o777) == "0o660"  # the agent's user and the workloads' group only
        await b.close()

    asyncio.run(main())


def test_agent_tells_registered_workloads_at_once(
    tmp_path: Path, sock_dir: Path, kube: Any, nats_server: Any, pod_cgroups: Any
) -> None:
    """The agent process serves the socket: a workload process of pod web-0 (in its cgroup) registered under the
    ``web`` contract (6 s budget in the test hall) is told of the notice with its budget, and its answer is in the
    agent's spool."""
    import subprocess

    from tests.harness import AgentEnv, add_pod, wait_for

    path = sock_dir / "agent.sock"
    env = AgentEnv(
        tmp_path / "agent", kube, nats_server, checkpoint_socket=str(path), kube_cgroup_root=pod_cgroups.root
    )
    pod = add_pod(kube, "web", "web-0", env.node, prestop=0.5)
    proc = None
    try:
        env.start().wait_subscribed()
        argv = [sys.executable, "-m", "tests.checkpoint_workload", str(path), "web-0", "done:0.3", "web"]
        proc = subprocess.Popen(pod_cgroups.argv(pod, argv), stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        registered = json.loads(proc.stdout.readline())
        assert registered["kind"] == "registered" and registered["budget_s"] == 6.0
        t0 = env.send(env.notice("ck-1", 20))
        notice = json.loads(proc.stdout.readline())
        accepted = env.of("notice.accepted")[0]
        assert notice["notice"] == "ck-1"
        assert notice["budget_end"] == pytest.approx(accepted["received_at"] + 6.0, abs=0.01)
        assert notice["t"] < t0 + 2  # told at once (the seed's first-action bound), not after the drain
        done = wait_for(lambda: env.of("checkpoint.done"), 10, "checkpoint.done in the spool")
        assert done[0]["workload"] == "web-0" and done[0]["notice"] == "ck-1"
        assert env.of("checkpoint.registered")[0]["pid"] == proc.pid
        assert env.outcome(20)["type"] == "drain.drained"
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        env.stop()
    assert not path.exists()  # removed on a clean stop


def test_client_library_is_one_standard_library_file(tmp_path: Path) -> None:
    """A workload image vendors the one file: it imports under the system interpreter with no site packages."""
    import shutil
    import subprocess

    import sco.workload.checkpoint_client as mod

    shutil.copy(mod.__file__, tmp_path / "checkpoint_client.py")
    r = subprocess.run(
        ["/usr/bin/python3", "-S", "-c", "import checkpoint_client as c; print(c.DEFAULT_SOCKET)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "/run/sco/checkpoint.sock"


def test_slurm_job_of_reads_cgroup_then_environment(tmp_path: Path) -> None:
    from sco.agent.checkpoint import slurm_job_of

    (tmp_path / "10").mkdir()
    (tmp_path / "10" / "cgroup").write_text("0::/system.slice/slurmstepd.scope/job_4242/step_batch/user/task_0\n")
    (tmp_path / "10" / "environ").write_bytes(b"SLURM_JOB_ID=1\0")
    (tmp_path / "11").mkdir()
    (tmp_path / "11" / "cgroup").write_text("0::/user.slice\n")
    (tmp_path / "11" / "environ").write_bytes(b"PATH=/bin\0SLURM_JOB_ID=77\0")
    (tmp_path / "12").mkdir()
    (tmp_path / "12" / "cgroup").write_text("0::/\n")
    (tmp_path / "12" / "environ").write_bytes(b"PATH=/bin\0")
    assert slurm_job_of(10, tmp_path) == 4242  # the cgroup wins over what the environment says
    assert slurm_job_of(11, tmp_path) == 77
    assert slurm_job_of(12, tmp_path) is None
    assert slurm_job_of(13, tmp_path) is None  # gone
    assert slurm_job_of(-1, tmp_path) is None


def test_bound_job_and_pod_come_only_from_where_the_scheduler_puts_them(tmp_path: Path) -> None:
    """What a registration is bound to: a ``job_<id>`` or ``pod<uid>`` cgroup a user made in a subtree delegated to
    it, or SLURM_JOB_ID in its environment, names nothing (the process chose them)."""
    from sco.agent.checkpoint import slurm_job_bound
    from sco.agent.owner import pod_cgroup, pod_uid_of

    uid = "0f5e1c9a-1b2c-4d3e-8f90-123456789abc"
    u_ = uid.replace("-", "_")  # the systemd cgroup driver's spelling
    cgroups = {
        10: "0::/system.slice/slurmstepd.scope/job_4242/step_batch/user/task_0\n",  # cgroup v2
        11: "4:freezer:/slurm/uid_1000/job_77/step_0/task_0\n0::/\n",  # cgroup v1
        12: "0::/user.slice/user-1000.slice/user@1000.service/job_99/x\n",  # delegated: forged
        13: f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u_}.slice/cri-containerd-a.scope\n",
        14: f"0::/kubepods/besteffort/pod{uid}/abc123\n",  # cgroupfs driver
        15: f"0::/user.slice/user-1000.slice/user@1000.service/kubepods/pod{uid}/x\n",  # delegated: forged
        16: f"0::/node-root/kubepods.slice/kubepods-pod{u_}.slice/c\n",  # --cgroup-root=/node-root
    }
    for pid, text in cgroups.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cgroup").write_text(text)
        (tmp_path / str(pid) / "environ").write_bytes(b"SLURM_JOB_ID=5\0")
        (tmp_path / str(pid) / "stat").write_bytes(f"{pid} (sh) S 1 1".encode())
    assert slurm_job_bound(10, tmp_path) == 4242
    assert slurm_job_bound(11, tmp_path) == 77
    assert slurm_job_bound(12, tmp_path) is None  # neither the delegated job_99 nor its SLURM_JOB_ID=5
    assert [pod_uid_of(p, tmp_path) for p in (13, 14, 15, 16)] == [uid, uid, None, None]
    assert pod_uid_of(16, tmp_path, pod_cgroup("/node-root")) == uid
