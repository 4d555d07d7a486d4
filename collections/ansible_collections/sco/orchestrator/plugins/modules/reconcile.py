#!/usr/bin/python
# Thin module: docs and argument spec here; the reconciliation lives in sco.control.reconcile.
from __future__ import annotations

DOCUMENTATION = r"""
module: reconcile
short_description: Make the fleet state agree with Nova before the plan is made
description:
  - Lists the hall's servers in Nova once (by their C(sco-hall) tag) and compares them with the fleet state.
  - A server with no record (a run killed between Nova's answer and the record) is adopted into its slot.
  - A record stuck in C(requested) or C(launching) is settled to what Nova says (ACTIVE, or ERROR with Nova's fault).
  - A record whose server Nova no longer lists (deleted by an operator, or by Blazar's preemption) becomes C(lost),
    with why, when it was last listed and a lifecycle event; lost instances are no capacity for the planner.
  - A server the product deleted that is still listed, a failed launch's server, or a second server in one slot is
    surplus - deleted, all at once, and waited for until Nova no longer lists it.
  - Never launches anything - what to launch is the plan's. Instances under reclaim are left to the reclaimer.
  - In check mode reports the differences and changes nothing.
version_added: 0.1.0
author: Spot Capacity Orchestrator developers (@sco-dev)
extends_documentation_fragment:
  - sco.orchestrator.control
options:
  concurrency:
    description: Surplus deletes sent at once.
    type: int
    default: 8
  lock_wait:
    description: Seconds to wait for the hall's writer lock (another acquirer or reclaimer holding it).
    type: float
    default: 0
attributes:
  check_mode:
    description: Reports what it would adopt, settle, mark lost or delete; changes nothing.
    support: full
  diff_mode:
    description: Returns no diff.
    support: none
requirements:
  - spot-capacity-orchestrator[control] of the collection's release on the host that runs the module
"""

EXAMPLES = r"""
- name: Reconcile the fleet state with Nova
  sco.orchestrator.reconcile:
    hall: hall-a
    cloud: hall-a
    state_dsn: "{{ sco_state_dsn }}"
  register: sco_reconcile
"""

RETURN = r"""
reconciliation:
  description: What Nova listed and what was done about each difference.
  returned: success
  type: dict
  contains:
    listed:
      description: Servers Nova lists with the hall's tag.
      type: int
      sample: 12
    drift:
      description: Differences found between the fleet state and Nova (0 - they agreed).
      type: int
      sample: 2
    adopted:
      description: Servers recorded now (name, server_id, status, pool, entry, slot).
      type: list
      elements: dict
      sample: [{name: hall-a-spot-s1a2b3c4-3, server_id: 9f0c..., status: ACTIVE, pool: spot, entry: s1a2b3c4,
                slot: 3}]
    settled:
      description: Records moved to what Nova says (name, server_id, from, to).
      type: list
      elements: dict
      sample: [{name: hall-a-spot-s1a2b3c4-1, server_id: 77aa..., from: launching, to: active}]
    lost:
      description: Records whose server is gone from Nova (name, server_id, why, last_seen).
      type: list
      elements: dict
      sample: [{name: hall-a-spot-s1a2b3c4-0, server_id: 1c2d..., why: "server 1c2d... is no longer in Nova ...",
                last_seen: 1764400000.0}]
    never_launched:
      description: Records of launches that never reached Nova, now failed.
      type: list
      elements: dict
      sample: []
    surplus:
      description: Servers deleted (name, server_id, why).
      type: list
      elements: dict
      sample: [{name: hall-a-spot-s1a2b3c4-5, server_id: 3e4f..., why: its record is deleted}]
    foreign:
      description: Servers with the hall's tag that name no known pool or slot - left alone.
      type: list
      elements: dict
      sample: []
    api_calls:
      description: Nova calls made.
      type: int
      sample: 1
explain:
  description: One line per difference.
  returned: success
  type: list
  elements: str
  sample: ["hall hall-a: Nova lists 12 servers; drift 1", "lost hall-a-spot-s1a2b3c4-0 (1c2d...): ..."]
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.sco.orchestrator.plugins.module_utils.sco_control import common_argument_spec, run_step


def main() -> None:
    spec = {
        **common_argument_spec(),
        "concurrency": {"type": "int", "default": 8},
        "lock_wait": {"type": "float", "default": 0.0},
    }
    run_step(AnsibleModule(argument_spec=spec, supports_check_mode=True), "reconcile")


if __name__ == "__main__":
    main()
