"""benchmarks/bench_hall_scale.py at a tiny size (20 nodes, 2 pools), run as ``make bench`` runs it: every figure is
there, one JSON object a line, and its counts are right (every notice delivered and verified, the event stream
holding exactly one event per node after every node replayed it, the loop's run reading every instance and
heartbeat). No time is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def bench(sizes: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SCO_BENCH_HALL_SIZES": sizes, "SCO_BENCH_REPEATS": "2"}
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "hall_scale"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_the_hall_scale_benchmark_at_20_nodes_counts_every_notice_event_and_instance() -> None:
    out = bench("20:2")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    assert all(x["bench"] == "hall_scale" for x in lines)
    sizes = {x["figure"]: x for x in lines if "growth" not in x}
    assert set(sizes) == {"relay", "notice_fanout", "events", "control_loop"}
    assert all(x["nodes"] == 20 for x in sizes.values())

    relay = sizes["relay"]
    assert relay["connections"] == 20 and relay["client_errors"] == []
    assert relay["rss_mib_connected"] > 0 and relay["rss_mib_idle"] > 0

    fan = sizes["notice_fanout"]  # 10 % of the nodes, twice: every notice there and signed by the reclaimer's key
    assert (fan["rounds"], fan["notices"], fan["sent"], fan["delivered"], fan["invalid"]) == (2, 2, 4, 4, 0), fan
    assert fan["p50_ms"] is not None and fan["max_ms"] >= fan["p99_ms"] >= fan["p50_ms"]

    ev = sizes["events"]
    assert (ev["acked"], ev["failed"], ev["stream_messages"]) == (20, 0, 20), ev
    # the replay of every event with its Nats-Msg-Id was acknowledged as a duplicate and stored nowhere
    assert (ev["replayed"], ev["replay_duplicates"], ev["replay_failed"]) == (20, 20, 0), ev
    assert ev["heartbeat_stream_messages"] == 20

    loop = sizes["control_loop"]
    assert (loop["pools"], loop["runs"], loop["plan_current"], loop["heartbeats_read"]) == (2, 2, 20, 20), loop
    assert loop["reads"]["fleet_state_instances"]["rows"] == 20
    assert loop["statements_per_run"] > 0 and loop["statements_same_every_run"] is True
    assert loop["statements_per_run"] == sum(
        p["statements"] for name, p in loop["phases"].items() if name != "total"
    ), loop["phases"]
    assert loop["plan_launch"] > 0  # the demand needs new instances: the plan is not empty

    growth = [x for x in lines if "growth" in x]
    assert {x["figure"] for x in growth} == set(sizes)
    for g in growth:  # one size: every ratio is 1, or none when the figure was 0 (CPU under one clock tick)
        assert (g["ratio_to_smallest"], g["linear"]) in [({"20": 1.0}, True), ({"20": None}, None)], g


def test_a_size_the_benchmark_cannot_run_is_one_line_naming_the_variable() -> None:
    out = bench("20:50")
    assert out.returncode != 0 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        "hall_scale: $SCO_BENCH_HALL_SIZES: '20:50': expected NODES (10 to 15000) or NODES:POOLS (1 to NODES pools),"
        " comma-separated, such as 500,1000,5000"
    ]
