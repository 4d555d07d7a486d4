"""The acquirer's and the reconciler's glue without services: counts per plan entry, the create call a pool's
launch options make, when to poll, and the steps' options."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import pytest

from sco.control.launch import BootVolumeSpec, LaunchParams, LaunchSpec
from sco.control.nova import next_poll, wait_until
from sco.control.record import entry_name
from sco.control.steps import entry_targets
from sco.errors import ConfigError


@dataclass
class S:
    id: int
    name: str
    pool: str
    entry: str
    slot: int
    state: str = "active"


def test_a_slot_freed_by_a_reclaim_is_not_refilled_when_the_plan_asks_nothing() -> None:
    # defect 9: slot 0 was reclaimed; the entry holds slots 1 and 2; the plan launches and deletes nothing
    e = entry_name(["web"])
    slots = [S(11, "n1", "spot", e, 1), S(12, "n2", "spot", e, 2)]
    plan = {"pools": [{"pool": "spot", "launch": 0, "launch_contracts": [], "delete": []}]}
    assert entry_targets(plan, {}, slots, {("spot", e): ("web",)}) == []
    # asked for one more: the count is what the entry holds plus one (the acquirer takes the lowest free slot)
    plan = {"pools": [{"pool": "spot", "launch": 1, "launch_contracts": ["web"], "delete": []}]}
    (t,) = entry_targets(plan, {}, slots, {("spot", e): ("web",)})
    assert (t.count, t.launch, t.delete) == (3, 1, ())


def test_the_create_call_carries_every_launch_option() -> None:
    p = LaunchParams(
        flavor_id="f1", image_id="i1", networks=[{"uuid": "n1"}, {"port": "p1"}], security_groups=("sg1",),
        key_name="ops", server_group_id="g1", availability_zone="az1",
        boot_volume=BootVolumeSpec(size_gib=20, volume_type="ssd"),
    )  # fmt: skip
    kw = p.create_kwargs()
    assert kw["networks"] == [{"uuid": "n1"}, {"port": "p1"}] and kw["flavor_id"] == "f1"
    assert kw["security_groups"] == [{"name": "sg1"}] and kw["key_name"] == "ops"
    assert kw["scheduler_hints"] == {"group": "g1"} and kw["availability_zone"] == "az1"
    assert "image_id" not in kw  # the image is the boot volume's source
    (bdm,) = kw["block_device_mapping"]
    assert bdm == {
        "boot_index": 0, "uuid": "i1", "source_type": "image", "destination_type": "volume", "volume_size": 20,
        "delete_on_termination": True, "volume_type": "ssd",
    }  # fmt: skip
    plain = LaunchParams(flavor_id="f1", image_id="i1").create_kwargs()
    assert plain == {"flavor_id": "f1", "image_id": "i1", "networks": "auto"}


def test_launch_options_are_checked_as_written() -> None:
    spec = LaunchSpec.model_validate({"networks": ["a"], "securityGroups": ["sg"], "serverGroup": {"name": "g"}})
    assert spec.server_group is not None and spec.server_group.policy == "anti-affinity"
    for bad in ({"networks": "some"}, {"serverGroup": {"name": "g", "policy": "spread"}}, {"bootVolume": {}},
                {"keyname": "x"}):  # fmt: skip
        with pytest.raises(ValueError):
            LaunchSpec.model_validate(bad)


def test_polls_land_when_the_rest_should_be_ready() -> None:
    # nothing done yet: wait as long again as it has taken (capped)
    assert next_poll(0.0, 2.0, 20, 0) == 2.0
    assert next_poll(0.0, 60.0, 20, 0) == 10.0
    # half done in 4 s: the other half in about 4 s more (10% over)
    assert next_poll(0.0, 4.0, 20, 10) == pytest.approx(4.4)
    assert next_poll(0.0, 4.0, 20, 20) == 0.0
    # a batch that finishes at a steady pace costs a handful of polls, not one per interval
    clock = [0.0]
    polls = []

    def done() -> tuple[int, int]:
        polls.append(clock[0])
        return min(20, int(clock[0] / 0.5)), 20  # one server ready every 0.5 s: all by 10 s

    def sleep(s: float) -> None:
        clock[0] += s

    clock[0] = 1.0
    assert wait_until(done, started=0.0, timeout_s=60, sleep=sleep, clock=lambda: clock[0])
    assert len(polls) <= 4 and polls[-1] <= 11.5, polls


def test_step_options_are_parsed_once_and_refuse_what_a_type_cannot_say() -> None:
    from sco.control.options import AcquireOptions, ReconcileOptions, parse_options

    pools = [{"name": "spot", "kind": "reclaimable", "flavor": "f", "vcpus": 1, "ramMiB": 512, "cap": 1}]
    o = parse_options("acquire", {"hall": "h", "pools": pools, "plan": {"plan": {"pools": []}}, "concurrency": 3})
    assert isinstance(o, AcquireOptions) and o.plan_doc == {"pools": []} and o.concurrency == 3
    assert o.plan.document.pools[0].launch.networks == "auto"
    with pytest.raises(ConfigError, match="plan: expected the plan module's result"):
        parse_options("acquire", {"hall": "h", "pools": pools, "plan": "yes"})
    with pytest.raises(ConfigError, match="concurrency: must be a finite number above 0"):
        parse_options("reconcile", {"hall": "h", "concurrency": 0})
    with pytest.raises(ConfigError, match="api_timeout"):
        parse_options("reconcile", {"hall": "h", "api_timeout": float("nan")})
    r = parse_options("reconcile", {"hall": "h", "cloud": "x", "api_timeout": 5})
    assert isinstance(r, ReconcileOptions) and r.cloud.api_timeout == 5.0 and r.cloud.given


def test_a_step_never_returns_a_key_ansible_reads_as_the_tasks_status(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "collections"))
    from ansible_collections.sco.orchestrator.plugins.module_utils import sco_control

    from sco.control import steps

    class Module:
        params: dict[str, Any] = {"hall": "h"}
        check_mode = False
        warned: list[str] = []

        def warn(self, w: str) -> None:
            self.warned.append(w)

        def fail_json(self, **kw: Any) -> None:
            raise SystemExit(("fail", kw))

        def exit_json(self, **kw: Any) -> None:
            raise SystemExit(("exit", kw))

    monkeypatch.setattr(sco_control, "require_product", lambda m, e: None)
    monkeypatch.setattr(steps, "run", lambda step, p, check: {"changed": True, "skipped": [], "warnings": ["w1"]})
    m = Module()
    with pytest.raises(SystemExit) as e:
        sco_control.run_step(m, "acquire")
    kind, kw = e.value.args[0]
    assert kind == "fail" and "reserved keys skipped" in kw["msg"] and m.warned == ["w1"]
    monkeypatch.setattr(steps, "run", lambda step, p, check: {"changed": False, "launched": 0, "warnings": ["w2"]})
    with pytest.raises(SystemExit) as e:
        sco_control.run_step(m, "acquire")
    assert e.value.args[0] == ("exit", {"changed": False, "launched": 0}) and m.warned[-1] == "w2"


def test_waiting_for_deletes_polls_at_a_short_fixed_interval() -> None:
    # the pace estimate slept up to 2 s between lists (the whole delete phase again at first): the batch's
    # wait ended up to 2 s after Nova had removed the last server
    import time

    from sco.control.nova import wait_gone

    slept: list[float] = []
    lists = [0]

    def listing() -> list[Any]:
        lists[0] += 1
        return [S(1, "a", "p", "e", 0)] if sum(slept) < 1.2 else []

    left = wait_gone(listing, [1], started=time.monotonic() - 1.5, sleep=slept.append)
    assert left == set() and slept and max(slept) <= 0.5, slept
    assert lists[0] <= 4  # one list call a round for the batch, not a GET per server


def test_the_clouds_messages_are_said_once_on_one_bounded_line() -> None:
    """25 builds in ERROR, each fault naming its instance's id, made an 11 KB error, and
    a message holding a newline made two lines."""
    from sco.control.steps import said_once

    faults = [f"Build of instance {uuid.uuid4()} aborted: Failure prepping block device." for _ in range(25)]
    line = said_once([*faults, "Policy doesn't allow\nos_compute_api:servers:create"])
    assert line == (
        "Build of instance <id> aborted: Failure prepping block device. (25 times);"
        " Policy doesn't allow os_compute_api:servers:create"
    )
    many = said_once([f"error number {i} " + "x" * 200 for i in range(40)])
    assert "\n" not in many and len(many) < 1600 and many.endswith("other messages")
