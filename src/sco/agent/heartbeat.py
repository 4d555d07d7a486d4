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
from typing import Any

from sco import __version__
from sco.agent.boot import boot_id

log = logging.getLogger("sco.agent.heartbeat")


def body(agent: Any) -> bytes:
    """What one beat says: who, which boot, the drain's state, the bundle serial, the spool backlog."""
    b = agent.cache.bundle
    return json.dumps(
        {
            "node": agent.cfg.node,
            "boot_id": boot_id(),
            "version": __version__,
            "drain": agent.drain_state(),
            "bundle_serial": b.serial if b else None,
            "backlog": agent.spool.last_seq - agent.spool.published_seq,
            "at": round(agent.clock(), 3),
        },
        separators=(",", ":"),
    ).encode()


async def run(agent: Any) -> None:
    """Beat once connected and then every ``heartbeat_seconds`` (at once again after an outage longer than that);
    a failed publish is said once until one succeeds again."""
    every = float(agent.cfg.heartbeat_seconds)
    if every <= 0:
        return
    subject = agent.cfg.subject(agent.cfg.heartbeat_subject)
    loop = asyncio.get_running_loop()
    last = -math.inf
    failing = False
    while not agent._stop.is_set():
        nc = agent.nc
        if nc is not None and nc.is_connected and loop.time() - last >= every:
            last = loop.time()
            try:
                await nc.publish(subject, body(agent))
                if failing:
                    log.info("heartbeat on %s published again", subject)
                failing = False
            except Exception as e:  # a closed or draining connection: the next beat tries again
                if not failing:
                    log.warning("heartbeat on %s not published: %s", subject, e)
                failing = True
        with contextlib.suppress(TimeoutError):  # a second at most: the first beat follows the connection
            await asyncio.wait_for(agent._stop.wait(), min(every, 1.0))


__all__ = ["body", "run"]
