"""Benchmarks: ``python -m benchmarks.run [NAME ...]``; each prints one JSON object per line with a "bench" key.

Figures are medians over repeats; nothing here asserts a time (these machines are shared and noisy).
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import sys
from collections.abc import Callable, Iterator
from typing import Any

import benchmarks

Bench = Callable[[], Iterator[dict[str, Any]]]


def discover() -> dict[str, Bench]:
    found: dict[str, Bench] = {}
    for mod in pkgutil.iter_modules(benchmarks.__path__):
        if mod.name.startswith("bench_"):
            m = importlib.import_module(f"benchmarks.{mod.name}")
            found.update(getattr(m, "BENCHES", {}))
    return found


def main(argv: list[str]) -> int:
    benches = discover()
    names = argv or sorted(benches)
    unknown = [n for n in names if n not in benches]
    if unknown:
        print(f"unknown benchmark(s): {', '.join(unknown)}; known: {', '.join(sorted(benches))}", file=sys.stderr)
        return 2
    for name in names:
        for line in benches[name]():
            print(json.dumps({"bench": name, **line}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
