"""Spot Capacity Orchestrator.

Packages follow the layers of seed view 07 (see ARCHITECTURE.md):

- ``sco.contract``   contract and policy: model, compiler, signing, distribution (imports no other layer)
- ``sco.agent``      node plane: bundle cache and fetcher, node agent (never imports the control plane)
- ``sco.schedulers`` scheduler adapters (Kubernetes, Slurm) used by the agent and the control plane
- ``sco.provider``   provider adapters (OpenStack)
- ``sco.control``    control plane: demand intake, planner, acquirer
- ``sco.cli``        the ``sco`` command, the only place errors become messages and exit codes
"""

from importlib.metadata import PackageNotFoundError, version

# pyproject.toml holds the version, its one place; an installed (or editable) distribution carries it here
try:
    __version__ = version("spot-capacity-orchestrator")
except PackageNotFoundError:  # sources on sys.path without an install: no release to name
    __version__ = "0+unknown"
