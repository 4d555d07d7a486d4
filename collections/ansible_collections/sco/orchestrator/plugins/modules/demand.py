#!/usr/bin/python
# Thin module: docs and argument spec here; the intake lives in sco.control.intake.
from __future__ import annotations

DOCUMENTATION = r"""
module: demand
short_description: Read the schedulers' pending work as units per contract and tier
description:
  - Lists pending pods that tolerate the taint reclaimable nodes register with, C(sco.dev/reclaim=reclaimable:NoSchedule)
    (Kubernetes, through the official client), and pending
    jobs on reclaimable partitions (Slurm, through C(squeue) against slurmctld), and folds their requests into one
    unit - 1 unit = 1 vCPU = 4 GiB of memory = 1/8 GPU, by the dominant resource - per contract and tier.
  - Work no contract selects is not counted; it is returned in C(report.uncontracted) with the reason.
  - Reading changes nothing, so the module runs in check mode too and never reports a change.
version_added: 0.1.0
author: Spot Capacity Orchestrator developers (@sco-dev)
extends_documentation_fragment:
  - sco.orchestrator.control
options:
  kubernetes:
    description: Where the Kubernetes API is; leave out for a Slurm-only hall.
    type: dict
    suboptions:
      url:
        description: API server URL.
        type: str
      token_file:
        description: File holding a bearer token.
        type: path
      kubeconfig:
        description: A kubeconfig file (instead of url and token_file).
        type: path
      ca_file:
        description: CA bundle of the API server.
        type: path
  slurm:
    description: Where slurmctld is; leave out for a Kubernetes-only hall.
    type: dict
    suboptions:
      slurm_conf:
        description: The C(slurm.conf) the Slurm commands read (C(SLURM_CONF)).
        type: path
      reclaimable_partitions:
        description: Partitions that run on reclaimable capacity; pending jobs elsewhere are not demand.
        type: list
        elements: str
        required: true
      timeout:
        description: Seconds each Slurm command may take.
        type: float
        default: 10
attributes:
  check_mode:
    description: Reads the schedulers' pending work; the module never changes anything, so check mode is a normal run.
    support: full
  diff_mode:
    description: Returns no diff.
    support: none
requirements:
  - spot-capacity-orchestrator[control] of the collection's release
    (C(pip install 'spot-capacity-orchestrator[control]')) on the host that runs the module with its control extra (kubernetes)
"""

EXAMPLES = r"""
- name: Read pending work
  sco.orchestrator.demand:
    hall: hall-a
    bundle: /var/lib/sco-distributor/hall-a/bundle.json
    trust_dir: /etc/sco/trusted
    kubernetes:
      kubeconfig: /etc/sco/control/kubeconfig
    slurm:
      slurm_conf: /etc/slurm/slurm.conf
      reclaimable_partitions: [spot]
  register: demand
"""

RETURN = r"""
report:
  description: The intake's report - C(demand) (contract, tier, scheduler, units_milli, items), C(uncontracted)
    and C(ineligible) (source, ref, units_milli, reason), C(node_load_milli) per node, and the unit's definition.
  returned: success
  type: dict
  sample: {demand: [{contract: web, tier: 3, scheduler: kubernetes, units_milli: 6000, items: 3}],
           uncontracted: [], ineligible: [], node_load_milli: {}}
units:
  description: Pending units per contract.
  returned: success
  type: dict
  sample: {web: 6.0}
uncontracted:
  description: How many pending items no contract selects (not counted).
  returned: success
  type: int
  sample: 0
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.sco.orchestrator.plugins.module_utils.sco_control import common_argument_spec, run_step


def main() -> None:
    spec = common_argument_spec()
    spec["kubernetes"] = {
        "type": "dict",
        "options": {
            "url": {"type": "str"},
            "token_file": {"type": "path"},
            "kubeconfig": {"type": "path"},
            "ca_file": {"type": "path"},
        },
    }
    spec["slurm"] = {
        "type": "dict",
        "options": {
            "slurm_conf": {"type": "path"},
            "reclaimable_partitions": {"type": "list", "elements": "str", "required": True},
            "timeout": {"type": "float", "default": 10},
        },
    }
    run_step(AnsibleModule(argument_spec=spec, supports_check_mode=True), "demand")


if __name__ == "__main__":
    main()
