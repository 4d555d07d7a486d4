"""The spool's publisher when JetStream refuses every publish (a stream missing or misconfigured for the hall).

Before: the publisher tried again at each wake-up, and while a backlog waits housekeeping wakes it twice a
second, so every agent of a hall sent two refused publishes a second, in step, for as long as the stream was
broken. Now a refused publish is tried again after ``sco._retry.Backoff`` (0.5 s doubling to 10 s, equal
jitter), and the backlog is published once JetStream takes it."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from pathlib import Path

import nats
from nats.aio.msg import Msg

from tests.harness import AgentEnv, NatsServer, ensure_stream, wait_for

REFUSAL = b'{"error":{"code":503,"err_code":10077,"description":"no stream for this subject"}}'


class RefusingJetStream:
    """Answers every publish on the events subjects as JetStream does when it cannot store it."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.at: list[float] = []
        self.refusing = True
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> RefusingJetStream:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    async def _run(self) -> None:
        nc = await nats.connect(self.url)

        async def on_msg(msg: Msg) -> None:
            if self.refusing:
                self.at.append(time.monotonic())
                await msg.respond(REFUSAL)

        sub = await nc.subscribe("sco.events.>", cb=on_msg)
        self._ready.set()
        while not self._stop.is_set():
            await asyncio.sleep(0.05)
        await sub.unsubscribe()
        await nc.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def test_a_refused_publish_is_retried_with_backoff_then_the_backlog_goes(tmp_path: Path) -> None:
    srv = NatsServer(tmp_path / "nats").start()  # no events stream: the refusals are the test's
    js = RefusingJetStream(srv.url).start()
    env = AgentEnv(tmp_path / "agent", None, srv)
    try:
        env.start().wait_subscribed()
        wait_for(lambda: js.at, 10, "the first refused publish")
        time.sleep(6.0)
        tries = [t for t in js.at if t - js.at[0] <= 6.0]
        gaps = [b - a for a, b in itertools.pairwise(tries)]
        # 0.5, 1, 2, 4 s steps, each drawn from its upper half: at most 5 tries in 6 s (was 12 or more)
        assert 2 <= len(tries) <= 5, gaps
        assert all(g >= 0.2 for g in gaps) and gaps[-1] >= 1.0, gaps
        # the stream made: the backlog is published at the next try (within the 10 s cap)
        js.refusing = False
        asyncio.run(ensure_stream(srv.url))
        wait_for(lambda: _backlog(env) == 0, 15, "the backlog published")
    finally:
        env.stop()
        js.stop()
        srv.stop()


def _backlog(env: AgentEnv) -> int:
    from sco.agent.spool import read_cursor

    published = read_cursor(env.state / "spool")
    return max(e["seq"] for e in env.events()) - published
