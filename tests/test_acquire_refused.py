"""A control-loop step whose every create the cloud refused ends red, with the cloud's words.

Against the real Nova: a project whose user holds a role that the cloud's policy forbids to create servers
(``os_compute_api:servers:create``: ``not role:sco-refused``, loaded into the running Nova beside its defaults, so
the other tests' projects are untouched). Plan, arbitrate and acquire run as the control loop runs them (ansible-runner,
the collection's modules): the acquire task fails with Nova's own message and the run exits non-zero, so
ScoControlLoopFailed can fire. Before, the task returned changed, launched 0, no msg, and the run exited 0."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from sco.contract.signing import generate, write_keypair
from tests.harness import hall_bundle

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENV = {"ANSIBLE_COLLECTIONS_PATH": str(ROOT / "collections"), "PATH": f"{BIN}:{os.environ['PATH']}"}
REFUSING = '"os_compute_api:servers:create": "not role:sco-refused"\n'

PLAY = """
- name: Plan, arbitrate and acquire as the control loop does
  hosts: localhost
  gather_facts: false
  module_defaults:
    group/sco.orchestrator.control:
      hall: refused
      bundle: "{{ bundle }}"
      trust_dir: "{{ trust_dir }}"
      state_dsn: "{{ dsn }}"
      cloud: "{{ cloud }}"
  tasks:
    - name: Plan
      sco.orchestrator.plan:
        demand: {demand: [{contract: web, units_milli: 4000}]}
        pools: "{{ pools }}"
      register: plan
    - name: Arbitrate
      sco.orchestrator.arbitrate:
        plan: "{{ plan }}"
        pools: "{{ pools }}"
        ceiling_per_hour: "0"
      register: arbitration
    - name: Acquire
      sco.orchestrator.acquire:
        plan: "{{ plan }}"
        arbitration: "{{ arbitration }}"
        pools: "{{ pools }}"
        signing_keys: ["{{ signing_key }}"]
"""


@pytest.fixture
def refusing_nova(openstack_cloud: Any) -> Iterator[None]:
    before = openstack_cloud.load_policy("nova", REFUSING)
    try:
        yield
    finally:
        openstack_cloud.load_policy("nova", before)


def test_a_step_whose_every_create_was_refused_fails_with_the_clouds_message(  # type: ignore[no-untyped-def]
    openstack_cloud, fleet_dsn, refusing_nova, tmp_path: Path
) -> None:
    import ansible_runner

    cfg = openstack_cloud.make_project(f"refused-{os.urandom(3).hex()}", roles=("member", "sco-refused"))
    key = generate()
    trust = tmp_path / "trusted"
    trust.mkdir()
    write_keypair(key, tmp_path / "k.key", trust / "k.pub")
    (tmp_path / "bundle.json").write_bytes(hall_bundle(tmp_path, key))
    pools = [{"name": "spot", "kind": "reclaimable", "flavor": openstack_cloud.flavors["sco.small"],
              "image": openstack_cloud.image_id, "vcpus": 1, "ramMiB": 512, "cap": 4,
              "launch": {"networks": "none"}}]  # fmt: skip
    pdd = tmp_path / "runner"
    (pdd / "project").mkdir(parents=True)
    (pdd / "project" / "play.yml").write_text(PLAY)
    r = ansible_runner.run(
        private_data_dir=str(pdd), playbook="play.yml", envvars=ENV, quiet=True,
        extravars={
            "bundle": str(tmp_path / "bundle.json"), "trust_dir": str(trust), "dsn": fleet_dsn, "pools": pools,
            "cloud": {k: v for k, v in cfg.items() if k != "project_id"}, "signing_key": str(tmp_path / "k.key"),
            "ansible_python_interpreter": sys.executable,
        },
    )  # fmt: skip
    ok = {e["event_data"]["task"]: e["event_data"]["res"] for e in r.events if e.get("event") == "runner_on_ok"}
    assert ok["Plan"]["plan"]["pools"][0]["launch"] == 4, yaml.safe_dump(ok["Plan"]["plan"]["pools"])
    failed = [e["event_data"] for e in r.events if e.get("event") == "runner_on_failed"]
    assert r.rc != 0 and [f["task"] for f in failed] == ["Acquire"], failed
    msg = failed[0]["res"]["msg"]
    assert msg.startswith("acquire: the cloud refused every launch of this run (4 of 4): "), msg
    assert "Policy doesn't allow os_compute_api:servers:create to be performed" in msg and "(4 times)" in msg, msg
