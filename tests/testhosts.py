"""Test hosts that behave like real nodes: a Debian rootfs in its own network namespace, running sshd in a
chroot; Ansible reaches each over real SSH through ``ip netns exec NS socat - TCP:127.0.0.1:22``."""

from __future__ import annotations

import contextlib
import hashlib
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

    @property
    def layer(self) -> Path:
        """The writable layer of a copy-on-write host (``create(overlay=True)``): upper and work directories."""
        return self.root.parent / f".{self.name}.cow"

    def create(self, image: Path | None = None, overlay: bool = False) -> TestHost:
        """``image``: a tree to copy instead of the test rootfs (another host's root: a baked image); its mounts
        (/proc) are not copied. ``overlay``: the root is an overlay with ``image`` as its read-only lower layer,
        copy-on-write as a cloud boots a disk over its base image, not a copy (a host's tree is about 1 GB: twenty
        copies fill this machine's disk); ``image`` must not change while such a host lives."""
        if image is None:
            image = ensure_rootfs()
        if overlay:
            for d in (self.layer / "upper", self.layer / "work", self.root):
                d.mkdir(parents=True)
            opts = f"lowerdir={image},upperdir={self.layer / 'upper'},workdir={self.layer / 'work'}"
            subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(self.root)], check=True, timeout=60)
        else:
            subprocess.run(
                ["cp", "-a", "--one-file-system", "--reflink=auto", str(image), str(self.root)],
                check=True,
                timeout=300,
            )
        (self.root / "proc").mkdir(exist_ok=True)
        if not self.key.exists():
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key)], check=True)
        ssh = self.root / "root" / ".ssh"
        ssh.mkdir(mode=0o700, parents=True, exist_ok=True)
        shutil.copy(f"{self.key}.pub", ssh / "authorized_keys")
        (self.root / "etc" / "hostname").write_text(f"{self.name}\n")
        (self.root / "run" / "sshd").mkdir(parents=True, exist_ok=True)
        # /dev/shm as a real machine has it (world-writable, sticky): POSIX semaphores (Python's multiprocessing
        # locks, which Patroni takes when it fails over) are files there; the rootfs leaves a root-only directory
        (self.root / "dev" / "shm").mkdir(parents=True, exist_ok=True)
        (self.root / "dev" / "shm").chmod(0o1777)
        (self.root / "etc" / "ssh" / "sshd_config.d" / "sco-test.conf").write_text(
            "ListenAddress 127.0.0.1\nPermitRootLogin prohibit-password\nPasswordAuthentication no\nUsePAM no\n"
        )
        subprocess.run(["chroot", str(self.root), "ssh-keygen", "-A"], check=True, capture_output=True)
        subprocess.run(["mount", "-t", "proc", "proc", str(self.root / "proc")], check=True)
        subprocess.run(["ip", "netns", "add", self.ns], check=True)
        subprocess.run(["ip", "netns", "exec", self.ns, "ip", "link", "set", "lo", "up"], check=True)
        # A session of its own: made by molecule's create playbook (the command module), sshd would be in the
        # Ansible worker's process group, which the worker kills (killpg SIGTERM) when ansible-playbook terminates
        # it: every host of the scenario lost its sshd seconds after create, now and then
        with open(self.root.parent / f"{self.name}.sshd.log", "ab") as log:
            subprocess.Popen(
                ["ip", "netns", "exec", self.ns, "chroot", str(self.root), "/usr/sbin/sshd", "-D", "-e"],
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,
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
        # a scenario's verify may have given the host the machine's /dev/pts (molecule hall-lifecycle)
        subprocess.run(["umount", "-l", str(self.root / "dev" / "pts")], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", self.ns], check=False)
        if self.layer.exists():  # a copy-on-write host: its overlay goes, then its layer (the image stays)
            subprocess.run(["umount", "-l", str(self.root)], capture_output=True, check=False)
            remove_in_background(self.layer)
        remove_in_background(self.root)


class TestNetwork:
    """A private IPv4 /24 shared by a set of test hosts, so they reach each other as real machines do (a hall's
    relay cluster, etcd and Patroni members): a bridge in a network namespace of its own (nothing is added to the
    machine's own namespace, and deleting that namespace removes the bridge and every veth end in it), a veth pair
    per host with ``eth0`` in the host's namespace, and every member's name in each host's /etc/hosts.

    Opt-in: hosts made without one keep only their loopback."""

    __test__ = False  # not a pytest class
    FIRST = 11  # the n-th host joined gets <prefix>.<FIRST + n>

    def __init__(self, ns: str, prefix: str) -> None:
        self.ns = ns
        self.prefix = prefix  # "10.231.7": the /24's first three octets
        self.members: dict[str, str] = {}  # host name -> address, in the order joined

    def create(self) -> TestNetwork:
        self.destroy()  # what a crashed run left under this name
        _ip("netns", "add", self.ns)
        _ip("-n", self.ns, "link", "set", "lo", "up")
        _ip("-n", self.ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.ns, "link", "set", "br0", "up")
        return self

    def address(self, index: int) -> str:
        if not 0 <= index < 240:
            raise ValueError(f"test network {self.ns}: host index {index} outside 0..239")
        return f"{self.prefix}.{self.FIRST + index}"

    def join(self, host: TestHost, addr: str | None = None) -> str:
        """Plug ``host`` (created, its namespace there) in: eth0 with ``addr`` (one of this /24's, not taken;
        default: the next one), a default route through the bridge (so a host has a default IPv4 address as a real
        one does; nothing lies beyond it). Returns the address. Call :meth:`write_hosts` once every host has
        joined."""
        index = len(self.members)
        if addr is None:
            # the next one not taken (a host that left makes the count lag behind the addresses given)
            free = (a for i in range(index, 240) if (a := self.address(i)) not in self.members.values())
            addr = next(free, None)
            if addr is None:
                raise ValueError(f"test network {self.ns}: {host.name}: no free address left in {self.prefix}.0/24")
        last = addr.removeprefix(f"{self.prefix}.")
        if addr == last or not last.isdigit() or not 1 <= int(last) <= 254 or addr in self.members.values():
            raise ValueError(f"test network {self.ns}: {host.name}: {addr} is not a free address of {self.prefix}.0/24")
        # named by the address, not the index: a host that left frees its index for the next one, while the
        # port of the host joined after it still holds that index's name
        port = f"v{last}"
        # both ends made in their namespaces at once: no name is ever taken in the machine's own namespace
        _ip("-n", self.ns, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", host.ns)
        _ip("-n", self.ns, "link", "set", port, "master", "br0", "up")
        _ip("-n", host.ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        _ip("-n", host.ns, "link", "set", "eth0", "up")
        _ip("-n", host.ns, "route", "add", "default", "dev", "eth0")
        self.members[host.name] = addr
        return addr

    def write_hosts(self, hosts: list[TestHost]) -> None:
        """Every member's name in each host's /etc/hosts (replacing what an earlier call wrote)."""
        begin, end = "# sco test network begin", "# sco test network end"
        block = [begin, *(f"{a} {n}" for n, a in self.members.items()), end]
        for h in hosts:
            f = h.root / "etc" / "hosts"
            lines = f.read_text().splitlines() if f.exists() else ["127.0.0.1 localhost"]
            if begin in lines and end in lines:
                lines = lines[: lines.index(begin)] + lines[lines.index(end) + 1 :]
            # the host's own name is its network address, not 127.0.1.1 (services bind and advertise it)
            lines = [ln for ln in lines if ln.split()[:1] != ["127.0.1.1"]]
            while lines and not lines[-1].strip():
                lines.pop()
            f.write_text("\n".join([*lines, *block]) + "\n")

    def destroy(self) -> None:
        """Remove the bridge's namespace (the bridge and the veths with it); the hosts' ends go with their own
        namespaces. Idempotent: nothing there is no error."""
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, check=False, timeout=30)


def network_prefix(name: str) -> str:
    """The private /24 of a set of hosts named ``name`` (a scenario): 10.231.<n>, n from 1 to 254 derived from the
    name, so a static inventory can name the addresses. Each network is in a namespace of its own, so two with the
    same n would not even meet; distinct ones keep traces and logs unambiguous."""
    n = 1 + int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % 254
    return f"10.231.{n}"


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip() or out.returncode}")


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


def _live_roots() -> list[str]:
    """Every process's root and working directory: a test host is alive while its sshd (chrooted) or a test in it is."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            for link in ("root", "cwd"):
                with contextlib.suppress(OSError):
                    out.append(os.readlink(f"/proc/{pid}/{link}"))
    return out


def sweep_dead_hosts(base: Path) -> list[str]:
    """Let go of what test hosts of dead sessions under ``base`` (pytest's ``pytest-of-<user>``) still hold: their
    /proc, /dev/pts and overlay mounts (a killed run never reached ``destroy``), then their network namespaces. With a
    mount left in it, pytest's own clean-up of old session directories fails and renames them ``garbage-*`` for good,
    each with a host's 1 GB tree: a few killed runs filled this machine's disk. A session directory is dead when no
    process has its root or working directory in it; another live session's hosts (a second pytest at once) are
    left alone. Returns what it unmounted and deleted."""
    done: list[str] = []
    prefix = str(base) + "/"
    roots = _live_roots()
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split()[4] for line in f]
    for m in sorted((m for m in mounts if m.startswith(prefix)), key=len, reverse=True):  # deepest first
        session = prefix + m[len(prefix) :].split("/", 1)[0]
        if any(r == session or r.startswith(session + "/") for r in roots):
            continue
        if subprocess.run(["umount", "-l", m], capture_output=True, check=False, timeout=30).returncode == 0:
            done.append(m)
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False, timeout=30)
    for ns in (line.split()[0] for line in netns.stdout.splitlines() if line.startswith("sco-")):
        creator = ns.rsplit("-", 1)[-1]
        if not creator.isdigit() or Path(f"/proc/{creator}").exists():
            continue
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False, timeout=30)
        if not pids.stdout.split():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False, timeout=30)
            done.append(f"netns {ns}")
    return done
