"""spark_decommission: real Spark (pyspark, local-cluster with 2 executors) with the settings the collection's
spark_decommission role ships; one executor decommissioned by SIGPWR (its preStop); blocks migrated, map-side
records recomputed afterwards, and SIGPWR-to-gone time. About a minute per run on a quiet machine."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.spark_decommission import run


def bench_spark_decommission() -> Iterator[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="sco-bench-spark-") as d:
        o = run(Path(d))
    yield {
        "executors": o.executors,
        "blocks_migrated": o.blocks_migrated,
        "rdd_blocks_migrated": o.rdd_blocks_migrated,
        "shuffle_blocks_migrated": o.shuffle_blocks_migrated,
        "shuffle_files_in_fallback": o.shuffle_files_in_fallback,
        "cached_partitions_after": o.cached_after,
        "tasks_recomputed": o.tasks_recomputed,
        "decommission_s": o.decommission_s,
    }


BENCHES = {"spark_decommission": bench_spark_decommission}
