"""Who may register on the checkpoint socket, and as what.

A registration is bound to the caller's pod: the agent reads the process's cgroup (real cgroups, named as kubelet
names a pod's; the pods are the Kubernetes API stand-in's) and the pod's contract from the bundle, and refuses a
registration naming any other contract, counted in sco_agent_checkpoint_refusals_total. The socket is 0660 with the
workloads' group: a uid outside it cannot connect (a real process as nobody). One uid holds at most
checkpoint_max_per_uid registrations. The Slurm half (a job of another contract) is in test_checkpoint_slurm.py.
"""

from __future__ import annotations

import asyncio
import errno
import grp
import json
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sco.agent.checkpoint import CheckpointServer
from sco_devkit.standins.kube_apiserver import KubeApiStandIn
from tests.harness import AgentEnv, NatsServer, PodCgroups, add_pod, wait_for

ROOT = Path(__file__).resolve().parents[1]
CLIENT = str(ROOT / "tests" / "checkpoint_register.py")


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    # Unix socket paths are limited to 107 bytes; other users must reach the socket's directory (as /run/sco)
    with tempfile.TemporaryDirectory(prefix="sco-ck-") as d:
        os.chmod(d, 0o755)
        yield Path(d)


def _register(argv_prefix: list[str], sock: Path, name: str, contract: str = "", hold: float = 0) -> dict[str, Any]:
    # the client as another user reads it from the socket's directory (0755): the checkout may be where only root
    # goes (CI clones into a 0700 mktemp directory)
    client = sock.parent / "checkpoint_register.py"
    if not client.exists():
        shutil.copyfile(CLIENT, client)
        client.chmod(0o644)
    argv = [*argv_prefix, "/usr/bin/python3", "-S", str(client), str(sock), name, contract, str(hold)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout.splitlines()[0]))


def _metric(url: str, line_start: str) -> float:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(line_start + " "):
                return float(line.split()[-1])
    raise AssertionError(f"{line_start} not in {url}")


def test_registration_is_bound_to_the_callers_pod(
    tmp_path: Path, sock_dir: Path, kube: KubeApiStandIn, nats_server: NatsServer, pod_cgroups: PodCgroups
) -> None:
    """A process in pod batch/batch-0's cgroup naming the web contract is refused with one clear line (before: it
    registered under web and held web's budget); without a contract it is under its own pod's (batch, 12 s); a
    process in web-0's cgroup registers as web; one in no pod's cgroup is refused. Both refusals are counted."""
    sock = sock_dir / "agent.sock"
    env = AgentEnv(
        tmp_path / "agent", kube, nats_server, checkpoint_socket=str(sock), kube_cgroup_root=pod_cgroups.root
    )
    web = add_pod(kube, "web", "web-0", env.node)
    batch = add_pod(kube, "batch", "batch-0", env.node)
    elsewhere = add_pod(kube, "web", "web-9", "node-2")  # a pod of another node: not this node's workload
    try:
        env.start().wait_subscribed()
        own = _register(pod_cgroups.argv(web, []), sock, "web-0", "web")
        assert own["op"] == "registered" and own["contract"] == "web" and own["budget_s"] == 6.0

        forged = _register(pod_cgroups.argv(batch, []), sock, "batch-0", "web")
        assert forged["op"] == "error"
        assert forged["error"] == (
            "register: refused: contract 'web' is not this process's: pod batch/batch-0 is under contract 'batch'"
        )
        unnamed = _register(pod_cgroups.argv(batch, []), sock, "batch-0")
        assert unnamed["op"] == "registered" and unnamed["contract"] == "batch" and unnamed["budget_s"] == 12.0

        stranger = _register(pod_cgroups.argv(None, []), sock, "stranger", "web")
        assert stranger["op"] == "error" and "is in no pod's cgroup" in stranger["error"], stranger
        other_node = _register(pod_cgroups.argv(elsewhere, []), sock, "web-9", "web")
        assert other_node["op"] == "error" and "no such pod is bound to node node-1" in other_node["error"]

        refused = "sco_agent_checkpoint_refusals_total"
        assert _metric(env.metrics_url, f'{refused}{{reason="wrong_contract"}}') == 1
        assert _metric(env.metrics_url, f'{refused}{{reason="not_a_workload"}}') == 2
        registered = env.of("checkpoint.registered")
        assert [(r["workload"], r["contract"]) for r in registered] == [("web-0", "web"), ("batch-0", "batch")]
    finally:
        env.stop()


def _some_group_without(user: str) -> grp.struct_group:
    """A group of this machine that ``user`` is not in (the socket's group in the test)."""
    import pwd

    pw = pwd.getpwnam(user)
    for g in grp.getgrall():
        if g.gr_gid not in (0, pw.pw_gid) and user not in g.gr_mem:
            return g
    raise AssertionError("no group without " + user)


def test_a_uid_outside_the_sockets_group_cannot_connect(sock_dir: Path) -> None:
    """The socket is 0660 with the workloads' group (before: 0666): a process as nobody, not in the group, gets
    EACCES from the kernel; the same uid with the group as a supplementary group registers."""
    g = _some_group_without("nobody")
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    member = ["setpriv", "--reuid=65534", "--regid=65534", f"--groups={g.gr_gid}"]

    async def main() -> tuple[dict[str, Any], dict[str, Any], int]:
        path = sock_dir / "ck.sock"
        srv = CheckpointServer(path, budget_for={"web": 6.0}.get, group=g.gr_name)
        await srv.start()
        try:
            mode = path.stat().st_mode & 0o777
            assert path.stat().st_gid == g.gr_gid
            outside = await asyncio.to_thread(_register, nobody, path, "intruder", "web")
            inside = await asyncio.to_thread(_register, member, path, "trainer", "web")
        finally:
            await srv.close()
        return outside, inside, mode

    outside, inside, mode = asyncio.run(main())
    assert mode == 0o660
    assert outside == {"op": "connect_failed", "errno": errno.EACCES, "error": "Permission denied"}
    assert inside["op"] == "registered"


def test_one_uid_cannot_fill_the_slots(sock_dir: Path) -> None:
    """checkpoint_max_per_uid: this uid's third registration is refused (its connection closed), another uid
    still registers, and a slot given back (a client gone) is free again."""

    async def main() -> None:
        path = sock_dir / "ck.sock"
        refusals: list[str] = []
        srv = CheckpointServer(
            path, budget_for={"web": 6.0}.get, max_per_uid=2, on_refused=refusals.append, group="nogroup"
        )
        await srv.start()

        def raw(name: str) -> tuple[socket.socket, dict[str, Any]]:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(10)
            s.connect(str(path))
            s.sendall(json.dumps({"op": "register", "workload": name, "contract": "web"}).encode() + b"\n")
            return s, json.loads(s.makefile("rb").readline())

        try:
            a, ra = await asyncio.to_thread(raw, "a")
            b, rb = await asyncio.to_thread(raw, "b")
            c, rc = await asyncio.to_thread(raw, "c")
            assert ra["op"] == rb["op"] == "registered"
            assert rc == {
                "v": 1,
                "op": "error",
                "error": f"register: uid {os.getuid()} already holds 2 registrations on this node",
            }
            assert await asyncio.to_thread(c.recv, 1) == b""  # closed: the refused one holds nothing
            other = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]  # nogroup: its primary group
            theirs = await asyncio.to_thread(_register, other, path, "theirs", "web", 1.0)
            assert theirs["op"] == "registered"
            a.close()
            await asyncio.to_thread(wait_for, lambda: len(srv.workloads) <= 2, 5, "the slot given back")
            d, rd = await asyncio.to_thread(raw, "d")
            assert rd["op"] == "registered"
            assert refusals == ["uid_cap"] and srv.refusals["uid_cap"] == 1
            for s in (b, c, d):
                s.close()
        finally:
            await srv.close()

    asyncio.run(main())


def test_an_idle_connection_that_never_registers_is_closed(sock_dir: Path) -> None:
    async def main() -> None:
        path = sock_dir / "ck.sock"
        srv = CheckpointServer(path, budget_for={}.get, register_within=0.5)
        await srv.start()

        def idle() -> bytes:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            s.connect(str(path))
            with s:
                return s.makefile("rb").read()

        try:
            got = await asyncio.to_thread(idle)
        finally:
            await srv.close()
        assert json.loads(got)["error"] == "no registration within 0.5 s; closing"

    asyncio.run(main())


def test_a_pod_seen_before_the_api_went_silent_still_registers(tmp_path: Path, kube: KubeApiStandIn) -> None:
    """Around a silent API (the fallback path's drain), a pod the API had bound to this node at its last answer is
    still bound to its contract; a pod never seen is "unverified" (retry), not taken on its word."""
    from sco.agent.bundle_cache import BundleCache
    from sco.agent.checkpoint import OwnerUnknown
    from sco.agent.owner import KubeOwners
    from sco.contract.signing import Keyring, generate, write_keypair
    from sco.schedulers.kube import KubeClient
    from tests.harness import hall_bundle

    key = generate()
    (tmp_path / "trusted").mkdir()
    (tmp_path / "bundle").mkdir()
    write_keypair(key, tmp_path / "signing.key", tmp_path / "trusted" / "signing.pub")
    (tmp_path / "bundle" / "bundle.json").write_bytes(hall_bundle(tmp_path, key))
    cache = BundleCache(tmp_path / "bundle", Keyring.from_dir(tmp_path / "trusted"), lambda: 0.0)
    kube.cluster.add_node("node-1")
    seen = add_pod(kube, "batch", "batch-0", "node-1")
    later = add_pod(kube, "web", "web-1", "node-1")
    proc = tmp_path / "proc"
    for pid, pod in ((10, seen), (11, later)):
        (proc / str(pid)).mkdir(parents=True)
        uid = pod["metadata"]["uid"]
        (proc / str(pid) / "cgroup").write_text(f"0::/kubepods/besteffort/pod{uid}/c0\n")

    async def main() -> None:
        client = KubeClient(kube.url)
        owners = KubeOwners(client, "node-1", lambda: cache.bundle, timeout=0.5, proc=proc)
        try:
            assert (await owners(10, 0)).contract == "batch"
            owners._known.pop(later["metadata"]["uid"])  # web-1 was bound after the last list that answered
            kube.go_silent(30)
            owner = await owners(10, 0)
            assert (owner.kind, owner.name, owner.contract) == ("pod", "batch/batch-0", "batch")
            with pytest.raises(OwnerUnknown, match="the pods of node node-1 could not be listed"):
                await owners(11, 0)
        finally:
            kube.latency_s, kube.silent = 0, False
            await client.close()

    asyncio.run(main())


def test_a_pod_cannot_fill_the_slots_with_many_uids(
    tmp_path: Path, sock_dir: Path, kube: KubeApiStandIn, pod_cgroups: PodCgroups
) -> None:
    """The cap holds per pod too: a root container can take any uid, so a second uid of the same pod is refused
    once the pod holds checkpoint_max_per_uid (1 here); another pod's process still registers."""
    from sco.agent.bundle_cache import BundleCache
    from sco.agent.owner import KubeOwners
    from sco.contract.signing import Keyring, generate, write_keypair
    from sco.schedulers.kube import KubeClient
    from tests.harness import hall_bundle

    key = generate()
    (tmp_path / "trusted").mkdir()
    (tmp_path / "bundle").mkdir()
    write_keypair(key, tmp_path / "signing.key", tmp_path / "trusted" / "signing.pub")
    (tmp_path / "bundle" / "bundle.json").write_bytes(hall_bundle(tmp_path, key))
    cache = BundleCache(tmp_path / "bundle", Keyring.from_dir(tmp_path / "trusted"), lambda: 0.0)
    kube.cluster.add_node("node-1")
    greedy = add_pod(kube, "batch", "batch-0", "node-1")
    other = add_pod(kube, "batch", "batch-1", "node-1")
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]

    async def main() -> list[dict[str, Any]]:
        client = KubeClient(kube.url)
        owners = KubeOwners(client, "node-1", lambda: cache.bundle, timeout=2.0, cgroup_root=pod_cgroups.root)
        path = sock_dir / "ck.sock"
        srv = CheckpointServer(path, budget_for={"batch": 12.0}.get, owner_of=owners, max_per_uid=1, group="nogroup")
        await srv.start()
        try:
            first = asyncio.to_thread(_register, pod_cgroups.argv(greedy, []), path, "a", "batch", 3)
            task = asyncio.ensure_future(first)  # holds its registration 3 s
            await asyncio.to_thread(wait_for, lambda: len(srv.workloads) == 1, 10, "the first registration")
            second = await asyncio.to_thread(_register, pod_cgroups.argv(greedy, as_nobody), path, "b", "batch")
            third = await asyncio.to_thread(_register, pod_cgroups.argv(other, as_nobody), path, "c", "batch")
            return [await task, second, third]
        finally:
            await srv.close()
            await client.close()

    first, second, third = asyncio.run(main())
    assert first["op"] == "registered"
    assert second == {
        "v": 1,
        "op": "error",
        "error": "register: pod batch/batch-0 already holds 1 registrations on this node",
    }
    assert third["op"] == "registered"
