"""A real one-node Ceph cluster with an RGW (S3) on loopback: one ceph-mon, one ceph-osd (bluestore on a sparse
file, so data survives a restart), one radosgw; cephx on, no mgr (RGW does not need one).

Settings and traps from ``shared/recipes/ceph-rgw-and-dcp.md`` (measured): first S3 PUT ~20 s after an empty
directory, restart ~5 s. Every port is picked free at construction (mon v1/v2, the RGW, a 100-port OSD range), so
several clusters (tests, a benchmark) can run beside each other and beside a default-port Ceph. The daemons run in
the foreground (``-f``) as children of this object, stopped by PID (never by name).

What a production hall points at instead: its real Ceph cluster's RGW endpoint and an admin user with
``users=*; buckets=*`` caps (role ``checkpoint_store``); nothing here is used by the product.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

from sco_devkit.ports import free_port

ADMIN_UID = "sco-store-admin"


def _port_range_free(lo: int, hi: int) -> bool:
    for p in range(lo, hi + 1):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                return False
    return True


class CephError(RuntimeError):
    pass


class CephCluster:
    def __init__(self, root: Path, *, block_bytes: int = 4 << 30) -> None:
        self.root = Path(root)
        self.conf = self.root / "ceph.conf"
        self.block_bytes = block_bytes
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.access_key = "SCOADMIN" + uuid.uuid4().hex[:12].upper()
        self.secret_key = uuid.uuid4().hex + uuid.uuid4().hex[:8]
        state = self.root / "ports.json"
        if state.exists():  # a restart keeps its ports: the monmap names them
            ports = json.loads(state.read_text())
            self.mon_v2, self.mon_v1, self.rgw_port, self.osd_lo = (
                ports["mon_v2"],
                ports["mon_v1"],
                ports["rgw"],
                ports["osd_lo"],
            )
            self.access_key, self.secret_key = ports["access_key"], ports["secret_key"]
        else:
            self.mon_v2, self.mon_v1, self.rgw_port = free_port(), free_port(), free_port()
            self.osd_lo = self._osd_range()
        self.fsid = ""

    @staticmethod
    def _osd_range() -> int:
        for _ in range(50):
            lo = random.randrange(20000, 60000, 100)
            if _port_range_free(lo, lo + 99):
                return lo
        raise CephError("no free 100-port range for the OSD")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.rgw_port}"

    def env(self) -> dict[str, str]:
        return {**os.environ, "CEPH_CONF": str(self.conf)}

    def run(self, *argv: str, timeout: float = 60, check: bool = True) -> str:
        p = subprocess.run(list(argv), env=self.env(), capture_output=True, text=True, timeout=timeout)
        if check and p.returncode != 0:
            raise CephError(f"{' '.join(argv)}: exit {p.returncode}: {p.stderr.strip()[-2000:] or p.stdout.strip()}")
        return p.stdout

    # --- configuration -----------------------------------------------------------------------------

    def _write_conf(self) -> None:
        d = self.root
        self.conf.write_text(
            f"""# written by sco_devkit.devcluster.ceph
[global]
fsid = {self.fsid}
mon host = [v2:127.0.0.1:{self.mon_v2},v1:127.0.0.1:{self.mon_v1}]
public network = 127.0.0.0/8
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
auth allow insecure global id reclaim = false
osd pool default size = 1
osd pool default min size = 1
mon allow pool size one = true
osd pool default pg num = 8
osd pool default pgp num = 8
osd crush chooseleaf type = 0
ms bind port min = {self.osd_lo}
ms bind port max = {self.osd_lo + 99}
mon data avail warn = 1
mon data avail crit = 1
run dir = {d}/run
pid file = {d}/run/$cluster-$name.pid
admin socket = {d}/run/$cluster-$name.asok
log file = {d}/log/$cluster-$name.log
keyring = {d}/$cluster.$name.keyring
mon data = {d}/mon/$cluster-$id
osd data = {d}/osd/$cluster-$id
[osd]
osd objectstore = bluestore
bluestore block create = true
bluestore block size = {self.block_bytes}
osd memory target = 1073741824
public addr = 127.0.0.1
cluster addr = 127.0.0.1
[client.rgw.a]
rgw frontends = beast endpoint=127.0.0.1:{self.rgw_port}
rgw data = {d}/rgw
"""
        )

    # --- life cycle --------------------------------------------------------------------------------

    def start(self, timeout: float = 120) -> CephCluster:
        """Bootstrap (an empty root) or restart (an existing one), and wait until the RGW answers S3."""
        if (self.root / "ports.json").exists():
            self.fsid = self.conf.read_text().split("fsid = ", 1)[1].split()[0]
            self._daemon("mon.a", ["ceph-mon", "-f", "-i", "a"])
            self._daemon("osd.0", ["ceph-osd", "-f", "-i", "0"])
            self._wait_osd_up(timeout)
            self._daemon("rgw.a", ["radosgw", "-f", "-n", "client.rgw.a"])
            self._wait_rgw(timeout)
            return self
        self.fsid = str(uuid.uuid4())
        for sub in ("run", "log", "mon", "osd", "rgw"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._write_conf()
        d = self.root
        self.run("ceph-authtool", "--create-keyring", f"{d}/ceph.mon.keyring", "--gen-key", "-n", "mon.",
                 "--cap", "mon", "allow *")  # fmt: skip
        self.run("ceph-authtool", "--create-keyring", f"{d}/ceph.client.admin.keyring", "--gen-key", "-n",
                 "client.admin", "--cap", "mon", "allow *", "--cap", "osd", "allow *", "--cap", "mds", "allow *",
                 "--cap", "mgr", "allow *")  # fmt: skip
        self.run("ceph-authtool", f"{d}/ceph.mon.keyring", "--import-keyring", f"{d}/ceph.client.admin.keyring")
        self.run("monmaptool", "--create", "--addv", "a", f"[v2:127.0.0.1:{self.mon_v2},v1:127.0.0.1:{self.mon_v1}]",
                 "--fsid", self.fsid, f"{d}/monmap")  # fmt: skip
        self.run("ceph-mon", "--mkfs", "-i", "a", "--monmap", f"{d}/monmap", "--keyring", f"{d}/ceph.mon.keyring")
        self._daemon("mon.a", ["ceph-mon", "-f", "-i", "a"])
        osd_uuid = str(uuid.uuid4())
        # the mon answers slowly on a loaded machine (30 s timed out at load 14)
        osd_id = self.run("ceph", "osd", "new", osd_uuid, timeout=120).strip()
        if osd_id != "0":
            raise CephError(f"ceph osd new: expected id 0 in a new cluster, got {osd_id!r}")
        (d / "osd" / "ceph-0").mkdir(parents=True, exist_ok=True)
        self.run("ceph-authtool", "--create-keyring", f"{d}/ceph.osd.0.keyring", "--gen-key", "-n", "osd.0")
        self.run("ceph", "auth", "add", "osd.0", "osd", "allow *", "mon", "allow profile osd", "mgr",
                 "allow profile osd", "-i", f"{d}/ceph.osd.0.keyring")  # fmt: skip
        self.run("ceph-osd", "-i", "0", "--mkfs", "--osd-uuid", osd_uuid, timeout=120)
        self._daemon("osd.0", ["ceph-osd", "-f", "-i", "0"])
        self._wait_osd_up(timeout)
        self.run("ceph", "auth", "get-or-create", "client.rgw.a", "mon", "allow rw", "osd", "allow rwx", "mgr",
                 "allow rw", "-o", f"{d}/ceph.client.rgw.a.keyring")  # fmt: skip
        self._daemon("rgw.a", ["radosgw", "-f", "-n", "client.rgw.a"])
        self._wait_rgw(timeout)
        self.run("radosgw-admin", "user", "create", f"--uid={ADMIN_UID}", "--display-name=sco checkpoint store admin",
                 f"--access-key={self.access_key}", f"--secret-key={self.secret_key}",
                 "--caps=users=*;buckets=*;metadata=*;usage=read", timeout=60)  # fmt: skip
        (d / "ports.json").write_text(
            json.dumps(
                {
                    "mon_v2": self.mon_v2,
                    "mon_v1": self.mon_v1,
                    "rgw": self.rgw_port,
                    "osd_lo": self.osd_lo,
                    "access_key": self.access_key,
                    "secret_key": self.secret_key,
                }
            )
        )
        return self

    def _daemon(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.stderr", "ab")  # noqa: SIM115 (the child holds it)
        self.procs[name] = subprocess.Popen(
            argv, env=self.env(), stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True
        )
        log.close()

    def _alive(self, name: str) -> None:
        p = self.procs.get(name)
        if p is not None and p.poll() is not None:
            tail = (self.root / "log" / f"{name}.stderr").read_text(errors="replace")[-1500:]
            raise CephError(f"{name} exited ({p.returncode}): {tail}")

    def _wait_osd_up(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self._alive("mon.a")
            self._alive("osd.0")
            with contextlib.suppress(CephError, subprocess.TimeoutExpired, ValueError):
                st = json.loads(self.run("ceph", "osd", "stat", "-f", "json", timeout=10))
                if st.get("num_up_osds") == 1:
                    return
            time.sleep(0.5)
        raise CephError(f"the OSD was not up after {timeout} s")

    def _wait_rgw(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self._alive("rgw.a")
            try:
                with urllib.request.urlopen(self.endpoint + "/", timeout=2):
                    return
            except urllib.error.HTTPError:
                return  # an S3 error document is an answer
            except OSError:
                time.sleep(0.3)
        raise CephError(f"the RGW did not answer on {self.endpoint} after {timeout} s")

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM by PID in the order rgw, osd, mon; SIGKILL whatever is left after ``timeout``."""
        for name in ("rgw.a", "osd.0", "mon.a"):
            p = self.procs.pop(name, None)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)

    def s3(self, access_key: str | None = None, secret_key: str | None = None, read_timeout: float = 60):  # type: ignore[no-untyped-def]
        """A boto3 S3 client for the RGW (the admin's keys unless given)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=access_key or self.access_key,
            aws_secret_access_key=secret_key or self.secret_key,
            config=Config(
                connect_timeout=5, read_timeout=read_timeout, retries={"max_attempts": 3, "mode": "standard"}
            ),
        )
