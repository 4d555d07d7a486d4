"""Spark executor decommissioning on real Spark (pyspark from PyPI, local-cluster mode on Java 17), with exactly
the settings the collection's spark_decommission role ships. Slow (a minute or two per scenario); CI runs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.spark_decommission import run, shipped_settings

pytestmark = pytest.mark.slow


def test_shipped_settings_are_the_decommissioning_ones() -> None:
    s = shipped_settings()
    for key in (
        "spark.decommission.enabled",
        "spark.storage.decommission.enabled",
        "spark.storage.decommission.shuffleBlocks.enabled",
        "spark.storage.decommission.rddBlocks.enabled",
    ):
        assert s[key] == "true", key


def test_sigpwr_migrates_blocks_and_nothing_is_recomputed(tmp_path: Path) -> None:
    """SIGPWR to one executor (what its pod's preStop does): its cached blocks move to the surviving executor,
    its shuffle outputs to the peer or the fallback store, and the follow-up actions recompute nothing."""
    o = run(tmp_path)
    print(json.dumps(o.as_dict()))  # the counts, for the record (pytest -s)
    assert o.executors == 2
    assert o.finished_decommissioning, o.log_lines
    assert o.cached_before == 8 and o.cached_after == 8  # every cached partition still cached
    assert o.rdd_blocks_migrated >= 1  # the victim held some of the 8 partitions, and they moved
    assert o.shuffle_blocks_migrated >= 1
    assert o.tasks_recomputed == 0  # neither the cached map nor the shuffle map side ran again
    assert o.result_ok


def test_control_sigkill_loses_blocks_and_recomputes(tmp_path: Path) -> None:
    """The same scenario with the executor killed outright (no preStop): the measurement sees recomputation, so
    the zero above means something."""
    o = run(tmp_path, trigger="SIGKILL")
    assert o.rdd_blocks_migrated == 0 and o.shuffle_blocks_migrated == 0
    assert o.cached_after < o.cached_before or o.tasks_recomputed > 0
    assert o.tasks_recomputed > 0
    assert o.result_ok  # Spark recomputes correctly; it just costs the work again
