"""``sco plan --explain`` on the sample hall's signed bundle: a plan, its reasons, and clear errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import SAMPLE
from tests.test_cli import no_traceback, sco

INPUT = {
    "now": 1_764_400_000,
    "pools": [
        {"name": "committed", "kind": "committed", "flavor": "m1.xlarge", "vcpus": 16, "ramMiB": 65536, "cap": 16},
        {
            "name": "spot-a",
            "kind": "reclaimable",
            "flavor": "m1.large",
            "vcpus": 8,
            "ramMiB": 32768,
            "cap": 20,
            "group": "r1",
        },
        {
            "name": "spot-b",
            "kind": "reclaimable",
            "flavor": "m1.large",
            "vcpus": 8,
            "ramMiB": 32768,
            "cap": 20,
            "group": "r2",
        },
        {
            "name": "spot-c",
            "kind": "reclaimable",
            "flavor": "m1.large",
            "vcpus": 8,
            "ramMiB": 32768,
            "cap": 20,
            "available": False,
            "unavailableReason": "aggregate in maintenance",
        },
    ],
    "settings": {"shares": {1: "1/2", 2: "1/2", 3: 1}, "idleGraceSeconds": 600},
    "reservations": [{"lease": "lease-1", "pool": "committed", "instances": 8}],
    "fleet": [
        {
            "id": "i-old",
            "name": "spot-a-old",
            "pool": "spot-a",
            "contracts": ["ci-runners"],
            "launchedAt": 1_764_390_000,
        }
    ],
    "demand": {
        "demand": [
            {"contract": "climate-ensemble", "units_milli": 40_000},
            {"contract": "pytorch-training", "units_milli": 24_000},
            {"contract": "inference-api", "units_milli": 8_000},
        ],
        "node_load_milli": {},
    },
}


@pytest.fixture
def bundle(tmp_path: Path) -> tuple[Path, Path]:
    keys = tmp_path / "keys"
    assert sco("keygen", "--out-dir", keys, "--name", "k").returncode == 0
    b = tmp_path / "bundle.json"
    p = sco("contract", "compile", SAMPLE, "-o", b, "--signing-key", keys / "k.key")
    assert p.returncode == 0, p.stderr
    return b, keys / "k.pub"


def test_plan_explain(tmp_path: Path, bundle: tuple[Path, Path]) -> None:
    doc = tmp_path / "plan.yaml"
    doc.write_text(yaml.safe_dump(INPUT))
    b, pub = bundle
    p = sco("plan", "--input", doc, "--bundle", b, "--trust", pub, "--explain")
    no_traceback(p)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    # the floor of inference-api (128 vCPU, 512 GiB = 128 units) on 8 committed 16-unit instances
    assert "floor      contract:inference-api" in out and "floor of 128 units held: 128 units on committed" in out
    assert "skip_pool  pool:spot-c" in out and "aggregate in maintenance" in out
    assert "scale_down instance:spot-a-old" in out
    assert "launch     pool:spot-a" in out and "launch     pool:spot-b" in out
    assert "plan " in out and ": changes" in out
    as_json = json.loads(sco("plan", "--input", doc, "--bundle", b, "--trust", pub, "--json").stdout)
    pools = {x["pool"]: x for x in as_json["pools"]}
    assert pools["committed"]["launch"] == 8 and pools["spot-c"]["launch"] == 0
    # 64 units of tier 2 split evenly over two groups (share 1/2)
    assert (
        pools["spot-a"]["placed_milli"]["climate-ensemble"] + pools["spot-a"]["placed_milli"]["pytorch-training"]
        == 32_000
    )
    assert pools["spot-a"]["delete"] == ["i-old"]


def test_plan_bad_input_names_file_and_field(tmp_path: Path, bundle: tuple[Path, Path]) -> None:
    b, pub = bundle
    bad = json.loads(json.dumps(INPUT))
    bad["pools"][1]["cap"] = -1
    bad["pools"][2]["kind"] = "spot"
    bad["settings"]["shares"] = {2: "3/2"}
    doc = tmp_path / "plan.yaml"
    doc.write_text(yaml.safe_dump(bad))
    p = sco("plan", "--input", doc, "--bundle", b, "--trust", pub)
    no_traceback(p)
    assert p.returncode == 5
    assert f"{doc}: pools.1.cap: Input should be greater than or equal to 0" in p.stderr
    assert f"{doc}: pools.2.kind:" in p.stderr
    assert "a share must be above 0 and at most 1, not 3/2" in p.stderr
    doc.write_text("pools: [")
    p = sco("plan", "--input", doc, "--bundle", b, "--trust", pub)
    assert p.returncode == 5 and "not YAML/JSON" in p.stderr
