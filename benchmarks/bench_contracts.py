"""10,000 contracts: compile (read YAML, validate, feasibility), sign, verify, size; and the compile against a
C-YAML parse of the same files (PyYAML's CSafeLoader, one process: the floor any YAML compiler stands on).
Target: compile_vs_cyaml <= 1.0 (issue 20)."""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from sco.contract.compiler import compile_repo
from sco.contract.signing import Keyring, generate, sign, verify
from sco_devkit.demo import sample_repo

N = 10_000
PER_FILE = 100

_DOC = """apiVersion: sco.dev/v1
kind: WorkloadContract
metadata:
  name: wl-{i:05d}
  owner: team-{team}
spec:
  scheduler: {scheduler}
  selector:
{selector}
  tier: {tier}
  drainBudgetSeconds: {budget}
  finalWriteSeconds: 5
  checkpoint:
    mode: signal
    signal: USR1
  requeue:
    policy: always
{extra}"""


def make_repo(root: Path, n: int = N) -> Path:
    repo = root / "repo"
    shutil.copytree(sample_repo(), repo)
    shutil.rmtree(repo / "contracts")
    out = repo / "contracts"
    out.mkdir()
    docs: list[str] = []
    for i in range(n):
        kind = ("kubernetes", "spark", "slurm")[i % 3]
        if kind == "slurm":
            selector = f"    account: acct-{i:05d}\n    partitions: [spot]"
        else:
            selector = f"    namespace: ns-{i // 10:04d}\n    matchLabels:\n      app: wl-{i:05d}"
        extra = "  spark:\n    decommission: true\n" if kind == "spark" else ""
        docs.append(
            _DOC.format(
                i=i, team=i % 50, scheduler=kind, selector=selector, tier=2 + i % 2, budget=10 + i % 90, extra=extra
            )
        )
        if len(docs) == PER_FILE:
            (out / f"batch-{i // PER_FILE:03d}.yaml").write_text("---\n".join(docs))
            docs = []
    if docs:
        (out / "batch-last.yaml").write_text("---\n".join(docs))
    return repo


def bench_contracts() -> Iterator[dict[str, Any]]:
    key = generate()
    ring = Keyring([key.public])
    with tempfile.TemporaryDirectory() as tmp:
        repo = make_repo(Path(tmp))
        files = sorted(repo.rglob("*.yaml"))
        compile_s, sign_ms, parse_s = [], [], []
        raw = b""
        for _ in range(3):  # interleaved, so both see the same machine load
            t0 = time.perf_counter()
            for f in files:
                list(yaml.load_all(f.read_text(encoding="utf-8"), Loader=yaml.CSafeLoader))
            parse_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            payload = compile_repo(repo)
            t1 = time.perf_counter()
            raw = sign(payload, [key])
            t2 = time.perf_counter()
            compile_s.append(t1 - t0)
            sign_ms.append((t2 - t1) * 1000)
        verify_ms = []
        for _ in range(15):
            t0 = time.perf_counter()
            verify(raw, ring)
            verify_ms.append((time.perf_counter() - t0) * 1000)
        assert len(payload["contracts"]) == N
    yield {
        "contracts": N,
        "compile_s": round(statistics.median(compile_s), 3),
        "cyaml_parse_s": round(statistics.median(parse_s), 3),
        "compile_vs_cyaml": round(statistics.median(c / p for c, p in zip(compile_s, parse_s, strict=True)), 2),
        "sign_ms": round(statistics.median(sign_ms), 1),
        "compile_and_sign_s": round(
            statistics.median(c + s / 1000 for c, s in zip(compile_s, sign_ms, strict=True)), 3
        ),
        "verify_ms": round(statistics.median(verify_ms), 2),
        "bundle_bytes": len(raw),
    }


BENCHES = {"contracts": bench_contracts}
