#!/usr/bin/python
# Thin module: docs and argument spec here; the acquirer lives in sco.control.acquirer (Nova), the mapping from
# a plan to plan entries in sco.control.steps.
from __future__ import annotations

DOCUMENTATION = r"""
module: acquire
short_description: Make each pool hold what the plan and the arbiter's grants say, through Nova
description:
  - Turns the plan (launches with their contract subset, idle instances to scale down) and the arbiter's
    on-demand grants into a count per plan entry - a pool's instances launched with one contract subset - and
    has the acquirer hold it - launching the missing instances with cloud-init user-data carrying the signed
    contract subset, deleting the idle ones the plan names, all at once, until Nova no longer lists them.
  - A preflight first resolves every launching pool's flavor, image, networks, ports, security groups, key pair,
    server group and availability zone against the cloud, once per run (names or ids), and fails with every
    problem and what to change before anything is launched. In check mode the preflight runs too.
  - Crash-safe and idempotent - servers carry tags naming their hall, pool, entry and slot, so a second run
    adopts what the first launched and reports no change. A slot freed by a reclaim is not refilled unless the
    plan asks for an instance.
  - A quota error or NoValidHost marks the pool unavailable for a while (no calls to Nova until then) and says
    so as a warning; the cloud's own messages are in C(errors).
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
    description:
      - Private keys that sign each new instance's contract subset.
      - With O(launch_delegation), the one launch key that delegation names (the node trusts the hall's root, which
        signed the delegation, never this key). Without it, keys the nodes trust themselves (a hall root key on this
        host; the result warns).
    type: list
    elements: path
    default: []
  launch_delegation:
    description:
      - The hall root key's delegation for the launch key in O(signing_keys) (C(sco delegate)); checked against
        the trusted keys (O(trust_dir)); each subset carries it and is dated inside it.
      - New instances then trust the root key that signed it, and take the subset as their first bundle only.
    type: path
  node_env:
    description:
      - Environment written to C(/etc/sco/agent.env) on every new instance (the agent's C(SCO_AGENT_*) settings,
        e.g. C(SCO_AGENT_BUNDLE_URL), C(SCO_AGENT_NATS_URL)).
      - C(SCO_AGENT_HALL) and C(SCO_AGENT_NODE) are always the hall's and the server's name, whatever this says.
    type: dict
    default: {}
  relay_ca_file:
    description:
      - The CA (PEM) the hall's relays' TLS certificates chain to, on the host the module runs on; every new
        instance's user-data carries it (C(/etc/sco/relay-ca.crt), named by C(SCO_AGENT_NATS_CA_FILE)).
    type: path
  distributor_ca_file:
    description:
      - The CA (PEM) the hall's distributor's TLS certificate chains to, on the host the module runs on; every new
        instance's user-data carries it (C(/etc/sco/distributor-ca.crt), named by C(SCO_AGENT_BUNDLE_CA_FILE)).
    type: path
  enrol_ca_file:
    description:
      - The CA (PEM) an https enrolment service's certificate chains to, on the host the module runs on; every new
        instance's user-data carries it (C(/etc/sco/enrol-ca.crt), named by C(SCO_AGENT_ENROL_CA_FILE)), so its agent
        checks the service that answers with its Kubernetes token.
    type: path
  concurrency:
    description: Creates (and deletes) sent at once.
    type: int
    default: 8
attributes:
  check_mode:
    description: Runs the preflight and reports the launches and deletions the plan would need; launches and
      deletes nothing.
    support: full
  diff_mode:
    description: Returns no diff.
    support: none
requirements:
  - spot-capacity-orchestrator[control] of the collection's release
    (C(pip install 'spot-capacity-orchestrator[control]')) on the host that runs the module with openstacksdk and psycopg
"""

EXAMPLES = r"""
- name: Acquire
  sco.orchestrator.acquire:
    hall: hall-a
    cloud: hall-a
    state_dsn: "{{ sco_state_dsn }}"
    bundle: /var/lib/sco-distributor/hall-a/bundle.json
    trust_dir: /etc/sco/trusted
    plan: "{{ plan }}"
    arbitration: "{{ arbitration }}"
    pools:
      - name: spot-a
        kind: reclaimable
        flavor: m1.large
        image: debian-12
        vcpus: 8
        ramMiB: 32768
        cap: 20
        launch:
          networks: [hall-a-net]
          securityGroups: [sco-node]
          keyName: ops
          serverGroup: {name: spot-a, policy: anti-affinity}
          availabilityZone: az1
    signing_keys: [/etc/sco/keys/2026-11.key]
"""

RETURN = r"""
entries:
  description: Per plan entry - pool, entry, contracts, count asked for, launch, delete (names).
  returned: success
  type: list
  elements: dict
  sample: [{pool: spot-a, entry: s1a2b3c4, contracts: [web], count: 3, launch: 1, delete: []}]
launched:
  description: Instances launched (in check mode - that would be).
  returned: success
  type: int
  sample: 1
deleted:
  description: Instances deleted (in check mode - that would be).
  returned: success
  type: int
  sample: 0
launch_failures:
  description: Launches Nova refused or failed (quota, no valid host, a bad request); the reasons are in C(errors).
  returned: success
  type: int
  sample: 0
errors:
  description: The cloud's own message for each failed launch or delete.
  returned: success
  type: list
  elements: str
  sample: ["hall-a-spot-a-s1a2b3c4-2: No valid host was found. There are not enough hosts available."]
unavailable:
  description: Entries not launched into, with the reason (the pool is unavailable after quota or NoValidHost).
  returned: success
  type: list
  elements: str
  sample: ["spot-a/s1a2b3c4: pool spot-a unavailable for 290 s more: quota: ..."]
preflight:
  description: Per launching pool, what its names resolved to.
  returned: success
  type: dict
  sample: {spot-a: {flavor_id: 3, image_id: 0b7e..., networks: [{uuid: 5d1f...}], server_group_id: 81c2...}}
api_calls:
  description: Nova calls the acquirer made (paid from the fleet state's shared budget).
  returned: when anything was acquired
  type: int
  sample: 5
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
        # user-data of every new instance: enrolment tokens, relay credentials
        "node_env": {"type": "dict", "default": {}, "no_log": True},
        "relay_ca_file": {"type": "path"},
        "distributor_ca_file": {"type": "path"},
        "enrol_ca_file": {"type": "path"},
        "launch_delegation": {"type": "path"},
        "concurrency": {"type": "int", "default": 8},
    }
    run_step(AnsibleModule(argument_spec=spec, supports_check_mode=True), "acquire")


if __name__ == "__main__":
    main()
