"""Canonical JSON: one byte string per value, so the same input always gives the same bytes.

Keys sorted, no insignificant whitespace, ASCII only, integers and strings only (no floats: their text
is not portable between implementations, and nothing in a bundle needs them).
"""

from __future__ import annotations

import json
import re
from typing import Any

_MAYBE_FLOAT = re.compile(r"(?:^|[:,\[])-?[0-9]+[.eE]")


def _no_floats(text: str) -> float:
    raise ValueError(f"floats are not allowed in canonical JSON (found {text})")


def dumps(value: Any) -> bytes:
    """The canonical encoding of ``value`` (no trailing newline). Raises ValueError on floats or non-JSON."""
    try:
        out = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    except TypeError as e:
        raise ValueError(str(e)) from None
    if _MAYBE_FLOAT.search(out):
        # Cheap pre-filter: a float is a value, after ":", "," or "[" (or the whole text), with a "." or an exponent;
        # only text where that is seen (maybe inside a string) is parsed again to be sure.
        json.loads(out, parse_float=_no_floats)
    return out.encode("ascii")


def loads(raw: bytes | str) -> Any:
    """Parse JSON, refusing floats (a canonical document never has them)."""
    return json.loads(raw, parse_float=_no_floats)
