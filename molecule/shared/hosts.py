"""Test hosts of a molecule scenario: the network-namespace SSH hosts of tests/testhosts.py (a Debian rootfs per host,
sshd in a chroot, reached over real SSH through `ip netns exec NS socat`), under fixed names so each scenario's
inventory can be static and testinfra can read it: netns `scom-<scenario>-<host>`, files under
/var/tmp/sco-molecule/<scenario>/ (one run of a scenario per machine at a time: scripts/molecule.sh's lock).

    python molecule/shared/hosts.py create [--network] SCENARIO HOST[=ADDRESS]...
    python molecule/shared/hosts.py destroy SCENARIO
    python molecule/shared/hosts.py network SCENARIO HOST...   # prints the addresses --network would give
    python molecule/shared/hosts.py add SCENARIO HOST --image FROM [--address ADDRESS] [--overlay]
        # one more host while the scenario runs (an instance its control loop launched): a copy of host FROM's tree
        # (a baked image), on the scenario's private network when it has one; destroy removes it with the rest

With --network the hosts share a private /24 (tests.testhosts.TestNetwork: a bridge in netns `scomnet-<scenario>`,
eth0 in each host, the address given as HOST=ADDRESS (a static inventory's ansible_host) or else 10.231.<n>.<11 + i>
for the i-th host named, n from the scenario's name, every name in each host's /etc/hosts); without, a host has
only its loopback, as before.
    python molecule/shared/hosts.py wheelhouse     # prints the directory of wheels the roles install from
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.testhosts import TestHost, TestNetwork, network_prefix, remove_in_background  # noqa: E402

BASE = Path("/var/tmp/sco-molecule")


def scenario_dir(scenario: str) -> Path:
    return BASE / scenario


def test_host(scenario: str, name: str) -> TestHost:
    h = TestHost(scenario_dir(scenario) / "hosts", name)
    h.ns = f"scom-{scenario}-{name}"
    return h


def test_network(scenario: str) -> TestNetwork:
    return TestNetwork(f"scomnet-{scenario}", network_prefix(scenario))


def addresses(scenario: str, names: list[str]) -> dict[str, str]:
    """The address each host gets with --network (in the order named: what a static inventory writes down)."""
    net = test_network(scenario)
    return {n: net.address(i) for i, n in enumerate(names)}


def create(scenario: str, names: list[str], network: bool = False) -> None:
    """``names``: host names, or NAME=ADDRESS with --network (the address a static inventory gives the host; the
    others get theirs in the order named)."""
    given = dict(n.split("=", 1) if "=" in n else (n, "") for n in names)
    names = [n.split("=", 1)[0] for n in names]
    if len(set(names)) != len(names):
        raise SystemExit(f"hosts.py create {scenario}: a host named twice in {names}")
    if any(given.values()) and not network:
        raise SystemExit(f"hosts.py create {scenario}: NAME=ADDRESS needs --network")
    destroy(scenario)
    (scenario_dir(scenario) / "hosts").mkdir(parents=True, exist_ok=True)
    # written first: a run that dies half-way is still cleaned up by name (destroy also lists the namespaces)
    (scenario_dir(scenario) / "hosts.json").write_text(json.dumps(names))
    hosts = [test_host(scenario, name).create() for name in names]
    out: dict[str, object] = {"scenario": scenario, "hosts": names}
    if network:
        net = test_network(scenario).create()
        for h in hosts:
            net.join(h, given[h.name] or None)
        net.write_hosts(hosts)
        out["network"] = {"namespace": net.ns, "addresses": net.members}
        # what add needs to plug one more host in (the addresses taken, in the order joined)
        (scenario_dir(scenario) / "network.json").write_text(json.dumps(net.members))
    print(json.dumps(out))


@contextlib.contextmanager
def _listing(scenario: str) -> Iterator[None]:
    """The scenario's lists (hosts.json, network.json) to read and write alone: adds run at once (instances booting
    side by side) and each rewrites them."""
    with open(scenario_dir(scenario) / ".hosts.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def add(scenario: str, name: str, image: str, address: str | None = None, overlay: bool = False) -> dict[str, object]:
    """One more host of a running scenario, a copy of host ``image``'s tree (not its mounts; ``overlay``: an
    overlay over it, copy-on-write), joined to the scenario's private network if it has one (at ``address``, else
    the next free one). Returns its name, namespace, root and address. Several may run at once."""
    d = scenario_dir(scenario)
    with _listing(scenario):
        names: list[str] = json.loads((d / "hosts.json").read_text())
        if name in names:
            raise SystemExit(f"hosts.py add {scenario}: host {name} exists")
        src = test_host(scenario, image).root
        if image not in names or not src.is_dir():
            raise SystemExit(f"hosts.py add {scenario}: no host {image} to copy")
        # written first, as create does: a host that dies half-way is still destroyed by name
        (d / "hosts.json").write_text(json.dumps([*names, name]))
    h = test_host(scenario, name).create(image=src, overlay=overlay)
    out: dict[str, object] = {"host": name, "namespace": h.ns, "root": str(h.root)}
    members_file = d / "network.json"
    with _listing(scenario):
        if members_file.exists():
            net = test_network(scenario)
            net.members = json.loads(members_file.read_text())
            out["address"] = net.join(h, address)
            members_file.write_text(json.dumps(net.members))
            net.write_hosts([test_host(scenario, n) for n in net.members])
    return out


def remove(scenario: str, names: list[str]) -> None:
    """Hosts ``add`` made, destroyed and taken off the scenario's lists (the instances a run booted, deleted)."""
    d = scenario_dir(scenario)
    for name in names:
        test_host(scenario, name).destroy()
    with _listing(scenario):
        listed = json.loads((d / "hosts.json").read_text())
        (d / "hosts.json").write_text(json.dumps([n for n in listed if n not in names]))
        members_file = d / "network.json"
        if members_file.exists():
            members = json.loads(members_file.read_text())
            members_file.write_text(json.dumps({n: a for n, a in members.items() if n not in names}))


def destroy(scenario: str) -> None:
    d = scenario_dir(scenario)
    names: list[str] = []
    with contextlib.suppress(FileNotFoundError, ValueError):
        names = json.loads((d / "hosts.json").read_text())
    # also namespaces left by a run that died before it wrote hosts.json
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    prefix = f"scom-{scenario}-"
    names += [ns.removeprefix(prefix) for ns in listed if ns.startswith(prefix)]
    for name in sorted(set(names)):
        test_host(scenario, name).destroy()
    # the private network's bridge and veths, whether or not this run made one (a crashed run's too)
    test_network(scenario).destroy()
    remove_in_background(d)


def fleet_state_requirements() -> list[str]:
    """The state extra (psycopg): what the fleet_state role's PostgreSQL modules and `sco db migrate` need. The
    rest of the control extra (openstacksdk, kubernetes, ansible-runner, highspy: ~40 MB, ~60 wheels) is
    left out of the hosts' installs: no scenario runs the control loop itself on a test host."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return list(extras["state"])


def wheelhouse() -> Path:
    """The product, its run-time dependencies and the fleet state's driver as wheels, rebuilt only when the sources
    changed."""
    h = hashlib.sha256()
    # this file too: it says what goes in
    pinned = REPO / "agent" / "constraints.txt"  # what a node's wheelhouse holds
    for p in sorted([REPO / "pyproject.toml", pinned, Path(__file__).resolve(), *(REPO / "src").rglob("*")]):
        if p.is_file() and "__pycache__" not in p.parts and ".egg-info" not in str(p):
            h.update(str(p.relative_to(REPO)).encode() + b"\0" + p.read_bytes())
    BASE.mkdir(parents=True, exist_ok=True)
    out = BASE / f"wheelhouse-{h.hexdigest()[:16]}"
    if not out.is_dir():
        tmp = out.with_suffix(".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        # the extras too: scenario local's controller installs the product from here, and its modules (the contract
        # compiler, the planner) need them; the hosts' roles install the product without extras
        # at the venv's pins (sco_devkit.wheels; agent/constraints.txt's for the node's part): unpinned, pip
        # backtracks through the control extra's dependencies for minutes
        from sco_devkit import wheels

        # ansible-core: role control_loop installs it beside the control extra (its runs' ansible-playbook)
        wheels.build(tmp, f"{REPO}[contract,control]", "ansible-core", *fleet_state_requirements())
        # other checkouts on this machine (other branches) run scenarios with their own: only stale ones go
        for old in BASE.glob("wheelhouse-*"):
            if old not in (tmp, out) and old.is_dir() and time.time() - old.stat().st_mtime > 12 * 3600:
                shutil.rmtree(old, ignore_errors=True)
        tmp.rename(out)
    out.touch()
    # replaced in one step: scenarios running at once (scripts/molecule.sh MOLECULE_JOBS) all come here
    new = BASE / f".wheelhouse-{os.getpid()}"
    new.unlink(missing_ok=True)
    new.symlink_to(out)
    os.replace(new, BASE / "wheelhouse")
    # the directory of these sources, not the link another checkout may point elsewhere mid-run
    # (scripts/molecule.sh exports it as SCO_MOLECULE_WHEELHOUSE for the scenarios' inventories)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("create")
    c.add_argument("--network", action="store_true", help="the hosts share a private /24 (else loopback only)")
    c.add_argument("scenario")
    c.add_argument("hosts", nargs="+")
    a = sub.add_parser("network")
    a.add_argument("scenario")
    a.add_argument("hosts", nargs="+")
    n = sub.add_parser("add")
    n.add_argument("scenario")
    n.add_argument("host")
    n.add_argument("--image", required=True, help="the host whose tree the new one copies")
    n.add_argument("--address", help="its address on the private network (default: the next free one)")
    n.add_argument("--overlay", action="store_true", help="copy-on-write over the image's tree, not a copy of it")
    d = sub.add_parser("destroy")
    d.add_argument("scenario")
    sub.add_parser("wheelhouse")
    args = p.parse_args()
    if args.cmd == "create":
        create(args.scenario, args.hosts, network=args.network)
    elif args.cmd == "network":
        print(json.dumps(addresses(args.scenario, args.hosts)))
    elif args.cmd == "add":
        print(json.dumps(add(args.scenario, args.host, args.image, args.address, overlay=args.overlay)))
    elif args.cmd == "destroy":
        destroy(args.scenario)
    else:
        print(wheelhouse())


if __name__ == "__main__":
    main()
