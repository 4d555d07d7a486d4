# Shared options of the control-loop modules (demand, reconcile, plan, arbitrate, acquire, reclaim), set once for all of them
# through the action group: module_defaults: {group/sco.orchestrator.control: {cloud: ..., hall: ...}}.
from __future__ import annotations


class ModuleDocFragment:
    DOCUMENTATION = r"""
options:
  hall:
    description: The hall (one OpenStack region's reclaimable estate) this run plans for.
    type: str
    required: true
  cloud:
    description:
      - As in openstack.cloud - the name of a cloud in C(clouds.yaml), or a dict of its settings.
      - Used by the modules that talk to OpenStack (acquire, reclaim); accepted by all so one action-group
        default serves every module.
    type: raw
  auth:
    description:
      - As in openstack.cloud - authentication settings (auth_url, username, password, project_name, ...)
        when no C(clouds.yaml) entry is used.
    type: dict
  auth_type:
    description: Keystone auth plugin (password, v3applicationcredential, ...).
    type: str
  region_name:
    description: OpenStack region.
    type: str
  interface:
    description: Endpoint interface.
    type: str
    choices: [admin, internal, public]
    default: public
  validate_certs:
    description: Verify TLS certificates of the OpenStack endpoints.
    type: bool
  ca_cert:
    description: CA bundle for the OpenStack endpoints.
    type: path
  state_dsn:
    description:
      - PostgreSQL connection string of the fleet state (falls back to C($SCO_DB_DSN)).
      - Without it the modules plan from the C(fleet) option and record nothing.
    type: str
  bundle:
    description: The hall's verified contract bundle (file).
    type: path
  trust:
    description: Public keys (files) the bundle must be signed with.
    type: list
    elements: path
  trust_dir:
    description: Directory of trusted public keys (C(*.pub)).
    type: path
  run_id:
    description: The control-loop run this step belongs to (set by C(sco-control-loop)); recorded with its output.
    type: int
  api_timeout:
    description: Seconds any one OpenStack API call may take before it fails (with the cloud's message).
    type: float
    default: 60.0
"""
