"""drill: playbooks/drill.yml for real, as a platform team runs it before trusting a hall: a relay configured by the
notice_relay role's template, two node agents (each its own process, its own relay identity) on the Kubernetes API
stand-in; spot-a-001 runs 4 web pods and a database pod a PodDisruptionBudget never lets go (deleted when its 3 s
budget is spent), spot-a-002 three batch pods. Per node, from the drill's report (the agents' own clocks): notice to
taint, notice to drained, time left at T (the harness hall's 20 s window); and the job's wall time (Ansible's per-task
cost included). Medians over the repeats, each on fresh agents and a fresh relay."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.harness import AgentEnv, add_pod
from tests.relays import REPO, run_playbook, start_relay

from sco.contract.signing import write_keypair
from sco_devkit.standins.kube_apiserver import KubeApiStandIn

REPEATS = 3
NODES = ["spot-a-001", "spot-a-002"]
WINDOW_S = 20


def _once(tmp: Path) -> dict[str, Any]:
    srv, creds = start_relay(tmp, NODES)
    kube = KubeApiStandIn().start()
    agents: list[AgentEnv] = []
    try:
        for n in NODES:
            pw = (creds / f"node-{n}").read_text().strip()
            a = AgentEnv(tmp / n, kube, srv, node=n, nats_user=f"node-{n}", nats_password=pw)
            write_keypair(a.notice_key, tmp / f"{n}.key", tmp / f"{n}.pub")
            agents.append(a)
        for i in range(4):
            add_pod(kube, "web", f"web-{i}", NODES[0], grace=30, prestop=0.5 + i * 0.4)
        add_pod(kube, "guarded", "db-0", NODES[0], grace=30, prestop=0.2, labels={"app": "db"})
        never = {"minAvailable": 1, "selector": {"matchLabels": {"app": "db"}}}
        kube.cluster.create_pdb("guarded", {"metadata": {"name": "db"}, "spec": never})
        for i in range(3):
            add_pod(kube, "batch", f"job-{i}", NODES[1], grace=30, prestop=1.0 + i)
        for a in agents:
            a.start().wait_subscribed()
        (tmp / "nats").symlink_to(creds)
        ev = {"drill_notice_keys": [str(tmp / f"{n}.key") for n in NODES], "sco_hall": "local",
              "sco_relay_url": srv.url, "sco_credentials_dir": str(tmp), "drill_nodes": NODES,
              "drill_notice_seconds": WINDOW_S, "drill_grace_seconds": 5, "drill_report_dir": str(tmp / "reports"),
              "drill_progress_seconds": 2}  # fmt: skip
        t = time.monotonic()
        out = run_playbook(tmp, REPO / "playbooks/drill.yml", ev)
        wall = time.monotonic() - t
        if out.returncode != 0:
            raise AssertionError(out.stdout[-3000:] + out.stderr[-2000:])
        (page,) = (tmp / "reports").glob("drill-*.html")
        nodes = json.loads(page.with_suffix(".json").read_text())["nodes"]
        return {"wall_s": wall, **{n: nodes[n] for n in NODES}}
    finally:
        for a in agents:
            a.stop()
        kube.stop()
        srv.stop()


def bench_drill() -> Iterator[dict[str, Any]]:
    runs = []
    for _ in range(REPEATS):
        with tempfile.TemporaryDirectory(prefix="sco-bench-drill-") as d:
            runs.append(_once(Path(d)))
    med = statistics.median
    for n in NODES:
        yield {
            "node": n,
            "repeats": REPEATS,
            "window_s": WINDOW_S,
            "pods": runs[0][n]["pods"],
            "pdb_refusals_median": med(r[n]["pdb_refusals"] for r in runs),
            "notice_to_taint_ms_median": med(r[n]["tainted_after_ms"] for r in runs),
            "notice_to_drained_s_median": med(r[n]["seconds_after_notice"] for r in runs),
            "left_at_t_s_median": med(r[n]["left_at_t_s"] for r in runs),
            "outcomes": sorted({r[n]["outcome"] for r in runs}),
        }
    yield {"job_wall_s_median": round(med(r["wall_s"] for r in runs), 1), "repeats": REPEATS}


BENCHES = {"drill": bench_drill}
