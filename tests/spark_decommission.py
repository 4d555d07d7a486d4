"""One Spark executor-decommissioning scenario on real Spark (pyspark from PyPI, ``local-cluster`` mode: a real
standalone master, workers and executor JVMs on this machine's Java 17), with exactly the settings the
collection ships (role ``spark_decommission``, ``vars/main.yml``).

Cache RDD blocks and write shuffle outputs on two executors; decommission one the way its pod's preStop does
(SIGPWR to the executor JVM); wait until it has gone; run the same actions again and count what was recomputed
(accumulators in the map functions) and what migrated (the executors' own logs, the fallback store, the
driver's block locations). Used by tests/test_spark.py and benchmarks/bench_spark.py.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
SETTINGS_FILE = REPO / "collections/ansible_collections/sco/orchestrator/roles/spark_decommission/vars/main.yml"

PARTITIONS = 8
ROWS = 40_000


def shipped_settings() -> dict[str, str]:
    """The settings the collection ships: the test runs Spark with exactly these."""
    doc = yaml.safe_load(SETTINGS_FILE.read_text())
    return {str(k): str(v) for k, v in doc["_spark_decommission_settings"].items()}


@dataclass
class Outcome:
    executors: int
    decommissioned: str
    cached_before: int  # cached RDD partitions before the decommission
    cached_after: int  # ... and after it (on the surviving executors)
    rdd_blocks_migrated: int
    shuffle_blocks_migrated: int
    shuffle_files_in_fallback: int
    tasks_recomputed: int  # map tasks (cache and shuffle map side) that ran again in the follow-up actions
    decommission_s: float  # SIGPWR to the executor having left the application
    finished_decommissioning: bool
    result_ok: bool
    log_lines: list[str] = field(default_factory=list)

    @property
    def blocks_migrated(self) -> int:
        return self.rdd_blocks_migrated + self.shuffle_blocks_migrated

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "log_lines"}
        d["blocks_migrated"] = self.blocks_migrated
        return d


def _executor_pids(app_id: str) -> dict[str, int]:
    """Executor id -> JVM pid, from the process table (CoarseGrainedExecutorBackend ... --executor-id N)."""
    pids = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv]
        if "org.apache.spark.executor.CoarseGrainedExecutorBackend" in args and app_id in args:
            pids[args[args.index("--executor-id") + 1]] = int(proc.name)
    return pids


def run(work: Path, settings: dict[str, str] | None = None, trigger: str = "SIGPWR") -> Outcome:
    """``settings`` default to the shipped ones; ``trigger`` SIGPWR (preStop) or SIGKILL (a control)."""
    from pyspark import SparkConf, SparkContext, StorageLevel

    settings = shipped_settings() if settings is None else settings
    fallback = work / "fallback"
    fallback.mkdir(parents=True, exist_ok=True)
    conf = (
        SparkConf()
        .setMaster("local-cluster[2,1,1024]")
        .setAppName("sco-decommission-test")
        .set("spark.executor.memory", "512m")
        .set("spark.driver.memory", "512m")
        .set("spark.ui.enabled", "false")
        .set("spark.local.dir", str(work / "local"))
        .set("spark.ui.showConsoleProgress", "false")
        # The hall's Ceph RGW bucket (s3a://...) in production; a local directory stands in for it here.
        .set("spark.storage.decommission.fallbackStorage.path", f"file://{fallback}/")
        .set("spark.storage.decommission.fallbackStorage.cleanUp", "false")  # so the test can count what is there
    )
    for k, v in settings.items():
        conf.set(k, v)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    sc = SparkContext(conf=conf)
    sc.setLogLevel("WARN")
    try:
        return _scenario(sc, work, trigger, StorageLevel.MEMORY_ONLY)
    finally:
        sc.stop()


def _wait(pred: Any, timeout: float, what: str) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _executor_log(app_id: str, executor: str, work: Path) -> list[str]:
    """The executor's stderr: local-cluster workers write it under $SPARK_HOME/work (inside the installed
    package), so it is moved into the scenario's directory and the application's work dir removed."""
    import shutil

    from pyspark.find_spark_home import _find_spark_home

    app_dir = Path(_find_spark_home()) / "work" / app_id
    log = app_dir / executor / "stderr"
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    if app_dir.is_dir():
        shutil.copytree(app_dir, work / "executor-logs", dirs_exist_ok=True)
        shutil.rmtree(app_dir, ignore_errors=True)
    return lines


def _cached_partitions(sc: Any, rdd_id: int) -> int:
    infos = sc._jsc.sc().getRDDStorageInfo()
    return sum(int(i.numCachedPartitions()) for i in infos if int(i.id()) == rdd_id)


def _scenario(sc: Any, work: Path, trigger: str, level: Any) -> Outcome:
    app_id = sc.applicationId
    executors = _wait(lambda: len(_executor_pids(app_id)) >= 2 and _executor_pids(app_id), 300, "two executors")
    cache_acc = sc.accumulator(0)
    shuffle_acc = sc.accumulator(0)

    # One accumulator increment per map task that runs: after the decommission both must stay put.
    def cache_task(it: Any) -> Any:
        cache_acc.add(1)
        return (x * 3 for x in it)

    def shuffle_task(it: Any) -> Any:
        shuffle_acc.add(1)
        return ((x % 97, x) for x in it)

    cached = sc.parallelize(range(ROWS), PARTITIONS).mapPartitions(cache_task).persist(level)
    assert cached.count() == ROWS
    pairs = sc.parallelize(range(ROWS), PARTITIONS).mapPartitions(shuffle_task).reduceByKey(lambda a, b: a + b, 4)
    expected = dict(pairs.collect())
    cached_before = _cached_partitions(sc, cached.id())
    acc_before = (cache_acc.value, shuffle_acc.value)

    victim = sorted(executors)[0]
    t0 = time.monotonic()
    os.kill(executors[victim], signal.SIGPWR if trigger == "SIGPWR" else signal.SIGKILL)
    # Gone from the application (the standalone master may start a replacement with another id).
    _wait(lambda: victim not in _executor_pids(app_id), 120, f"executor {victim} to leave")
    decommission_s = time.monotonic() - t0

    again = dict(pairs.collect())
    assert cached.count() == ROWS
    cached_after = _cached_partitions(sc, cached.id())
    recomputed = (cache_acc.value - acc_before[0]) + (shuffle_acc.value - acc_before[1])

    lines = _executor_log(app_id, victim, work)
    shuffle_migrated = sum(1 for ln in lines if "Migrated migrate_shuffle_" in ln)
    migrated_re = re.compile(r"Block (rdd_\d+_\d+) migrated successfully")
    rdd_migrated = len({m.group(1) for ln in lines if (m := migrated_re.search(ln))})
    in_fallback = sum(1 for p in (work / "fallback").rglob("*") if p.is_file())
    return Outcome(
        executors=len(executors),
        decommissioned=victim,
        cached_before=cached_before,
        cached_after=cached_after,
        rdd_blocks_migrated=rdd_migrated,
        shuffle_blocks_migrated=shuffle_migrated,
        shuffle_files_in_fallback=in_fallback,
        tasks_recomputed=recomputed,
        decommission_s=round(decommission_s, 2),
        finished_decommissioning=any("Finished decommissioning" in ln for ln in lines),
        result_ok=again == expected,
        log_lines=[ln for ln in lines if "igrat" in ln or "ecommission" in ln],
    )
