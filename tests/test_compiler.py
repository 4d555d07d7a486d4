from __future__ import annotations

import time
from pathlib import Path

import pytest

from sco.contract.compiler import compile_repo
from sco.errors import ConfigError, ContractError
from tests.cli_run import run_module
from tests.conftest import SAMPLE, WriteFn, contract_yaml


def problems(repo: Path) -> list[str]:
    with pytest.raises(ContractError) as e:
        compile_repo(repo)
    return e.value.lines()


def test_sample_repository_compiles_with_every_scheduler_kind() -> None:
    payload = compile_repo(SAMPLE)
    assert payload["hall"] == "local"
    assert payload["policy"]["noticeWindowSeconds"] == 120
    assert payload["policy"]["schedulerApiTimeoutMs"] == 800
    assert payload["policy"]["metadataPollSeconds"] == 5
    assert payload["policy"]["bundleRefreshSeconds"] == 60
    kinds = {c["scheduler"] for c in payload["contracts"]}
    assert kinds == {"kubernetes", "spark", "slurm"}
    names = [c["name"] for c in payload["contracts"]]
    assert names == sorted(names)
    genomics = next(c for c in payload["contracts"] if c["name"] == "genomics-align")
    assert genomics["selector"] == {"account": "genomics", "partitions": ["spot"]}
    assert genomics["source"] == "contracts/slurm/genomics.yaml"
    ci = next(c for c in payload["contracts"] if c["name"] == "ci-runners")
    assert ci["source"] == "contracts/kubernetes/ci.yaml#1"
    assert next(c for c in payload["contracts"] if c["name"] == "inference-api")["fallback"] == {
        "onDemand": True,
        "spendCapPerHour": "40.00",
    }


def test_an_inherited_issued_at_is_bounded_too() -> None:
    first = compile_repo(SAMPLE, issued_at=1_764_400_000)
    forged = {**first, "issuedAt": 1_764_400_000_000}  # milliseconds, from a bundle made before the bound
    with pytest.raises(ConfigError) as e:
        compile_repo(SAMPLE, previous=forged)
    assert "issuedAt 1764400000000" in str(e.value) and "previous bundle" in str(e.value), e.value
    for bad in ("yesterday", True, -5, 1.5):
        with pytest.raises(ConfigError):
            compile_repo(SAMPLE, previous={**first, "issuedAt": bad})
    assert compile_repo(SAMPLE, previous=first)["issuedAt"] == 1_764_400_000  # a sane one is still inherited
    fresh = compile_repo(SAMPLE, previous=forged, issued_at=1_764_400_100)  # an explicit one replaces it
    assert fresh["issuedAt"] == 1_764_400_100


def test_contract_bundle_module_fails_on_an_inherited_millisecond_issued_at(tmp_path: Path) -> None:
    from sco.contract.bundle import peek_payload
    from sco.contract.signing import generate, sign, write_keypair

    key = generate()
    write_keypair(key, tmp_path / "k.key", tmp_path / "k.pub")
    dest = tmp_path / "bundle.json"
    dest.write_bytes(sign({**compile_repo(SAMPLE, issued_at=1), "issuedAt": 1_764_400_000_000}, [key]))
    out = run_module(
        "contract_bundle", {"repo": str(SAMPLE), "dest": str(dest), "signing_keys": [str(tmp_path / "k.key")]}, tmp_path
    )
    assert out.get("failed") is True and "1764400000000" in out["msg"], out
    assert (peek_payload(dest.read_bytes()) or {})["issuedAt"] == 1_764_400_000_000  # left as it was


def test_same_input_same_payload_and_serial_only_grows(repo: Path, write: WriteFn) -> None:
    now = time.time()  # the same input includes the clock: expiresAt is now + lifetime, and a second passed once
    first = compile_repo(repo, now=now)
    assert first == compile_repo(repo, now=now)
    assert first["serial"] == 1
    same = compile_repo(repo, previous=first)
    assert same == first  # unchanged content keeps the serial: same input, same bytes
    write("contracts/extra.yaml", contract_yaml("extra"))
    second = compile_repo(repo, previous=first)
    assert second["serial"] == 2
    assert second["contentDigest"] != first["contentDigest"]
    with pytest.raises(ContractError, match="must be above"):
        compile_repo(repo, previous=first, serial=1)
    assert compile_repo(repo, previous=first, serial=7)["serial"] == 7


def test_all_problems_reported_at_once_with_file_and_field(repo: Path, write: WriteFn) -> None:
    write(
        "contracts/bad1.yaml",
        contract_yaml("bad-one", drainBudgetSeconds="-5", tier="7", colour="blue"),
    )
    write("contracts/bad2.yaml", contract_yaml("bad_two", checkpoint="{mode: sometimes}"))
    write("contracts/bad3.yaml", "apiVersion: sco.dev/v1\nkind: WorkloadContract\nmetadata: {name: [\n")
    write("contracts/bad4.yaml", "apiVersion: sco.dev/v2\nkind: WorkloadContract\n")
    write("contracts/bad5.yaml", "apiVersion: sco.dev/v1\nkind: Gadget\n")
    lines = problems(repo)
    joined = "\n".join(lines)
    assert "contracts/bad1.yaml: spec.drainBudgetSeconds: Input should be greater than 0" in joined
    assert "contracts/bad1.yaml: spec.tier:" in joined
    assert "contracts/bad1.yaml: spec.colour: Extra inputs are not permitted" in joined
    assert "contracts/bad2.yaml: metadata.name: String should match pattern" in joined
    assert "contracts/bad2.yaml: spec.checkpoint.mode: Input should be 'signal' or 'none'" in joined
    assert any(line.startswith("contracts/bad3.yaml: line ") and "invalid YAML" in line for line in lines)
    assert "contracts/bad4.yaml: apiVersion: expected 'sco.dev/v1'" in joined
    assert "contracts/bad5.yaml: kind: expected one of HallPolicy, WorkloadContract" in joined
    assert len(lines) >= 8


def test_selector_errors_name_the_fields_of_the_selector_meant(repo: Path, write: WriteFn) -> None:
    write(
        "contracts/s.yaml",
        contract_yaml(
            "s",
            scheduler="slurm",
            selector="{account: Bad Name, partition: spot}",
            requeue="{policy: always}",
        ),
    )
    joined = "\n".join(problems(repo))
    assert "contracts/s.yaml: spec.selector.account: String should match pattern" in joined
    assert "contracts/s.yaml: spec.selector.partition: Extra inputs are not permitted" in joined
    write("contracts/s.yaml", contract_yaml("s", scheduler="slurm", requeue="{policy: always}"))
    assert "contracts/s.yaml: spec: a slurm contract's selector needs account (and partitions)" in "\n".join(
        problems(repo)
    )


def test_drain_budget_must_fit_window_less_margin(repo: Path, write: WriteFn) -> None:
    write("contracts/fits.yaml", contract_yaml("fits", drainBudgetSeconds="100", finalWriteSeconds="10"))
    compile_repo(repo)  # 110 == 120 - 10: fits exactly
    write("contracts/fits.yaml", contract_yaml("fits", drainBudgetSeconds="100", finalWriteSeconds="11"))
    assert problems(repo) == [
        "contracts/fits.yaml: spec.drainBudgetSeconds: drain budget 100 s + final write 11 s = 111 s does not "
        "fit the notice window 120 s less the safety margin 10 s (110 s)"
    ]


def test_tier1_floors_must_fit_reserved_capacity(repo: Path, write: WriteFn) -> None:
    write(
        "contracts/big.yaml",
        contract_yaml("big", tier="1", floor="{vcpus: 129, memoryGiB: 10}"),
    )
    assert problems(repo) == [
        "hall.yaml: spec.reservedCapacity.vcpus: tier-1 floors need 257 vCPU (big 129, inference-api 128) "
        "but only 256 are reserved"
    ]
    write("contracts/big.yaml", contract_yaml("big", tier="2", floor="{vcpus: 1}"))
    assert problems(repo) == ["contracts/big.yaml: spec: only tier 1 contracts hold a floor"]


def test_overlapping_selectors_refused(repo: Path, write: WriteFn) -> None:
    # training selects its whole namespace; any other contract there overlaps
    write("contracts/zz.yaml", contract_yaml("o1", selector="{namespace: training, matchLabels: {a: b}}"))
    assert problems(repo) == [
        "contracts/zz.yaml: spec.selector: selects the same workloads as contract 'pytorch-training' "
        "(contracts/kubernetes/training.yaml)"
    ]
    # ci has role=runner and role=cache-warmer: a third with role=runner and more labels overlaps runner
    write("contracts/zz.yaml", contract_yaml("o1", selector="{namespace: ci, matchLabels: {role: other}}"))
    compile_repo(repo)
    write(
        "contracts/zz.yaml",
        contract_yaml("o1", selector="{namespace: ci, matchLabels: {role: runner, x: y}}"),
    )
    assert len(problems(repo)) == 1
    # slurm: same account, partitions intersect (or one side means all partitions)
    write(
        "contracts/zz.yaml",
        contract_yaml("o1", scheduler="slurm", selector="{account: genomics, partitions: [gpu, spot]}"),
    )
    assert "'genomics-align'" in problems(repo)[0]
    write(
        "contracts/zz.yaml",
        contract_yaml("o1", scheduler="slurm", selector="{account: genomics, partitions: [gpu]}"),
    )
    compile_repo(repo)


def test_slurm_must_requeue_and_spark_must_decommission(repo: Path, write: WriteFn) -> None:
    write(
        "contracts/x.yaml",
        contract_yaml("x", scheduler="slurm", selector="{account: x}", requeue="{policy: never}"),
    )
    write(
        "contracts/y.yaml",
        contract_yaml("y", scheduler="spark", selector="{namespace: y}", spark="{decommission: false}"),
    )
    write("contracts/z.yaml", contract_yaml("z", scheduler="spark", selector="{namespace: z}"))
    assert problems(repo) == [
        "contracts/x.yaml: spec.requeue.policy: slurm contracts must be requeueable (not 'never')",
        "contracts/y.yaml: spec.spark.decommission: spark contracts must enable decommissioning (true)",
        "contracts/z.yaml: spec.spark.decommission: spark contracts must enable decommissioning (true)",
    ]


def test_duplicate_names_and_policy_count(repo: Path, write: WriteFn) -> None:
    write("contracts/zz-dup.yaml", contract_yaml("ci-runners", selector="{namespace: dup}"))
    assert problems(repo) == [
        "contracts/zz-dup.yaml: metadata.name: 'ci-runners' is already defined in contracts/kubernetes/ci.yaml#1"
    ]
    (repo / "contracts/zz-dup.yaml").unlink()
    (repo / "hall.yaml").unlink()
    assert problems(repo)[0].endswith("kind: expected exactly one HallPolicy, found 0")


def test_hidden_directories_are_skipped(repo: Path, write: WriteFn) -> None:
    write(".git/junk.yaml", "not: [valid")
    compile_repo(repo)


def test_parallel_and_serial_loading_give_the_same_payload(tmp_path: Path) -> None:
    from benchmarks.bench_contracts import make_repo

    repo = make_repo(tmp_path, n=300)  # 3 files of 100 documents plus the policy
    for i in range(20):  # and enough files to take the pool path
        (repo / "contracts" / f"single-{i:02d}.yaml").write_text(
            contract_yaml(f"single-{i:02d}", selector=f"{{namespace: single-{i:02d}}}")
        )
    now = 2_000_000_000.0  # the expiry is dated from the signing time: one for both
    assert compile_repo(repo, workers=1, now=now) == compile_repo(repo, workers=2, now=now)
