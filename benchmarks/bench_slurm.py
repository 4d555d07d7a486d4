"""Slurm benchmarks: the drain on a real cluster, and the cost of job_submit.lua per submission."""

from __future__ import annotations

import asyncio
import shutil
import statistics
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.harness import AgentEnv, NatsServer, ensure_stream, hall_bundle, wait_for

from sco.contract.bundle import Bundle
from sco.contract.signing import Keyring, generate
from sco.schedulers.slurm_admission import render_lua, write
from sco_devkit.devcluster.slurm import SlurmCluster

ROOT = Path(__file__).resolve().parents[1]
JOB = """#!/bin/bash
#SBATCH --output={jobs}/out.%j
trap 'date +%s.%N >> {jobs}/usr1.$SLURM_JOB_ID; exit 0' USR1
if [ -f {jobs}/usr1.$SLURM_JOB_ID ]; then exit 0; fi
touch {jobs}/start.$SLURM_JOB_ID
sleep 300 & wait $!
"""


def bench_slurm_drain(jobs: int = 4, rounds: int = 5) -> Iterator[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        key = generate()
        bundle = Bundle.from_bytes(hall_bundle(root, key), Keyring([key.public]))
        c = SlurmCluster(root / "slurm", cpus=jobs, job_submit_lua=ROOT / "slurm_plugins" / "job_submit.lua")
        c.write_conf()
        write(c.root, render_lua(bundle.hall, bundle.serial, bundle.contracts, ["spot"]), bundle.serial)
        c.start()
        nats = NatsServer(root / "nats").start()
        asyncio.run(ensure_stream(nats.url))
        jobdir = c.root / "jobs"
        (jobdir / "job.sh").write_text(JOB.format(jobs=jobdir))
        drain_ms, usr1_ms, requeue_ms = [], [], []
        try:
            for r in range(rounds):
                node = c.nodes[r % len(c.nodes)]
                ids = [
                    c.sbatch(
                        jobdir / "job.sh",
                        "--account=genomics",
                        "--comment=sco-contract=genomics-ckpt",
                        f"--nodelist={node}",
                    )
                    for _ in range(jobs)
                ]
                wait_for(lambda ids=ids: all((jobdir / f"start.{j}").exists() for j in ids), 30, "jobs running")
                env = AgentEnv(
                    root / f"agent-{r}",
                    None,
                    nats,
                    node=node,
                    slurm_conf=str(c.conf),
                    slurmd_spool_dir=str(c.root / "spool" / "%n"),
                )
                env.start().wait_subscribed()
                t0 = env.send(env.notice(f"bench-{r}", 20))
                out = env.outcome(20)
                assert out["type"] == "drain.drained", out
                drain_ms.append((env.of("node.drain_set")[0]["at"] - t0) * 1000)
                usr1_ms.append((max(float((jobdir / f"usr1.{j}").read_text().split()[0]) for j in ids) - t0) * 1000)
                requeue_ms.append((max(e["at"] for e in env.of("job.requeued")) - t0) * 1000)
                env.stop()
                c.run("scancel", "--user=root", check=False)
                c.run("scontrol", "update", f"nodename={node}", "state=RESUME")
                wait_for(lambda: all(s == "idle" for s in c.node_states().values()), 30, "idle", 0.2)
        finally:
            nats.stop()
            c.stop()
    yield {
        "jobs": jobs,
        "rounds": rounds,
        "notice_to_drain_ms": round(statistics.median(drain_ms), 1),
        "notice_to_usr1_ms": round(statistics.median(usr1_ms), 1),
        "notice_to_requeued_ms": round(statistics.median(requeue_ms), 1),
    }


_LUA_HARNESS = """
slurm = {SUCCESS = 0, ERROR = -1}
local refused = 0
function slurm.log_user(fmt, ...) refused = refused + 1 end
function slurm.log_error(fmt, ...) error(string.format(fmt, ...)) end
function slurm.log_info(fmt, ...) end
dofile(arg[1])
local N = tonumber(arg[2])
local t0 = os.clock()
local first = slurm_job_submit({partition = "spot", account = "acct-0000", comment = "sco-contract=wl-0000"}, {}, 0)
local load_ms = (os.clock() - t0) * 1000
assert(first == slurm.SUCCESS)
local ok = {partition = "spot", account = "acct-0500", comment = "x sco-contract=wl-0500"}
t0 = os.clock()
for i = 1, N do
  ok.requeue = 0
  assert(slurm_job_submit(ok, {}, 0) == slurm.SUCCESS and ok.requeue == 1)
end
local accept_us = (os.clock() - t0) / N * 1e6
local bad = {partition = "spot", account = "acct-0500", comment = "sco-contract=nope"}
t0 = os.clock()
for i = 1, N do assert(slurm_job_submit(bad, {}, 0) == slurm.ERROR) end
local refuse_us = (os.clock() - t0) / N * 1e6
print(string.format("%.3f %.3f %.3f %d", accept_us, refuse_us, load_ms, refused))
"""


def bench_job_submit_lua(contracts: int = 1000, n: int = 200_000) -> Iterator[dict[str, Any]]:
    """job_submit.lua in Lua 5.1 (the interpreter Debian's job_submit_lua.so links), with Slurm's ``slurm``
    table reduced to the calls the script makes. Reports CPU time per submission."""
    lua = shutil.which("lua5.1")
    if lua is None:
        raise SystemExit("lua5.1 is needed (apt-get install lua5.1; scripts/setup.sh installs it)")
    table = {
        f"wl-{i:04d}": {
            "name": f"wl-{i:04d}",
            "scheduler": "slurm",
            "selector": {"account": f"acct-{i:04d}", "partitions": ["spot"]},
            "tier": 3,
            "drainBudgetSeconds": 60,
            "finalWriteSeconds": 10,
            "checkpoint": {"mode": "signal", "signal": "USR1"},
        }
        for i in range(contracts)
    }
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        shutil.copy(ROOT / "slurm_plugins" / "job_submit.lua", d / "job_submit.lua")
        write(d, render_lua("bench", 1, table, ["spot"]), 1)
        (d / "harness.lua").write_text(_LUA_HARNESS)
        runs = []
        for _ in range(3):
            out = subprocess.run(
                [lua, str(d / "harness.lua"), str(d / "job_submit.lua"), str(n)],
                capture_output=True,
                text=True,
                check=True,
                timeout=300,
            ).stdout.split()
            runs.append([float(x) for x in out[:3]])
        table_bytes = (d / "sco_contracts.lua").stat().st_size
    yield {
        "contracts": contracts,
        "us_per_submit": round(statistics.median(r[0] for r in runs), 3),
        "us_per_refusal": round(statistics.median(r[1] for r in runs), 3),
        "table_load_ms": round(statistics.median(r[2] for r in runs), 2),
        "table_bytes": table_bytes,
        "submissions": n,
    }


BENCHES = {"slurm_drain": bench_slurm_drain, "job_submit_lua": bench_job_submit_lua}
