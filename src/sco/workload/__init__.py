"""Workloads layer (seed view 07, top): what a workload links to talk to the node plane.

Standard library only, and importing nothing else from ``sco``: a workload image may vendor a single file
(``checkpoint_client.py``) without the agent's dependencies.
"""
