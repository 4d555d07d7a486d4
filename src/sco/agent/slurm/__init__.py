"""The Slurm drain path of a node (the scheduler factory, ``sco.agent.scheduler``, builds it).

``drain`` (DRAIN, USR1 per job, requeue; around a silent slurmctld, signal the job's processes directly) uses
``jobprocs`` (a job's processes from its cgroup or slurmstepd's process tree).
"""
