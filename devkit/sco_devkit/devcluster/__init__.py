"""Real daemons started on loopback for the tests and the demo (not stand-ins): a Slurm cluster, Ceph, OpenStack, and
a Patroni cluster (etcd, PostgreSQL 15, Patroni)."""
