#!/usr/bin/python
# Copyright: Spot Capacity Orchestrator developers
# Apache License 2.0 (see LICENSE)
# Thin module: argument spec and docs here, the compiler and signer live in the sco package.
from __future__ import annotations

DOCUMENTATION = r"""
module: contract_bundle
short_description: Compile a contract repository into a signed bundle
description:
  - Validates every contract and the hall policy of a contract repository, checks feasibility, and writes a
    canonical signed bundle. The same input gives the same bytes, so a second run reports no change.
  - The serial only grows; it continues from the bundle already at O(dest).
  - "Runs where the signing keys and the contract repository are, usually the controller or the execution
    environment (C(delegate_to: localhost)); that Python needs the C(spot-capacity-orchestrator) distribution of
    this collection's release, and the module fails with the install command when it is missing or of another release."
version_added: 0.1.0
author: Spot Capacity Orchestrator developers (@sco-dev)
extends_documentation_fragment:
  - sco.orchestrator.signing
options:
  repo:
    description: Directory holding C(hall.yaml) and the C(WorkloadContract) files.
    type: path
    required: true
  dest:
    description: Bundle file to write.
    type: path
    required: true
  issued_at:
    description: Issue time in epoch seconds recorded in the bundle; omitted when not given.
    type: int
attributes:
  check_mode:
    description: Compiles and reports the serial it would write, writes nothing.
    support: full
  diff_mode:
    description: No diff; the bundle is canonical JSON, compare serials and digests instead.
    support: none
requirements:
  - spot-capacity-orchestrator of the collection's release (C(pip install spot-capacity-orchestrator)),
    on the host that runs the module
"""

EXAMPLES = r"""
- name: Compile and sign the hall's contracts
  sco.orchestrator.contract_bundle:
    repo: /srv/contracts/hall-a
    dest: /var/lib/sco-distributor/hall-a/bundle.json
    signing_keys:
      - /etc/sco/keys/2026-11.key
  delegate_to: localhost
  run_once: true
"""

RETURN = r"""
serial:
  description: Serial of the bundle at O(dest) after the run (or that would be written in check mode).
  returned: success
  type: int
contracts:
  description: Number of contracts in the bundle.
  returned: success
  type: int
keyids:
  description: Key ids that signed the bundle.
  returned: success
  type: list
  elements: str
problems:
  description: One line per problem (file, field, message) when the repository does not compile.
  returned: failure
  type: list
  elements: str
"""

import traceback
from pathlib import Path

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.sco.orchestrator.plugins.module_utils.product import require_product

try:
    from sco._fs import atomic_write
    from sco.contract.bundle import peek_payload
    from sco.contract.compiler import compile_repo
    from sco.contract.signing import load_private, sign
    from sco.errors import ScoError

    IMPORT_ERROR = None
except ImportError:
    IMPORT_ERROR = traceback.format_exc()


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "repo": {"type": "path", "required": True},
            "dest": {"type": "path", "required": True},
            "signing_keys": {"type": "list", "elements": "path", "required": True, "no_log": False},
            "issued_at": {"type": "int"},
        },
        supports_check_mode=True,
    )
    require_product(module, IMPORT_ERROR)
    p = module.params
    dest = Path(p["dest"])
    try:
        keys = [load_private(Path(k)) for k in p["signing_keys"]]
        old = dest.read_bytes() if dest.exists() else None
        payload = compile_repo(Path(p["repo"]), previous=peek_payload(old) if old else None, issued_at=p["issued_at"])
        raw = sign(payload, keys)
    except ScoError as e:
        module.fail_json(msg=str(e), problems=e.lines())
    result = {
        "changed": raw != old,
        "serial": payload["serial"],
        "contracts": len(payload["contracts"]),
        "keyids": [k.keyid for k in keys],
    }
    if result["changed"] and not module.check_mode:
        dest.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(dest, raw)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
