"""The checkpoint socket (seed view 10: "Checkpoint client - agent socket - on_notice()").

A Unix socket on the node. A workload connects and registers; when a notice arrives every registered
workload is told at once (the deadline and its own budget); it answers ``done`` or ``need N`` more seconds
(refused past its budget). The drain waits for the workloads with :meth:`CheckpointServer.wait_settled`,
which returns as soon as every registered workload is done (or gone), so nobody waits for a budget that is
not needed. The protocol (newline-delimited JSON) is documented in ``agent/CHECKPOINT-PROTOCOL.md``.

Standard library only: it runs in the agent (40 MiB budget).
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import json
import logging
import math
import os
import re
import socket
import stat
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sco.agent.deadline import Deadline

log = logging.getLogger("sco.agent.checkpoint")
_JOB_CGROUP = re.compile(r"/job_(\d+)(/|$)", re.M)
# Only where slurmstepd makes jobs' cgroups (cgroup v2: system.slice/[<node>_]slurmstepd.scope; v1:
# slurm[_<node>]/uid_<n>): a "job_<id>" a user made in a subtree delegated to it is not a job.
_JOB_CGROUP_BOUND = re.compile(
    r"^\d+:[^:\n]*:/(?:system\.slice/(?:[^/\n]+_)?slurmstepd\.scope|slurm(?:_[^/\n]+)?/uid_\d+)/job_(\d+)(?:/|$)", re.M
)

PROTOCOL_VERSION = 1
MAX_LINE = 64 * 1024  # a registration is a few hundred bytes; anything longer is not a client of ours
MAX_CLIENTS = 1024
MAX_PER_UID = 128  # one uid cannot hold the node's slots (pods sharing a uid share this cap)
REGISTER_WITHIN_S = 10.0  # a connection that has not registered by then is closed: idle ones hold no slot
NAME_MAX = 253

# States a registration goes through. "settled" ones need no more waiting.
REGISTERED, NOTIFIED, EXTENDED, DONE, GONE, SILENT = "registered", "notified", "extended", "done", "gone", "silent"
SETTLED = frozenset({DONE, GONE, SILENT})

BudgetFn = Callable[[str | None], float | None]
"""contract name (or None) -> the contract's drain budget in seconds, None when the bundle has no such contract."""
EventFn = Callable[..., None]
"""(event type, **fields): where the server records what happened (the agent's spool)."""


@dataclass(frozen=True)
class Owner:
    """The pod or Slurm job a client process runs in, as the node sees it (its cgroup, then the scheduler)."""

    kind: str  # "pod" or "job"
    name: str  # namespace/name, or the job id
    contract: str | None  # the contract the bundle puts it under; None: none covers it
    job: int | None = None


class NotAWorkload(Exception):
    """The client process is in no pod or job of this node (the message says what was looked at)."""


class OwnerUnknown(Exception):
    """The process's pod or job could not be checked now (the scheduler did not answer): the client may retry."""


OwnerFn = Callable[[int, int], Awaitable[Owner]]
"""(pid, uid) from SO_PEERCRED -> the pod or job the process runs in; raises NotAWorkload or OwnerUnknown."""
RefusedFn = Callable[[str], None]
"""reason -> counted (the agent's sco_agent_checkpoint_refusals_total)."""
REFUSAL_REASONS = ("not_a_workload", "wrong_contract", "unverified", "uid_cap", "owner_cap", "full")


class Refused(Exception):
    """A registration refused: ``reason`` one of REFUSAL_REASONS, the message one line for the client."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class ProtocolError(Exception):
    """A client sent something the protocol does not allow; the message says what."""


@dataclass
class Workload:
    id: str
    name: str
    contract: str | None
    budget_s: float | None  # the contract's drain budget; None: the deadline's (no contract in the bundle)
    pid: int
    uid: int
    writer: asyncio.StreamWriter
    slurm_job: int | None = None  # the Slurm job the client process belongs to (from the kernel, not the client)
    owner: str | None = None  # "pod ns/name" or "job N": what the registration is bound to (None: not bound)
    state: str = REGISTERED
    budget_end: float = 0.0  # absolute time; set when notified
    granted_until: float = 0.0  # absolute time of the last "need" granted
    answered_at: float | None = None
    notified_at: float | None = None
    report: dict[str, Any] = field(default_factory=dict)  # what the workload said its done cost (checked)
    resume: dict[str, Any] = field(default_factory=dict)  # what it resumed from, said at registration

    def summary(self) -> dict[str, Any]:
        return {"id": self.id, "workload": self.name, "contract": self.contract, "state": self.state}

    def lost_work(self) -> dict[str, Any]:
        """Lost work as a figure: checkpointed or not, the save against the budget, steps redone on resume."""
        granted = (self.budget_end - self.notified_at) if self.notified_at is not None else None
        save_s = self.report.get("save_s")
        out: dict[str, Any] = {
            "workload": self.name,
            "contract": self.contract,
            "state": self.state,
            "checkpointed": self.state == DONE and self.report.get("checkpointed", True) is True,
            "save_s": save_s,
            "budget_s": round(granted, 3) if granted is not None else self.budget_s,
            "answered_after_s": (
                round(self.answered_at - self.notified_at, 3)
                if self.answered_at is not None and self.notified_at is not None
                else None
            ),
        }
        if save_s is not None and granted is not None:
            out["save_within_budget"] = save_s <= granted
        if "step" in self.report:
            out["step"] = self.report["step"]
        if self.resume:
            out["resumed_from_step"] = self.resume.get("from_step")
            out["steps_redone"] = self.resume.get("steps_redone")
        return out


@dataclass
class ActiveNotice:
    id: str
    deadline: Deadline  # the drain's one Deadline, shared: budgets here are its budget ends
    told_terminate_at: float  # the termination time workloads were last told


@dataclass
class Settled:
    """What :meth:`CheckpointServer.wait_settled` found."""

    all_done: bool
    counts: dict[str, int] = field(default_factory=dict)
    pending: list[dict[str, Any]] = field(default_factory=list)


def _peercred(sock: socket.socket | None) -> tuple[int, int]:
    """(pid, uid) of the connecting process, from the kernel (SO_PEERCRED): recorded, never taken from the client."""
    if sock is None:
        return -1, -1
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", raw)
        return pid, uid
    except OSError:
        return -1, -1


def slurm_job_of(pid: int, proc: Path = Path("/proc")) -> int | None:
    """The Slurm job a process runs in: its cgroup (``.../job_<id>/...``), else its environment (SLURM_JOB_ID), else
    the ``slurmstepd: [<job>.<step>]`` it descends from (the agent, as its own user, may not read another user's
    environment; any user may read a process's stat and cmdline)."""
    if pid <= 0:
        return None
    try:
        m = _JOB_CGROUP.search((proc / str(pid) / "cgroup").read_text())
        if m:
            return int(m.group(1))
    except (OSError, ValueError):
        return None
    try:
        for item in (proc / str(pid) / "environ").read_bytes().split(b"\0"):
            if item.startswith(b"SLURM_JOB_ID="):
                return int(item.split(b"=", 1)[1])
    except PermissionError:
        return _stepd_ancestor_job(pid, proc)
    except (OSError, ValueError):
        return None
    return None


_STEPD_CMD = re.compile(rb"^slurmstepd: \[(\d+)\.")


def slurm_job_bound(pid: int, proc: Path = Path("/proc")) -> int | None:
    """The Slurm job a process runs in, from what the process cannot choose: its cgroup (``job_<id>``,
    proctrack/cgroup), else the root-owned ``slurmstepd: [<job>.<step>]`` it descends from (proctrack/linuxproc).
    Never its environment (SLURM_JOB_ID is the process's own to set)."""
    if pid <= 0:
        return None
    try:
        m = _JOB_CGROUP_BOUND.search((proc / str(pid) / "cgroup").read_text())
    except (OSError, ValueError):
        return None
    if m:
        return int(m.group(1))
    return _stepd_ancestor_job(pid, proc, root_only=True)


def _stepd_ancestor_job(pid: int, proc: Path, root_only: bool = False) -> int | None:
    for _ in range(64):  # a job's process tree is shallow; a loop guard, not a limit anyone meets
        try:
            ppid = int((proc / str(pid) / "stat").read_bytes().rsplit(b")", 1)[1].split()[1])
            m = _STEPD_CMD.match((proc / str(ppid) / "cmdline").read_bytes())
            # any process may rename itself "slurmstepd: [...]": only root's (slurmstepd runs as root) counts
            if m and root_only and (proc / str(ppid)).stat().st_uid != 0:
                m = None
        except (OSError, ValueError, IndexError):
            return None
        if m:
            return int(m.group(1))
        if ppid <= 1:
            return None
        pid = ppid
    return None


# What a workload may say of its own work: small, typed, and only these keys (the spool records it).
_REPORT_KEYS: dict[str, type] = {"checkpointed": bool, "save_s": float, "step": int, "steps_at_risk": int}
_RESUME_KEYS: dict[str, type] = {"from_step": int, "steps_redone": int}


def _figures(msg: dict[str, Any], key: str, allowed: dict[str, type]) -> dict[str, Any]:
    v = msg.get(key)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ProtocolError(f"{key}: expected an object with {', '.join(allowed)}")
    out: dict[str, Any] = {}
    for k, val in v.items():
        want = allowed.get(k)
        if want is None:
            raise ProtocolError(f"{key}.{k}: unknown field (expected {', '.join(allowed)})")
        if want is bool:
            ok = isinstance(val, bool)
        elif want is int:
            ok = isinstance(val, int) and not isinstance(val, bool) and 0 <= val < 2**53
        else:
            ok = isinstance(val, int | float) and not isinstance(val, bool) and math.isfinite(val) and val >= 0
        if not ok:
            raise ProtocolError(f"{key}.{k}: expected a {'boolean' if want is bool else 'non-negative number'}")
        out[k] = round(float(val), 3) if want is float else val
    return out


def _name(msg: dict[str, Any], key: str, required: bool) -> str | None:
    v = msg.get(key)
    if v is None and not required:
        return None
    if not isinstance(v, str) or not v or len(v) > NAME_MAX or any(ord(c) < 32 for c in v):
        raise ProtocolError(f"{key}: expected a non-empty string of at most {NAME_MAX} printable characters")
    return v


class CheckpointServer:
    def __init__(
        self,
        path: Path,
        *,
        budget_for: BudgetFn,
        on_event: EventFn | None = None,
        clock: Callable[[], float] = time.time,
        mode: int = 0o660,
        group: str = "",
        max_clients: int = MAX_CLIENTS,
        max_per_uid: int = MAX_PER_UID,
        owner_of: OwnerFn | None = None,
        on_refused: RefusedFn | None = None,
        register_within: float = REGISTER_WITHIN_S,
    ) -> None:
        self.path = Path(path)
        self.budget_for = budget_for
        self.on_event = on_event or (lambda *a, **k: None)
        self.clock = clock
        self.mode = mode
        self.group = group
        self.max_clients = max_clients
        self.max_per_uid = max_per_uid
        # None: a client's word on its contract is taken (library use, tests of the protocol); the agent always
        # binds a registration to the caller's pod or job.
        self.owner_of = owner_of
        self.on_refused = on_refused or (lambda reason: None)
        self.register_within = register_within
        self.refusals: dict[str, int] = dict.fromkeys(REFUSAL_REASONS, 0)
        self._said: dict[str, float] = {}  # refusal reason -> when last logged (a flood is one line a minute)
        self.workloads: dict[str, Workload] = {}
        self.notice: ActiveNotice | None = None
        self._server: asyncio.AbstractServer | None = None
        self._seq = 0
        self._changed = asyncio.Event()
        self._conns: set[asyncio.Task[None]] = set()

    # --- life cycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            st = self.path.lstat()
            if not stat.S_ISSOCK(st.st_mode):
                raise FileExistsError(f"{self.path}: exists and is not a socket; not removing it")
            if self._live(self.path):
                raise FileExistsError(f"{self.path}: another process is listening on it")
            self.path.unlink()  # a stale socket from a previous run
        gid = -1
        if self.group:
            try:
                gid = grp.getgrnam(self.group).gr_gid
            except KeyError:
                raise FileNotFoundError(f"checkpoint_group: no group {self.group!r} on this node") from None
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path), limit=MAX_LINE)
        # Only the workloads' users connect: the socket's group (the workloads' users are its members, pods get
        # it as a supplemental group), never every local process. Whoever connects is still bound to the pod or
        # job its process runs in (owner_of).
        try:
            if gid >= 0:
                os.chown(self.path, -1, gid)
            os.chmod(self.path, self.mode)
        except OSError:
            self._server.close()
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            raise
        log.info("checkpoint socket listening on %s", self.path)

    @staticmethod
    def _live(path: Path) -> bool:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(0.2)
            try:
                s.connect(str(path))
                return True
            except OSError:
                return False

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for w in list(self.workloads.values()):
                w.writer.close()
            for t in list(self._conns):
                t.cancel()
            if self._conns:
                await asyncio.wait(self._conns, timeout=2)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
            self._server = None
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    # --- the notice --------------------------------------------------------------------------------

    def start_notice(self, notice_id: str, deadline: Deadline) -> int:
        """Tell every registered workload, at once. Returns how many were told."""
        self.notice = ActiveNotice(notice_id, deadline, deadline.terminate_at)
        told = 0
        for w in list(self.workloads.values()):
            if w.state not in SETTLED:
                self._notify(w)
                told += 1
        self.on_event("checkpoint.notified", notice_id=notice_id, workloads=told)
        self._changed.set()
        return told

    def update_deadline(self) -> None:
        """The shared Deadline moved earlier: budgets shrink; every workload still working is told again."""
        n = self.notice
        if n is None or n.deadline.terminate_at >= n.told_terminate_at:
            return
        n.told_terminate_at = n.deadline.terminate_at
        for w in list(self.workloads.values()):
            if w.state not in SETTLED:
                self._notify(w)
        self._changed.set()

    def _budget_end(self, w: Workload) -> float:
        """min(notice + contract budget, kill time); without a known contract, the kill time."""
        n = self.notice
        assert n is not None
        return n.deadline.kill_at if w.budget_s is None else n.deadline.budget_end(w.budget_s)

    def _notify(self, w: Workload) -> None:
        n = self.notice
        assert n is not None
        now = self.clock()
        w.budget_end = self._budget_end(w)
        w.granted_until = min(w.granted_until, w.budget_end) if w.granted_until else 0.0
        if w.state in (REGISTERED, NOTIFIED):
            w.state = NOTIFIED
        w.notified_at = now
        self._send(
            w,
            {
                "op": "notice",
                "notice": n.id,
                "deadline": round(n.deadline.terminate_at, 3),
                "budget_end": round(w.budget_end, 3),
                "budget_s": round(max(0.0, w.budget_end - now), 3),
                "now": round(now, 3),
            },
        )

    def _send(self, w: Workload, msg: dict[str, Any]) -> None:
        # A write to a closed peer fails quietly here: the reader sees the disconnect and records it.
        with contextlib.suppress(ConnectionError, RuntimeError):
            w.writer.write(json.dumps({"v": PROTOCOL_VERSION, **msg}, separators=(",", ":")).encode() + b"\n")

    # --- waiting for the workloads ------------------------------------------------------------------

    def _pending(self, now: float) -> list[Workload]:
        """Workloads still owed a wait: not settled, and inside their grant (if they asked) or their budget."""
        out = []
        for w in self.workloads.values():
            if w.state in SETTLED:
                continue
            if now >= w.budget_end or (w.state == EXTENDED and now >= w.granted_until):
                w.state = SILENT
                self.on_event(
                    "checkpoint.silent",
                    id=w.id,
                    workload=w.name,
                    contract=w.contract,
                    reason="granted time over without done" if w.granted_until else "no answer within its budget",
                )
                continue
            out.append(w)
        return out

    async def wait_settled(self, until: float) -> Settled:
        """Wait until every registered workload is done, gone, or out of time, or ``until`` comes."""
        while True:
            self._changed.clear()
            now = self.clock()
            pending = self._pending(now) if self.notice is not None else list(self._unsettled())
            if not pending or now >= until:
                return self.settled(pending)
            wake = min(
                [until, *(w.budget_end for w in pending), *(w.granted_until for w in pending if w.granted_until)]
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), max(0.01, wake - now))

    def job_done(self, job: int) -> bool:
        """Whether the Slurm job's workloads have all answered: at least one ``done``, none still working."""
        ws = [w for w in self.workloads.values() if w.slurm_job == job]
        return any(w.state == DONE for w in ws) and all(w.state in SETTLED for w in ws)

    def lost_work(self) -> list[dict[str, Any]]:
        """Per workload told of the current notice: for every drain outcome (``workloads``)."""
        if self.notice is None:
            return []
        return [w.lost_work() for w in self.workloads.values() if w.notified_at is not None]

    def _unsettled(self) -> list[Workload]:
        return [w for w in self.workloads.values() if w.state not in SETTLED]

    def settled(self, pending: list[Workload] | None = None) -> Settled:
        pending = self._unsettled() if pending is None else pending
        counts: dict[str, int] = {}
        for w in self.workloads.values():
            counts[w.state] = counts.get(w.state, 0) + 1
        return Settled(not pending, counts, [w.summary() for w in pending])

    # --- one client --------------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        pid, uid = _peercred(writer.get_extra_info("socket"))
        w: Workload | None = None
        registered_by = time.monotonic() + self.register_within
        try:
            while True:
                try:
                    if w is None:  # an idle connection that never registers holds nothing for long
                        async with asyncio.timeout_at(
                            asyncio.get_running_loop().time() + max(0.0, registered_by - time.monotonic())
                        ):
                            line = await reader.readuntil(b"\n")
                    else:
                        line = await reader.readuntil(b"\n")
                except TimeoutError:
                    self._error(writer, f"no registration within {self.register_within:g} s; closing")
                    return
                except asyncio.IncompleteReadError:
                    return  # EOF (a partial last line is dropped: it was never a whole message)
                except asyncio.LimitOverrunError:
                    self._error(writer, f"line longer than {MAX_LINE} bytes; closing")
                    return
                if not line.strip():
                    continue
                try:
                    msg = json.loads(line)
                    if not isinstance(msg, dict):
                        raise ProtocolError("expected a JSON object per line")
                    w = await self._handle(msg, w, writer, pid, uid)
                except Refused as e:
                    self._refused(e, pid, uid)
                    self._error(writer, str(e))
                    if e.reason != "unverified":
                        await writer.drain()
                        return  # nothing more to say to it: the slot and the connection go back at once
                except (ValueError, ProtocolError) as e:  # JSONDecodeError is a ValueError
                    self._error(writer, str(e))
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._conns.discard(task)
            if w is not None:
                self._gone(w)
            writer.close()

    def _error(self, writer: asyncio.StreamWriter, message: str) -> None:
        with contextlib.suppress(ConnectionError, RuntimeError):
            writer.write(json.dumps({"v": PROTOCOL_VERSION, "op": "error", "error": message}).encode() + b"\n")

    def _refused(self, e: Refused, pid: int, uid: int) -> None:
        self.refusals[e.reason] = self.refusals.get(e.reason, 0) + 1
        self.on_refused(e.reason)
        now = time.monotonic()
        if now - self._said.get(e.reason, -math.inf) >= 60:  # counted always, logged once a minute a reason
            self._said[e.reason] = now
            log.warning("checkpoint registration refused (pid %d, uid %d): %s", pid, uid, e)

    async def _handle(
        self, msg: dict[str, Any], w: Workload | None, writer: asyncio.StreamWriter, pid: int, uid: int
    ) -> Workload | None:
        op = msg.get("op")
        v = msg.get("v", PROTOCOL_VERSION)
        if v != PROTOCOL_VERSION:
            raise ProtocolError(f"v: this agent speaks protocol version {PROTOCOL_VERSION}, not {v!r}")
        if op == "register":
            if w is not None:
                raise ProtocolError("register: this connection is already registered as " + w.id)
            return await self._register(msg, writer, pid, uid)
        if w is None:
            raise ProtocolError(f"op {op!r}: register first")
        if op == "done":
            self._done(w, msg)
        elif op == "need":
            self._need(w, msg)
        elif op == "ping":
            self._send(w, {"op": "pong"})
        else:
            raise ProtocolError(f"op: unknown operation {op!r} (register, done, need, ping)")
        return w

    async def _owner(self, pid: int, uid: int, contract: str | None) -> tuple[str | None, int | None, str | None]:
        """(the contract the registration is under, the Slurm job) as the node sees the caller's process."""
        if self.owner_of is None:
            return contract, slurm_job_of(pid), None
        try:
            owner = await self.owner_of(pid, uid)
        except NotAWorkload as e:
            why = f"register: refused: {e}; only a pod's or job's process may register"
            raise Refused("not_a_workload", why) from None
        except OwnerUnknown as e:
            raise Refused("unverified", f"register: refused for now: {e}; try again") from None
        if contract is not None and contract != owner.contract:
            theirs = f"contract {owner.contract!r}" if owner.contract else "no contract"
            raise Refused(
                "wrong_contract",
                f"register: refused: contract {contract!r} is not this process's: {owner.kind} {owner.name} is under "
                f"{theirs}",
            )
        return owner.contract, owner.job, f"{owner.kind} {owner.name}"

    def _room(self, uid: int, owner: str | None = None) -> None:
        if len(self._unsettled()) >= self.max_clients:
            raise Refused("full", f"register: {self.max_clients} workloads already registered on this node")
        if sum(1 for w in self._unsettled() if w.uid == uid) >= self.max_per_uid:
            raise Refused("uid_cap", f"register: uid {uid} already holds {self.max_per_uid} registrations on this node")
        # a pod or job is held to the same cap whatever uids its processes take (a root container may take many)
        if owner is not None and sum(1 for w in self._unsettled() if w.owner == owner) >= self.max_per_uid:
            raise Refused("owner_cap", f"register: {owner} already holds {self.max_per_uid} registrations on this node")

    async def _register(self, msg: dict[str, Any], writer: asyncio.StreamWriter, pid: int, uid: int) -> Workload:
        self._room(uid)
        name = _name(msg, "workload", True)
        contract = _name(msg, "contract", False)
        assert name is not None
        resume = _figures(msg, "resume", _RESUME_KEYS)
        contract, job, owner = await self._owner(pid, uid, contract)
        self._room(uid, owner)  # again, and its pod's or job's: others may have registered meanwhile
        budget = self.budget_for(contract)
        self._seq += 1
        w = Workload(f"w-{self._seq}", name, contract, budget, pid, uid, writer, job, owner=owner, resume=resume)
        self.workloads[w.id] = w
        self._send(
            w,
            {
                "op": "registered",
                "id": w.id,
                "contract": contract,
                "known_contract": budget is not None,
                "budget_s": budget,
            },
        )
        self.on_event(
            "checkpoint.registered",
            id=w.id,
            workload=name,
            contract=contract,
            pid=pid,
            uid=uid,
            job=w.slurm_job,
            **({"resume": resume} if resume else {}),
        )
        if self.notice is not None:  # registered after the notice: told at once
            self._notify(w)
        return w

    def _done(self, w: Workload, msg: dict[str, Any]) -> None:
        if w.state in SETTLED:
            self._send(w, {"op": "ack", "state": w.state})
            return
        if self.notice is None:
            raise ProtocolError("done: there is no notice to answer")
        w.report = _figures(msg, "report", _REPORT_KEYS)
        w.state, w.answered_at = DONE, self.clock()
        self._send(w, {"op": "ack", "state": DONE})
        self.on_event(
            "checkpoint.done",
            id=w.id,
            workload=w.name,
            contract=w.contract,
            after_s=round(w.answered_at - (w.notified_at or w.answered_at), 3),
            **({"report": w.report} if w.report else {}),
        )
        self._changed.set()

    def _need(self, w: Workload, msg: dict[str, Any]) -> None:
        if self.notice is None:
            raise ProtocolError("need: there is no notice to answer")
        secs = msg.get("seconds")
        if isinstance(secs, bool) or not isinstance(secs, int | float) or not math.isfinite(secs) or secs <= 0:
            raise ProtocolError(f"need: seconds: expected a positive number, got {secs!r}")
        if w.state in SETTLED:
            raise ProtocolError(f"need: this workload is already {w.state}")
        now = self.clock()
        until = now + float(secs)
        if until > w.budget_end:
            # Past its budget: refused; the workload keeps what is left of its budget and no more.
            self._send(
                w,
                {
                    "op": "refused",
                    "seconds": secs,
                    "budget_end": round(w.budget_end, 3),
                    "budget_s": round(max(0.0, w.budget_end - now), 3),
                    "reason": f"{secs} s would end {until - w.budget_end:.1f} s past this workload's budget",
                },
            )
            self.on_event("checkpoint.need_refused", id=w.id, workload=w.name, seconds=secs)
            return
        w.state, w.granted_until, w.answered_at = EXTENDED, until, now
        self._send(w, {"op": "granted", "seconds": secs, "until": round(until, 3)})
        self.on_event("checkpoint.need_granted", id=w.id, workload=w.name, seconds=secs)
        self._changed.set()

    def _gone(self, w: Workload) -> None:
        if w.state not in SETTLED:
            if self.notice is None:
                self.workloads.pop(w.id, None)  # left before any notice: forget it
                return
            w.state = GONE
            self.on_event("checkpoint.gone", id=w.id, workload=w.name, contract=w.contract)
        self._changed.set()
