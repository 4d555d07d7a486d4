#!/usr/bin/python
# Thin module: docs and argument spec here; the reclaimer lives in sco.provider.reclaimer.
from __future__ import annotations

DOCUMENTATION = r"""
module: reclaim
short_description: Reclaim instances - notice, drain window, delete
description:
  - Sends each named instance its reclaim notice on both channels (the hall's NATS notice relay and the instance
    metadata), waits out the notice window while the node agent drains, then deletes the server - the
    provider's reclaimer, recorded in the fleet state.
  - Instances already under reclaim are left as they are (no second notice), so a repeated task reports no change.
  - In check mode reports which instances would be reclaimed.
version_added: 0.1.0
author: Spot Capacity Orchestrator developers (@sco-dev)
extends_documentation_fragment:
  - sco.orchestrator.control
options:
  nodes:
    description: Instance (node) names to reclaim.
    type: list
    elements: str
    required: true
  nats_url:
    description: The hall's notice relay.
    type: str
  nats_user:
    description:
      - The relay user the reclaimer connects as (the notice_relay role's C(reclaimer)), which may publish the hall's
        notices and read the hall's events, from which the agents' accounts are recorded.
    type: str
  nats_password:
    description: The password of O(nats_user).
    type: str
  nats_creds:
    description: A NATS credentials file (JWT and nkey seed), instead of O(nats_user) and O(nats_password).
    type: path
  window:
    description: Seconds from the notice to the delete (120 in production).
    type: float
    default: 120
  notice_keys:
    description:
      - The hall's notice signing keys (C(sco keygen --purpose notice)); agents refuse unsigned notices.
      - Falls back to C($SCO_NOTICE_KEY); required unless in check mode or nothing is to be reclaimed.
    type: list
    elements: path
    default: []
  wait:
    description: Wait for the deletes (else return once every notice is sent).
    type: bool
    default: true
  lock_wait:
    description: Seconds to wait for the hall's fleet-state writer lock.
    type: float
    default: 0
attributes:
  check_mode:
    description: Reports which instances would be reclaimed; sends no notice and deletes nothing.
    support: full
  diff_mode:
    description: Returns no diff.
    support: none
requirements:
  - spot-capacity-orchestrator[control] of the collection's release
    (C(pip install 'spot-capacity-orchestrator[control]==0.1.0')) on the host that runs the module with openstacksdk, psycopg and nats-py
"""

EXAMPLES = r"""
- name: Reclaim two nodes
  sco.orchestrator.reclaim:
    hall: hall-a
    cloud: hall-a
    nodes: [hall-a-spot-a-s1f2e3d4c-0, hall-a-spot-a-s1f2e3d4c-1]
    nats_url: nats://relay.hall-a:4222
    nats_user: reclaimer
    nats_password: "{{ lookup('ansible.builtin.file', 'credentials/nats/reclaimer') }}"
"""

RETURN = r"""
reclaimed:
  description:
    - Per instance - name, notice id, terminate_at, published (relay reached), state after the run, and agent -
      what the node's agent had reported when the delete went out (drained, overrun, draining, or notified when no
      account came), null when the instance was not deleted in this run (O(wait=false)).
  returned: success
  type: list
  elements: dict
would_reclaim:
  description: Names that are (or in check mode would be) reclaimed now.
  returned: success
  type: list
  elements: str
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.sco.orchestrator.plugins.module_utils.sco_control import common_argument_spec, run_step


def main() -> None:
    spec = {
        **common_argument_spec(),
        "nodes": {"type": "list", "elements": "str", "required": True},
        "nats_url": {"type": "str"},
        "nats_user": {"type": "str"},
        "nats_password": {"type": "str", "no_log": True},
        "nats_creds": {"type": "path"},
        "window": {"type": "float", "default": 120},
        "notice_keys": {"type": "list", "elements": "path", "default": [], "no_log": False},
        "wait": {"type": "bool", "default": True},
        "lock_wait": {"type": "float", "default": 0},
    }
    module = AnsibleModule(
        argument_spec=spec,
        supports_check_mode=True,
        mutually_exclusive=[("nats_creds", "nats_user")],
        required_by={"nats_password": "nats_user"},
    )
    run_step(module, "reclaim")


if __name__ == "__main__":
    main()
