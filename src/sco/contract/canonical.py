"""Canonical JSON: one byte string per value, so the same input always gives the same bytes.

Keys sorted, no insignificant whitespace, ASCII only, integers and strings only (no floats: their text
is not portable between implementations, and nothing in a bundle needs them).
"""

from __future__ import annotations

import json
from typing import Any


def _check(value: Any, path: str) -> None:
    if isinstance(value, bool) or value is None or isinstance(value, int | str):
        return
    if isinstance(value, float):
        raise ValueError(f"{path or '<root>'}: floats are not allowed in canonical JSON")
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check(item, f"{path}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{path or '<root>'}: key {k!r} is not a string")
            _check(v, f"{path}.{k}" if path else k)
        return
    raise ValueError(f"{path or '<root>'}: {type(value).__name__} is not JSON")


def dumps(value: Any) -> bytes:
    """The canonical encoding of ``value`` (no trailing newline)."""
    _check(value, "")
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")
