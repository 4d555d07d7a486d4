# Shared options of the modules that read the hall's planning configuration (plan, arbitrate, acquire).
from __future__ import annotations


class ModuleDocFragment:
    DOCUMENTATION = r"""
options:
  pools:
    description:
      - The hall's pools, each a dict with C(name), C(kind) (reclaimable, committed, on-demand), C(flavor),
        C(vcpus), C(ramMiB), C(gpus), C(cap) (most instances, at most 10000), C(group) (diversification group),
        C(image), C(available), C(unavailableReason), C(pricePerHour) (on-demand), C(lease) and
        C(instancesPerHost) (committed).
      - Pools the fleet state marks unavailable (quota, no valid host) are skipped whatever this says.
    type: list
    elements: dict
    required: true
  settings:
    description:
      - "C(shares) (most of a tier's new units in one pool or group, per tier, for example C({1: '1/2', 2: '1/2', 3: 1})),
        C(idleGraceSeconds) (an idle instance is scaled down after this), C(settleSeconds)."
    type: dict
    default: {}
  reservations:
    description: Committed capacity as C(lease), C(pool), C(instances) (with O(reservations_from=options)).
    type: list
    elements: dict
    default: []
  reservations_from:
    description:
      - C(options) - committed capacity is the O(reservations) option.
      - C(blazar) - read the leases from Blazar (the reservation service in the cloud's catalog) - the reservations
        in force now of the lease named in a committed pool's C(lease) (default its name); a host reservation
        counts C(instancesPerHost) instances per host.
    type: str
    choices: [options, blazar]
    default: options
  fleet:
    description:
      - The fleet as C(id), C(name), C(pool), C(contracts), C(launchedAt), C(state); read from the fleet state
        when not given.
    type: list
    elements: dict
  now:
    description: Plan as of this Unix time (default - now).
    type: float
"""
