#!/usr/bin/python
# Thin module: docs and argument spec here; the planner lives in sco.control.planner.
from __future__ import annotations

DOCUMENTATION = r"""
module: plan
short_description: Plan target instance counts per pool from demand, fleet and reservations
description:
  - Runs the portfolio planner - per-pool caps, no more than a tier's share of new units in one pool or
    diversification group, tier-1 floors held on committed (Blazar) capacity, idle reclaimable instances scaled
    down, unavailable pools skipped - and returns every decision with its reason.
  - Deterministic - the same input gives the same plan (and C(plan.digest)); C(changed) is true only when the plan
    launches or deletes something, so a second run with nothing new reports no change.
  - Records the plan in the fleet state (not in check mode).
version_added: 0.1.0
author: Spot Capacity Orchestrator developers (@sco-dev)
extends_documentation_fragment:
  - sco.orchestrator.control
  - sco.orchestrator.planning
options:
  demand:
    description: The C(demand) module's result (or its C(report)).
    type: dict
    required: true
attributes:
  check_mode:
    description: Computes and explains the plan; records nothing in the fleet state.
    support: full
  diff_mode:
    description: Returns no diff.
    support: none
requirements:
  - spot-capacity-orchestrator[control] of the collection's release
    (C(pip install 'spot-capacity-orchestrator[control]')) on the host that runs the module
"""

EXAMPLES = r"""
- name: Plan
  sco.orchestrator.plan:
    hall: hall-a
    bundle: /var/lib/sco-distributor/hall-a/bundle.json
    trust_dir: /etc/sco/trusted
    demand: "{{ demand }}"
    pools: "{{ sco_pools }}"
    settings: {shares: {1: "1/2", 2: "1/2", 3: 1}, idleGraceSeconds: 600}
  register: plan
"""

RETURN = r"""
plan:
  description: Per pool (current, target, launch, launch_contracts, delete, placed_milli), the shortfall per
    contract for the fallback arbiter, the floors held, the digest, and every decision (kind, subject, reason).
  returned: success
  type: dict
  sample: {digest: 9c1e..., changed: true, pools: [{pool: spot-a, current: 2, target: 3, launch: 1,
           launch_contracts: [web], delete: []}], shortfall_milli: {}}
explain:
  description: The decisions, one line each (as C(sco plan --explain) prints them).
  returned: success
  type: list
  elements: str
  sample: ["launch 1 x spot-a for web: 6 units pending"]
plan_id:
  description: The plan's row in the fleet state.
  returned: when recorded
  type: int
  sample: 42
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.sco.orchestrator.plugins.module_utils.sco_control import (
    common_argument_spec,
    planning_argument_spec,
    run_step,
)


def main() -> None:
    spec = {**common_argument_spec(), **planning_argument_spec(), "demand": {"type": "dict", "required": True}}
    run_step(AnsibleModule(argument_spec=spec, supports_check_mode=True), "plan")


if __name__ == "__main__":
    main()
