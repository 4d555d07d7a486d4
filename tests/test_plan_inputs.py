"""Planning inputs: JSON as JSON, YAML where it is YAML, lists bounded before validation, duplicates refused."""

from __future__ import annotations

import time
from typing import Any

import pytest

from sco.control import inputs
from sco.control.inputs import parse, plan_input, read_document
from sco.errors import ConfigError

POOL = {"name": "a", "kind": "reclaimable", "flavor": "m1", "vcpus": 8, "ramMiB": 32768, "cap": 4}


def test_json_is_read_as_json_and_yaml_as_yaml() -> None:
    assert read_document(b' {"x":\t"a", "n": 1e3}', "in") == {"x": "a", "n": 1000.0}  # a tab YAML refuses
    assert read_document(b"x: [1, 2]\n", "in.yaml") == {"x": [1, 2]}
    with pytest.raises(ConfigError, match=r"in.json: not JSON"):
        read_document(b"x: 1", "in.json")
    with pytest.raises(ConfigError, match=r"in: not YAML/JSON"):
        read_document(b"x: [", "in")


def test_oversized_lists_are_refused_before_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inputs, "_BOUNDS", {"fleet": 3, "reservations": 3})
    fleet = [{"id": str(k), "name": f"n{k}", "pool": "a"} for k in range(4)]
    with pytest.raises(ConfigError, match=r"plan.json: fleet: 4 entries, at most 3"):
        parse({"pools": [POOL], "fleet": fleet}, "plan.json")
    big = {"pools": [POOL], "demand": {"demand": [{"contract": "w", "units_milli": 1}] * (inputs.MAX_DEMAND_LINES + 1)}}
    with pytest.raises(ConfigError, match=r"demand.demand: 10001 entries"):
        parse(big, "plan.json")


def test_a_fleet_of_the_largest_size_is_refused_quickly() -> None:
    fleet = [{"id": str(k), "name": f"n{k}", "pool": "a"} for k in range(inputs.MAX_FLEET + 1)]
    t0 = time.process_time()
    with pytest.raises(ConfigError, match="at most 100000"):
        parse({"pools": [POOL], "fleet": fleet}, "plan.json")
    assert time.process_time() - t0 < 1  # refused by length, not validated entry by entry (that took 178 s)


@pytest.mark.parametrize(
    ("dup", "msg"),
    [
        ({"id": "i1", "name": "other"}, "instance id 'i1' is listed twice: fleet.0 and fleet.1"),
        ({"id": "i2", "name": "n1"}, "instance name 'n1' is listed twice: fleet.0 and fleet.1"),
    ],
)
def test_duplicate_instances_are_refused_naming_them(dup: dict[str, str], msg: str) -> None:
    fleet = [{"id": "i1", "name": "n1", "pool": "a"}, {**dup, "pool": "a"}]
    with pytest.raises(ConfigError) as e:
        parse({"pools": [POOL], "fleet": fleet}, "plan.json")
    assert any(p.where == "plan.json" and p.field == "fleet" and msg in p.message for p in e.value.problems)


def test_demand_lines_become_whole_requests() -> None:
    doc: dict[str, Any] = {
        "pools": [POOL],
        "demand": {
            "demand": [
                {"contract": "w", "units_milli": 5000, "items": 2},  # two requests, as even as integers allow
                {"contract": "w", "units_milli": 3000, "requests_milli": {"1000": 1, "2000": 1}},
                {"contract": "v", "units_milli": 1500},  # no count, no sizes: units, the remainder last
            ]
        },
    }
    inp = plan_input(parse(doc, "plan.json"), {}, 0.0)
    assert inp.demand == {"w": 8000, "v": 1500}
    assert inp.requests == {"w": {2500: 2, 1000: 1, 2000: 1}, "v": {1000: 1, 500: 1}}
    doc["demand"]["demand"][1]["units_milli"] = 2999
    with pytest.raises(ConfigError) as e:
        plan_input(parse(doc, "plan.json"), {}, 0.0, "plan.json")
    (prob,) = e.value.problems
    assert (prob.where, prob.field) == ("plan.json", "demand.demand.1")
    assert "requests_milli add up to 3000, not units_milli 2999" in prob.message


def test_a_price_the_solver_cannot_weigh_and_a_document_nested_too_deeply_are_refused() -> None:
    """Both were tracebacks of `sco plan` (OverflowError in the solver's weights; RecursionError in json.loads)."""
    with pytest.raises(ConfigError) as e:
        parse({"pools": [{**POOL, "pricePerHour": "1e300"}]}, "plan.json")
    assert any(p.field.endswith("price_per_hour") or "price" in p.field for p in e.value.problems), e.value.problems
    deep = b"{" + b'"pools": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(ConfigError, match=r"plan\.json: not a planning document: nested too deeply"):
        read_document(deep, "plan.json")
    with pytest.raises(ConfigError, match=r"nested too deeply|not YAML/JSON"):
        read_document(b"pools: " + b"[" * 100_000 + b"]" * 100_000, "plan.yaml")
