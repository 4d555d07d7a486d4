"""Scheduler adapters (Kubernetes API, Slurm commands) shared by the node agent and the control plane."""
