# Shared by the control-loop modules: the common argument spec (openstack.cloud-style credentials, the fleet
# state, the bundle) and the one way a step runs (errors become fail_json with every problem line).
from __future__ import annotations

import os
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
        "cloud": {"type": "raw"},
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


def run_step(module: Any, step: str) -> None:
    """Run ``sco.control.loop.step_<step>`` (or the provider's) with the module's params and exit."""
    # the same check as every module of the collection: the product, of the collection's release, where it runs
    require_product(module, SCO_IMPORT_ERROR)
    params = dict(module.params)
    params["state_dsn"] = params.get("state_dsn") or os.environ.get("SCO_DB_DSN")
    try:
        from sco.control import loop

        store = loop.open_store(params) if params.get("state_dsn") else None
        try:
            result = getattr(loop, f"step_{step}")(params, module.check_mode, store)
        finally:
            if store is not None:
                store.close()
    except ScoError as e:
        module.fail_json(msg=str(e), problems=e.lines())
    module.exit_json(**result)
