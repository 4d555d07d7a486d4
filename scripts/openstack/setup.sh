#!/usr/bin/env bash
# The real OpenStack services the provider tests and benchmarks run on loopback (Keystone, Nova, Placement,
# Glance, Blazar, Ironic), in their own virtualenv so their pins never fight the product's (~590 MB, ~1 min
# from a warm pip cache), plus the brokers and databases they need from Debian: RabbitMQ for Nova's RPC and
# MariaDB for Blazar (its migrations run on MySQL only). Called by scripts/setup.sh. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV=${SCO_OPENSTACK_VENV:-.venv-openstack}
REQS=scripts/openstack/requirements.txt
APT_PACKAGES=(rabbitmq-server mariadb-server)

need_apt=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need_apt+=("$p")
done
if ((${#need_apt[@]})); then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  echo "setup: apt-get install ${need_apt[*]}"
  $SUDO apt-get update -qq
  # Debian would start the daemons system-wide; the tests start their own on free ports instead.
  DEBIAN_FRONTEND=noninteractive RUNLEVEL=1 $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.installed"
# The stamp holds the requirements' hash, not a time: worktrees share one venv (a symlink), and a fresh checkout's
# requirements file is always newer than the stamp - pip then reinstalled keystoneauth1 & co. under the running
# clouds of the other worktrees (nova-metadata: "No module named keystoneauth1.loading._plugins", HTTP 500).
want=$(sha256sum "$REQS" | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: pip install OpenStack into $VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -r "$REQS"
  echo "$want" >"$stamp"
fi
echo "setup: OpenStack ok ($("$VENV/bin/python" -m pip show nova 2>/dev/null | sed -n 's/^Version: /nova /p'))"
