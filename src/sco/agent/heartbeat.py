"""The agent's heartbeat: a small message every ``heartbeat_seconds`` on ``sco.heartbeat.<hall>.<node>``.

The relay's heartbeat stream keeps only the last message per subject (``max_msgs_per_subject=1``), so it holds
one message per node whatever the hall's size, and the control loop reads them all through one consumer that
delivers the last per subject (``sco.provider.heartbeats``): no request per node, no server work per node beyond
storing one message. The relay's allow-list lets a node publish only on its own heartbeat subject, and the
reader takes the node from the subject, never from the body, so a node cannot speak for another.

A plain publish (no JetStream ack): nothing waits on the relay, and a beat lost while the link is down is
replaced by the next one. No beat is queued while disconnected (nats-py would buffer stale ones); the body says
what the node is doing, for ``sco hall status``, never for a decision.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import Callable
from typing import Any

from sco import __version__

log = logging.getLogger("sco.agent.heartbeat")


def body(*, node: str, boot_id: str, drain: str, bundle_serial: int | None, backlog: int, at: float) -> bytes:
    """What one beat says: who, which boot, the drain's state, the bundle serial, the spool backlog."""
    return json.dumps(
        {
            "node": node,
            "boot_id": boot_id,
            "version": __version__,
            "drain": drain,
            "bundle_serial": bundle_serial,
            "backlog": backlog,
            "at": round(at, 3),
        },
        separators=(",", ":"),
    ).encode()


async def run(
    *, connection: Callable[[], Any], subject: str, every: float, beat: Callable[[], bytes], stop: asyncio.Event
) -> None:
    """Beat once connected and then every ``every`` seconds (at once again after an outage longer than that);
    a failed publish is said once until one succeeds again. ``connection()``: the relay's nats-py client or
    None; ``beat()``: the body as of now."""
    if every <= 0:
        return
    loop = asyncio.get_running_loop()
    last = -math.inf
    failing = False
    while not stop.is_set():
        nc = connection()
        if nc is not None and nc.is_connected and loop.time() - last >= every:
            last = loop.time()
            try:
                await nc.publish(subject, beat())
                if failing:
                    log.info("heartbeat on %s published again", subject)
                failing = False
            except Exception as e:  # a closed or draining connection: the next beat tries again
                if not failing:
                    log.warning("heartbeat on %s not published: %s", subject, e)
                failing = True
        with contextlib.suppress(TimeoutError):  # a second at most: the first beat follows the connection
            await asyncio.wait_for(stop.wait(), min(every, 1.0))


__all__ = ["body", "run"]
