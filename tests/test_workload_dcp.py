"""The checkpoint store (a real one-node Ceph RGW) and the PyTorch DCP workload against it, without a scheduler:
per-contract users scoped to their prefix, an interrupted run resumed bitwise from the newest complete checkpoint
(never from an interrupted save), retention of the last K, the contract's checkpoint size against the hall's
store throughput, and lost work as figures on the checkpoint socket."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from sco.contract.compiler import compile_repo
from sco.errors import ContractError
from sco.provider.checkpoint_store import ContractStore, StoreAdmin, stores_of
from sco_devkit.devcluster.ceph import CephCluster
from tests.conftest import WriteFn, contract_yaml
from tests.dcp_runs import ROOT, SMALL, assert_bitwise, lines, provision, reference, workload_env


def test_store_user_is_scoped_to_its_contract_prefix(ceph: CephCluster) -> None:
    from botocore.exceptions import ClientError

    admin = StoreAdmin(ceph.endpoint, ceph.access_key, ceph.secret_key)
    store = ContractStore("scoped-a", "sco-ckpt-scoped-a", "runs/", 2)
    first = admin.ensure(store)
    assert first["changed"] == ["user", "bucket", "policy", "lifecycle"] and first["access_key"]
    again = admin.ensure(store)
    assert again["changed"] == [] and again["access_key"] == first["access_key"]  # idempotent
    other = admin.ensure(ContractStore("scoped-b", "sco-ckpt-scoped-b", "runs/", 2))
    s3 = ceph.s3(first["access_key"], first["secret_key"])
    s3.put_object(Bucket=store.bucket, Key="runs/x/obj", Body=b"ok")
    assert s3.get_object(Bucket=store.bucket, Key="runs/x/obj")["Body"].read() == b"ok"
    assert [o["Key"] for o in s3.list_objects_v2(Bucket=store.bucket, Prefix="runs/")["Contents"]] == ["runs/x/obj"]
    ceph.s3().put_object(Bucket=store.bucket, Key="elsewhere/admin", Body=b"admin's")
    denied = [
        lambda: s3.put_object(Bucket=store.bucket, Key="elsewhere/obj", Body=b"no"),
        lambda: s3.get_object(Bucket=store.bucket, Key="elsewhere/admin"),
        lambda: s3.delete_object(Bucket=store.bucket, Key="elsewhere/admin"),
        lambda: s3.list_objects_v2(Bucket=other["bucket"], Prefix="runs/"),
        lambda: s3.put_object(Bucket=other["bucket"], Key="runs/x/obj", Body=b"no"),
        lambda: s3.get_bucket_policy(Bucket=store.bucket),
    ]
    multi = s3.delete_objects(
        Bucket=store.bucket, Delete={"Objects": [{"Key": "elsewhere/admin"}, {"Key": "runs/x/obj"}]}
    )
    assert [e["Key"] for e in multi["Errors"]] == ["elsewhere/admin"] and multi["Errors"][0]["Code"] == "AccessDenied"
    assert [d["Key"] for d in multi["Deleted"]] == ["runs/x/obj"]
    for call in denied:
        with pytest.raises(ClientError) as e:
            call()
        assert e.value.response["Error"]["Code"] == "AccessDenied"
    lc = ceph.s3().get_bucket_lifecycle_configuration(Bucket=store.bucket)["Rules"][0]
    assert lc["Filter"] == {"Prefix": "runs/"} and lc["AbortIncompleteMultipartUpload"]["DaysAfterInitiation"] == 1


def test_check_mode_changes_nothing(ceph: CephCluster) -> None:
    admin = StoreAdmin(ceph.endpoint, ceph.access_key, ceph.secret_key)
    store = ContractStore("dry-run", "sco-ckpt-dry-run", "runs/", 2)
    assert admin.ensure(store, check_mode=True)["changed"] == ["user", "bucket", "policy", "lifecycle"]
    assert admin.user(store.uid) is None
    assert "sco-ckpt-dry-run" not in [b["Name"] for b in ceph.s3().list_buckets()["Buckets"]]


def test_killed_run_resumes_bitwise_from_the_newest_complete_checkpoint(ceph: CephCluster, tmp_path: Path) -> None:
    """Killed (-9) after its checkpoint at step 10, with an interrupted save planted just after its last one
    (data, no .metadata): the next attempt resumes from that last complete one, counts the steps redone, ends
    bitwise equal to a straight run, and keeps only the last 2 complete checkpoints."""
    creds = provision(ceph, "dcp-resume")
    env = workload_env(ceph, creds)
    store = f"s3://{creds['bucket']}/runs/"
    argv = [sys.executable, "-m", "sco_workloads.dcp_train", "--run", "r1", "--store", store, "--steps", "20",
            "--every", "5", "--keep", "2", "--step-seconds", "0.05", *SMALL,
            "--out", str(tmp_path / "final.pt")]  # fmt: skip
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    assert p.stdout is not None
    seen = []
    for line in p.stdout:
        seen.append(json.loads(line))
        if seen[-1]["kind"] == "checkpoint" and seen[-1]["step"] == 10:
            break
    time.sleep(0.1)  # a step or two past the checkpoint, then the node dies
    p.send_signal(signal.SIGKILL)
    p.wait()
    s3 = ceph.s3(creds["access_key"], creds["secret_key"])

    def progress_now() -> int:
        return int(json.loads(s3.get_object(Bucket=creds["bucket"], Key="runs/r1/progress")["Body"].read())["step"])

    # a progress PUT the killed process had sent may still land in RGW after the kill (seen under load): read until
    # two reads a second apart agree
    progress, prev = progress_now(), -1
    while progress != prev:
        time.sleep(1.0)
        prev, progress = progress, progress_now()
    listed = [o["Key"] for o in s3.list_objects_v2(Bucket=creds["bucket"], Prefix="runs/r1/")["Contents"]]
    last = max(int(k.split("/")[2].removeprefix("step-")) for k in listed if k.endswith("/.metadata"))
    assert last >= 10 and progress >= last
    # an interrupted save just after it, the newest checkpoint directory: a data file, no .metadata
    data = next(k for k in listed if k.startswith(f"runs/r1/step-{last:08d}/") and k.endswith(".distcp"))
    s3.copy_object(Bucket=creds["bucket"], Key=f"runs/r1/step-{last + 1:08d}/__0_0.distcp",
                   CopySource={"Bucket": creds["bucket"], "Key": data})  # fmt: skip
    second = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    out = lines(second.stdout)
    resumed = next(m for m in out if m["kind"] == "resumed")
    assert resumed["from_step"] == last and resumed["steps_redone"] == progress - last
    assert_bitwise(tmp_path / "final.pt", reference(20, *SMALL))
    keys = {o["Key"].split("/")[2] for o in s3.list_objects_v2(Bucket=creds["bucket"], Prefix="runs/r1/")["Contents"]}
    assert keys == {"progress", "step-00000015", "step-00000020"}  # the last 2; the interrupted save is gone


def _server_and_client(sock: Path, report: dict[str, Any] | None, resume: dict[str, Any] | None) -> Any:
    from sco.agent.checkpoint import CheckpointServer
    from sco.agent.deadline import Deadline
    from sco.workload.checkpoint_client import CheckpointClient

    async def main() -> tuple[list[dict[str, Any]], list[tuple[str, dict[str, Any]]]]:
        events: list[tuple[str, dict[str, Any]]] = []
        srv = CheckpointServer(sock, budget_for={"train": 6.0}.get, on_event=lambda t, **f: events.append((t, f)))
        await srv.start()
        c = CheckpointClient("trainer", contract="train", path=str(sock), on_notice=lambda n: report, resume=resume)
        await asyncio.to_thread(c.connect)
        t0 = time.time()
        srv.start_notice("n-1", Deadline(t0 + 20, 2, t0))
        await srv.wait_settled(until=t0 + 5)
        c.close()
        out = srv.lost_work()
        await srv.close()
        return out, events

    return asyncio.run(main())


def test_lost_work_figures_on_the_socket() -> None:
    with tempfile.TemporaryDirectory(prefix="sco-ck-") as d:
        lost, events = _server_and_client(
            Path(d) / "s.sock", {"checkpointed": True, "save_s": 0.8, "step": 40}, {"from_step": 30, "steps_redone": 3}
        )
    (w,) = lost
    assert w["checkpointed"] is True and w["save_s"] == 0.8 and w["save_within_budget"] is True
    assert w["budget_s"] == pytest.approx(6.0, abs=0.05) and w["step"] == 40
    assert w["resumed_from_step"] == 30 and w["steps_redone"] == 3
    assert dict(events)["checkpoint.registered"]["resume"] == {"from_step": 30, "steps_redone": 3}
    assert dict(events)["checkpoint.done"]["report"]["save_s"] == 0.8


def test_a_bad_report_is_refused_with_what_was_wrong() -> None:
    from sco.agent.checkpoint import _REPORT_KEYS, ProtocolError, _figures

    for bad, msg in (
        ({"report": {"save_s": -1}}, "report.save_s: expected a non-negative number"),
        ({"report": {"save_s": float("nan")}}, "report.save_s"),
        ({"report": {"colour": 1}}, "report.colour: unknown field"),
        ({"report": {"checkpointed": 1}}, "report.checkpointed: expected a boolean"),
        ({"report": [1]}, "report: expected an object"),
    ):
        with pytest.raises(ProtocolError, match=msg.replace(".", r"\.")):
            _figures(bad, "report", _REPORT_KEYS)


HALL_STORE = "  checkpointStore: {endpoint: 'http://rgw.hall:7480', throughputMiBPerSecond: 80}\n"


def test_compiler_refuses_a_budget_that_cannot_fit_the_save(repo: Path, write: WriteFn) -> None:
    hall = (repo / "hall.yaml").read_text()
    store = "{mode: signal, store: {prefix: runs/, sizeMiB: 1024, keep: 3}}"
    write("contracts/train.yaml", contract_yaml("train", drainBudgetSeconds="10", checkpoint=store))
    with pytest.raises(ContractError) as e:
        compile_repo(repo)
    assert "contracts/train.yaml: spec.checkpoint.store.sizeMiB: a 1024 MiB checkpoint cannot be checked" in "\n".join(
        e.value.lines()
    )
    (repo / "hall.yaml").write_text(hall.replace("spec:\n", "spec:\n" + HALL_STORE, 1))
    with pytest.raises(ContractError) as e:
        compile_repo(repo)
    (line,) = [x for x in e.value.lines() if "sizeMiB" in x]
    assert line == (
        "contracts/train.yaml: spec.checkpoint.store.sizeMiB: a 1024 MiB checkpoint takes 12.8 s at the hall's"
        " measured store throughput of 80 MiB/s, more than the drain budget of 10 s (drainBudgetSeconds): raise"
        " the budget to at least 13 s or make the checkpoint smaller than 800 MiB"
    )
    write("contracts/train.yaml", contract_yaml("train", drainBudgetSeconds="13", checkpoint=store))
    payload = compile_repo(repo)
    assert payload["policy"]["checkpointStore"]["throughputMiBPerSecond"] == 80
    (st,) = stores_of({c["name"]: c for c in payload["contracts"]})
    assert (st.bucket, st.prefix, st.keep) == ("sco-ckpt-train", "runs/", 3)
    for bad in ("/abs/", "a/../b/", "no-slash"):
        bad_store = f"{{mode: signal, store: {{prefix: '{bad}', sizeMiB: 1}}}}"
        write("contracts/train.yaml", contract_yaml("train", checkpoint=bad_store))
        with pytest.raises(ContractError) as e:
            compile_repo(repo)
        assert any("contracts/train.yaml: spec.checkpoint.store.prefix: " in x for x in e.value.lines()), bad


def test_a_hall_without_a_store_keeps_its_bundle_bytes(repo: Path) -> None:
    assert "checkpointStore" not in compile_repo(repo)["policy"]


def test_workload_refuses_bad_arguments() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "sco_workloads.dcp_train", "--run", "x", "--store", "/tmp/x", "--every", "0"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert p.returncode == 2 and "--every: must be a positive integer, got 0" in p.stderr


def test_workload_package_imports_only_the_client_library() -> None:
    """Checked by import-linter too; here the running module's own imports of sco."""
    code = "import sys, sco_workloads.dcp_train; print(sorted(m for m in sys.modules if m.startswith('sco.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert json.loads(out.stdout.replace("'", '"')) == ["sco.workload", "sco.workload.checkpoint_client"]


def test_the_drill_report_says_each_workloads_lost_work() -> None:
    """The drain outcome's ``workloads`` (the agent's, per workload on the socket) in the drill report's JSON and in
    its HTML table; a node's figures that are not numbers are left blank, its names escaped."""
    from sco.control.drill import DrillReport, fold, render_html

    t0 = 1_764_400_000.0
    saved = {"workload": "trainer@job-7", "contract": "genomics-ckpt", "state": "done", "checkpointed": True,
             "save_s": 0.42, "budget_s": 6.0, "save_within_budget": True, "step": 17, "resumed_from_step": 8,
             "steps_redone": 3}  # fmt: skip
    silent = {"workload": "<b>etl</b>", "contract": None, "state": "silent", "checkpointed": False, "save_s": "slow",
              "budget_s": 6.0}  # fmt: skip
    events = [
        {"type": "notice.accepted", "notice": "n-1", "at": t0, "seq": 1, "received_at": t0, "terminate_at": t0 + 120},
        {"type": "drain.drained", "notice": "n-1", "at": t0 + 4, "seq": 2, "workloads": [saved, silent, "junk"]},
    ]
    tl = fold("n1", events, notice="n-1")
    report = DrillReport("local", "d-1", t0, t0 + 120, {"n1": tl}, finished=True)
    assert report.as_json()["nodes"]["n1"]["workloads"] == [saved, silent]
    page = render_html(report)
    row = page.split('<tr data-workload="trainer@job-7">', 1)[1].split("</tr>", 1)[0]
    assert row == (
        '<td>n1</td><td>trainer@job-7</td><td>genomics-ckpt</td><td class="ok">yes (done)</td>'
        '<td class="num">0.42 s</td><td class="num">6 s</td><td class="num">17</td><td class="num">3 (from step 8)</td>'
    )
    row = page.split('<tr data-workload="&lt;b&gt;etl&lt;/b&gt;">', 1)[1].split("</tr>", 1)[0]
    assert '<td class="bad">no (silent)</td><td class="num"></td><td class="num">6 s</td>' in row
    assert "<b>etl" not in page


def test_every_save_and_load_of_a_run_puts_through_one_boto3_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """DCP takes a new writer (and reader) per checkpoint: each must write and read the store through the run's one
    boto3 client (S3Objects: a PUT per file on DCP's own writer threads, not s3fs's one asyncio thread, which made a
    save 1.6-2.0x a raw PUT of its bytes: bench workload_dcp), and the listings reuse one S3 filesystem; one made for
    other credentials is never reused (the recipe's trap: it kept failing)."""
    from sco_workloads.dcp_train import S3Objects, Store, parse

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AK-ONE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "SK-ONE")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    store = Store(parse(["--run", "r", "--store", "s3://sco-ckpt-x/runs/"]))
    assert isinstance(store.objects, S3Objects)
    for w, step in ((store._writer(1), 1), (store._writer(2), 2), (store._reader(2), 2)):
        assert w.fs is store.objects and w.path == f"s3://sco-ckpt-x/runs/r/step-{step:08d}"
    assert store.objects.client.meta.endpoint_url == "http://127.0.0.1:9"
    assert Store(parse(["--run", "r", "--store", "s3://sco-ckpt-x/runs/"])).fs is store.fs
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AK-TWO")
    other = Store(parse(["--run", "r", "--store", "s3://sco-ckpt-x/runs/"]))
    assert other.fs is not store.fs and other.fs.key == "AK-TWO"


def _local_run(store: Path, steps: int, *extra: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "sco_workloads.dcp_train", "--run", "r", "--store", str(store), "--steps", str(steps),
            "--every", "10", "--keep", "3", *SMALL, *extra]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_a_fresh_local_store_is_made_on_first_use(tmp_path: Path) -> None:
    """--store a local directory that does not exist yet (documented as allowed): the first progress mark comes
    before the first save, and makes the run's directory."""
    store = tmp_path / "store"
    p = _local_run(store, 20)
    assert p.returncode == 0, p.stderr[-3000:]
    assert [m["kind"] for m in lines(p.stdout)][-1] == "finished"
    assert json.loads((store / "r" / "progress").read_text()) == {"step": 20}
    assert sorted(x.name for x in (store / "r").iterdir()) == ["progress", "step-00000010", "step-00000020"]


def test_a_newest_checkpoint_that_does_not_load_falls_back_to_the_older_one(tmp_path: Path) -> None:
    """The newest complete checkpoint (its .metadata there) lost a data file: it is said, the next older one resumed
    from (bitwise as a straight run), and the damaged one written again whole; when none loads, exit 74 naming
    each, not a fresh start (which would redo everything and prune them)."""
    store = tmp_path / "store"
    (store / "r").mkdir(parents=True)  # the run's directory: this test is about loading, not about making it
    first = _local_run(store, 20)
    assert first.returncode == 0, first.stderr[-3000:]
    (store / "r" / "step-00000020" / "__0_0.distcp").unlink()
    second = _local_run(store, 30, "--out", str(tmp_path / "final.pt"))
    assert second.returncode == 0, second.stderr[-3000:]
    out = lines(second.stdout)
    bad = next(m for m in out if m["kind"] == "checkpoint_unloadable")
    assert bad["step"] == 20 and bad["error"].startswith("FileNotFoundError: ") and "__0_0.distcp" in bad["error"]
    resumed = next(m for m in out if m["kind"] == "resumed")
    assert resumed["from_step"] == 10 and resumed["steps_redone"] == 10
    assert_bitwise(tmp_path / "final.pt", reference(30, *SMALL))
    assert (store / "r" / "step-00000020" / "__0_0.distcp").exists()  # saved again at step 20

    for step in (10, 20, 30):
        (store / "r" / f"step-{step:08d}" / "__0_0.distcp").unlink()
    third = _local_run(store, 40)
    assert third.returncode == 74, (third.returncode, third.stderr[-3000:])
    assert "Traceback" not in third.stderr
    (err,) = [x for x in third.stderr.splitlines() if x.startswith("dcp_train: error: ")]
    assert "no complete checkpoint of run 'r'" in err
    assert all(f"step {s}: FileNotFoundError" in err for s in (10, 20, 30)), err
    assert "started" not in [m["kind"] for m in lines(third.stdout)]


def test_a_checkpoint_that_did_not_load_is_not_kept_in_place_of_good_ones(tmp_path: Path) -> None:
    """keep 1, resumed from 10 because 20 did not load, a notice save at 15: 15 is kept (not just 20, which would
    leave the next attempt nothing that loads); 20 stays until a newer good one replaces it."""
    from sco_workloads.dcp_train import Store, parse

    store = Store(parse(["--run", "r", "--store", str(tmp_path)]))
    for step in (10, 15, 20):
        d = tmp_path / "r" / f"step-{step:08d}"
        d.mkdir(parents=True)
        (d / ".metadata").write_bytes(b"")
    assert store.prune(1, {20}) == [10]
    assert store.steps() == ([15, 20], [])
