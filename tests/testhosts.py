"""Test hosts that behave like real nodes: a Debian rootfs in its own network namespace, running sshd in a
chroot; Ansible reaches each over real SSH through ``ip netns exec NS socat - TCP:127.0.0.1:22``."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from pathlib import Path

ROOTFS = Path(os.environ.get("SCO_TESTHOST_ROOTFS", "/var/cache/sco-testhost/rootfs"))
REPO = Path(__file__).resolve().parents[1]


def ensure_rootfs() -> Path:
    subprocess.run([str(REPO / "scripts" / "testhost-rootfs.sh"), str(ROOTFS)], check=True, timeout=900)
    return ROOTFS


class TestHost:
    __test__ = False  # not a pytest class

    def __init__(self, workdir: Path, name: str) -> None:
        self.name = name
        self.ns = f"sco-{name}-{os.getpid()}"
        self.root = workdir / name
        self.key = workdir / "id_ed25519"

    def create(self) -> TestHost:
        ensure_rootfs()
        subprocess.run(["cp", "-a", "--reflink=auto", str(ROOTFS), str(self.root)], check=True, timeout=300)
        if not self.key.exists():
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key)], check=True)
        ssh = self.root / "root" / ".ssh"
        ssh.mkdir(mode=0o700, parents=True, exist_ok=True)
        shutil.copy(f"{self.key}.pub", ssh / "authorized_keys")
        (self.root / "etc" / "hostname").write_text(f"{self.name}\n")
        (self.root / "run" / "sshd").mkdir(parents=True, exist_ok=True)
        (self.root / "etc" / "ssh" / "sshd_config.d" / "sco-test.conf").write_text(
            "ListenAddress 127.0.0.1\nPermitRootLogin prohibit-password\nPasswordAuthentication no\nUsePAM no\n"
        )
        subprocess.run(["chroot", str(self.root), "ssh-keygen", "-A"], check=True, capture_output=True)
        subprocess.run(["mount", "-t", "proc", "proc", str(self.root / "proc")], check=True)
        subprocess.run(["ip", "netns", "add", self.ns], check=True)
        subprocess.run(["ip", "netns", "exec", self.ns, "ip", "link", "set", "lo", "up"], check=True)
        with open(self.root.parent / f"{self.name}.sshd.log", "ab") as log:
            subprocess.Popen(
                ["ip", "netns", "exec", self.ns, "chroot", str(self.root), "/usr/sbin/sshd", "-D", "-e"],
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        end = time.monotonic() + 15
        while time.monotonic() < end:
            if self.ssh("true", check=False).returncode == 0:
                return self
            time.sleep(0.2)
        raise RuntimeError(f"test host {self.name}: sshd did not come up")

    @property
    def proxy(self) -> str:
        return f"ip netns exec {self.ns} socat - TCP:127.0.0.1:22"

    def ssh_args(self) -> list[str]:
        return [
            "-o",
            f"ProxyCommand={self.proxy}",
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "LogLevel=ERROR",
            "-i",
            str(self.key),
        ]

    def ssh(self, *cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ssh", *self.ssh_args(), "root@127.0.0.1", *cmd],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=check,
        )

    def inventory_vars(self) -> dict[str, str]:
        common = " ".join(f"'{a}'" if " " in a else a for a in self.ssh_args()[:-2])
        # Every test host is root@127.0.0.1:22 to ssh: without a path of its own, Ansible's shared connection
        # (ControlPath keyed on host, port and user) would carry one host's tasks to another, even another run's.
        common += f" -o ControlPath=/tmp/sco-cp-{self.ns}-%C"
        return {
            "ansible_host": "127.0.0.1",
            "ansible_user": "root",
            "ansible_connection": "ssh",
            "ansible_ssh_private_key_file": str(self.key),
            "ansible_ssh_common_args": common,
            "ansible_python_interpreter": "/usr/bin/python3",
        }

    def destroy(self) -> None:
        out = subprocess.run(["ip", "netns", "pids", self.ns], capture_output=True, text=True)
        for pid in out.stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), 9)
        time.sleep(0.2)
        subprocess.run(["umount", "-l", str(self.root / "proc")], check=False)
        subprocess.run(["ip", "netns", "del", self.ns], check=False)
        remove_in_background(self.root)


def remove_in_background(path: Path) -> None:
    """Rename ``path`` away at once and remove it in the background: a converged host's tree took 20-70 s to
    remove while other scenarios copied theirs (molecule's destroy waited on it). --one-file-system: never through
    a mount a lazy unmount has not let go of yet."""
    trash = path.with_name(f".{path.name}.removed-{os.getpid()}-{time.monotonic_ns()}")
    try:
        path.rename(trash)
    except FileNotFoundError:
        return
    except OSError:
        trash = path
    subprocess.Popen(
        ["rm", "-rf", "--one-file-system", str(trash)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
