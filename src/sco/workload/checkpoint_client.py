"""Python client for the node agent's checkpoint socket (protocol: ``agent/CHECKPOINT-PROTOCOL.md``).

Standard library only and self-contained: copy this one file into a workload image if you like.

    from sco.workload.checkpoint_client import CheckpointClient

    def save(notice):                       # runs in the client's thread when a reclaim notice comes
        while not checkpoint_written():
            if notice.budget_left() < 5:
                notice.need(3)              # ask for 3 s more; raises Refused past the budget
            write_some()
        # returning answers "done": the agent's drain moves on; a dict returned is the done's report
        return {"checkpointed": True, "save_s": 1.2, "step": 400}

    client = CheckpointClient("trainer-0", contract="training", on_notice=save,
                              resume={"from_step": 390, "steps_redone": 4})   # what the last attempt lost
    client.connect()                        # registers; the notice may come at any time after this

Socket path: ``$SCO_CHECKPOINT_SOCKET`` or ``/run/sco/checkpoint.sock`` (pods mount ``/run/sco`` as hostPath).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_SOCKET = "/run/sco/checkpoint.sock"
PROTOCOL_VERSION = 1


class CheckpointError(Exception):
    """The agent answered with an error, or the socket is gone."""


class Refused(CheckpointError):
    """A ``need`` past the workload's budget: nothing more is granted."""

    def __init__(self, reason: str, budget_end: float) -> None:
        super().__init__(reason)
        self.budget_end = budget_end


@dataclass
class Notice:
    id: str
    deadline: float  # epoch seconds: the instance is gone then
    budget_end: float  # epoch seconds: this workload's own budget ends then (at or before the deadline)
    client: CheckpointClient

    def budget_left(self) -> float:
        return self.budget_end - time.time()

    def need(self, seconds: float) -> float:
        """Ask for ``seconds`` more from now; returns the granted end time. Raises :class:`Refused` past the budget."""
        return self.client.need(seconds)


class CheckpointClient:
    def __init__(
        self,
        workload: str,
        *,
        contract: str | None = None,
        on_notice: Callable[[Notice], Any] | None = None,
        path: str | None = None,
        auto_done: bool = True,
        timeout: float = 5.0,
        resume: dict[str, Any] | None = None,
    ) -> None:
        """``on_notice(notice)`` runs in the client's reader thread; when it returns (and ``auto_done``), the
        client answers ``done``, with the returned dict (if any) as its report (``checkpointed``, ``save_s``,
        ``step``). If it raises, nothing is answered: the agent waits out the budget. ``resume`` is said at
        registration: what this run resumed from (``from_step``, ``steps_redone``: the work lost last time)."""
        self.workload, self.contract, self.on_notice = workload, contract, on_notice
        self.resume = resume
        self.path = path or os.environ.get("SCO_CHECKPOINT_SOCKET", DEFAULT_SOCKET)
        self.auto_done, self.timeout = auto_done, timeout
        self.id: str | None = None
        self.budget_s: float | None = None
        self.notice: Notice | None = None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._replies: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._handled: set[str] = set()

    # --- connection --------------------------------------------------------------------------------

    def connect(self) -> CheckpointClient:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self.path)
        except OSError as e:
            s.close()
            raise CheckpointError(f"{self.path}: cannot connect to the node agent: {e}") from None
        s.settimeout(None)
        self._sock = s
        self._thread = threading.Thread(target=self._read, name=f"checkpoint:{self.workload}", daemon=True)
        self._thread.start()
        msg: dict[str, Any] = {"op": "register", "workload": self.workload}
        if self.contract:
            msg["contract"] = self.contract
        if self.resume:
            msg["resume"] = self.resume
        reply = self._call(msg, ("registered",))
        self.id, self.budget_s = reply["id"], reply.get("budget_s")
        return self

    def close(self) -> None:
        self._closed = True
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()

    def __enter__(self) -> CheckpointClient:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- answers -----------------------------------------------------------------------------------

    def done(self, report: dict[str, Any] | None = None) -> None:
        """The final write is safe. ``report``: what it cost (``checkpointed``, ``save_s``, ``step``)."""
        msg: dict[str, Any] = {"op": "done"}
        if report:
            msg["report"] = report
        self._call(msg, ("ack",))

    def need(self, seconds: float) -> float:
        reply = self._call({"op": "need", "seconds": seconds}, ("granted", "refused"))
        if reply["op"] == "refused":
            raise Refused(reply.get("reason", "refused"), float(reply.get("budget_end", 0)))
        return float(reply["until"])

    def wait_notice(self, timeout: float | None = None) -> Notice | None:
        """For workloads without a callback: block until a notice has come (or ``timeout``)."""
        with self._cond:
            self._cond.wait_for(lambda: self.notice is not None or self._closed, timeout)
        return self.notice

    # --- plumbing ----------------------------------------------------------------------------------

    def _write(self, msg: dict[str, Any]) -> None:
        if self._sock is None:
            raise CheckpointError("not connected")
        data = json.dumps({"v": PROTOCOL_VERSION, **msg}).encode() + b"\n"
        with self._lock:
            try:
                self._sock.sendall(data)
            except OSError as e:
                raise CheckpointError(f"{self.path}: {e}") from None

    def _call(self, msg: dict[str, Any], ops: tuple[str, ...]) -> dict[str, Any]:
        self._write(msg)
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self._closed or any(r["op"] in (*ops, "error") for r in self._replies), self.timeout
            )
            if not ok:
                raise CheckpointError(f"no answer to {msg['op']} within {self.timeout} s")
            for i, r in enumerate(self._replies):
                if r["op"] in (*ops, "error"):
                    del self._replies[i]
                    if r["op"] == "error":
                        raise CheckpointError(r.get("error", "error"))
                    return r
        raise CheckpointError("the agent closed the connection")

    def _read(self) -> None:
        assert self._sock is not None
        f = self._sock.makefile("rb")
        try:
            for line in f:
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                if msg.get("op") == "notice":
                    self._on_notice(msg)
                else:
                    with self._cond:
                        self._replies.append(msg)
                        self._cond.notify_all()
        except OSError:
            pass
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()

    def _on_notice(self, msg: dict[str, Any]) -> None:
        nid = str(msg["notice"])
        with self._cond:
            if self.notice is not None and self.notice.id == nid:
                # A repeat (the deadline moved earlier): the running callback sees the shorter budget.
                self.notice.deadline, self.notice.budget_end = float(msg["deadline"]), float(msg["budget_end"])
                return
            n = self.notice = Notice(nid, float(msg["deadline"]), float(msg["budget_end"]), self)
            self._cond.notify_all()
        if self.on_notice is None or nid in self._handled:
            return
        self._handled.add(n.id)
        # The callback may call need()/done(), whose replies this thread must keep reading: run it apart.
        threading.Thread(target=self._run_callback, args=(n,), name=f"on_notice:{self.workload}", daemon=True).start()

    def _run_callback(self, n: Notice) -> None:
        assert self.on_notice is not None
        report = self.on_notice(n)
        if self.auto_done and not self._closed:
            with contextlib.suppress(CheckpointError):
                self.done(report if isinstance(report, dict) else None)
