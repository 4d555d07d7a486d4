"""Checks every hall scenario's verify shares: a converged host's units, the agent's config, trust revocation, the
relay's permissions (real nats-py clients, molecule/shared/natsprobe.py) and the distributor's bundle. Reached over
SSH (testinfra) and, for the clients, from inside a host's network namespace. Without systemd as PID 1 the units
cannot be started, so each check runs the unit's own command lines.

A scenario's tests/test_hall.py makes one `Scenario` and calls these with its host names."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import testinfra

BASE = Path("/var/tmp/sco-molecule")
SHARED = Path(__file__).resolve().parent
REPO = SHARED.parents[1]
SAMPLES = REPO / "src" / "sco" / "samples" / "local"
HARDENING = [
    "NoNewPrivileges=yes",
    "ProtectSystem=strict",
    "ProtectHome=yes",
    "PrivateTmp=yes",
    "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6",
    "SystemCallFilter=@system-service",
]
AGENT_LIMITS = ["MemoryMax=64M", "CPUQuota=20%", "ProtectControlGroups=yes"]


class Scenario:
    def __init__(self, name: str) -> None:
        self.name = name
        self.work = BASE / name
        self.inventory = REPO / "molecule" / name / "inventory" / "hosts.yml"

    def host(self, name: str) -> Any:
        return testinfra.get_host(f"ansible://{name}", ansible_inventory=str(self.inventory))

    def root(self, name: str) -> Path:
        """The host's root filesystem as the controller sees it."""
        return self.work / "hosts" / name

    def in_netns(self, host: str, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ip", "netns", "exec", f"scom-{self.name}-{host}", *argv], capture_output=True, text=True, timeout=timeout
        )


def unit_text(h: Any, unit: str) -> str:
    return str(h.file(f"/etc/systemd/system/{unit}").content_string)


def exec_line(h: Any, unit: str, key: str) -> str:
    """A unit's command line as systemd would run it (the first `key=` line, prefixes such as + dropped)."""
    line = next(ln for ln in unit_text(h, unit).splitlines() if ln.startswith(f"{key}="))
    return line.removeprefix(f"{key}=").lstrip("+-@:!")


# ansible-runner (the control loop's unit) runs ansible-playbook on a pseudo-terminal (pexpect): a host gets a devpts
# of its own, as a real one has (else 'out of pty devices'), mounted from inside its chroot; the hosts' destroy
# unmounts it (tests/testhosts.py)
GIVE_PTYS = "mountpoint -q /dev/pts || mount -t devpts -o newinstance,ptmxmode=0666,mode=620 devpts /dev/pts"


def unit_settings(run: Any, unit: str) -> dict[str, list[str]]:
    """A unit's settings with its drop-ins (an empty assignment resets a list, as systemd does); ``run`` runs a
    shell command on the host and returns its stdout."""
    text = run(
        f"cat /etc/systemd/system/{unit} 2>/dev/null || cat /lib/systemd/system/{unit}; "
        f"cat /etc/systemd/system/{unit}.d/*.conf 2>/dev/null; true"
    )
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" not in line or line.lstrip().startswith(("#", ";", "[")):
            continue
        k, v = line.split("=", 1)
        if v == "":
            out[k] = []
        else:
            out.setdefault(k, []).append(v)
    return out


class UnitAccount(NamedTuple):
    """Whom systemd runs a unit's commands as and what it says about that user in their environment."""

    name: str  # the user the harness runs the command as (root for a dynamic user: no dynamic users here)
    uid: int
    gid: int  # Group=, else the user's own group
    environment: dict[str, str | None]  # USER, LOGNAME, HOME, SHELL; None: unset


def _getent(run: Any, db: str, key: str) -> list[str]:
    out = run(f"getent {db} {shlex.quote(key)}; true").strip()
    return out.splitlines()[0].split(":") if out else []


def unit_account(run: Any, unit: str, u: dict[str, list[str]], user: str | None = None) -> UnitAccount:
    """The account of ``unit`` (settings ``u``; ``user``: another user and its own group instead of User= and
    Group=) and the environment systemd (252, the hosts' Debian's) gives it for that user, as systemd.exec(5)'s
    "$USER, $LOGNAME, $HOME, $SHELL" says: with User=, the user's name twice, its home directory and its login shell
    from its passwd entry; with DynamicUser=, only the dynamic user's name twice (User= or the unit's name); with
    neither, none of the four. ``run`` runs a shell command on the host and returns its stdout."""
    dynamic = (u.get("DynamicUser") or ["no"])[-1] in ("yes", "true", "on", "1")
    name = user or (u.get("User") or [""])[-1]
    if dynamic and not user:
        name = name or unit.removesuffix(".service").split("@")[0]
        return UnitAccount("root", 0, 0, {"USER": name, "LOGNAME": name, "HOME": None, "SHELL": None})
    if not name:
        return UnitAccount("root", 0, 0, dict.fromkeys(("USER", "LOGNAME", "HOME", "SHELL")))
    pw = _getent(run, "passwd", name)
    if len(pw) < 7:  # systemd would not start it: status=217/USER
        raise AssertionError(f"{unit}: User={name} has no passwd entry on the host (systemd: 217/USER)")
    gid = int(pw[3])
    group = "" if user else (u.get("Group") or [""])[-1]
    if group:
        gr = _getent(run, "group", group)
        if len(gr) < 3:  # status=216/GROUP
            raise AssertionError(f"{unit}: Group={group} has no group entry on the host (systemd: 216/GROUP)")
        gid = int(gr[2])
    env: dict[str, str | None] = {"USER": pw[0], "LOGNAME": pw[0], "HOME": pw[5], "SHELL": pw[6]}
    return UnitAccount(pw[0], int(pw[2]), gid, env)


def service_command(run: Any, unit: str, key: str = "ExecStart", user: str | None = None, index: int = -1) -> str:
    """The shell line that runs ``unit``'s ``key`` command (its ``index``-th) as systemd would: as its User and
    Group (``user``: another user, with its own group; DynamicUser: root, no dynamic users here), with the
    environment systemd hands it (USER, LOGNAME, HOME and SHELL for that user: unit_account; its EnvironmentFile
    and Environment), its RuntimeDirectory and StateDirectory made and given to its user, its LoadCredential files
    copied into $CREDENTIALS_DIRECTORY. ``run`` runs a shell command on the host and returns its stdout. The line
    holds the environment's values: where they are secrets, give it on stdin (``bash -s``), not as an argument."""
    u = unit_settings(run, unit)
    raw = u[key][index]
    prefix = raw[: len(raw) - len(raw.lstrip("+-@:!"))]
    # systemd's "$$" is a literal "$" (a shell would read the pid)
    cmd = raw.removeprefix(prefix).replace("$$", "$")
    acct = unit_account(run, unit, u, user)
    # what the SSH session set is not the unit's: systemd starts from its own environment
    pre = ["set -a"]
    pre += [f"unset {k}" if v is None else f"export {k}={shlex.quote(v)}" for k, v in acct.environment.items()]
    # systemd's order: its own variables, Environment=, then EnvironmentFile= (each overrides the one before)
    for e in u.get("Environment", []):
        k, v = e.split("=", 1)
        pre.append(f"export {k}={shlex.quote(v)}")
    for f in u.get("EnvironmentFile", []):
        # systemd's syntax (KEY=VALUE, the rest of the line the value, quotes around it removed), not a shell's:
        # a DSN's spaces would split it
        text = run(f"cat {f.lstrip('-')} 2>/dev/null; true")
        for line in text.splitlines():
            if "=" in line and not line.lstrip().startswith(("#", ";")):
                k, v = line.split("=", 1)
                v = v.strip()
                if len(v) >= 2 and v[0] == v[-1] and v[0] in "'\"":
                    v = v[1:-1]
                pre.append(f"export {k.strip()}={shlex.quote(v)}")
    # systemd makes them with their mode and gives them to the unit's user and group (everything below too, when
    # the directory's owner is another)
    owner = f"{acct.uid}:{acct.gid}"
    for setting, base, var in (("RuntimeDirectory", "/run", "RUNTIME_DIRECTORY"),
                               ("StateDirectory", "/var/lib", "STATE_DIRECTORY")):  # fmt: skip
        mode = (u.get(f"{setting}Mode") or ["0755"])[-1]
        for d in u.get(setting, []):
            path = shlex.quote(f"{base}/{d}")
            pre.append(
                f"mkdir -p {path}; chmod {mode} {path}; "
                f'[ "$(stat -c %u:%g {path})" = {owner} ] || chown -R {owner} {path}; export {var}={path}'
            )
    creds = u.get("LoadCredential", [])
    if creds:
        d = f"/run/credentials/{unit}"
        pre.append(f"rm -rf {d}; mkdir -p {d}")
        for c in creds:
            name, src = c.split(":", 1)
            pre.append(f"cp {src} {d}/{name}")
        # readable by the unit's user only, as systemd's
        pre.append(f"chown -R {owner} {d}; chmod -R go-rwx {d}; export CREDENTIALS_DIRECTORY={d}")
    pre.append("set +a")
    # "+": the command runs with full privileges (root), whatever User says; its environment is the user's still.
    # setpriv keeps the environment (set above, as systemd hands the unit its own); --init-groups: the user's groups
    as_user = ""
    if acct.uid != 0 and "+" not in prefix:
        as_user = f"setpriv --reuid={shlex.quote(acct.name)} --regid={acct.gid} --init-groups "
    return "; ".join(pre) + f"; exec {as_user}{cmd}"


def check_unit_enabled_and_hardened(h: Any, unit: str, extra: list[str], wanted_by: str = "multi-user.target") -> None:
    lines = unit_text(h, unit).splitlines()
    for line in HARDENING + extra:
        assert line in lines or any(ln.startswith(line) for ln in lines), (unit, line)
    link = h.file(f"/etc/systemd/system/{wanted_by}.wants/{unit}")
    assert link.is_symlink and link.linked_to == f"/etc/systemd/system/{unit}"
    assert h.run(f"systemctl is-enabled {unit}").stdout.strip() == "enabled"


def check_agent_unit(h: Any) -> None:
    check_unit_enabled_and_hardened(h, "sco-agent.service", AGENT_LIMITS)
    # its own user, no capability in the unit; the drop-in gives CAP_KILL back on a Slurm node only
    lines = unit_text(h, "sco-agent.service").splitlines()
    assert "CapabilityBoundingSet=" in lines and "AmbientCapabilities=" in lines
    dropin = h.file("/etc/systemd/system/sco-agent.service.d/10-ansible.conf").content_string
    assert "ExecStart=/opt/sco/bin/sco-agent run --config /etc/sco/agent.toml" in dropin
    cfg = tomllib.loads(h.file("/etc/sco/agent.toml").content_string)["agent"]
    slurm = cfg.get("scheduler") == "slurm"
    # Slurm decides by uid who may DRAIN: a Slurm node's agent runs as the cluster's SlurmUser (root without one)
    user = slurm_user(h, cfg.get("slurm_conf") or "/etc/slurm/slurm.conf") if slurm else "sco-agent"
    assert f"User={user}" in dropin.splitlines() and f"Group={user}" in dropin.splitlines(), dropin
    assert ("CapabilityBoundingSet=CAP_KILL" in dropin.splitlines()) == slurm
    if not slurm:
        assert h.user("sco-agent").shell == "/usr/sbin/nologin"
    state = h.file("/var/lib/sco")
    assert state.user == user and state.group == user and state.mode == 0o750


def slurm_user(h: Any, conf: str) -> str:
    """SlurmUser= of the node's slurm.conf (keys case-insensitive, the last wins), else Slurm's default, root."""
    found = [
        line.split("=", 1)[1].split()[0]
        for line in (raw.split("#", 1)[0].strip() for raw in h.file(conf).content_string.splitlines())
        if "=" in line and line.split("=", 1)[0].strip().lower() == "slurmuser" and line.split("=", 1)[1].split()
    ]
    return found[-1] if found else "root"


def operator_mode(sc: Scenario) -> bool:
    """Whether the hall's relay runs in operator mode: notice_relay made the hall's operator keys on the controller
    (role hall's sco_relay_auth_mode: operator when the hall has control hosts)."""
    return (sc.work / "credentials" / "nats" / "operator").is_dir()


def check_agent_config(sc: Scenario, h: Any, node: str, hall: str, scheduler: str, nats_url: str) -> None:
    """check-config passes, with the node's own relay identity: the one the relay's allow-lists were written for
    (static mode: its nkey seed; operator mode: its creds file, the user JWT notice_relay minted and its seed)."""
    out = h.run("/opt/sco/bin/sco-agent check-config --config /etc/sco/agent.toml")
    assert out.rc == 0, out.stderr
    assert f"node {node}, hall {hall}, {scheduler}" in out.stdout
    cfg = h.file("/etc/sco/agent.toml")
    assert cfg.mode == 0o640
    name = "nats.creds" if operator_mode(sc) else "nats.nk"
    setting = "nats_creds_file" if operator_mode(sc) else "nats_nkey_seed_file"
    for line in (f'nats_url = "{nats_url}"', f'{setting} = "/etc/sco/{name}"'):
        assert line in cfg.content_string.splitlines(), line
    assert "password" not in cfg.content_string
    # the node's own identity, the agent user's alone (0600): the one the relay knows the public key of
    seed = h.file(f"/etc/sco/{name}")
    user = h.file("/var/lib/sco").user  # the agent's user (sco-agent; a Slurm node's: its SlurmUser), check_agent_unit
    assert seed.mode == 0o600 and seed.user == user and seed.group == user, (seed.mode, seed.user, seed.group)
    assert cfg.user == "root" and cfg.group == user
    mine = sc.work / "credentials" / "nats" / f"node-{node}.{name.split('.')[1]}"
    assert seed.content_string.strip() == mine.read_text().strip()
    if operator_mode(sc):  # a bare seed beside the creds would be one more secret on the node, and refused anyway
        assert not h.file("/etc/sco/nats.nk").exists
    pkgs = h.run("/opt/sco/bin/python -m pip list --format=freeze").stdout
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert f"spot-capacity-orchestrator=={version}" in pkgs


def check_removed_key_refused(sc: Scenario, h: Any, node: str) -> None:
    """prepare (shared/retired_key.yml) left retired.pub trusted, as a previous run would have; site.yml's list has
    only hall.pub, so converge took it out and a bundle it signed no longer verifies."""
    assert h.run("ls /etc/sco/trusted").stdout.split() == ["hall.pub"]
    for name, key in (("by-retired", sc.work / "retired" / "retired.key"), ("by-hall", sc.work / "keys" / "hall.key")):
        subprocess.run(
            [sys.executable, "-m", "sco.cli", "contract", "compile", str(SAMPLES), "-o",
             str(sc.root(node) / "root" / f"{name}.json"), "--signing-key", str(key), "--issued-at", "1"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
    refused = h.run("/opt/sco/bin/sco contract verify /root/by-retired.json --trust-dir /etc/sco/trusted")
    assert refused.rc == 3, refused.stderr
    accepted = h.run("/opt/sco/bin/sco contract verify /root/by-hall.json --trust-dir /etc/sco/trusted")
    assert accepted.rc == 0, accepted.stderr


def check_relay_unit_and_config(h: Any, operator: bool = False) -> None:
    check_unit_enabled_and_hardened(h, "sco-nats.service", ["User=sco-nats", "CapabilityBoundingSet="])
    checked = h.run("/usr/local/bin/nats-server -t -c /etc/sco-nats/nats-server.conf")
    assert checked.rc == 0, checked.stderr
    conf = h.file("/etc/sco-nats/nats-server.conf")
    assert conf.mode == 0o640 and conf.group == "sco-nats"
    if operator:
        # operator mode: the hall's operator trusted, a full resolver, public keys and signed JWTs; the stream
        # tool's creds the only seed on the host (and, in a cluster, the catch-up's)
        assert h.file("/etc/sco-nats/admin.creds").mode == 0o600 and not h.file("/etc/sco-nats/admin.nk").exists
        text = conf.content_string
        assert "\noperator: eyJ" in text and "resolver {\n  type: full" in text, text[:2000]
        assert not re.search(r"\bS[OAU][A-Z2-7]{50,}", text), "a seed in the relay's configuration"
        start = text.find("\ncluster {")
        rest = text if start < 0 else text[:start] + text[text.index("\n}\n", start) + 3 :]
        assert "password" not in rest
        return
    assert h.file("/etc/sco-nats/admin.nk").mode == 0o600
    # no user's secret in the relay's config: nkey users, public keys only. A cluster's routes log in with the
    # hall's route password: in the cluster block alone (the reason the file is 0640)
    text = conf.content_string
    start = text.find("\ncluster {")
    rest = text if start < 0 else text[:start] + text[text.index("\n}\n", start) + 3 :]
    users = "\n".join(ln for ln in rest.splitlines() if not ln.lstrip().startswith("#"))  # not the comments
    assert "password" not in users and 'nkey: "U' in users


@contextmanager
def relay_running(h: Any) -> Iterator[str]:
    """nats-server started as the unit would (its user, its config); yields the unit's ExecStartPost (the event
    stream's creation)."""
    # The test hosts share the machine's process table (a network namespace and a chroot, not a container):
    # pkill -x nats-server would kill every nats-server on the machine. Stop only the process group started here.
    started = h.run(
        "setsid runuser -u sco-nats -- /usr/local/bin/nats-server -c /etc/sco-nats/nats-server.conf "
        "> /var/log/sco-nats.log 2>&1 < /dev/null & echo $! > /run/sco-verify-nats.pgid"
    )
    assert started.rc == 0, started.stderr
    try:
        yield exec_line(h, "sco-nats.service", "ExecStartPost")
    finally:
        h.run("kill -TERM -- -$(cat /run/sco-verify-nats.pgid) 2>/dev/null; rm -f /run/sco-verify-nats.pgid")


def check_stream_created_once(h: Any, post: str) -> None:
    first = h.run(post)
    assert first.rc == 0, first.stderr + h.run("cat /var/log/sco-nats.log").stdout
    assert [json.loads(x) for x in first.stdout.splitlines()] == [
        {"stream": "SCO_EVENTS", "action": "created"},
        {"stream": "SCO_HEARTBEATS", "action": "created"},
    ]
    again = h.run(post)
    assert [json.loads(x)["action"] for x in again.stdout.splitlines()] == ["unchanged", "unchanged"]


def relay_ca(sc: Scenario) -> Path | None:
    """The hall's CA the relays' certificates chain to, where the relay serves TLS (role notice_relay signed its
    certificates under the controller's tls/relay; sco_relay_tls false: none, plaintext)."""
    ca = sc.work / "tls" / "ca.crt"
    return ca if (sc.work / "tls" / "relay").is_dir() and ca.exists() else None


def check_node_credentials_reach_only_their_own_subjects(
    sc: Scenario, relay: str, hall: str, node: str, other: str
) -> None:
    """Real clients as the node, the reclaimer and the control loop's reader, inside the relay host's namespace, on
    the files notice_relay made on the controller (creds files in operator mode, nkey seeds in static mode)."""
    probe = sc.in_netns(
        relay, sys.executable, str(SHARED / "natsprobe.py"), "--credentials", str(sc.work / "credentials" / "nats"),
        "--hall", hall, "--node", node, "--other", other, *(["--creds"] if operator_mode(sc) else []),
        *(["--ca-file", str(ca)] if (ca := relay_ca(sc)) else []),
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr
    r = json.loads(probe.stdout)

    def refused(bucket: str, what: str, subject: str) -> bool:
        # nats-py lowercases the server's -ERR text
        return any(f'permissions violation for {what} to "{subject}"'.lower() in e.lower() for e in r[bucket])

    assert r["node_subscribes_own_notices"] == [], r
    assert refused("node_subscribes_other_notices", "subscription", f"sco.notice.{hall}.{other}"), r
    assert refused("node_subscribes_all_notices", "subscription", f"sco.notice.{hall}.>"), r
    assert refused("node_publishes_notice", "publish", f"sco.notice.{hall}.{other}"), r
    assert refused("node_subscribes_all_inboxes", "subscription", "_INBOX.>"), r
    # the reclaimer's notice is the one the node receives; the node's forged one and the reader's were refused
    assert r["reclaimer_publishes_notice"] == [] and r["node_received"] == '{"id": "probe"}', r
    assert refused("reader_publishes_notice", "publish", f"sco.notice.{hall}.{node}"), r
    assert r["node_publishes_own_event"]["stream"] == "SCO_EVENTS", r
    assert refused("node_publishes_other_event", "publish", f"sco.events.{hall}.{other}"), r


_FETCH = """
import socket, ssl, sys, time, urllib.request, urllib.error
url, ca = sys.argv[1], sys.argv[2]
ctx = ssl.create_default_context(cafile=ca)
for i in range(50):
    try:
        r = urllib.request.urlopen(url, timeout=2, context=ctx); break
    except OSError:
        time.sleep(0.2)
etag = r.headers['ETag']; body = r.read()
try:
    urllib.request.urlopen(urllib.request.Request(url, headers={'If-None-Match': etag}), timeout=2, context=ctx)
    print('no-304')
except urllib.error.HTTPError as e:
    print(r.status, len(body), e.code)
# plaintext to the TLS port: no HTTP answer (the connection closed at the failed handshake)
host, port = url.split('/')[2].rsplit(':', 1)
with socket.create_connection((host, int(port)), timeout=5) as s:
    s.sendall(b'GET ' + url.split(port, 1)[1].encode() + b' HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n')
    got = b''
    try:
        while chunk := s.recv(65536):
            got += chunk
    except OSError:
        pass
print('plaintext-answered' if b'HTTP/' in got else 'plaintext-refused')
"""


def check_distributor_serves_the_signed_bundle(sc: Scenario, host: str, hall: str) -> None:
    """The published bundle verifies against the distributor's trust, and the unit's server answers over TLS only
    (its certificate checked against the hall's CA the role put beside it) 200 with it, then 304 on its ETag, and
    a plaintext request gets no answer (fetched from inside the host's namespace)."""
    h = sc.host(host)
    check_unit_enabled_and_hardened(h, "sco-distributor.service", ["DynamicUser=yes"])
    verify = h.run(
        f"/opt/sco/bin/sco contract verify /var/lib/sco-distributor/{hall}/bundle.json --trust-dir "
        "/etc/sco/distributor-trusted"
    )
    assert verify.rc == 0, verify.stderr
    serve = exec_line(h, "sco-distributor.service", "ExecStart")
    assert "--listen 0.0.0.0:8470" in serve and "--tls-cert /etc/sco/distributor-tls/distributor.crt" in serve
    assert h.file("/etc/sco/distributor-tls/distributor.key").mode == 0o640
    h.run(f"setsid {serve} > /var/log/sco-distributor.log 2>&1 < /dev/null & echo $! > /run/sco-verify-dist.pgid")
    try:
        ca = str(sc.root(host) / "etc/sco/distributor-tls/ca.crt")
        url = f"https://127.0.0.1:8470/v1/halls/{hall}/bundle.json"
        out = sc.in_netns(host, sys.executable, "-c", _FETCH, url, ca)
        published = (sc.root(host) / f"var/lib/sco-distributor/{hall}/bundle.json").read_bytes()
        assert out.stdout.split() == ["200", str(len(published)), "304", "plaintext-refused"], out.stdout + out.stderr
    finally:
        h.run("kill -TERM -- -$(cat /run/sco-verify-dist.pgid) 2>/dev/null; rm -f /run/sco-verify-dist.pgid")
