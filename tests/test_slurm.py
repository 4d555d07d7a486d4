"""The Slurm path on a real cluster: slurmctld and three slurmd on loopback (Debian's slurm-wlm 22.05).

Jobs trap USR1 and write a checkpoint marker; requeued jobs find the marker and resume on another node.
"""

from __future__ import annotations

from pathlib import Path

from sco.contract.signing import generate
from sco_devkit.devcluster.slurm import SlurmCluster
from tests.harness import AGENT_USER, NatsServer, hall_bundle, wait_for
from tests.slurm_hall import WINDOW, agent_for, running_on

ROOT = Path(__file__).resolve().parents[1]


def submit(c: SlurmCluster, *args: str) -> int:
    return c.sbatch(c.root / "jobs" / "job.sh", "--account=genomics", "--comment=sco-contract=genomics-ckpt", *args)


def test_drain_signal_requeue_through_slurmctld(tmp_path: Path, nats_server: NatsServer, clean: SlurmCluster) -> None:
    c = clean
    jid = submit(c)
    node = running_on(c, jid)
    assert c.job(jid).get("Requeue") == "1"  # forced by job_submit.lua
    env = agent_for(tmp_path, nats_server, c, node)
    try:
        env.start().wait_subscribed()
        t0 = env.send(env.notice("slurm-1", WINDOW))
        state = wait_for(
            lambda: "drain" in c.node_states().get(node, "") and c.node_states()[node],
            2.0,
            "the node DRAIN within 2 s",
            0.02,
        )
        assert state in ("draining", "drained", "drain")
        # slurmctld shows DRAIN before the agent's scontrol returns and the agent spools it: its own time is the test
        drain_set = wait_for(lambda: env.of("node.drain_set"), 5, "node.drain_set spooled")[0]
        assert drain_set["at"] - t0 < 2.0 and "slurm-1" in drain_set["reason"]
        out = env.outcome(WINDOW)
        assert out["type"] == "drain.drained" and out["path"] == "scheduler" and out["at"] < t0 + WINDOW
        usr1 = (c.root / "jobs" / f"marker.{jid}.usr1").read_text().split()
        assert usr1[1] == node and float(usr1[0]) - t0 < 6  # USR1 reached the job inside its 6 s budget
        signalled = env.of("job.signalled")[0]
        assert signalled["job"] == jid and signalled["contract"] == "genomics-ckpt" and signalled["signal"] == "USR1"
        assert env.of("job.requeued")[0]["jobs"] == [jid]
        resumed = wait_for(
            lambda: (
                (c.root / "jobs" / f"marker.{jid}.resumed").exists()
                and (c.root / "jobs" / f"marker.{jid}.resumed").read_text().split()
            ),
            40,
            "the resumed job",
        )
        assert resumed[0] != node  # ran again elsewhere, from its checkpoint
        assert int(c.job(jid).get("Restarts", "0")) >= 1
        assert "sco reclaim slurm-1" in c.run("sinfo", "-h", "-n", node, "-o", "%E")
    finally:
        env.stop()


def test_around_an_unreachable_slurmctld(tmp_path: Path, nats_server: NatsServer, clean: SlurmCluster) -> None:
    c = clean
    jid = c.sbatch(c.root / "jobs" / "job.sh", "--account=climate", "--comment=sco-contract=climate-sims")
    node = running_on(c, jid)
    env = agent_for(tmp_path, nats_server, c, node)
    try:
        env.start().wait_subscribed()
        c.freeze_ctld()  # slurmctld stops answering
        t0 = env.send(env.notice("around-1", WINDOW))
        out = env.outcome(WINDOW)
        assert out["type"] == "drain.drained" and out["path"] == "around" and out["at"] < t0 + WINDOW
        assert out["method"] == "stepd-tree"  # no cgroups on these machines: slurmstepd's process tree
        unreachable = env.of("scheduler.unreachable")[0]
        assert unreachable["at"] - t0 < 1.5  # gave up on slurmctld after the 800 ms timeout
        sig = env.of("job.signalled")[0]
        assert sig["path"] == "around" and sig["job"] == jid and sig["pids"]
        # budget found from the job's own environment; the agent as its own user may not read another user's (ptrace
        # access), so the job gets what the deadline leaves (jobprocs.py), signalled at once all the same
        assert sig["contract"] == (None if AGENT_USER else "climate-sims")
        usr1 = (c.root / "jobs" / f"marker.{jid}.usr1").read_text().split()
        assert float(usr1[0]) - t0 < 4  # inside the climate-sims budget of 4 s
        assert not env.of("scheduler.told")
        c.thaw_ctld()  # the scheduler answers again and learns late
        told = wait_for(lambda: env.of("scheduler.told"), 30, "slurmctld told", 0.2)
        assert told[0]["requeued"] == [jid]
        wait_for(lambda: "drain" in c.node_states().get(node, ""), 10, "DRAIN after the fact")
        resumed = wait_for(
            lambda: (
                (c.root / "jobs" / f"marker.{jid}.resumed").exists()
                and (c.root / "jobs" / f"marker.{jid}.resumed").read_text().split()
            ),
            40,
            "resumed",
        )
        assert resumed[0] != node
    finally:
        env.stop()


def sbatch_result(c: SlurmCluster, *args: str) -> tuple[bool, str]:
    p = __import__("subprocess").run(
        ["sbatch", "--parsable", *args, str(c.root / "jobs" / "job.sh")],
        env=c.env(),
        capture_output=True,
        text=True,
        timeout=10,
    )
    return p.returncode == 0, (p.stdout + p.stderr).strip()


def test_job_submit_refusals_and_acceptances(clean: SlurmCluster) -> None:
    c = clean
    ok, msg = sbatch_result(c, "--account=genomics")
    assert not ok and "sco: partition spot is reclaimable: add --comment=sco-contract=<name>" in msg
    assert "(contracts for account genomics: genomics-ckpt)" in msg
    ok, msg = sbatch_result(c, "--account=genomics", "--comment=sco-contract=nope")
    assert not ok and "sco: contract nope is not in bundle serial 1 (hall local)" in msg
    ok, msg = sbatch_result(c, "--account=climate", "--comment=sco-contract=genomics-ckpt")
    assert not ok and "is for account genomics: add --account=genomics" in msg
    ok, msg = sbatch_result(c, "--account=genomics", "--comment=team-x sco-contract=genomics-ckpt", "--no-requeue")
    assert ok, msg
    job = c.job(int(msg.split(";")[0]))
    assert job["Requeue"] == "1"  # forced on, although the user asked for --no-requeue
    ok, msg = sbatch_result(c, "--partition=onprem")  # not reclaimable: no contract needed
    assert ok, msg
    c.run("scancel", "--user=root")


def test_cli_filter_defaults_the_warning_signal(clean: SlurmCluster) -> None:
    import subprocess

    c = clean
    script = str(c.root / "jobs" / "job.sh")
    base = ["sbatch", "-vv", "--account=genomics", "--comment=sco-contract=genomics-ckpt"]
    p = subprocess.run([*base, "--time=2", script], env=c.env(), capture_output=True, text=True, timeout=10)
    assert p.returncode == 0 and "signal              : B:USR1@120" in p.stderr  # sbatch's final options
    jid = int(p.stdout.split()[-1])
    q = subprocess.run([*base, "--signal=B:TERM@30", script], env=c.env(), capture_output=True, text=True, timeout=10)
    assert "signal              : B:TERM@30" in q.stderr  # a signal the user set is kept
    # and slurmctld delivers it: 120 s before a 2 min limit means at its first time-limit check (~30 s)
    marker = c.root / "jobs" / f"marker.{jid}.usr1"
    wait_for(marker.exists, 75, "the default warning signal", 0.5)


def test_render_contracts_cli(tmp_path: Path) -> None:
    import subprocess
    import sys

    from sco.contract.signing import write_keypair

    key = generate()
    write_keypair(key, tmp_path / "k.key", tmp_path / "k.pub")
    b = tmp_path / "b.json"
    b.write_bytes(hall_bundle(tmp_path, key))
    out = tmp_path / "etc"
    out.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "sco.cli",
        "slurm",
        "render-contracts",
        str(b),
        "--trust",
        str(tmp_path / "k.pub"),
        "--out-dir",
        str(out),
        "--reclaimable-partition",
        "spot",
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0 and "2 slurm contracts" in p.stdout and "(written)" in p.stdout
    assert (out / "sco_contracts.serial").read_text() == "1\n"
    lua = (out / "sco_contracts.lua").read_text()
    assert '["genomics-ckpt"] = {account = "genomics"' in lua
    assert subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.endswith("(unchanged)\n")
    b.write_bytes(b.read_bytes().replace(b'"drainBudgetSeconds":6', b'"drainBudgetSeconds":7'))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert p.returncode == 3 and "payloadSha256" in p.stderr
    assert (out / "sco_contracts.lua").read_text() == lua  # nothing lost
    __import__("json")


LINGER = """#!/bin/bash
marker={jobs}/marker.$SLURM_JOB_ID
trap 'echo "$(date +%s.%N) $SLURMD_NODENAME" >> $marker.usr1' USR1
if [ -f $marker.usr1 ]; then echo "$SLURMD_NODENAME" >> $marker.resumed; exit 0; fi
echo "$SLURMD_NODENAME" >> $marker.start
while true; do sleep 1 & wait $!; done
"""


def test_kill9_mid_slurm_drain_resumes_without_signalling_twice(
    tmp_path: Path, nats_server: NatsServer, clean: SlurmCluster
) -> None:
    c = clean
    script = c.root / "jobs" / "linger.sh"
    script.write_text(LINGER.format(jobs=c.root / "jobs"))
    jid = c.sbatch(script, "--account=genomics", "--comment=sco-contract=genomics-ckpt")
    node = running_on(c, jid)
    env = agent_for(tmp_path, nats_server, c, node)
    try:
        env.start().wait_subscribed()
        t0 = env.send(env.notice("k-slurm", WINDOW))
        wait_for(lambda: env.of("job.signalled"), 5, "the signal")
        env.kill9()  # the job checkpointed but keeps running: the agent was waiting out its 6 s budget
        env.start()
        out = env.outcome(WINDOW)
        assert out["type"] == "drain.drained" and out["at"] < t0 + WINDOW
        assert len(env.of("drain.resumed")) == 1 and env.of("drain.resumed")[0]["signalled"] == 1
        assert len(env.of("job.signalled")) == 1 and len(env.of("node.drain_set")) == 1
        assert len((c.root / "jobs" / f"marker.{jid}.usr1").read_text().splitlines()) == 1  # one USR1
        requeued = env.of("job.requeued")
        assert [e["jobs"] for e in requeued] == [[jid]]
        assert requeued[0]["at"] - t0 >= 5.5  # the budget (6 s) was still honoured after the restart
    finally:
        env.stop()
