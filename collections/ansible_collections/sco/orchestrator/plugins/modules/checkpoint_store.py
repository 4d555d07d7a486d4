#!/usr/bin/python
# Thin module: docs and argument spec here; the logic lives in sco.provider.checkpoint_store.
from __future__ import annotations

DOCUMENTATION = r"""
module: checkpoint_store
short_description: Per-contract checkpoint buckets and S3 users on a Ceph RGW
description:
  - For every contract of a verified bundle that names a checkpoint store (C(spec.checkpoint.store)), makes sure
    the RGW has an S3 user of its own (C(sco-ckpt-<contract>)), a bucket of its own (C(sco-ckpt-<contract>)), a
    bucket policy that lets the user read, write, delete and list only under the contract's prefix, and a
    lifecycle rule on the prefix that aborts the multipart uploads of interrupted saves.
  - Writes each contract's credentials (its keys, the endpoint, the store URL) to O(credentials_dir), mode 0600.
  - Speaks to the RGW over HTTP only (Admin Ops API and S3) as an admin user with C(users=*; buckets=*) caps.
  - With O(state=absent), removes each contract's S3 user (its keys), the bucket policy naming it and its
    credentials file (and O(credentials_dir) once empty); the bucket and its checkpoints stay unless O(purge_data).
  - Idempotent; in check mode reports what would change and changes nothing.
version_added: 0.1.0
author: Spot Capacity Orchestrator developers (@sco-dev)
options:
  bundle:
    description: The signed contract bundle (C(sco contract compile)).
    type: path
    required: true
  trust:
    description: Public keys the bundle must be signed by (one is enough).
    type: list
    elements: path
    required: true
  endpoint:
    description: The RGW's S3 endpoint; defaults to the bundle hall policy's C(checkpointStore.endpoint).
    type: str
  admin_access_key:
    description: The RGW admin user's access key.
    type: str
    required: true
  admin_secret_key:
    description: The RGW admin user's secret key.
    type: str
    required: true
  credentials_dir:
    description: Where each contract's credentials go (C(<contract>.env)); nothing is written when unset.
    type: path
  state:
    description: V(present) converges the stores; V(absent) removes the users, bucket policies and credentials files.
    type: str
    choices: [present, absent]
    default: present
  purge_data:
    description: With O(state=absent), also delete each contract's bucket with every checkpoint in it (no undo).
    type: bool
    default: false
attributes:
  check_mode:
    description: Reports what would be created or changed; creates nothing.
    support: full
  diff_mode:
    description: Returns no diff.
    support: none
requirements:
  - spot-capacity-orchestrator[control] of the collection's release on the host that runs the module (boto3)
"""

EXAMPLES = r"""
- name: Checkpoint buckets and users for the hall's contracts
  sco.orchestrator.checkpoint_store:
    bundle: /var/lib/sco-distributor/hall-a/bundle.json
    trust: [keys/2026-11.pub]
    admin_access_key: "{{ vault_rgw_admin_access_key }}"
    admin_secret_key: "{{ vault_rgw_admin_secret_key }}"
    credentials_dir: credentials/checkpoints
"""

RETURN = r"""
stores:
  description: Per contract - contract, bucket, prefix, user, and changed (what was or would be created, changed or removed).
  returned: success
  type: list
  elements: dict
"""

import traceback
from pathlib import Path

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.sco.orchestrator.plugins.module_utils.product import require_product

try:
    from sco.contract.bundle import Bundle
    from sco.contract.signing import Keyring, load_public
    from sco.errors import ScoError
    from sco.provider.checkpoint_store import deprovision, provision

    IMPORT_ERROR = None
except ImportError:
    IMPORT_ERROR = traceback.format_exc()


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "bundle": {"type": "path", "required": True},
            "trust": {"type": "list", "elements": "path", "required": True},
            "endpoint": {"type": "str"},
            "admin_access_key": {"type": "str", "required": True, "no_log": True},
            "admin_secret_key": {"type": "str", "required": True, "no_log": True},
            "credentials_dir": {"type": "path"},
            "state": {"type": "str", "choices": ["present", "absent"], "default": "present"},
            "purge_data": {"type": "bool", "default": False},
        },
        supports_check_mode=True,
    )
    require_product(module, IMPORT_ERROR)
    p = module.params
    try:
        bundle = Bundle.from_bytes(Path(p["bundle"]).read_bytes(), Keyring([load_public(Path(k)) for k in p["trust"]]))
        endpoint = p["endpoint"] or bundle.policy.get("checkpointStore", {}).get("endpoint")
        if not endpoint:
            module.fail_json(msg="endpoint: not given, and the bundle's hall policy has no checkpointStore.endpoint")
        common = {
            "endpoint": endpoint,
            "access_key": p["admin_access_key"],
            "secret_key": p["admin_secret_key"],
            "credentials_dir": Path(p["credentials_dir"]) if p["credentials_dir"] else None,
            "check_mode": module.check_mode,
        }
        if p["state"] == "absent":
            stores = deprovision(bundle.contracts, purge_data=p["purge_data"], **common)
        else:
            stores = provision(bundle.contracts, **common)
    except (ScoError, OSError) as e:
        module.fail_json(msg=str(e))
    module.exit_json(changed=any(s["changed"] for s in stores), stores=stores)


if __name__ == "__main__":
    main()
