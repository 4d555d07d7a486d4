"""A PyTorch training job that keeps its work across a reclaim (seed views 07 and 10): DCP checkpoints to the
contract's checkpoint store (Ceph RGW over S3, or a local directory).

- **Periodic**: a checkpoint every ``--every`` steps, so a node that dies without a notice costs at most that
  many steps.
- **On notice** (USR1/TERM from Slurm or kubelet, or a notice on the agent's checkpoint socket): the step in
  progress is finished, a checkpoint saved, the agent told ``done`` with what it cost (``save_s``, ``step``), and
  the process exits 75 (EX_TEMPFAIL: requeue me).
- **Resume**: from the newest *complete* checkpoint: complete only once DCP's ``.metadata`` is written (DCP
  writes it last, after every data file), so an interrupted save is never resumed from. The steps the last
  attempt did past it (its progress marker) are the steps redone, said at registration on the socket. One that
  does not load (a data file lost since) is said (``checkpoint_unloadable``) and the next older tried; if
  checkpoints exist and none loads, the job exits 74 (EX_IOERR) naming each, rather than start over.
- **Retention**: the newest ``--keep`` complete checkpoints are kept; older ones, and incomplete ones older than
  the newest complete one, are deleted after each save.

Deterministic (seeded model, data seeded by step index, one thread, deterministic algorithms): a resumed run's
final parameters are bitwise equal to an uninterrupted run's.

    python -m sco_workloads.dcp_train --run job-7 --store s3://sco-ckpt-training/runs/ --steps 40 --every 10 \\
        --contract training --out final.pt

S3 credentials: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` and ``AWS_ENDPOINT_URL`` (or ``--endpoint``).
The contract's credentials file (role ``checkpoint_store``) also names its store and retention:
``SCO_CHECKPOINT_STORE`` and ``SCO_CHECKPOINT_KEEP`` are the defaults of ``--store`` and ``--keep``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from sco.workload.checkpoint_client import CheckpointClient, CheckpointError, Notice

EX_REQUEUE = 75  # EX_TEMPFAIL: checkpointed on a notice; run me again
EX_UNLOADABLE = 74  # EX_IOERR: checkpoints exist and none loads; a requeue would fail the same way
STEP_DIR = "step-"


@dataclass
class Config:
    run: str
    store: str  # s3://bucket/prefix/ or a local directory
    steps: int = 40
    every: int = 10
    keep: int = 3
    inputs: int = 64
    hidden: int = 256
    batch: int = 32
    seed: int = 0
    step_seconds: float = 0.0  # extra time per step (a slower job: gives a notice a step in progress)
    threads: int = 4  # DCP's S3 writer threads
    contract: str | None = None
    socket: str | None = None  # None: $SCO_CHECKPOINT_SOCKET if set, else no socket
    out: str | None = None  # the final parameters (torch.save), for comparison
    endpoint: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)


def emit(kind: str, **f: Any) -> None:
    sys.stdout.write(json.dumps({"kind": kind, "t": time.time(), **f}) + "\n")
    sys.stdout.flush()


# --- the model and its data -------------------------------------------------------------------------


def build(cfg: Config) -> tuple[Any, Any]:
    import torch

    torch.manual_seed(cfg.seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(cfg.inputs, cfg.hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(cfg.hidden, cfg.inputs),
    )
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def train_step(model: Any, optim: Any, step: int, cfg: Config) -> float:
    import torch

    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)  # the data of a step depends on its index only
    x = torch.randn(cfg.batch, cfg.inputs, generator=g)
    y = torch.roll(x, 1, dims=1)
    optim.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optim.step()
    if cfg.step_seconds:
        time.sleep(cfg.step_seconds)
    return float(loss.detach())


def _deterministic() -> None:
    import torch

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def uninterrupted(cfg: Config) -> dict[str, Any]:
    """The reference: the same job run straight through, in this process; its final parameters."""
    _deterministic()
    model, optim = build(cfg)
    for step in range(cfg.steps):
        train_step(model, optim, step, cfg)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class App:
    """DCP ``Stateful``: model, optimizer (its state made to exist before an in-place load) and the step."""

    def __init__(self, model: Any, optim: Any, step: int = 0) -> None:
        self.model, self.optim, self.step = model, optim, step

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.optim)
        return {"model": msd, "optim": osd, "step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.step = int(sd["step"])


# --- the store ----------------------------------------------------------------------------------------


class _Buffer(io.BytesIO):
    """A file's bytes, kept when DCP closes the stream (it does, before the stream's context ends)."""

    data: bytes | None = None

    def close(self) -> None:
        if self.data is None and not self.closed:
            self.data = self.getvalue()
        super().close()


class S3Objects:
    """DCP's file system interface (``FileSystemBase``: the methods ``FileSystemWriter``/``FileSystemReader`` call)
    over one boto3 client, so each of DCP's writer threads PUTs its file on its own thread.

    Why not DCP's ``FsspecWriter`` (s3fs): every request of every writer thread then runs on s3fs's one asyncio
    thread, which signs and hashes each body and, on Python 3.11, copies the unsent rest of a body on every socket
    send. Measured on this project's machine (bench workload_dcp): a DCP save through s3fs took 1.6-2.0x a raw
    boto3 PUT of the same bytes, the same bytes through s3fs without DCP as long, and this 1.1-1.2x.

    A file is one PUT, so it exists whole or not at all; ``.metadata`` is written (DCP: ``.tmp``, then renamed)
    only after every data file, so a checkpoint whose ``.metadata`` exists is complete."""

    def __init__(self, client: Any) -> None:
        self.client = client

    @staticmethod
    def _split(path: str | os.PathLike[str]) -> tuple[str, str]:
        bucket, _, key = os.fspath(path).removeprefix("s3://").partition("/")
        return bucket, key

    def init_path(self, path: str | os.PathLike[str], **_kwargs: Any) -> str:
        return os.fspath(path)

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return f"{os.fspath(path).rstrip('/')}/{suffix}"

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Any:
        bucket, key = self._split(path)
        if "r" in mode:
            body = self.client.get_object(Bucket=bucket, Key=key)["Body"]
            try:
                yield io.BytesIO(body.read())
            finally:
                body.close()
            return
        buf = _Buffer()
        yield buf  # an exception here (a failed serialisation) leaves nothing on the store
        self.client.put_object(Bucket=bucket, Key=key, Body=buf.data if buf.data is not None else buf.getvalue())

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        bucket, key = self._split(path)
        _, new_key = self._split(new_path)
        self.client.copy_object(Bucket=bucket, Key=new_key, CopySource={"Bucket": bucket, "Key": key})
        self.client.delete_object(Bucket=bucket, Key=key)

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        """S3 has no directories (and a user scoped to its prefix may not ask whether the bucket exists)."""

    def exists(self, path: str | os.PathLike[str]) -> bool:
        from botocore.exceptions import ClientError

        bucket, key = self._split(path)
        try:
            self.client.head_object(Bucket=bucket, Key=key)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise
        return True

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        bucket, key = self._split(path)
        self.client.delete_object(Bucket=bucket, Key=key)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return os.fspath(checkpoint_id).startswith("s3://")


class Store:
    """Checkpoints of one run: ``<store>/<run>/step-NNNNNNNN/`` (DCP layout) and ``<store>/<run>/progress``."""

    def __init__(self, cfg: Config) -> None:
        import fsspec

        self.cfg = cfg
        self.s3 = cfg.store.startswith("s3://")
        opts: dict[str, Any] = dict(cfg.storage_options)
        if self.s3:
            endpoint = cfg.endpoint or os.environ.get("AWS_ENDPOINT_URL")
            # One S3 filesystem (its client and warm connections) for the run's listings, progress marks and
            # pruning: a new one per use costs 0.1-0.5 s of client setup and new connections. fsspec caches
            # filesystems by their arguments, so the credentials are among them: one made before they were set
            # (recipe trap: it keeps failing) is never this one. No listing cache (another attempt writes beside us).
            for opt, var in (("key", "AWS_ACCESS_KEY_ID"), ("secret", "AWS_SECRET_ACCESS_KEY")):
                if os.environ.get(var):
                    opts.setdefault(opt, os.environ[var])
            opts.setdefault("use_listings_cache", False)
            ck = opts.setdefault("client_kwargs", {})
            ck.setdefault("region_name", os.environ.get("AWS_DEFAULT_REGION", "us-east-1"))
            if endpoint:
                ck.setdefault("endpoint_url", endpoint)
            opts.setdefault("config_kwargs", {"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 4}})
            # the checkpoints' own bytes: one boto3 client for every writer and reader of the run (S3Objects)
            import boto3
            from botocore.config import Config as BotoConfig

            self.objects = S3Objects(
                boto3.client(
                    "s3",
                    endpoint_url=endpoint,
                    region_name=ck["region_name"],
                    config=BotoConfig(
                        connect_timeout=5,
                        read_timeout=120,  # a 1 GB state's file is ~250 MB: its PUT's answer comes after the upload
                        retries={"max_attempts": 4, "mode": "standard"},  # backoff with jitter
                        max_pool_connections=max(10, 2 * cfg.threads),
                    ),
                )
            )
        self.opts = opts
        self.fs, root = fsspec.core.url_to_fs(cfg.store, **opts)
        self.root = root.rstrip("/") + "/" + cfg.run
        self.url_root = cfg.store.rstrip("/") + "/" + cfg.run
        self._run_dir_made = False

    def _url(self, step: int) -> str:
        return f"{self.url_root}/{STEP_DIR}{step:08d}"

    def _path(self, step: int) -> str:
        return f"{self.root}/{STEP_DIR}{step:08d}"

    def steps(self) -> tuple[list[int], list[int]]:
        """(complete, incomplete) checkpoint steps, ascending."""
        try:
            names = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return [], []
        complete: list[int] = []
        incomplete: list[int] = []
        for n in names:
            base = n.rstrip("/").rsplit("/", 1)[-1]
            if not base.startswith(STEP_DIR):
                continue
            try:
                step = int(base[len(STEP_DIR) :])
            except ValueError:
                continue
            (complete if self.fs.exists(f"{self._path(step)}/.metadata") else incomplete).append(step)
        return sorted(complete), sorted(incomplete)

    def save(self, app: App) -> float:
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        dcp.save({"app": app}, storage_writer=self._writer(app.step))
        return time.perf_counter() - t0

    def _writer(self, step: int) -> Any:
        from torch.distributed.checkpoint import FileSystemWriter

        if not self.s3:
            return FileSystemWriter(self._path(step), sync_files=True, thread_count=self.cfg.threads)
        # sync_files=False: S3 objects have no fileno(), DCP would os.sync() the whole machine per file.
        w = FileSystemWriter(self._url(step), sync_files=False, thread_count=self.cfg.threads)
        w.fs, w.path = self.objects, self._url(step)
        return w

    def load(self, app: App, step: int) -> float:
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        dcp.load({"app": app}, storage_reader=self._reader(step))
        return time.perf_counter() - t0

    def _reader(self, step: int) -> Any:
        from torch.distributed.checkpoint import FileSystemReader

        if not self.s3:
            return FileSystemReader(self._path(step))
        r = FileSystemReader(self._url(step))
        r.fs, r.path = self.objects, self._url(step)
        return r

    def prune(self, keep: int, unloadable: set[int] | frozenset[int] = frozenset()) -> list[int]:
        """Keeps the newest ``keep`` complete checkpoints; one that failed to load counts as incomplete (else the
        last good ones could be pruned in favour of it, and every later attempt would find nothing to load)."""
        complete, incomplete = self.steps()
        incomplete = sorted(incomplete + [s for s in complete if s in unloadable])
        complete = [s for s in complete if s not in unloadable]
        if not complete:
            return []
        gone = complete[:-keep] + [s for s in incomplete if s < complete[-1]]
        for s in gone:
            self.fs.rm(self._path(s), recursive=True)
        return gone

    def progress(self) -> int | None:
        try:
            return int(json.loads(self.fs.cat_file(f"{self.root}/progress"))["step"])
        except (FileNotFoundError, ValueError, KeyError):
            return None

    def set_progress(self, step: int) -> None:
        if not self.s3 and not self._run_dir_made:
            # a local store's run directory is made by the first save, and the first progress mark comes before it
            # (S3 has no directories, and s3fs's makedirs would try to make the bucket)
            self.fs.makedirs(self.root, exist_ok=True)
            self._run_dir_made = True
        self.fs.pipe_file(f"{self.root}/progress", json.dumps({"step": step}).encode())


def _first_line(e: BaseException) -> str:
    """The root cause's type and first line: DCP wraps a rank's error (its traceback as text) in a
    CheckpointException."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = str(e)
    inner = [x for x in text.splitlines() if x and not x.startswith(" ") and "Error" in x]
    if inner:  # the wrapped traceback's last exception line, e.g. "FileNotFoundError: [Errno 2] ..."
        return inner[-1][:300]
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:300]


# --- the job ------------------------------------------------------------------------------------------


class Trainer:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.store = Store(cfg)
        self.notice_at: float | None = None
        self.notice_via = ""
        self._lock = threading.Lock()
        self.client: CheckpointClient | None = None
        # complete checkpoints (.metadata written) that failed to load: never counted among the kept ones
        self.unloadable: set[int] = set()

    def _noticed(self, via: str) -> None:
        with self._lock:
            if self.notice_at is None:
                self.notice_at, self.notice_via = time.time(), via

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._noticed(signal.Signals(signum).name)

    def _on_notice(self, n: Notice) -> None:
        self._noticed("socket")  # the main loop finishes its step, saves and answers done itself

    def run(self) -> int:
        cfg = self.cfg
        _deterministic()
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        complete, _ = self.store.steps()
        loaded = self._load_newest(complete)
        if loaded is None:
            return EX_UNLOADABLE
        model, optim, app, load_s = loaded
        resume: dict[str, Any] = {}
        if load_s is not None:
            done_before = self.store.progress()
            redone = max(0, (done_before or app.step) - app.step)
            resume = {"from_step": app.step, "steps_redone": redone}
            emit("resumed", from_step=app.step, steps_redone=redone, load_s=round(load_s, 4))
        else:
            emit("started")
        self._connect(resume)
        last_saved = app.step if load_s is not None else None
        while app.step < cfg.steps:
            train_step(model, optim, app.step, cfg)
            app.step += 1
            self.store.set_progress(app.step)
            if self.notice_at is not None:
                return self._checkpoint_and_go(app, last_saved)
            if app.step % cfg.every == 0 and app.step < cfg.steps:
                self._save(app, "periodic")
                last_saved = app.step
                if self.notice_at is not None:  # came during the save: it is on the store already
                    return self._checkpoint_and_go(app, last_saved)
        self._save(app, "final")
        if cfg.out:
            import torch

            torch.save(model.state_dict(), cfg.out)
        emit("finished", step=app.step)
        if self.client is not None:
            self.client.close()
        return 0

    def _load_newest(self, complete: list[int]) -> tuple[Any, Any, App, float | None] | None:
        """The model, optimizer and state of the newest complete checkpoint that loads (load_s None: there was
        none, a fresh start); None when there were some and none loaded.

        A checkpoint that does not load (a data file lost or unreadable beside its ``.metadata``) is said and the
        next older one tried: the job is deterministic, so an older checkpoint costs redone steps, not a wrong
        result, where retrying the same one would fail every requeue. If none loads the job fails rather than
        start over: that is a store problem (access, damage) for an operator, and a fresh start would redo all the
        work and then prune the very checkpoints that might be recovered."""
        # DCP's CheckpointException (a rank's error, wrapped) derives from BaseException, not Exception
        from torch.distributed.checkpoint.api import CheckpointException

        tried: list[str] = []
        for step in reversed(complete):
            model, optim = build(self.cfg)  # fresh each try: a failed load may have filled some tensors already
            app = App(model, optim)
            try:
                load_s = self.store.load(app, step)
            except (Exception, CheckpointException) as e:  # whatever DCP or the store raised: this one is unusable
                why = _first_line(e)
                tried.append(f"step {step}: {why}")
                self.unloadable.add(step)
                emit("checkpoint_unloadable", step=step, error=why)
                continue
            return model, optim, app, load_s
        if tried:
            msg = f"no complete checkpoint of run {self.cfg.run!r} under {self.cfg.store} loads: " + "; ".join(tried)
            emit("resume_failed", error=msg)
            print(f"dcp_train: error: {msg}", file=sys.stderr)
            return None
        model, optim = build(self.cfg)
        return model, optim, App(model, optim), None

    def _connect(self, resume: dict[str, Any]) -> None:
        path = self.cfg.socket or os.environ.get("SCO_CHECKPOINT_SOCKET")
        if not path:
            return
        name = (os.environ.get("SLURM_JOB_ID") and f"{self.cfg.run}@job-{os.environ['SLURM_JOB_ID']}") or self.cfg.run
        c = CheckpointClient(
            name, contract=self.cfg.contract, on_notice=self._on_notice, path=path, auto_done=False, resume=resume
        )
        try:
            c.connect()
        except CheckpointError as e:  # no agent on this node: periodic checkpoints still cover a reclaim
            emit("socket_unavailable", error=str(e))
            return
        self.client = c
        emit("registered", id=c.id, budget_s=c.budget_s)

    def _save(self, app: App, reason: str) -> float:
        secs = self.store.save(app)
        self.unloadable.discard(app.step)  # written again whole
        pruned = self.store.prune(self.cfg.keep, self.unloadable)
        emit("checkpoint", step=app.step, reason=reason, save_s=round(secs, 4), pruned=pruned)
        return secs

    def _checkpoint_and_go(self, app: App, last_saved: int | None) -> int:
        assert self.notice_at is not None
        secs = 0.0 if last_saved == app.step else self._save(app, "notice")
        complete_ms = (time.time() - self.notice_at) * 1000
        report = {"checkpointed": True, "save_s": round(secs, 3), "step": app.step}
        emit("noticed", via=self.notice_via, notice_to_checkpoint_ms=round(complete_ms, 1), **report)
        if self.client is not None:
            try:
                if self.client.notice is None:  # told by a signal first: the socket's notice may follow
                    self.client.wait_notice(timeout=2)
                if self.client.notice is not None:
                    self.client.done(report)
                    emit("acked", after_ms=round((time.time() - self.notice_at) * 1000, 1))
            except CheckpointError as e:
                emit("ack_failed", error=str(e))
            self.client.close()
        return EX_REQUEUE


def parse(argv: list[str] | None = None) -> Config:
    p = argparse.ArgumentParser(prog="python -m sco_workloads.dcp_train", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="run name: its checkpoints live under STORE/RUN/")
    env_store, env_keep = os.environ.get("SCO_CHECKPOINT_STORE"), os.environ.get("SCO_CHECKPOINT_KEEP")
    p.add_argument(
        "--store", default=env_store, help="s3://bucket/prefix/ or a local directory ($SCO_CHECKPOINT_STORE)"
    )
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10, help="a periodic checkpoint every N steps")
    p.add_argument(
        "--keep", type=int, help="complete checkpoints kept (the contract's keep; $SCO_CHECKPOINT_KEEP, else 3)"
    )
    p.add_argument("--inputs", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-seconds", type=float, default=0.0)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--contract")
    p.add_argument("--socket")
    p.add_argument("--out")
    p.add_argument("--endpoint")
    a = p.parse_args(argv)
    if not a.store:
        p.error("--store: not given, and $SCO_CHECKPOINT_STORE is not set (the contract's credentials file names it)")
    if a.keep is None:
        try:
            a.keep = int(env_keep or 3)
        except ValueError:
            a.keep = 0
        if a.keep <= 0:
            p.error(f"$SCO_CHECKPOINT_KEEP: expected a positive integer, got {env_keep!r}")
    for name in ("steps", "every", "keep", "inputs", "hidden", "batch", "threads"):
        if getattr(a, name) <= 0:
            p.error(f"--{name}: must be a positive integer, got {getattr(a, name)}")
    return Config(
        run=a.run,
        store=a.store,
        steps=a.steps,
        every=a.every,
        keep=a.keep,
        inputs=a.inputs,
        hidden=a.hidden,
        batch=a.batch,
        seed=a.seed,
        step_seconds=a.step_seconds,
        threads=a.threads,
        contract=a.contract,
        socket=a.socket,
        out=a.out,
        endpoint=a.endpoint,
    )


def main(argv: list[str] | None = None) -> int:
    return Trainer(parse(argv)).run()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # Everything that matters is on the store (the checkpoint is complete, the agent has its answer): skip the
    # interpreter's shutdown, which waits ~8 s here for s3fs's event-loop thread and its sessions to wind down,
    # time a notice's grace does not have.
    os._exit(code)
