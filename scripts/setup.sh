#!/usr/bin/env bash
# Everything the demo and the tests need, on a fresh Debian 12 machine (root, or sudo available).
# Idempotent: re-running installs nothing new. Used by `make setup`, `make demo`, `make test` and .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
# slurm-wlm: the real slurmctld/slurmd the Slurm tests run; lua5.1: the job_submit.lua benchmark.
# debootstrap, openssh-client, socat, iproute2: the SSH test hosts (network namespaces) Ansible runs against.
# dbus: the real dbus-daemon the logind stand-in serves on (Kubernetes fallback tests).
# openjdk-17-jre-headless: the JVMs of the pyspark decommissioning test (local-cluster mode).
# chromium: the headless browser the drill report's screenshot test renders the report in.
# ceph-mon ceph-osd ceph-mgr radosgw ceph-common: the one-node Ceph cluster with an RGW (S3) that the DCP
# checkpoint tests and benchmark run on loopback (sco_devkit.devcluster.ceph; role checkpoint_store).
# prometheus: the real server (and promtool) the metrics tests scrape with and the alert rules are tested by.
# prometheus-node-exporter: the real textfile collector that serves the control loop's .prom files to that server.
APT_PACKAGES=(python3 python3-venv python3-dev gcc make git ca-certificates systemd procps slurm-wlm lua5.1
  debootstrap openssh-client socat iproute2 openssl dbus openjdk-17-jre-headless chromium
  ceph-mon ceph-osd ceph-mgr radosgw ceph-common prometheus
  prometheus-node-exporter
  patroni python3-etcd etcd-server postgresql-15)

need_apt=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need_apt+=("$p")
done
if ((${#need_apt[@]})); then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  echo "setup: apt-get install ${need_apt[*]}"
  $SUDO apt-get -o DPkg::Lock::Timeout=600 update -qq
  # RUNLEVEL=1: Debian would start ceph's (and others') daemons system-wide; the tests start their own. Without
  # systemd as PID 1 that also keeps etcd's and PostgreSQL's init scripts (Debian's main cluster, port 5432) and
  # Patroni's from starting: the fleet-state tests run their own members (sco_devkit.devcluster.patroni).
  DEBIAN_FRONTEND=noninteractive RUNLEVEL=1 $SUDO apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
    --no-install-recommends "${need_apt[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ devkit/pyproject.toml -nt "$stamp" ] \
  || [ agent/constraints.txt -nt "$stamp" ] || [ constraints/control.txt -nt "$stamp" ]; then
  echo "setup: pip install -e .[dev] -e devkit"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # the distribution was called `sco` before it was renamed: drop that stale record so only one claims the package
  rm -rf src/sco.egg-info
  # PyTorch for the DCP training workload (extra `dcp`, never a runtime dependency): exactly this spec, which
  # pip takes as the CPU build lying on the machine's disk; any other spec pulls a multi-GB CUDA build.
  "$VENV/bin/python" -m pip install -q torch==2.13.0
  # devkit: the test support (stand-ins, dev clusters, demo); the node's and the control plane's pins, so tests run
  # what nodes, controllers and the execution environment run
  "$VENV/bin/python" -m pip install -q -c agent/constraints.txt -c constraints/control.txt -e '.[dev,dcp]' -e ./devkit
  touch "$stamp"
fi
# OpenStack services for the provider tests, in their own venv (.venv-openstack).
bash scripts/openstack/setup.sh
echo "setup: ok ($("$VENV/bin/python" --version))"
