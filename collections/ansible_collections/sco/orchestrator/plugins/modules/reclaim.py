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
  - A delete is retried with capped exponential backoff and jitter until Nova confirms the server is gone. While
    any instance of the hall is not confirmed gone when the retry budget (O(retry_for)) is spent, the task fails
    with the cloud's own message; the instance stays under reclaim and the next run keeps deleting it.
  - Every OpenStack call has a deadline (the connection's O(api_timeout), and O(call_timeout) around each call), so
    a Nova or Keystone that never answers fails the task instead of hanging it with the hall's lock held.
  - The options are those of C(sco reclaim) (one options type for both), checked alike and refused with the same
    line, which names the option as this module spells it.
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
    default: []
  before_leases:
    description:
      - Also reclaim the hall's reclaimable instances on hosts a Blazar host lease takes within one notice window
        (plus a minute, the control loop's period), so they are noticed, drained and deleted before the lease
        starts (at its start Blazar deletes every server on those hosts, with no notice).
      - Their deadline is the earlier of the window and 10 seconds before the lease starts.
    type: bool
    default: false
  lease_lookahead:
    description:
      - With O(before_leases), seconds to look beyond one notice window for host leases. Give at least the period
        of the runs (the control loop's timer interval), because a lease must be seen by a run a whole window before
        it starts, and the run before it may be a period earlier.
    type: float
    default: 60
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
  nats_token:
    description: A relay token, instead of O(nats_user) and O(nats_password) (C(sco reclaim --token)).
    type: str
  nats_nkey_seed:
    description:
      - The reclaimer's nkey seed file (the notice_relay role's C(<credentials_dir>/nats/reclaimer.nk); the relay
        knows only its public key), instead of O(nats_user) and O(nats_password).
    type: path
  nats_ca_file:
    description:
      - The hall's CA (PEM) the relay's TLS certificate must chain to (role hall's C(sco_relay_ca_file), the hall's
        CA on the controller); the hall's relays serve TLS only.
    type: path
  window:
    description:
      - Seconds from the notice to the delete (120 in production); at least 3 and at most 3600.
      - With O(bundle) (and O(trust) or O(trust_dir)), a window shorter than the hall's largest drain budget plus
        final write plus its safety margin is refused, in check mode too.
    type: float
    default: 120
  retry_for:
    description:
      - Seconds past the later of the run's start and the last deadline to keep retrying deletes Nova refuses or
        does not answer; the task then fails naming each instance not confirmed gone (a later run carries on).
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
  call_timeout:
    description:
      - Seconds each OpenStack call of the reclaimer may take on its thread before it counts as a failed attempt
        (more than 0, at most 600; C(sco reclaim --call-timeout)).
    type: float
    default: 30
  reconnect_for:
    description:
      - Seconds to connect to the fleet state again and retake the hall's lock when it is lost mid-run (a Patroni
        failover, a PostgreSQL restart) before the task fails; 0 to 3600 (C(sco reclaim --reconnect-for)).
    type: float
    default: 90
  finish:
    description:
      - Also finish the hall's reclaims under way that no run is finishing - instances an earlier run noticed
        whose run stopped before their T (its control host died); each is deleted at its recorded T, or at once
        when T has passed, and returned in RV(finished) with how late.
      - An instance whose notice was never sent (its run stopped between recording T and telling the node) is
        noticed now with a whole O(window) when O(notice_keys) are given, and otherwise left under reclaim and
        returned in RV(unnoticed); it is never deleted without a notice.
      - Needs neither O(nats_url) nor O(notice_keys) when no node is named. While another run holds the hall's
        lock (a reclaim under way elsewhere, which finishes them itself), the task changes nothing and returns
        RV(busy).
      - The control loop's playbook runs it on every run, so a second control host finishes what the first began.
    type: bool
    default: false
attributes:
  check_mode:
    description: Reports which instances would be reclaimed; sends no notice and deletes nothing.
    support: full
  diff_mode:
    description: Returns no diff.
    support: none
requirements:
  - spot-capacity-orchestrator[control] of the collection's release
    (C(pip install 'spot-capacity-orchestrator[control]')) on the host that runs the module with openstacksdk, psycopg and nats-py
"""

EXAMPLES = r"""
- name: Reclaim two nodes
  sco.orchestrator.reclaim:
    hall: hall-a
    cloud: hall-a
    nodes: [hall-a-spot-a-s1f2e3d4c-0, hall-a-spot-a-s1f2e3d4c-1]
    nats_url: nats://relay.hall-a:4222
    nats_nkey_seed: credentials/nats/reclaimer.nk
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
finished:
  description:
    - With O(finish), per instance an earlier run noticed and this one deleted - name, terminate_at, deleted_at,
      late_s (seconds past its T when the delete went out, 0 when on time), state after the run, and agent.
  returned: success
  type: list
  elements: dict
would_finish:
  description: With O(finish), the names under reclaim that this run finishes (or in check mode would).
  returned: success
  type: list
  elements: str
unnoticed:
  description:
    - With O(finish), instances under reclaim whose notice was never sent (the run that recorded their T stopped
      before telling anyone) and that this run did not delete because it has no O(notice_keys) to send one - name
      and why. They stay under reclaim; a run with the notice key notices them with a whole window, then deletes.
      Each is also a warning.
  returned: success
  type: list
  elements: dict
busy:
  description: With O(finish) and no node named, why nothing was done - another run holds the hall's lock.
  returned: when another run holds the hall
  type: str
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.sco.orchestrator.plugins.module_utils.sco_control import common_argument_spec, run_step


def main() -> None:
    spec = {
        **common_argument_spec(),
        "nodes": {"type": "list", "elements": "str", "default": []},
        "before_leases": {"type": "bool", "default": False},
        "lease_lookahead": {"type": "float", "default": 60},
        "nats_url": {"type": "str"},
        "nats_user": {"type": "str"},
        "nats_password": {"type": "str", "no_log": True},
        "nats_creds": {"type": "path"},
        "nats_token": {"type": "str", "no_log": True},
        "nats_nkey_seed": {"type": "path"},
        "nats_ca_file": {"type": "path"},
        "window": {"type": "float", "default": 120},
        "notice_keys": {"type": "list", "elements": "path", "default": [], "no_log": False},
        "wait": {"type": "bool", "default": True},
        "retry_for": {"type": "float", "default": 120},
        "lock_wait": {"type": "float", "default": 0},
        "call_timeout": {"type": "float", "default": 30},
        "reconnect_for": {"type": "float", "default": 90},
        "finish": {"type": "bool", "default": False},
    }
    module = AnsibleModule(
        argument_spec=spec,
        supports_check_mode=True,
        mutually_exclusive=[("nats_creds", "nats_user", "nats_nkey_seed", "nats_token")],
        required_by={"nats_password": "nats_user"},
    )
    run_step(module, "reclaim")


if __name__ == "__main__":
    main()
