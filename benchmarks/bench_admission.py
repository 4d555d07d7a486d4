"""The contracts ConfigMap Kubernetes admission reads: its size for 10,000 contracts against Kubernetes' 1 MiB
limit, and publishing it to the API stand-in (HTTP, create then unchanged)."""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.bench_contracts import N, make_repo
from sco.contract.bundle import Bundle
from sco.contract.compiler import compile_repo
from sco.contract.signing import Keyring, generate, sign
from sco.schedulers.kube_contracts import MAX_DATA_BYTES, KubeConfigMaps, configmap_data, publish
from sco_devkit.standins.kube_apiserver import KubeApiStandIn


def bench_admission_configmap() -> Iterator[dict[str, Any]]:
    key = generate()
    with tempfile.TemporaryDirectory() as tmp:
        payload = compile_repo(make_repo(Path(tmp)))
    bundle = Bundle.from_bytes(sign(payload, [key]), Keyring([key.public]))
    data = configmap_data(bundle)
    size = sum(len(k.encode()) + len(v.encode()) for k, v in data.items())
    kube = sum(1 for c in bundle.contracts.values() if c["scheduler"] != "slurm")
    per = (size - 200) / N  # minus the few bundle-wide keys, roughly
    srv = KubeApiStandIn().start()
    try:
        api = KubeConfigMaps(srv.url)
        t0 = time.perf_counter()
        first = publish(api, bundle).outcome
        create_ms = (time.perf_counter() - t0) * 1000
        again = []
        for _ in range(5):
            t0 = time.perf_counter()
            assert publish(api, bundle).outcome == "unchanged"
            again.append((time.perf_counter() - t0) * 1000)
    finally:
        srv.stop()
    yield {
        "contracts": N,
        "kubernetes_and_spark": kube,
        "data_bytes": size,
        "limit_bytes": MAX_DATA_BYTES,
        "bytes_per_contract": round(per, 1),
        "contracts_that_fit": int(MAX_DATA_BYTES / per),
        "publish_create_ms": round(create_ms, 1),
        "publish_unchanged_ms": round(statistics.median(again), 1),
        "first_outcome": first,
    }


BENCHES = {"admission_configmap": bench_admission_configmap}
