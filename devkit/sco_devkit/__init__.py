"""Test support for SCO, kept out of the runtime wheel (issue 19): nodes get only what they run.

- ``sco_devkit.standins``    protocol-level stand-ins (Kubernetes API server, systemd-logind) for what cannot run here
- ``sco_devkit.devcluster``  real daemons on loopback: a Slurm cluster, OpenStack (Keystone, Nova fake driver, ...)
- ``sco_devkit.demo``        ``make demo`` (``sco-demo``): the main job on the embedded local hall
"""
