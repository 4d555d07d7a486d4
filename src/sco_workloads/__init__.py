"""Workloads (seed view 07, top layer): real jobs that lend themselves to reclaimable capacity.

Each depends on nothing of SCO but the workload client library (``sco.workload``); import-linter checks it.
``dcp_train``: a PyTorch training job that checkpoints with DCP to the contract's checkpoint store (extra ``dcp``).
"""
