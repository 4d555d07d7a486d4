"""Logging setup shared by the entry points (sco, sco-agent, sco-control-loop).

``SCO_LOG_FORMAT=json`` (or ``--log-format json`` where an entry point offers it) writes one JSON object per line
with ``time`` (RFC 3339, UTC), ``level``, ``logger`` and ``message`` (and ``exc`` with a traceback), for journald
forwarders and log pipelines that parse lines; the default ``text`` is ``LEVEL logger: message``.
``SCO_LOG_LEVEL`` sets the level where the entry point has no setting of its own (default INFO).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import UTC, datetime

FORMATS = ("text", "json")
TEXT_FORMAT = "%(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: a message with newlines stays one line (json escapes them)."""

    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj, sort_keys=True, default=str)


def log_format(value: str | None = None) -> str:
    """The format asked for (argument, else $SCO_LOG_FORMAT, else text); ValueError naming a bad one."""
    fmt = (value or os.environ.get("SCO_LOG_FORMAT") or "text").strip().lower()
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: use one of {', '.join(FORMATS)} (SCO_LOG_FORMAT or --log-format)")
    return fmt


def setup(level: str | int | None = None, fmt: str | None = None) -> None:
    """Configure the root logger to stderr once per process (a second call replaces the handler, never adds one)."""
    if level is None:
        level = os.environ.get("SCO_LOG_LEVEL") or "INFO"
    if isinstance(level, str):
        name = level.strip().upper()
        if not isinstance(logging.getLevelName(name), int):
            raise ValueError(f"log level {level!r}: use DEBUG, INFO, WARNING or ERROR (SCO_LOG_LEVEL)")
        level = logging.getLevelName(name)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format(fmt) == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_sco", False):
            root.removeHandler(h)
    handler._sco = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level)
