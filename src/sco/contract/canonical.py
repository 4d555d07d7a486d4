"""Canonical JSON: one byte string per value, so the same input always gives the same bytes.

Keys sorted, no insignificant whitespace, ASCII only, integers and strings only (no floats: their text
is not portable between implementations, and nothing in a bundle needs them).
"""

from __future__ import annotations

import json
from typing import Any


def _no_floats(text: str) -> float:
    raise ValueError(f"floats are not allowed in canonical JSON (found {text})")


def dumps(value: Any) -> bytes:
    """The canonical encoding of ``value`` (no trailing newline). Raises ValueError on floats or non-JSON."""
    try:
        out = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    except TypeError as e:
        raise ValueError(str(e)) from None
    if "." in out or "e" in out or "E" in out:
        # Cheap pre-filter; only text that could hold a float is parsed again to be sure.
        json.loads(out, parse_float=_no_floats)
    return out.encode("ascii")


def loads(raw: bytes | str) -> Any:
    """Parse JSON, refusing floats (a canonical document never has them)."""
    return json.loads(raw, parse_float=_no_floats)
