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
APT_PACKAGES=(python3 python3-venv python3-dev gcc make git ca-certificates systemd procps slurm-wlm lua5.1
  debootstrap openssh-client socat iproute2 openssl dbus openjdk-17-jre-headless)

need_apt=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need_apt+=("$p")
done
if ((${#need_apt[@]})); then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  echo "setup: apt-get install ${need_apt[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: pip install -e .[dev]"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # the distribution was called `sco` before it was renamed: drop that stale record so only one claims the package
  rm -rf src/sco.egg-info
  "$VENV/bin/python" -m pip install -q -e '.[dev]'
  touch "$stamp"
fi
# OpenStack services for the provider tests, in their own venv (.venv-openstack).
bash scripts/openstack/setup.sh
echo "setup: ok ($("$VENV/bin/python" --version))"
