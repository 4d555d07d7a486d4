#!/usr/bin/env bash
# The Debian rootfs the test hosts boot from (network-namespace hosts running sshd in a chroot), built once and
# cached: ~45-100 s and ~310 MB. Usage: scripts/testhost-rootfs.sh [DIR]  (default /var/cache/sco-testhost/rootfs)
set -euo pipefail
dir=${1:-/var/cache/sco-testhost/rootfs}
if [ -x "$dir/usr/sbin/sshd" ] && [ -x "$dir/usr/bin/python3" ] && [ -f "$dir/.sco-complete" ]; then
  echo "testhost rootfs: cached at $dir"
  exit 0
fi
rm -rf "$dir.partial"
mkdir -p "$(dirname "$dir")"
debootstrap --variant=minbase --include=python3,python3-venv,systemd,openssh-server,procps \
  bookworm "$dir.partial" >/dev/null
touch "$dir.partial/.sco-complete"
rm -rf "$dir"
mv "$dir.partial" "$dir"
echo "testhost rootfs: built at $dir"
