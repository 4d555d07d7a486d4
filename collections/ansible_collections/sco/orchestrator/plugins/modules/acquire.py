#!/usr/bin/python
# Thin module: docs and argument spec here; the acquirer lives in sco.control.acquirer (Nova), the mapping from
# a plan to plan entries in sco.control.loop.
from __future__ import annotations

DOCUMENTATION = r"""
module: acquire
short_description: Make each pool hold what the plan and the arbiter's grants say, through Nova
description:
  - Turns the plan (launches with their contract subset, idle instances to scale down) and the arbiter's
    on-demand grants into a count per plan entry - a pool's instances launched with one contract subset - and
    has the acquirer hold it - launching the missing slots with cloud-init user-data carrying the signed
    contract subset, deleting the slots above the count.
  - Crash-safe and idempotent - servers carry tags naming their hall, pool, entry and slot, so a second run
    adopts what the first launched and reports no change.
  - In check mode returns the counts it would ask for, and launches or deletes nothing.
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
  arbitration:
    description: The C(arbitrate) module's result (or its C(arbitration)); its grants are launched too.
    type: dict
    default: {}
  signing_keys:
    description: Private keys that sign each new instance's contract subset (the node trusts their public keys).
    type: list
    elements: path
    default: []
  node_env:
    description: Environment written to C(/etc/sco/agent.env) on every new instance.
    type: dict
    default: {}
attributes:
  check_mode:
    description: Reports the launches and deletions the plan would need; launches and deletes nothing.
    support: full
  diff_mode:
    description: Returns no diff.
    support: none
requirements:
  - spot-capacity-orchestrator[control] of the collection's release
    (C(pip install 'spot-capacity-orchestrator[control]==0.1.0')) on the host that runs the module with openstacksdk and psycopg
"""

EXAMPLES = r"""
- name: Acquire
  sco.orchestrator.acquire:
    hall: hall-a
    cloud: hall-a
    state_dsn: "{{ sco_state_dsn }}"
    bundle: /var/lib/sco/distributor/hall-a/bundle.json
    trust_dir: /etc/sco/trusted
    plan: "{{ plan }}"
    arbitration: "{{ arbitration }}"
    pools: "{{ sco_pools }}"
    signing_keys: [/etc/sco/keys/2026-11.key]
"""

RETURN = r"""
entries:
  description: Per plan entry - pool, entry, contracts, count asked for, launch, delete (names), kept (names the
    plan would scale down but that sit below a busy slot).
  returned: success
  type: list
  elements: dict
launched:
  description: Instances launched (in check mode - that would be).
  returned: success
  type: int
deleted:
  description: Instances deleted (in check mode - that would be).
  returned: success
  type: int
failed:
  description: Launches that failed (quota, no valid host, error).
  returned: success
  type: int
skipped:
  description: Entries not acted on, with the reason (pool unavailable, not configured).
  returned: success
  type: list
  elements: str
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
        "arbitration": {"type": "dict", "default": {}},
        "signing_keys": {"type": "list", "elements": "path", "default": [], "no_log": False},
        "node_env": {"type": "dict", "default": {}},
    }
    run_step(AnsibleModule(argument_spec=spec, supports_check_mode=True), "acquire")


if __name__ == "__main__":
    main()
