# Shared by the control-loop modules: the common argument spec (openstack.cloud-style credentials, the fleet
# state, the bundle) and the one way a step runs (errors become fail_json with every problem line).
from __future__ import annotations

import os
import re
import traceback
from typing import Any

from ansible_collections.sco.orchestrator.plugins.module_utils.product import require_product

try:
    from sco.errors import ScoError

    SCO_IMPORT_ERROR = None
except ImportError:
    SCO_IMPORT_ERROR = traceback.format_exc()

    class ScoError(Exception):  # type: ignore[no-redef]
        def lines(self) -> list[str]:
            return [str(self)]


def common_argument_spec() -> dict[str, Any]:
    return {
        "hall": {"type": "str", "required": True},
        # no_log: a cloud given as a dict carries its auth (run_step lets a clouds.yaml entry's name be shown)
        "cloud": {"type": "raw", "no_log": True},
        "auth": {"type": "dict", "no_log": True},
        "auth_type": {"type": "str"},
        "region_name": {"type": "str"},
        "interface": {"type": "str", "choices": ["admin", "internal", "public"], "default": "public"},
        "validate_certs": {"type": "bool"},
        "ca_cert": {"type": "path"},
        "state_dsn": {"type": "str", "no_log": True},
        "bundle": {"type": "path"},
        "trust": {"type": "list", "elements": "path"},
        "trust_dir": {"type": "path"},
        "run_id": {"type": "int"},
        "api_timeout": {"type": "float", "default": 60.0},
    }


def planning_argument_spec() -> dict[str, Any]:
    """The hall's planning configuration (pools, settings, reservations) and an optional fleet override."""
    return {
        "pools": {"type": "list", "elements": "dict", "required": True},
        "settings": {"type": "dict", "default": {}},
        "reservations": {"type": "list", "elements": "dict", "default": []},
        "reservations_from": {"type": "str", "choices": ["options", "blazar"], "default": "options"},
        "fleet": {"type": "list", "elements": "dict"},
        "now": {"type": "float"},
    }


# Keys Ansible reads as the task's own status: a step never returns them (a launch that failed is
# ``launch_failures``, a pool that was not tried is in ``unavailable``), so a result cannot fail or skip a task
# without a message.
RESERVED = ("failed", "skipped", "msg", "rc", "unreachable")


SECRET_KEY = re.compile(r"password|secret|token|passcode|credential|api_?key|private", re.IGNORECASE)


def cloud_values(cloud: Any, key: str = "") -> tuple[set[str], set[str]]:
    """The string values of a cloud given as a dict: (those under a key that names a secret, every other one)."""
    secret: set[str] = set()
    shown: set[str] = set()
    if isinstance(cloud, dict):
        for k, v in cloud.items():
            s, o = cloud_values(v, str(k))
            secret |= s
            shown |= o
    elif isinstance(cloud, (list, tuple)):
        for v in cloud:
            s, o = cloud_values(v, key)
            secret |= s
            shown |= o
    elif cloud is not None:
        (secret if SECRET_KEY.search(key) else shown).add(str(cloud))
    return secret, shown


def run_step(module: Any, step: str) -> None:
    """Run the control-loop step ``step`` (``sco.control.steps.run``) with the module's params and exit: a cloud or
    input error fails the task with its own message (and every problem line), warnings go through module.warn."""
    # A cloud named by a clouds.yaml entry is no secret: masked, the name would be starred wherever it appears (in
    # the hall's name too, when they are the same). Of a cloud given as a dict only the secrets stay masked: with
    # every value starred, the cloud's own message named no address ("Unable to establish connection to
    # ********/auth/tokens"), and a task must fail with the cloud's words
    cloud = module.params.get("cloud")
    if isinstance(cloud, str):
        module.no_log_values.discard(cloud)
    elif isinstance(cloud, dict):
        secret, shown = cloud_values(cloud)
        module.no_log_values.difference_update(shown - secret)
    # the same check as every module of the collection: the product, of the collection's release, where it runs
    require_product(module, SCO_IMPORT_ERROR)
    params = dict(module.params)
    params["state_dsn"] = params.get("state_dsn") or os.environ.get("SCO_DB_DSN")
    try:
        from sco.control import steps

        result = steps.run(step, params, module.check_mode)
    except ScoError as e:
        module.fail_json(msg=str(e), problems=e.lines())
    for w in result.pop("warnings", None) or []:
        module.warn(str(w))
    clash = [k for k in RESERVED if k in result]
    if clash:  # a bug in the step, said plainly rather than read by Ansible as the task's status
        module.fail_json(msg="step %s returned reserved keys %s" % (step, ", ".join(clash)))
    module.exit_json(**result)
