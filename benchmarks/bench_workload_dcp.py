"""workload_dcp: the PyTorch DCP training workload against a real one-node Ceph RGW started for the run.

- save / load of a ~100 MB and a ~1 GB state (MLP + Adam) with DCP to RGW (4 writer threads, the workload's
  settings), medians of 3; against a raw boto3 ``put_object`` of the same number of bytes in the same run
  (``save_ratio_vs_raw_put``: goal <= 1.3). What a save is made of, to tell where a ratio above that goes: the same
  DCP save to a local directory (``local_save_s``: planning and serialisation, no network) and the same bytes
  written as 4 files at once through s3fs (``s3fs_put_s``: what DCP's own ``FsspecWriter`` does beneath; the
  workload writes through boto3 instead, ``sco_workloads.dcp_train.S3Objects``, and this line says why).
- notice -> checkpoint complete: the workload process (~100 MB state) gets USR1 mid-run; the time from the signal
  to its DCP checkpoint being complete (``.metadata`` written), as the workload measures it; median of 3.
- steps redone on resume with a notice (goal 0) and without one (killed -9 a few steps past a periodic
  checkpoint every 5 steps: at most 5).

The store's throughput to quote in ``hall.yaml`` (``checkpointStore.throughputMiBPerSecond``) is ``save_mib_s``.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
REPEATS = 3
SIZES = {"100MB": 4096, "1GB": 40960}  # hidden width of a 1024-H-1024 MLP: params x 3 (Adam) x 4 bytes


def _env(endpoint: str, creds: dict[str, Any]) -> dict[str, str]:
    return {
        **os.environ,
        "AWS_ACCESS_KEY_ID": creds["access_key"],
        "AWS_SECRET_ACCESS_KEY": creds["secret_key"],
        "AWS_ENDPOINT_URL": endpoint,
    }


def _save_load(bucket: str, env: dict[str, str], s3: Any) -> Iterator[dict[str, Any]]:
    import torch

    from sco_workloads.dcp_train import App, Config, Store, build, train_step

    os.environ.update({k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL")})
    for label, hidden in SIZES.items():
        cfg = Config(run=f"bench-{label}", store=f"s3://{bucket}/runs/", inputs=1024, hidden=hidden, batch=8)
        model, optim = build(cfg)
        train_step(model, optim, 0, cfg)  # Adam's state exists: a real training state
        app = App(model, optim, 1)
        nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        nbytes += sum(
            v.numel() * v.element_size() for st in optim.state.values() for v in st.values() if torch.is_tensor(v)
        )
        store = Store(cfg)
        saves, loads, puts, locals_, s3fs_puts = [], [], [], [], []
        payload = os.urandom(nbytes)
        for i in range(REPEATS):
            app.step = i + 1
            saves.append(store.save(app))
            loads.append(store.load(App(*build(cfg)), app.step))
            t0 = time.perf_counter()
            s3.put_object(Bucket=bucket, Key=f"runs/raw-{label}-{i}", Body=payload)
            puts.append(time.perf_counter() - t0)
            # the one OSD's disk is a sparse file: keep what the repeats leave behind small
            s3.delete_object(Bucket=bucket, Key=f"runs/raw-{label}-{i}")
            store.prune(1)
            locals_.append(_local_save(app))
            s3fs_puts.append(_s3fs_put(store.fs, f"{bucket}/runs/s3fs-{label}", payload))
        save, load, put = statistics.median(saves), statistics.median(loads), statistics.median(puts)
        mib = nbytes / 2**20
        yield {
            "case": f"save_load_{label}",
            "state_mib": round(mib, 1),
            "save_s": round(save, 3),
            "load_s": round(load, 3),
            "raw_put_s": round(put, 3),
            "save_mib_s": round(mib / save, 1),
            "load_mib_s": round(mib / load, 1),
            "raw_put_mib_s": round(mib / put, 1),
            "save_ratio_vs_raw_put": round(save / put, 3),
            "local_save_s": round(statistics.median(locals_), 3),
            "s3fs_put_s": round(statistics.median(s3fs_puts), 3),
            "save_ratio_vs_s3fs_put": round(save / statistics.median(s3fs_puts), 3),
            "saves_s": [round(x, 3) for x in saves],
            "raw_puts_s": [round(x, 3) for x in puts],
            "s3fs_puts_s": [round(x, 3) for x in s3fs_puts],
        }
        del model, optim, app, payload


def _local_save(app: Any) -> float:
    """The same DCP save (4 threads, no fsync) to a local directory: DCP's own cost without the store."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    with tempfile.TemporaryDirectory(prefix="sco-bench-dcp-") as d:
        t0 = time.perf_counter()
        dcp.save({"app": app}, storage_writer=FileSystemWriter(d, sync_files=False, thread_count=4))
        return time.perf_counter() - t0


def _s3fs_put(fs: Any, prefix: str, payload: bytes, files: int = 4) -> float:
    """The same bytes as ``files`` files written at once through s3fs, as DCP's writer threads write them."""
    chunk = -(-len(payload) // files)
    view = memoryview(payload)

    def one(i: int) -> None:
        with fs.open(f"{prefix}/{i}", "wb") as f:
            f.write(view[i * chunk : (i + 1) * chunk])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(files) as pool:
        list(pool.map(one, range(files)))
    took = time.perf_counter() - t0
    fs.rm(prefix, recursive=True)
    return took


def _workload(bucket: str, run: str, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "sco_workloads.dcp_train", "--run", run, "--store", f"s3://{bucket}/runs/", *args]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def _read_until(p: subprocess.Popen[str], kind: str, **match: Any) -> dict[str, Any]:
    assert p.stdout is not None
    for line in p.stdout:
        m = json.loads(line)
        if m["kind"] == kind and all(m.get(k) == v for k, v in match.items()):
            return dict(m)
    raise RuntimeError(f"the workload ended before {kind} {match}")


def _resumed(bucket: str, run: str, env: dict[str, str], *args: str) -> dict[str, Any]:
    p = _workload(bucket, run, env, *args)
    m = _read_until(p, "resumed")
    p.wait(300)
    return m


def _notice_and_redone(bucket: str, env: dict[str, str]) -> Iterator[dict[str, Any]]:
    big = ["--inputs", "1024", "--hidden", "4096", "--batch", "8", "--steps", "400", "--every", "1000"]
    times, redone_with = [], []
    for i in range(REPEATS):
        run = f"notice-{i}"
        p = _workload(bucket, run, env, *big)
        _read_until(p, "started")
        time.sleep(1.0)  # some steps in
        p.send_signal(signal.SIGUSR1)
        noticed = _read_until(p, "noticed")
        p.wait(60)
        times.append(noticed["notice_to_checkpoint_ms"])
        redone_with.append(_resumed(bucket, run, env, *big[:-4], "--steps", str(noticed["step"] + 1))["steps_redone"])
    small = ["--steps", "60", "--every", "5", "--step-seconds", "0.05"]
    redone_without = []
    for i in range(REPEATS):
        run = f"killed-{i}"
        p = _workload(bucket, run, env, *small)
        _read_until(p, "checkpoint", step=20)
        time.sleep(0.05 * (2 + i))  # 2, 3, 4 steps past it
        p.send_signal(signal.SIGKILL)
        p.wait()
        redone_without.append(_resumed(bucket, run, env, *small)["steps_redone"])
    yield {
        "case": "notice_and_resume",
        "notice_to_checkpoint_ms": round(statistics.median(times), 1),
        "notice_to_checkpoint_ms_all": times,
        "steps_redone_with_notice": max(redone_with),
        "steps_redone_without_notice": max(redone_without),
        "steps_redone_without_notice_all": redone_without,
        "periodic_every": 5,
    }


def run() -> Iterator[dict[str, Any]]:
    from sco.provider.checkpoint_store import ContractStore, StoreAdmin
    from sco_devkit.devcluster.ceph import CephCluster

    with tempfile.TemporaryDirectory(prefix="sco-bench-ceph-") as d:
        t0 = time.perf_counter()
        ceph = CephCluster(Path(d), block_bytes=16 << 30).start()
        try:
            started = time.perf_counter() - t0
            creds = StoreAdmin(ceph.endpoint, ceph.access_key, ceph.secret_key).ensure(
                ContractStore("bench", "sco-ckpt-bench", "runs/", 3)
            )
            env = _env(ceph.endpoint, creds)
            s3 = ceph.s3(creds["access_key"], creds["secret_key"], read_timeout=600)
            # RGW makes its pools lazily; the first multipart upload is slow (recipe trap): warm up first
            from boto3.s3.transfer import TransferConfig

            s3.upload_fileobj(
                __import__("io").BytesIO(os.urandom(24 << 20)),
                creds["bucket"],
                "runs/warmup",
                Config=TransferConfig(multipart_threshold=8 << 20, multipart_chunksize=8 << 20),
            )
            lines = []
            for line in _save_load(creds["bucket"], env, s3):
                lines.append(line)
                yield line
            (notice,) = _notice_and_redone(creds["bucket"], env)
            yield notice
            hundred = next(x for x in lines if x["case"] == "save_load_100MB")
            gig = next(x for x in lines if x["case"] == "save_load_1GB")
            yield {
                "case": "summary",
                "ceph_start_s": round(started, 1),
                "save_ratio_vs_raw_put": hundred["save_ratio_vs_raw_put"],
                "save_ratio_vs_raw_put_1gb": gig["save_ratio_vs_raw_put"],
                "save_ratio_vs_s3fs_put": hundred["save_ratio_vs_s3fs_put"],
                "save_ratio_vs_s3fs_put_1gb": gig["save_ratio_vs_s3fs_put"],
                "save_mib_s_100mb": hundred["save_mib_s"],
                "save_mib_s_1gb": gig["save_mib_s"],
                "load_s_100mb": hundred["load_s"],
                "load_s_1gb": gig["load_s"],
                "notice_to_checkpoint_ms": notice["notice_to_checkpoint_ms"],
                "steps_redone_with_notice": notice["steps_redone_with_notice"],
                "steps_redone_without_notice": notice["steps_redone_without_notice"],
            }
        finally:
            ceph.stop()


BENCHES = {"workload_dcp": run}
