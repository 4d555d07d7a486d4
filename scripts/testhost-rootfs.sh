#!/usr/bin/env bash
# The Debian rootfs the test hosts boot from (network-namespace hosts running sshd in a chroot), built once and
# cached: ~2-3 min and ~550 MB. Usage: scripts/testhost-rootfs.sh [DIR]  (default /var/cache/sco-testhost/rootfs)
#
# The hosts have no network beyond their scenario's, so what a role installs with apt must be here already:
# PostgreSQL, Patroni and etcd for the fleet state's HA members (molecule scenario hall-ha). They are installed
# after debootstrap with a policy-rc.d that refuses every start (a chroot's postinst would otherwise start
# postgresql and etcd on the build machine's own network) and without Debian's "main" cluster (Patroni makes its
# own); the policy is removed afterwards, so the hosts behave as before. python3-apt: Ansible's apt module finds
# an installed package without network; iproute2 and iputils-ping: a scenario's private network checked from inside;
# prometheus and prometheus-node-exporter: role monitoring on the control hosts (verify runs them with the files
# the role wrote); cloud-init: an instance of molecule scenario hall-lifecycle boots through Debian's real cloud-init
# against Nova's metadata API (it does nothing on the other hosts: without systemd nothing starts it).
#
# KEY names what the rootfs holds: a cached rootfs with another key (an older list) is built again.
set -euo pipefail
dir=${1:-/var/cache/sco-testhost/rootfs}
BASE_PACKAGES=python3,python3-venv,systemd,openssh-server,procps
EXTRA_PACKAGES=(postgresql patroni etcd-server etcd-client python3-apt iproute2 iputils-ping prometheus
  prometheus-node-exporter cloud-init)
KEY="v5 $BASE_PACKAGES ${EXTRA_PACKAGES[*]}"
cached() { [ -x "$dir/usr/sbin/sshd" ] && [ -x "$dir/usr/bin/python3" ] && [ "$(cat "$dir/.sco-complete" 2>/dev/null)" = "$KEY" ]; }
if cached; then
  echo "testhost rootfs: cached at $dir"
  exit 0
fi
mkdir -p "$(dirname "$dir")"
# two sessions building at once would share $dir.partial: the second waits and then finds the first's
exec 9>"$dir.lock"
flock -w 1800 9 || { echo "testhost rootfs: $dir.lock held for 30 min" >&2; exit 1; }
if cached; then
  echo "testhost rootfs: cached at $dir"
  exit 0
fi
rm -rf "$dir.partial"
debootstrap --variant=minbase --include="$BASE_PACKAGES" bookworm "$dir.partial" >/dev/null
p=$dir.partial
printf '#!/bin/sh\nexit 101\n' >"$p/usr/sbin/policy-rc.d"
chmod 755 "$p/usr/sbin/policy-rc.d"
mkdir -p "$p/etc/postgresql-common"
echo "create_main_cluster = false" >"$p/etc/postgresql-common/createcluster.conf"
cp /etc/resolv.conf "$p/etc/resolv.conf"
# no documentation or translations for the extras (~90 MB per host copy), as Debian's slim images do
cat >"$p/etc/dpkg/dpkg.cfg.d/sco-testhost-nodoc" <<'EOF2'
path-exclude=/usr/share/doc/*
path-exclude=/usr/share/man/*
path-exclude=/usr/share/info/*
path-exclude=/usr/share/locale/*
path-include=/usr/share/locale/locale.alias
EOF2
mount -t proc proc "$p/proc"
trap 'umount -l "$p/proc" 2>/dev/null || true' EXIT
chroot "$p" apt-get -qq update
DEBIAN_FRONTEND=noninteractive chroot "$p" apt-get install -y -qq --no-install-recommends "${EXTRA_PACKAGES[@]}" >/dev/null
chroot "$p" apt-get clean
# the package lists only served this install (the hosts have no network); dpkg's status still names what is here
rm -rf "$p/var/lib/apt/lists/"*
umount -l "$p/proc"
trap - EXIT
rm -f "$p/usr/sbin/policy-rc.d"
echo "$KEY" >"$p/.sco-complete"
# the old tree is renamed away first, so a host being copied from it meanwhile keeps a whole tree under its feet
old=""
[ -e "$dir" ] && { old="$dir.old-$$"; mv "$dir" "$old"; }
mv "$p" "$dir"
[ -n "$old" ] && rm -rf --one-file-system "$old"
echo "testhost rootfs: built at $dir"
