#!/usr/bin/python
# Thin module: docs and argument spec here; the arbiter lives in sco.control.arbiter.
from __future__ import annotations

DOCUMENTATION = r"""
module: arbitrate
short_description: Decide which shortfall may fall back to on-demand capacity
description:
  - For each contract the plan could not place on reclaimable or committed capacity, grants on-demand
    instances within the contract's spend authority per hour (its C(fallback.spendCapPerHour), counting the
    on-demand instances it already holds) and the hall's cost ceiling per hour, cheapest per unit first.
  - Every grant and refusal carries its reason and is recorded in the fleet state (not in check mode).
version_added: 0.1.0
author: Spot Capacity Orchestrator developers (@sco-dev)
extends_documentation_fragment:
  - sco.orchestrator.control
  - sco.orchestrator.planning
options:
  plan:
    description: The C(plan) module's result (or its C(plan)).
    type: dict
    required: true
  ceiling_per_hour:
    description: The hall's on-demand cost ceiling per hour, in the hall's currency.
    type: str
    required: true
attributes:
  check_mode:
    description: Decides grants and refusals and reports them; records nothing in the fleet state.
    support: full
  diff_mode:
    description: Returns no diff.
    support: none
requirements:
  - spot-capacity-orchestrator[control] of the collection's release
    (C(pip install 'spot-capacity-orchestrator[control]')) on the host that runs the module
"""

EXAMPLES = r"""
- name: Arbitrate the shortfall
  sco.orchestrator.arbitrate:
    hall: hall-a
    bundle: /var/lib/sco-distributor/hall-a/bundle.json
    trust_dir: /etc/sco/trusted
    plan: "{{ plan }}"
    pools: "{{ sco_pools }}"
    ceiling_per_hour: "250.00"
  register: arbitration
"""

RETURN = r"""
arbitration:
  description: C(grants) (contract, pool, instances, cost_per_hour, reason), C(refusals) (contract, units_milli,
    reason), the hall's on-demand spend per hour once the grants run, and the ceiling.
  returned: success
  type: dict
  sample: {grants: [{contract: web, pool: od, instances: 1, cost_per_hour: "3.00", reason: "..."}], refusals: []}
explain:
  description: One line per grant and refusal.
  returned: success
  type: list
  elements: str
  sample: ["grant web: 1 x od at 3.00/h"]
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.sco.orchestrator.plugins.module_utils.sco_control import (
    common_argument_spec,
    planning_argument_spec,
    run_step,
)


def main() -> None:
    spec = {
        **common_argument_spec(),
        **planning_argument_spec(),
        "plan": {"type": "dict", "required": True},
        "ceiling_per_hour": {"type": "str", "required": True},
    }
    run_step(AnsibleModule(argument_spec=spec, supports_check_mode=True), "arbitrate")


if __name__ == "__main__":
    main()
