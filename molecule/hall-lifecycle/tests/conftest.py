"""Scenario hall-lifecycle's opt-in measurement (molecule.yml, molecule/README.md): with SCO_LIFECYCLE_BOOTS=N in
the environment, boots.py is a test module of the verify too, run after test_lifecycle.py. Without it boots.py is not
a test module at all (its name is no test file's: never collected, so nothing is skipped), as an opt-in scenario is
not in `make molecule`'s list. A value other than a number of instances stops the run before anything starts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

BOOTS_MAX = 100  # addresses on the hall's /24 and memory for the agents: far more than a measurement needs
BOOTS = Path(__file__).with_name("boots.py")


def boots_asked() -> int:
    """N, the instances SCO_LIFECYCLE_BOOTS asks for (0: not set)."""
    raw = os.environ.get("SCO_LIFECYCLE_BOOTS", "").strip()
    if not raw:
        return 0
    if not raw.isdigit() or not 1 <= int(raw) <= BOOTS_MAX:
        raise pytest.UsageError(f"SCO_LIFECYCLE_BOOTS={raw!r}: expected a number of instances from 1 to {BOOTS_MAX}")
    return int(raw)


def _walked(config: pytest.Config) -> bool:
    """Whether pytest walks boots.py's directory (it was named, or one above it): pytest_collect_file then sees it."""
    named = [Path(config.invocation_params.dir, a.split("::")[0]).resolve() for a in config.args]
    return any(p.is_dir() and BOOTS.resolve().is_relative_to(p) for p in named)


def pytest_configure(config: pytest.Config) -> None:
    # a bad value refused here, at once, not after the cloud has started; molecule's verify names each test_*.py
    # file to pytest, so boots.py is named too
    if boots_asked() and not _walked(config):
        config.args.append(str(BOOTS))


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    # pytest run on the directory: boots.py, not named, is not a test file by its name
    if file_path == BOOTS and boots_asked() and _walked(parent.config):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # after the lifecycle (collected in name order, boots.py would come first): it starts a cloud of its own, so the
    # lifecycle's timeline stays what the default run measures
    items.sort(key=lambda item: item.path == BOOTS)
