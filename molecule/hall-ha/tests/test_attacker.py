"""The attacker's-eye test of hall HA (molecule scenario hall-ha, issue 29): a host on the hall's private network
that is in no inventory (ha-attacker, made by create.yml from the inventory's sco_test_strangers), reaching the
hall's members by address as a stranger would, tries each attack on the converged hall in normal operation (the
relays, the distributor, the agents and the Kubernetes API stand-in running as test_drill.py starts them; etcd,
Patroni and PostgreSQL as the role runs them) and must fail at each:

- Patroni's REST API: switchover and a config patch (archive_command) without a password, with a wrong one and
  with the right one, from ha-attacker (not in the allowlist: 403); from an allowed control host, 401 without the
  password;
- etcd: a write of Patroni's leader key without a user, and over plain HTTP;
- the relay cluster: joining as a route (TLS on the cluster port without a certificate, or with one of another CA);
- a plaintext NATS client, a plaintext PostgreSQL connection;
- a secret of the hall's in any of its hosts' process arguments (what `ps` shows every local user), sampled while
  it runs, and in the control hosts' ansible-runner artifacts and logs;
- registering on a node's checkpoint socket as another contract: a user outside the socket's group, a root process
  in no pod, a pod's process naming another pod's contract;
- serving a node bundles from ha-attacker, the node's way to the distributor taken over (its name for ha-ctl1
  pointed at ha-attacker, which forwards the Kubernetes API on): as a man in the middle without the hall's
  certificate (its own certificate, plain HTTP), and as a stale mirror the hall's CA vouches for (an expired
  bundle, an undated one, the node's previous one replayed).

Each attack has its control where that is safe: the same client with the right credentials, address, certificate
or contract succeeds, so a refusal is the defence's and not a network error. Each attack's service, attack and
result go to a table printed at the end and written to .work/molecule/hall-ha-verify/attacks.txt.

Runs before test_drill.py (file order) and leaves the hall as it found it: the services it started stopped (and
waited for), the pod cgroup removed, the node's bundle cache and /etc/hosts restored (its agent's log and spool
of the bundle attacks copied to the table's directory first: the drill starts them afresh).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "shared"))
import hosts  # molecule/shared/hosts.py
import verify  # molecule/shared/verify.py

# the drill's fixtures (module scope: started again for this module, stopped at its end) and helpers
from test_drill import (  # noqa: F401 (agents, kube, relays: fixtures this module's tests use)
    ADDRESS,
    CA,
    HALL,
    INFRA,
    SC,
    _agent_exec_start,
    _kill,
    _patroni_primary,
    _pids,
    _spool,
    _wait,
    agents,
    kube,
    relays,
)

ATTACKER = "ha-attacker"
CONTROL = ["ha-ctl1", "ha-ctl2"]
HALL_HOSTS = [*INFRA, *CONTROL, "ha-node1", "ha-node2"]
TOOLS = Path(__file__).with_name("attacker.py")
REPO = Path(__file__).resolve().parents[3]
REPORT = REPO / ".work" / "molecule" / "hall-ha-verify" / "attacks.txt"
CREDENTIALS = SC.work / "credentials"
NODE = "ha-node1"

# every test runs against the hall in normal operation: the relays, distributor, agents and API stand-in running
pytestmark = pytest.mark.usefixtures("agents")

ROWS: list[tuple[str, str, str, bool]] = []  # service, attack, result, refused as it must be


def record(service: str, attack: str, result: str, refused: bool) -> None:
    """One row of the table (recorded before the test asserts, so a failure is in the table too)."""
    ROWS.append((service, attack, result, refused))


def table() -> str:
    w1 = max([len("service"), *(len(r[0]) for r in ROWS)])
    w2 = max([len("attack"), *(len(r[1]) for r in ROWS)])
    lines = [f"{'service':<{w1}} | {'attack':<{w2}} | result", f"{'-' * w1}-|-{'-' * w2}-|-------"]
    for service, attack, result, ok in ROWS:
        lines.append(f"{service:<{w1}} | {attack:<{w2}} | {result}{'' if ok else '   <-- NOT REFUSED'}")
    return "\n".join(lines) + "\n"


def _ns(host: str) -> str:
    return f"scom-{HALL}-{host}"


def attack(ops: list[dict[str, Any]], host: str = ATTACKER, timeout: float = 180) -> list[dict[str, Any]]:
    """attacker.py's operations from inside ``host``'s network namespace (secrets on stdin, never in argv)."""
    r = subprocess.run(
        ["ip", "netns", "exec", _ns(host), sys.executable, str(TOOLS)],
        input=json.dumps(ops),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got: list[dict[str, Any]] = json.loads(r.stdout)
    return got


def _word(path: Path) -> str:
    return path.read_text().split()[0]


def _said(r: dict[str, Any]) -> str:
    """What a request got, short: the status and the start of the body, or the error."""
    if "error" in r:
        return str(r["error"])[:90]
    body = re.sub(r"\s+", " ", str(r.get("body", "")))[:60]
    return f"{r['status']} {body}".strip()


def _settle() -> None:
    """No relay, distributor or agent of another module's left running in the hosts (each is started again on the
    same port): each waited for a while, then killed."""
    end = time.monotonic() + 30
    for host, comm in [
        *((h, "nats-server") for h in INFRA),
        ("ha-ctl1", "sco"),
        ("ha-node1", "sco-agent"),
        ("ha-node2", "sco-agent"),
    ]:
        while _pids(host, comm) and time.monotonic() < end:
            time.sleep(0.2)
        _kill(host, comm)


@pytest.fixture(scope="module", autouse=True)
def report() -> Iterator[None]:
    """Set up first, torn down last: the hosts settled before this module starts its services and after it stopped
    them (test_drill.py starts them again on the same ports); the table printed and written."""
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    _settle()
    yield
    _settle()
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(table())
    print(f"\nattacker: {len(ROWS)} attacks from {ATTACKER}; table in {REPORT}\n{table()}")


# --- Patroni's REST API ---------------------------------------------------------------------------------------------


def test_patroni_switchover_and_config_patch_are_refused() -> None:
    leader = _patroni_primary()
    url = f"https://{ADDRESS[leader]}:8008"
    password = _word(CREDENTIALS / "fleet-state" / "patroni-restapi")
    right, wrong = ["patroni", password], ["patroni", "guess-" + secrets.token_hex(4)]
    switch = {"leader": leader}
    evil = {"postgresql": {"parameters": {"archive_command": "touch /tmp/archive-command-by-ha-attacker"}}}
    ca = str(CA)
    before = attack([{"op": "http", "method": "GET", "url": f"{url}/config", "ca": ca}], host="ha-ctl2")[0]
    assert before.get("status") == 200, before
    ttl = json.loads(before["body"])["ttl"]
    tries = [
        ("POST /switchover from ha-attacker, no password", "POST", "/switchover", switch, None, 403),
        ("POST /switchover from ha-attacker, wrong password", "POST", "/switchover", switch, wrong, 403),
        ("POST /switchover from ha-attacker, the right password", "POST", "/switchover", switch, right, 403),
        ("PATCH /config archive_command from ha-attacker, no password", "PATCH", "/config", evil, None, 403),
        ("PATCH /config archive_command from ha-attacker, wrong password", "PATCH", "/config", evil, wrong, 403),
        ("PATCH /config archive_command from ha-attacker, the right password", "PATCH", "/config", evil, right, 403),
    ]
    got = attack([{"op": "http", "method": m, "url": url + p, "body": b, "auth": a} for _, m, p, b, a, _ in tries])
    # the same from an allowed address (a control host): the password is what refuses it there
    allowed = [
        ("POST /switchover from ha-ctl2 (allowed), no password", "POST", "/switchover", switch, None, 401),
        ("PATCH /config archive_command from ha-ctl2 (allowed), wrong password", "PATCH", "/config", evil, wrong, 401),
    ]
    got += attack(
        [{"op": "http", "method": m, "url": url + p, "body": b, "auth": a, "ca": ca} for _, m, p, b, a, _ in allowed],
        host="ha-ctl2",
    )
    # controls: the attacker reaches the API (GET is open), and the allowed host with the password is obeyed (a
    # PATCH that sets ttl to what it is: accepted, nothing changes)
    seen = attack([{"op": "http", "method": "GET", "url": f"{url}/cluster"}])[0]
    record("Patroni REST", "control: GET /cluster from ha-attacker (open)", _said(seen), seen.get("status") == 200)
    # what the open endpoints tell a stranger: no secret of the hall's
    wanted = hall_secrets()
    told = attack([{"op": "http", "method": "GET", "url": f"{url}/{p}"} for p in ("config", "patroni", "cluster")])
    leaked = sorted(k for k, v in wanted.items() for r in told if v in r.get("body", ""))
    record(
        "Patroni REST",
        f"GET /config, /patroni, /cluster from ha-attacker: {len(wanted)} secrets looked for",
        f"{[r.get('status') for r in told]}, " + ("none in the answers" if not leaked else f"SEEN: {leaked}"),
        not leaked,
    )
    obeyed = attack(
        [{"op": "http", "method": "PATCH", "url": f"{url}/config", "body": {"ttl": ttl}, "auth": right, "ca": ca}],
        host="ha-ctl2",
    )[0]
    record(
        "Patroni REST",
        "control: PATCH /config ttl unchanged, ha-ctl2 + password",
        _said(obeyed),
        obeyed.get("status") == 200,
    )
    for (what, *_, want), r in zip([*tries, *allowed], got, strict=True):
        record("Patroni REST", what, _said(r), r.get("status") == want)
    after = attack([{"op": "http", "method": "GET", "url": f"{url}/config", "ca": ca}], host="ha-ctl2")[0]
    unchanged = "archive_command" not in after.get("body", "") and json.loads(after["body"])["ttl"] == ttl
    record(
        "Patroni REST",
        "afterwards: /config without archive_command, leader kept",
        f"archive_command absent: {unchanged}, leader {_patroni_primary()}",
        unchanged and _patroni_primary() == leader,
    )
    assert seen.get("status") == 200 and obeyed.get("status") == 200, (seen, obeyed)
    assert not leaked, leaked
    for (what, *_, want), r in zip([*tries, *allowed], got, strict=True):
        assert r.get("status") == want, (what, r)
    assert unchanged, after
    assert _patroni_primary() == leader


# --- etcd ------------------------------------------------------------------------------------------------------------


def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def test_etcd_refuses_a_write_of_patronis_leader_key() -> None:
    key = _b64("/service/sco-fleet/leader")
    put = {"key": key, "value": _b64(ATTACKER)}
    ops: list[dict[str, Any]] = []
    for h in INFRA:
        ops.append({"op": "http", "method": "POST", "url": f"https://{ADDRESS[h]}:2379/v3/kv/put", "body": put})
        ops.append({"op": "http", "method": "POST", "url": f"http://{ADDRESS[h]}:2379/v3/kv/put", "body": put})
    got = attack(ops)
    # control: the same client with Patroni's etcd user reads the key (a write would move the leader)
    password = _word(CREDENTIALS / "fleet-state" / "etcd-patroni")
    base = f"https://{ADDRESS[INFRA[0]]}:2379"
    login = attack(
        [
            {
                "op": "http",
                "method": "POST",
                "url": f"{base}/v3/auth/authenticate",
                "body": {"name": "patroni", "password": password},
            }
        ]
    )[0]
    token = json.loads(login.get("body") or "{}").get("token", "")
    read = attack(
        [
            {
                "op": "http",
                "method": "POST",
                "url": f"{base}/v3/kv/range",
                "body": {"key": key},
                "headers": {"Authorization": token},
            }
        ]
    )[0]
    kvs = json.loads(read.get("body") or "{}").get("kvs") or []
    holder = base64.b64decode(kvs[0]["value"]).decode() if kvs else ""
    record(
        "etcd",
        "control: login as Patroni's user, read the leader key",
        f"{_said(read)[:3]} leader key = {holder}",
        read.get("status") == 200 and holder in INFRA,
    )
    results = []
    for h, tls, plain in zip(INFRA, got[::2], got[1::2], strict=True):
        # no user: etcd's authentication refuses (its JSON gateway says the user name is empty)
        refused_tls = tls.get("status") in (400, 401, 403) and "user name is empty" in tls.get("body", "")
        record("etcd", f"PUT leader key on {h} over https, no client cert, no user", _said(tls), refused_tls)
        # plain HTTP: no answer (or Go's 400 for HTTP spoken to a TLS port), never a 200
        refused_plain = "error" in plain or (plain.get("status") == 400 and "HTTPS" in plain.get("body", ""))
        record("etcd", f"PUT leader key on {h} over plain HTTP", _said(plain), refused_plain)
        results.append((h, refused_tls, refused_plain, tls, plain))
    record("etcd", "afterwards: the leader key still names the leader", holder, holder == _patroni_primary())
    assert read.get("status") == 200 and holder in INFRA, (login.get("status"), read)
    for h, refused_tls, refused_plain, tls, plain in results:
        assert refused_tls and refused_plain, (h, tls, plain)
    assert holder == _patroni_primary()


# --- the relay cluster -----------------------------------------------------------------------------------------------


def test_joining_the_relay_cluster_as_a_route_is_refused() -> None:
    relay = INFRA[0]
    tls = SC.work / "tls" / "relay"
    where = {"op": "route", "host": ADDRESS[relay], "port": 6222}
    no_cert, foreign, own = attack(
        [
            where,
            {**where, "cert": "self-signed"},
            # control: the relay's own certificate (the hall's CA signed it), as a relay of the cluster shows
            {**where, "cert": str(tls / f"{relay}.crt"), "key": str(tls / f"{relay}.key")},
        ]
    )
    record(
        "NATS cluster",
        f"route to {relay}:6222 over TLS, no certificate",
        no_cert["outcome"][:90],
        no_cert["outcome"].startswith("refused") or no_cert["outcome"] == "closed",
    )
    record(
        "NATS cluster",
        f"route to {relay}:6222 with another CA's certificate",
        foreign["outcome"][:90],
        foreign["outcome"].startswith("refused") or foreign["outcome"] == "closed",
    )
    record(
        "NATS cluster",
        "control: the same with a relay's certificate",
        own["outcome"][:90],
        own["outcome"].startswith(("answered", "held open")),
    )
    assert no_cert["outcome"].startswith("refused") or no_cert["outcome"] == "closed", no_cert
    assert foreign["outcome"].startswith("refused") or foreign["outcome"] == "closed", foreign
    assert own["outcome"].startswith(("answered", "held open")), own


def test_a_plaintext_nats_client_is_refused() -> None:
    """The reclaimer's own credentials (its JWT, the INFO's nonce signed by its seed) on the client port, in the
    clear: no PONG (a relay serving plaintext answers it: checked against a local relay without TLS when this test
    was written); control: the same bytes over TLS, the relay checked against the hall's CA, get their PONG."""
    relay = INFRA[1]
    creds = str(CREDENTIALS / "nats" / "reclaimer.creds")
    where = {"op": "nats_raw", "host": ADDRESS[relay], "port": 4222, "creds": creds}
    plain, tls = attack([where, {**where, "ca": str(CA)}])
    record(
        "NATS client",
        f"CONNECT (reclaimer's creds) + PING in plaintext to {relay}:4222",
        f"INFO tls_required {plain.get('tls_required')}, PONG {plain.get('pong')}",
        not plain.get("pong"),
    )
    record("NATS client", "control: the same over TLS", f"PONG {tls.get('pong')}", bool(tls.get("pong")))
    assert not plain.get("pong"), plain
    assert tls.get("pong"), tls


# --- PostgreSQL ------------------------------------------------------------------------------------------------------


def _fleet_dsn() -> tuple[dict[str, str], str]:
    """The control hosts' DSN (fleet_state wrote it on ha-ctl1) as keywords, and its password."""
    env = (SC.root("ha-ctl1") / "etc" / "sco" / "fleet-state.env").read_text()
    dsn = next(ln.split("=", 1)[1] for ln in env.splitlines() if ln.startswith("SCO_DB_DSN="))
    words = dict(w.split("=", 1) for w in dsn.strip().strip("'\"").split())
    return words, words.pop("password", "") or _word(CREDENTIALS / "fleet-state" / "sco")


def test_a_plaintext_postgresql_connection_is_refused() -> None:
    words, password = _fleet_dsn()
    primary = ADDRESS[_patroni_primary()]
    base = f"host={primary} port={words['port'].split(',')[0]} dbname={words['dbname']} user={words['user']}"
    plain, tls = attack(
        [
            {"op": "pg", "dsn": f"{base} sslmode=disable", "password": password},
            # control: the same user and password over TLS, the server checked against the hall's CA
            {"op": "pg", "dsn": f"{base} sslmode=verify-full sslrootcert={CA}", "password": password},
        ]
    )
    said = str(plain.get("error", "connected"))
    record(
        "PostgreSQL",
        "sslmode=disable to the primary, the right password",
        said[-90:],
        not plain["connected"] and "no encryption" in said,
    )
    record(
        "PostgreSQL",
        "control: the same over TLS (verify-full)",
        f"connected {tls['connected']}, ssl {tls.get('ssl')}",
        bool(tls["connected"] and tls.get("ssl")),
    )
    assert not plain["connected"] and "no encryption" in said, plain
    assert tls["connected"] and tls.get("ssl"), tls


# --- secrets ---------------------------------------------------------------------------------------------------------

SEED = re.compile(r"\bS[OAUNC][A-Z2-7]{50,}")


def hall_secrets() -> dict[str, str]:
    """Every secret the hall's controller made or was given, by where it came from: the relay users' nkey seeds
    (creds files, seed files, the operator's and accounts' keys), the fleet state's generated passwords (SCO's
    database user, Patroni's REST API, etcd's root and Patroni's user), the inventory's passwords (PostgreSQL's
    admin, replication), the signing keys' seeds, the nodes' tokens, and a line from the middle of every TLS
    private key."""
    out: dict[str, str] = {}
    for p in sorted(CREDENTIALS.rglob("*")):
        if not p.is_file():
            continue
        rel = str(p.relative_to(SC.work))
        text = p.read_text(errors="replace")
        seeds = SEED.findall(text)
        for i, s in enumerate(seeds):
            out[f"{rel} (seed {i})"] = s
        words = text.split()
        public = re.fullmatch(r"[UOANC][A-Z2-7]{55}", words[0]) if len(words) == 1 else None
        if not seeds and len(words) == 1 and not public and not words[0].startswith("eyJ"):
            out[rel] = words[0]  # a generated password or token alone in its file (not a public key, not a JWT)
    inv: dict[str, Any] = {}
    for f in sorted((SC.inventory.parent / "group_vars").rglob("*.yml")):
        inv.update(yaml.safe_load(f.read_text()) or {})
    for k, v in sorted(inv.items()):
        if "password" in k and isinstance(v, str) and v:
            out[f"inventory {k}"] = v
    for p in sorted([*SC.work.glob("keys/*.key"), *SC.work.glob("retired/*.key")]):
        # the signing keys (the hall's root, the launch key, the notice key, a retired one): their seeds
        with contextlib.suppress(ValueError, KeyError, TypeError):  # sco keygen's JSON; anything else is not one
            out[str(p.relative_to(SC.work))] = json.loads(p.read_text())["seed"]
    for p in sorted(SC.work.glob("tls/**/*.key")):
        body = [ln for ln in p.read_text().splitlines() if ln and not ln.startswith("-----")]
        if body:
            out[str(p.relative_to(SC.work))] = body[len(body) // 2]
    for n in ("ha-node1", "ha-node2"):
        token = SC.root(n) / "var" / "lib" / "sco" / "kube-token"
        if token.is_file():
            out[f"{n} kube token"] = token.read_text().strip()
    return {k: v for k, v in out.items() if len(v) >= 8}


def _sample(
    done: Callable[[], bool], wanted: dict[str, str]
) -> tuple[dict[str, set[str]], dict[str, set[str]], int, int]:
    """Every process in the hall's hosts' namespaces, read again and again until ``done()``: which secret showed in
    whose arguments (what any local user's `ps` reads) and environment (root's only); processes and passes."""
    args: dict[str, set[str]] = {}
    env: dict[str, set[str]] = {}
    seen: set[int] = set()
    passes = 0
    needles = [(k, v.encode()) for k, v in wanted.items()]
    # a process's host: its network namespace (the inode `ip netns` names it by), no `ip` spawned per pass
    hosts_by_ns = {os.stat(f"/run/netns/{_ns(h)}").st_ino: h for h in HALL_HOSTS}
    while not done() or passes == 0:
        for pid in (p for p in os.listdir("/proc") if p.isdigit()):
            try:
                host = hosts_by_ns.get(os.stat(f"/proc/{pid}/ns/net").st_ino)
                if host is None:
                    continue
                argv = Path(f"/proc/{pid}/cmdline").read_bytes()
                environ = Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:  # gone meanwhile
                continue
            seen.add(int(pid))
            argv0 = argv.split(b"\0")[0].decode(errors="replace")
            for k, v in needles:
                if v in argv:
                    args.setdefault(k, set()).add(f"{host}:{argv0}")
                if v in environ:
                    env.setdefault(k, set()).add(f"{host}:{argv0}")
        passes += 1
        time.sleep(0.1)  # several passes a second: short-lived processes still seen, the machine not flooded
    return args, env, len(seen), passes


def _for(seconds: float) -> Callable[[], bool]:
    end = time.monotonic() + seconds
    return lambda: time.monotonic() >= end


def test_no_secret_in_the_halls_process_arguments() -> None:
    wanted = hall_secrets()
    kinds = {"seed": sum("seed" in k for k in wanted), "fleet-state": sum("fleet-state" in k for k in wanted)}
    # the controller's files were read (relay seeds, the fleet state's passwords, the signing keys)
    assert kinds["seed"] >= 5 and kinds["fleet-state"] >= 4 and "keys/hall.key" in wanted, sorted(wanted)
    # control: a process of the node's with a canary in its arguments is seen by the same sampler
    canary = "canary-" + secrets.token_hex(12)
    # the canary is the shell's $0, so it stays in that process's arguments for 120 s (`sleep 120 CANARY` exits at
    # once on the argument it cannot parse, and the sampler had nothing to see)
    assert SC.host(NODE).run(f"setsid sh -c 'sleep 120; :' {canary} > /dev/null 2>&1 < /dev/null &").rc == 0
    try:
        args, env, procs, passes = _sample(_for(6.0), {**wanted, "canary": canary})
    finally:
        for pid in _pids(NODE, "sh"):
            with contextlib.suppress(OSError):
                if canary.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)
    canary_seen = args.pop("canary", set())
    env.pop("canary", None)
    record(
        "process args",
        f"control: a canary in a {NODE} process's arguments",
        f"seen: {sorted(canary_seen)}",
        bool(canary_seen),
    )
    record(
        "process args",
        f"{len(wanted)} secrets in `ps` of the 7 hall hosts ({procs} processes, {passes} passes)",
        "none seen" if not args else f"SEEN: {sorted((k, sorted(v)) for k, v in args.items())}",
        not args,
    )
    # environments: only root (or the process's own user) reads them; said, not asserted (a unit's own secret in
    # its own environment is how systemd's EnvironmentFile gives it)
    record(
        "process environ",
        "the same secrets in the processes' environments (root-only)",
        "none seen" if not env else f"seen: {sorted((k, sorted(v)) for k, v in env.items())}",
        True,
    )
    assert canary_seen, "the sampler did not see the canary"
    assert not args, args


def _unit_run(host: str, unit: str) -> str:
    """A shell script that runs ``unit``'s ExecStart as systemd would (verify.service_command: its User and Group,
    the USER, LOGNAME, HOME and SHELL systemd sets for that user, its Environment and EnvironmentFile), given on
    stdin: the secrets in it never reach a command line."""
    th = hosts.test_host(HALL, host)

    def run(cmd: str) -> str:
        return th.ssh("bash", "-c", shlex.quote(cmd), timeout=60).stdout

    return verify.service_command(run, unit) + "\n"


def test_no_secret_in_a_control_loop_runs_arguments_artifacts_or_logs() -> None:
    """One run of the control loop's unit on ha-ctl2, as its timer starts it (no cloud is configured in this hall,
    so its steps after the demand fail: what matters is what it wrote), with the process sampler on every hall host
    meanwhile; then every file of both control hosts' runner directories (env/, artifacts/), and of every hall host's
    /var/log (the services' output, as the drill starts them) and /tmp."""
    wanted = hall_secrets()
    ctl = "ha-ctl2"
    h = SC.host(ctl)
    # ansible-runner runs ansible-playbook on a pseudo-terminal: the host gets a devpts of its own, as a real one has
    assert (
        h.run("mountpoint -q /dev/pts || mount -t devpts -o newinstance,ptmxmode=0666,mode=620 devpts /dev/pts").rc == 0
    )
    th = hosts.test_host(HALL, ctl)
    log = REPORT.parent / "control-loop-run.log"
    t0 = time.monotonic()
    with open(log, "w") as out:  # a file, not a pipe: nobody reads a pipe while the sampler runs
        run = subprocess.Popen(
            ["ssh", *th.ssh_args(), "root@127.0.0.1", "bash", "-s"],
            stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    assert run.stdin is not None
    run.stdin.write(_unit_run(ctl, "sco-control-loop.service"))
    run.stdin.close()
    end = time.monotonic() + 300
    args, _, procs, passes = _sample(lambda: run.poll() is not None or time.monotonic() > end, wanted)
    if run.poll() is None:
        run.kill()
    rc = run.wait(10)
    took = time.monotonic() - t0
    printed = log.read_text(errors="replace")
    in_output = sorted(k for k, v in wanted.items() if v in printed)
    record(
        "process args",
        f"the same secrets during a control-loop run on {ctl} ({procs} processes, {passes} passes, {took:.0f} s)",
        "none seen" if not args else f"SEEN: {sorted((k, sorted(v)) for k, v in args.items())}",
        not args,
    )
    said = "none seen" if not in_output else f"SEEN: {in_output}"
    record("control loop", f"secrets in the run's output (exit {rc})", said, not in_output)
    scanned = 0
    found: dict[str, list[str]] = {}
    # control: a canary in a file where the grep looks is found
    canary = "canary-" + secrets.token_hex(12)
    planted = SC.root(ctl) / "tmp" / "attacker-canary.txt"
    planted.write_text(f"a log line with {canary} in it\n")
    wanted = {**wanted, "canary": canary}
    for host in HALL_HOSTS:
        root = SC.root(host)
        # the loop's ansible-runner directory (role control_loop's control_loop_data_dir since it left /var/lib/sco)
        for d in (root / "var" / "lib" / "sco-control-loop", root / "var" / "log", root / "tmp"):
            for p in sorted(d.rglob("*")) if d.is_dir() else []:
                if not p.is_file() or p.is_symlink():
                    continue
                with contextlib.suppress(OSError):
                    data = p.read_bytes()
                    scanned += 1
                    for k, v in wanted.items():
                        if v.encode() in data:
                            found.setdefault(k, []).append(f"{host}:{p.relative_to(root)}")
    planted.unlink()
    canary_found = found.pop("canary", [])
    record("ansible-runner", f"control: a canary in {ctl}:/tmp", f"found: {canary_found}", bool(canary_found))
    artifacts = sum(1 for p in (SC.root(ctl) / "var/lib/sco/control-loop/artifacts").rglob("*") if p.is_file())
    record(
        "ansible-runner",
        f"secrets in the control hosts' runner directories, every host's /var/log and /tmp ({scanned} files, "
        f"{artifacts} artifact files)",
        "none seen" if not found else f"SEEN: {found}",
        not found and artifacts > 0,
    )
    assert canary_found, "the grep did not find the canary"
    assert artifacts > 0, f"the control loop's run wrote no artifacts (exit {rc}):\n{printed[-3000:]}"
    assert not args, args
    assert not in_output, in_output
    assert not found, found


# --- the checkpoint socket -------------------------------------------------------------------------------------------

CLIENT = REPO / "tests" / "checkpoint_register.py"


def _cgroup2() -> Path:
    for line in Path("/proc/self/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) > 2 and parts[2] == "cgroup2":
            return Path(parts[1])
    raise AssertionError("no cgroup2 hierarchy mounted: the pod's cgroup cannot be made")


@contextlib.contextmanager
def pod_cgroup(uid: str) -> Iterator[Path]:
    """The cgroup kubelet (systemd driver, --cgroup-root /: the role's node_agent_kube_cgroup_root) gives a pod's
    container; made for the test, removed after (only what it made)."""
    mount = _cgroup2()
    parts = [
        "kubepods.slice",
        "kubepods-besteffort.slice",
        f"kubepods-besteffort-pod{uid.replace('-', '_')}.slice",
        "cri-containerd-attacker.scope",
    ]
    made: list[Path] = []
    d = mount
    for p in parts:
        d = d / p
        if not d.is_dir():
            d.mkdir()
            made.append(d)
    try:
        yield d
    finally:
        for m in reversed(made):
            end = time.monotonic() + 5
            while m.is_dir():
                try:
                    m.rmdir()
                except OSError:
                    if time.monotonic() > end:
                        raise
                    time.sleep(0.1)


def _register(
    name: str, contract: str, outside: list[str] | None = None, inside: list[str] | None = None
) -> dict[str, Any]:
    """The checkpoint client run on the node (its own python3, in its chroot and namespace): ``outside`` before
    entering the node (as root of the machine: into a pod's cgroup), ``inside`` within it (to drop to a user)."""
    argv = [
        *(outside or []),
        "ip",
        "netns",
        "exec",
        _ns(NODE),
        "chroot",
        str(SC.root(NODE)),
        *(inside or []),
        "/usr/bin/python3",
        "-S",
        "/tmp/checkpoint_register.py",
        "/run/sco/checkpoint.sock",
        name,
        contract,
    ]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout.splitlines()[0]))


def _metrics_scheme(node: str) -> str:
    """https when role node_agent gave the agent a /metrics certificate (the hall's default, sco_metrics_tls: TLS
    only, a plain request gets no answer), else http."""
    conf = (SC.root(node) / "etc" / "sco" / "agent.toml").read_text()
    return "https" if re.search(r'^metrics_tls_cert_file = "/', conf, re.M) else "http"


_SCRAPE = """
import ssl, sys, urllib.request
ctx = ssl.create_default_context(cafile=sys.argv[2]) if sys.argv[2] else None
print(urllib.request.urlopen(sys.argv[1], timeout=5, context=ctx).read().decode())
"""


def _metrics(node: str, wait_s: float = 30) -> str:
    """The agent's /metrics, scraped on the node's loopback, over TLS checked against the hall's CA when it serves
    TLS (waited for: an agent just restarted opens it soon)."""
    scheme = _metrics_scheme(node)
    argv = [sys.executable, "-c", _SCRAPE, f"{scheme}://127.0.0.1:9469/metrics", str(CA) if scheme == "https" else ""]
    end = time.monotonic() + wait_s
    while True:
        r = subprocess.run(["ip", "netns", "exec", _ns(node), *argv], capture_output=True, text=True, timeout=30)
        if r.returncode == 0 or time.monotonic() > end:
            break
        time.sleep(0.5)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_the_agents_metrics_are_not_served_to_the_network() -> None:
    """The agent's /metrics listens on the node's loopback (metrics_listen 127.0.0.1:9469): a stranger's scrape, or
    its idle connections, never reach it (control: the node itself scrapes it, over TLS against the hall's CA)."""
    scheme = _metrics_scheme(NODE)
    got = attack([{"op": "http", "method": "GET", "url": f"{scheme}://{ADDRESS[NODE]}:9469/metrics"}])[0]
    own = _metrics(NODE)
    record("agent /metrics", f"GET {scheme}://{NODE}:9469/metrics from ha-attacker", _said(got), "error" in got)
    record(
        "agent /metrics",
        f"control: the same on {NODE}'s loopback",
        f"{len(own.splitlines())} lines",
        "sco_agent_" in own,
    )
    assert "error" in got, got
    assert "sco_agent_" in own


def test_registering_on_the_checkpoint_socket_as_another_contract_is_refused() -> None:
    root = SC.root(NODE)
    shutil.copyfile(CLIENT, root / "tmp" / "checkpoint_register.py")
    (root / "tmp" / "checkpoint_register.py").chmod(0o644)
    pod = "runner-ha-node1-1"  # test_drill's kube fixture: ci/runner-<node>-<i>, contract ci-runners
    get = (
        "import json, sys, urllib.request;"
        " print(json.load(urllib.request.urlopen(sys.argv[1], timeout=5))['metadata']['uid'])"
    )
    url = f"http://{ADDRESS['ha-ctl1']}:6443/api/v1/namespaces/ci/pods/{pod}"
    uid = SC.in_netns("ha-ctl1", sys.executable, "-c", get, url).stdout.strip()
    assert re.fullmatch(r"[0-9a-f-]{36}", uid), uid
    refusals = 'sco_agent_checkpoint_refusals_total{reason="%s"}'
    m0 = _metrics(NODE)
    # a user outside the socket's group (nobody): the kernel refuses the connection
    outsider = _register(
        "w", "pytorch-training", inside=["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
    )
    # root, in no pod's cgroup (a shell on the node), naming a contract
    stranger = _register("w", "pytorch-training")
    with pod_cgroup(uid) as cg:
        into = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(cg)]
        forged = _register(pod, "pytorch-training", outside=into)
        # control: the pod's own process under its own contract registers
        own = _register(pod, "ci-runners", outside=into)
    m1 = _metrics(NODE)
    grew = {r: _metric(m1, refusals % r) - _metric(m0, refusals % r) for r in ("not_a_workload", "wrong_contract")}
    record(
        "checkpoint socket",
        f"register as pytorch-training, uid nobody (not in sco-checkpoint), {NODE}",
        json.dumps(outsider)[:90],
        outsider.get("op") == "connect_failed" and outsider.get("errno") == 13,
    )
    record(
        "checkpoint socket",
        "register as pytorch-training, root in no pod",
        str(stranger.get("error", stranger))[:90],
        stranger.get("op") == "error" and "no pod" in stranger["error"],
    )
    record(
        "checkpoint socket",
        f"register as pytorch-training from pod {pod} (ci-runners)",
        str(forged.get("error", forged))[:90],
        forged.get("op") == "error" and "is not this process's" in forged["error"],
    )
    record(
        "checkpoint socket",
        "control: the same pod as ci-runners",
        f"{own.get('op')} {own.get('contract')}",
        own.get("op") == "registered" and own.get("contract") == "ci-runners",
    )
    record(
        "checkpoint socket",
        "refusals counted (sco_agent_checkpoint_refusals_total)",
        json.dumps(grew),
        grew == {"not_a_workload": 1, "wrong_contract": 1},
    )
    assert outsider.get("op") == "connect_failed" and outsider.get("errno") == 13, outsider
    assert stranger.get("op") == "error" and "no pod" in stranger["error"], stranger
    assert forged.get("op") == "error" and "is not this process's" in forged["error"], forged
    assert own.get("op") == "registered" and own.get("contract") == "ci-runners", own
    assert grew == {"not_a_workload": 1, "wrong_contract": 1}, grew


# --- the bundle's way to a node --------------------------------------------------------------------------------------

WWW = SC.work / "attacker"  # the fake distributor's files and certificates (the controller's; never under tls/)
TAKEN_OR_NOT = ("bundle.accepted", "bundle.refused", "bundle.error")  # a fetch's outcome, whichever it is


def attacker_address() -> str:
    """ha-attacker's address on the hall's network (create.yml gave it; it is in no inventory)."""
    members: dict[str, str] = json.loads((hosts.scenario_dir(HALL) / "network.json").read_text())
    return members[ATTACKER]


def _sign(payload: dict[str, Any]) -> bytes:
    from sco.contract.signing import load_private, sign

    return sign(payload, [load_private(SC.work / "keys" / "hall.key")])


def _notes(log: Path) -> list[dict[str, Any]]:
    """The fake distributor's log: one JSON object per connection's handshake, request or error."""
    return [json.loads(ln) for ln in log.read_text().splitlines() if ln.startswith("{")] if log.is_file() else []


def _fetched(node: str, what: str) -> dict[str, Any]:
    """The node's agent stopped and started again as the drill starts it (its log appended to, its first refresh at
    once): the first fetch outcome it spools since, taken, refused or failed."""
    n = len(_spool(node))
    _kill(node, "sco-agent", signal.SIGTERM)
    _wait(lambda: not _pids(node, "sco-agent"), 30, f"{node}'s agent to stop")
    h = SC.host(node)
    assert h.run(f"setsid {_agent_exec_start(h)} >> /var/log/sco-agent.log 2>&1 < /dev/null &").rc == 0
    got: dict[str, Any] = _wait(
        lambda: next((e for e in _spool(node)[n:] if e.get("type") in TAKEN_OR_NOT), None),
        90,
        f"{node}'s agent to fetch {what} (the fake distributor's log is in {REPORT.parent})",
        1,
    )
    return got


@contextlib.contextmanager
def fake_distributor(name: str, tls: dict[str, str] | None) -> Iterator[Path]:
    """attacker.py's fake distributor on ha-attacker at the distributor's port, serving WWW/www over HTTPS with
    ``tls`` (its cert and key) or plain HTTP, until the block ends; its log (kept in the report's directory) is
    yielded."""
    log = REPORT.parent / f"fake-distributor-{name}.log"
    log.unlink(missing_ok=True)
    argv = ["ip", "netns", "exec", _ns(ATTACKER), sys.executable, str(TOOLS), "serve", attacker_address(), "8470"]
    argv += [str(WWW / "www"), str(log), *((tls["cert"], tls["key"]) if tls else ())]
    with open(REPORT.parent / "fake-distributor.out", "ab") as out:
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait(lambda: p.poll() is not None or any("serving" in n for n in _notes(log)), 30, f"the {name} distributor")
        assert p.poll() is None, (REPORT.parent / "fake-distributor.out").read_text()[-2000:]
        yield log
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)


@contextlib.contextmanager
def kube_forwarded() -> Iterator[None]:
    """ha-attacker forwarding the Kubernetes API on to ha-ctl1 (sco_kube_url names ha-ctl1 too): the node's agent
    keeps its API while its name for ha-ctl1 leads to ha-attacker."""
    me = attacker_address()
    with open(REPORT.parent / "fake-distributor.out", "ab") as out:
        p = subprocess.Popen(
            ["ip", "netns", "exec", _ns(ATTACKER), "socat", f"TCP-LISTEN:6443,bind={me},fork,reuseaddr",
             f"TCP:{ADDRESS['ha-ctl1']}:6443"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)


@contextlib.contextmanager
def node_led_to_attacker(node: str) -> Iterator[None]:
    """The node's way to ha-ctl1 taken over (its /etc/hosts entry for it: a poisoned resolver), its bundle cache
    kept aside. After: the agent's log and spool copied to the report's directory (the drill's fixture starts the
    log afresh), the resolver and the cache put back, the agent running on them as before."""
    root = SC.root(node)
    etc_hosts = root / "etc" / "hosts"
    saved = etc_hosts.read_text()
    h = SC.host(node)
    keep = "/var/lib/sco/.bundle-before-attack"
    assert h.run(f"rm -rf {keep} && cp -a /var/lib/sco/bundle {keep}").rc == 0
    me = attacker_address()
    etc_hosts.write_text(re.sub(rf"^{re.escape(ADDRESS['ha-ctl1'])} ha-ctl1$", f"{me} ha-ctl1", saved, flags=re.M))
    assert f"{me} ha-ctl1" in etc_hosts.read_text()
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            shutil.copyfile(root / "var" / "log" / "sco-agent.log", REPORT.parent / f"{node}-agent.log")
        with contextlib.suppress(AssertionError):
            (REPORT.parent / f"{node}-events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in _spool(node)))
        etc_hosts.write_text(saved)
        _kill(node, "sco-agent", signal.SIGTERM)
        _wait(lambda: not _pids(node, "sco-agent"), 30, f"{node}'s agent to stop")
        assert h.run(f"rm -rf /var/lib/sco/bundle && cp -a {keep} /var/lib/sco/bundle && rm -rf {keep}").rc == 0
        assert h.run(f"setsid {_agent_exec_start(h)} >> /var/log/sco-agent.log 2>&1 < /dev/null &").rc == 0


def test_a_bundle_from_a_man_in_the_middle_or_a_stale_mirror_is_refused_and_the_last_good_one_kept() -> None:
    """ha-node1's name for ha-ctl1 (the host of its bundle_url) leads to ha-attacker, which serves its own bundles
    at the distributor's port and path (and forwards the Kubernetes API on):

    (a) a man in the middle without the hall's certificate, serving a bundle the node would take (the hall's, fresh,
        the next serial: better than the replays such an attacker holds), over HTTPS with a certificate of its own,
        then over plain HTTP: the agent refuses at TLS (a failed fetch, CERTIFICATE_VERIFY_FAILED / an SSL error,
        in its spool and its log); the fake distributor saw it come (its handshake refused, or a ClientHello where
        HTTP was expected) and served nothing;
    (b) a stale mirror the hall trusts (a certificate for ha-ctl1 signed by the hall's CA): a later serial signed by
        the hall that expired an hour ago, a later serial without an expiry (older-dated), then, after the control,
        the node's own bundle replayed (a lower serial, issued earlier, not expired): each refused with its reason;
        control: a fresh bundle through the same mirror is taken, and when it expires the node keeps it
        (sco_agent_bundle_expired 1).

    After each refusal the bundle in use (serial, file, so its budgets) is the one held before. Until TLS became the
    default (b678433) the agent fetched http:// and (b) was the only line. This test's first form (left out in
    887d20b) served plain HTTP, which an https:// bundle_url meets with a failed handshake, not the refusal it waited
    for; its outcomes here are taken as they come (taken, refused or failed) and said."""
    from sco.contract.bundle import Bundle
    from sco.contract.signing import Keyring, load_public

    conf = SC.host(NODE).file("/etc/sco/agent.toml").content_string
    url = re.search(r'^bundle_url = "https://ha-ctl1:8470(/[^"]+)"$', conf, re.M)
    assert url and re.search(r'^bundle_ca_file = "/', conf, re.M), conf  # TLS, checked against the hall's CA
    cache = SC.root(NODE) / "var" / "lib" / "sco" / "bundle"
    held_raw = (cache / "bundle.json").read_bytes()
    held = Bundle.from_bytes(held_raw, Keyring([load_public(SC.work / "keys" / "hall.pub")]))
    s = held.serial
    assert _metric(_metrics(NODE), "sco_agent_bundle_serial") == s
    assert held.expires_at is not None, "the node's bundle carries no expiry: an undated one would not be older-dated"
    payload = dict(held.verified.payload)
    agent_log = SC.root(NODE) / "var" / "log" / "sco-agent.log"
    shutil.rmtree(WWW, ignore_errors=True)
    served = WWW / "www" / url.group(1).lstrip("/")
    served.parent.mkdir(parents=True)
    own, mirror = attack(
        [
            {"op": "cert", "dir": str(WWW / "own"), "name": "ha-ctl1"},  # self-signed: a CA of the attacker's own
            {"op": "cert", "dir": str(WWW / "mirror"), "name": "ha-ctl1", "ca_cert": str(CA),
             "ca_key": str(SC.work / "tls" / "ca.key")},  # the hall's CA (the controller's state directory)
        ]
    )  # fmt: skip

    def fetch(what: str, raw: bytes, log: Path) -> dict[str, Any]:
        """``raw`` served, the agent restarted: its outcome, the bundle it holds after, what the fake saw."""
        served.write_bytes(raw)
        seen = len(_notes(log))
        ev = _fetched(NODE, what)
        return {
            "event": ev,
            "reason": str(ev.get("reason", "")),
            "serial": _metric(_metrics(NODE), "sco_agent_bundle_serial"),
            "held": (cache / "bundle.json").read_bytes(),
            "notes": _notes(log)[seen:],
        }

    def short(r: dict[str, Any]) -> str:
        return f"{r['event']['type']}: {r['reason'][-70:]}; held serial {r['serial']:g}".replace(": ;", ";")

    try:
        with kube_forwarded(), node_led_to_attacker(NODE):
            log_from = agent_log.stat().st_size
            refused_before = json.loads((cache / "state.json").read_text()).get("refused", 0)
            now = int(time.time())
            would_take = _sign({**payload, "serial": s + 1, "issuedAt": now, "expiresAt": now + 3600})
            with fake_distributor("own-certificate", own) as log:
                own_tls = fetch("the bundle over TLS with ha-attacker's own certificate", would_take, log)
            with fake_distributor("plain-http", None) as log:
                plain = fetch("the bundle over plain HTTP", would_take, log)
            with fake_distributor("hall-ca-mirror", mirror) as log:
                now = int(time.time())
                expired = fetch(
                    "an expired bundle from the mirror",
                    _sign({**payload, "serial": s + 1, "issuedAt": now - 7 * 86_400 - 3600, "expiresAt": now - 3600}),
                    log,
                )
                undated = fetch(
                    "an undated bundle from the mirror",
                    _sign({k: v for k, v in {**payload, "serial": s + 2}.items() if k != "expiresAt"}),
                    log,
                )
                # control: fresh, through the same mirror; it expires 90 s after it is served
                now = int(time.time())
                fresh_raw = _sign({**payload, "serial": s + 3, "issuedAt": now, "expiresAt": now + 90})
                fresh = fetch("a fresh bundle from the mirror", fresh_raw, log)
                # the node's own bundle of before, replayed: the hall's, not expired, but an older serial and issue
                replay = fetch("the node's previous bundle replayed by the mirror", held_raw, log)
                _wait(lambda: _metric(_metrics(NODE), "sco_agent_bundle_expired") == 1,
                      max(0.0, now + 90 - time.time()) + 60, "the held bundle to expire", 2)  # fmt: skip
                expired_held = _metrics(NODE)
                held_after = (cache / "bundle.json").read_bytes()
            refused_after = json.loads((cache / "state.json").read_text()).get("refused", 0)
            warned = [ln for ln in agent_log.read_bytes()[log_from:].decode(errors="replace").splitlines() if
                      "WARNING" in ln and "bundle " in ln]  # fmt: skip
    finally:
        shutil.rmtree(WWW, ignore_errors=True)  # the mirror's key: the hall's CA signed its certificate

    def said(*words: str) -> bool:
        """The agent's own log says it: a WARNING with each of ``words``."""
        return any(all(w in ln for w in words) for ln in warned)

    kept = f"bundle error, serial {s} kept"
    checks = [
        (
            "HTTPS with ha-attacker's own certificate for ha-ctl1",
            own_tls,
            own_tls["event"]["type"] == "bundle.error" and "CERTIFICATE_VERIFY_FAILED" in own_tls["reason"]
            and said(kept, "CERTIFICATE_VERIFY_FAILED") and own_tls["held"] == held_raw and own_tls["serial"] == s
            and any(str(n.get("tls", "")).startswith("failed") for n in own_tls["notes"])
            and not any("request" in n for n in own_tls["notes"]),
        ),
        (
            "plain HTTP on the distributor's port",
            plain,
            plain["event"]["type"] == "bundle.error" and "[SSL: " in plain["reason"] and said(kept, "[SSL: ")
            and plain["held"] == held_raw and plain["serial"] == s and any("error" in n for n in plain["notes"])
            and not any(n.get("status") == 200 for n in plain["notes"]),
        ),
    ]  # fmt: skip
    for attack_, r, ok in checks:
        record("bundle (MITM)", f"{attack_}, serving serial {s + 1} (hall-signed, fresh)", short(r), ok)
    mirror_checks = [
        (
            f"serial {s + 1} signed by the hall, expired 1 h ago",
            expired,
            expired["event"]["type"] == "bundle.refused" and "expired at" in expired["reason"]
            and expired["held"] == held_raw and expired["serial"] == s
            and any(n.get("status") == 200 for n in expired["notes"]),
        ),
        (
            f"serial {s + 2} signed by the hall, undated (older-dated)",
            undated,
            undated["event"]["type"] == "bundle.refused" and "older-dated" in undated["reason"]
            and undated["held"] == held_raw and undated["serial"] == s,
        ),
        (
            f"control: serial {s + 3}, fresh (90 s), same mirror",
            fresh,
            fresh["event"]["type"] == "bundle.accepted" and fresh["serial"] == s + 3 and fresh["held"] == fresh_raw,
        ),
        (
            f"the node's previous serial {s} replayed (issued earlier, not expired)",
            replay,
            replay["event"]["type"] == "bundle.refused" and "(rollback)" in replay["reason"]
            and replay["held"] == fresh_raw and replay["serial"] == s + 3,
        ),
    ]  # fmt: skip
    for attack_, r, ok in mirror_checks:
        record("bundle (hall-CA mirror)", attack_, short(r), ok)
    held_expired = _metric(expired_held, "sco_agent_bundle_expired") == 1 and held_after == fresh_raw
    record(
        "bundle (hall-CA mirror)",
        "the held bundle expires: kept, sco_agent_bundle_expired",
        f"expired {_metric(expired_held, 'sco_agent_bundle_expired'):g}, serial "
        f"{_metric(expired_held, 'sco_agent_bundle_serial'):g}, file unchanged {held_after == fresh_raw}",
        held_expired and _metric(expired_held, "sco_agent_bundle_serial") == s + 3,
    )
    counted = refused_after - refused_before == 3 and said("bundle refused", "expired at") and said("older-dated")
    record(
        "bundle (hall-CA mirror)",
        "refusals counted (sco-agent status) and said in the agent's log",
        f"refused +{refused_after - refused_before}, {len(warned)} WARNING lines",
        counted and said("bundle refused", "(rollback)"),
    )
    for what, r, ok in [*checks, *mirror_checks]:
        assert ok, (what, r["event"], r["serial"], r["notes"][-3:], warned)
    assert held_expired and _metric(expired_held, "sco_agent_bundle_serial") == s + 3, expired_held
    assert counted and said("bundle refused", "(rollback)"), (refused_before, refused_after, warned)
    # put back: the node's own cache and resolver (node_led_to_attacker), its agent on the hall's bundle again
    _wait(lambda: _metric(_metrics(NODE), "sco_agent_bundle_serial") == s, 60, f"{NODE} back on serial {s}")
    assert (cache / "bundle.json").read_bytes() == held_raw
