"""A workload process for the checkpoint-socket tests: connects with the real client library and behaves as told.

    python -m tests.checkpoint_workload SOCKET NAME MODE [CONTRACT]

MODE: done[:SECONDS]   save for SECONDS (default 0), then answer done (by returning from on_notice)
      silent           never answers (stays connected)
      disconnect       exits at the notice without answering
      need:N[:M]       asks for N more seconds, then (after M s, default N/2) answers done
      needonly:N       asks for N more seconds and never answers done
      greedy:N         asks for N more seconds (past its budget), reports the refusal, then answers done

Prints one JSON line per thing it learnt (registered, notice, granted, refused, exit), flushing each.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from sco.workload.checkpoint_client import CheckpointClient, Notice, Refused

_out_lock = threading.Lock()


def out(kind: str, **f: object) -> None:
    # One whole line at a time: the callback thread and the main thread both report.
    line = json.dumps({"kind": kind, "t": time.time(), **f}) + "\n"
    with _out_lock:
        sys.stdout.write(line)
        sys.stdout.flush()


def main() -> None:
    path, name, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    contract = sys.argv[4] if len(sys.argv) > 4 else None
    verb, _, arg = mode.partition(":")
    stop = threading.Event()

    def on_notice(n: Notice) -> None:
        out("notice", notice=n.id, deadline=n.deadline, budget_end=n.budget_end)
        if verb == "done":
            time.sleep(float(arg or 0))
        elif verb == "silent":
            stop.wait()
        elif verb == "disconnect":
            out("exit")
            os._exit(0)
        elif verb in ("need", "needonly", "greedy"):
            secs, _, then = arg.partition(":")
            try:
                until = n.need(float(secs))
                out("granted", until=until)
            except Refused as e:
                out("refused", reason=str(e), budget_end=e.budget_end)
            if verb == "needonly":
                stop.wait()
            time.sleep(float(then) if then else (float(secs) / 2 if verb == "need" else 0))

    c = CheckpointClient(name, contract=contract, on_notice=on_notice, path=path).connect()
    out("registered", id=c.id, budget_s=c.budget_s)
    # Stay alive until the agent closes the socket (or the test kills us).
    c.wait_notice()
    while not c._closed:
        time.sleep(0.05)


if __name__ == "__main__":
    main()
