# Copyright: Spot Capacity Orchestrator developers
# Apache License 2.0 (see LICENSE)
"""Where the modules' logic lives: the spot-capacity-orchestrator distribution (import package ``sco``), on the
host that runs the module. This checks it is there and of the collection's release, and says what to install."""

from __future__ import annotations

import re

from ansible.module_utils.basic import missing_required_lib

try:
    from importlib.metadata import PackageNotFoundError, version
except ImportError:  # Python < 3.8 on a managed host: reported as the product missing
    version = None

DISTRIBUTION = "spot-capacity-orchestrator"
# The collection's own version (galaxy.yml); the product must be of the same major.minor release.
COLLECTION_VERSION = "0.1.0"
INSTALL_HINT = (
    "Install it in the Python that runs the module: pip install %s==%s. Modules of this collection usually run "
    "on the controller or in the execution environment (delegate_to: localhost), which already has it."
    % (DISTRIBUTION, COLLECTION_VERSION)
)


def _release(v):
    m = re.match(r"(\d+)\.(\d+)", v or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def installed_version():
    """The version of the distribution importlib finds first on sys.path, or None."""
    if version is None:
        return None
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return None


def version_problem(found, wanted=COLLECTION_VERSION):
    """A message when ``found`` is not of the release ``wanted`` (same major.minor), else None."""
    if found is None:
        return "%s is importable but not installed as a distribution. %s" % (DISTRIBUTION, INSTALL_HINT)
    if _release(found) != _release(wanted):
        return "%s %s is installed, but collection sco.orchestrator %s needs %s==%s on the host running the module." % (
            DISTRIBUTION,
            found,
            wanted,
            DISTRIBUTION,
            wanted,
        )
    return None


def require_product(module, import_error):
    """Fail the module unless the product imported (``import_error`` is the traceback when it did not) and is
    of the collection's release."""
    if import_error is not None:
        module.fail_json(
            msg="%s %s" % (missing_required_lib(DISTRIBUTION), INSTALL_HINT),
            exception=import_error,
        )
    problem = version_problem(installed_version())
    if problem:
        module.fail_json(msg=problem)
