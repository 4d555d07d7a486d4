"""This instance's boot, read by the drain latch (daemon) and the heartbeat; a module of its own so that neither
imports the other for it."""

from __future__ import annotations


def boot_id() -> str:
    """This instance's boot: a drain latch from another boot (a new instance) does not hold."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""
