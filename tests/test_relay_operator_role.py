"""Role notice_relay in operator mode (notice_relay_auth_mode: operator). The role applied to this machine
as a relay host without systemd (its paths in the test's directory); nats-server started exactly as the unit it
installed says (ExecStart), the stream tool run as its ExecStartPost runs it (on the relay-admin creds the role
copied). An inventory node connects with the creds the role minted on the controller and hears the reclaimer's
notice; a node enrolled at run time (relay_identity.issue, with the controller's keys the role made) connects
without a restart or reload; a node may not subscribe to another's notices; a node added to the inventory is pushed
to the running relay by the role's next run (no restart notified), and a run after that changes nothing. The attacks
of test_relay_accounts.py against operator mode are test_relay_jwt.py's."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
from pathlib import Path

import nats
from nats.errors import TimeoutError as NatsTimeoutError

from sco.provider import relay_identity as ri
from tests.relays import (
    HALL,
    OPERATOR_PLAY,
    Deployed,
    ca_for,
    event_acked,
    notices_reach,
    relay_refusal,
    run_playbook,
    tls_for,
)

SHOW = """
- name: What role hall hands node a's agent
  hosts: localhost
  gather_facts: false
  roles: [sco.orchestrator.hall]
  tasks:
    - name: Show
      ansible.builtin.debug:
        msg: "{{ {'creds': node_agent_nats_creds} | to_json }}"
"""


async def cross_subscription(url: str, creds: Path, node: str, other: str) -> str:
    """Node ``node`` subscribes to ``other``'s notices: the relay's answer."""
    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    nc = await nats.connect(url, user_credentials=str(creds), error_cb=on_error, **tls_for(url))
    try:
        await nc.subscribe(f"sco.notice.{HALL}.{other}")
        with contextlib.suppress(NatsTimeoutError):
            await nc.flush(timeout=3)
        for _ in range(30):
            if errors:
                break
            await asyncio.sleep(0.1)
        return errors[0] if errors else "no error"
    finally:
        await nc.close()


def enrol_at_run_time(relay: Deployed, node: str) -> Path:
    """As the control loop would for a node it launched: the controller's hall keys (the ones the role made), the
    node's own key, its account pushed to the running relay."""
    keys = ri.HallKeys.ensure(relay.creds / "operator", HALL)
    key = ri.NKey.generate("user")

    async def issue() -> ri.NodeIdentity:
        admin = await ri.RelayAdmin.connect(relay.url, keys, tls_ca_file=ca_for(relay.url))
        try:
            return await ri.issue(admin, keys, node, key.public)
        finally:
            await admin.close()

    identity = asyncio.run(issue())
    path = relay.root / f"node-{node}.creds"
    path.write_text(ri.creds(identity.user_jwt, key.seed))
    path.chmod(0o600)
    return path


def recap_changed(out: str) -> int:
    m = re.search(r"localhost\s+:\s+ok=\d+\s+changed=(\d+)", out)
    assert m, out[-3000:]
    return int(m.group(1))


def test_the_role_in_operator_mode_serves_inventory_and_run_time_nodes(tmp_path: Path) -> None:
    relay = Deployed(tmp_path)
    first = relay.apply(["a", "b"])
    assert "RUNNING HANDLER [sco.orchestrator.notice_relay : Find out whether systemd runs here]" in first.stdout

    # the relay host: public keys and signed JWTs; the only seed is the stream tool's (relay-admin's creds)
    conf = relay.etc / "nats-server.conf"
    text = conf.read_text()
    assert "resolver {\n  type: full" in text and f'dir: "{tmp_path}/store/accounts"' in text
    assert not re.search(r"\bS[OAU][A-Z2-7]{50,}", text), "a seed in the relay's configuration"
    admin = relay.etc / "admin.creds"
    assert admin.stat().st_mode & 0o777 == 0o600 and not (relay.etc / "admin.nk").exists()
    seeds = {p.name for p in relay.etc.iterdir() if re.search(r"\bS[OAU][A-Z2-7]{50,}", p.read_text())}
    assert seeds == {"admin.creds"}, seeds
    assert admin.read_text() == (relay.creds / "relay-admin.creds").read_text()
    # the controller: the hall's keys (and the public halves the enrolment service gets) and one creds file per
    # user, 0600
    keys = ("operator", "operator-signer", "system", "notices", "events", "node-issuer", "system-admin")
    assert sorted(p.name for p in (relay.creds / "operator").iterdir()) == sorted(
        [f"{n}.nk" for n in keys] + [f"{n}.pub" for n in ("operator", "notices", "events")]
    )
    made = sorted(p.name for p in relay.creds.glob("*.creds"))
    # relay-sync: a cluster's relay catching up before it starts (the relay host gets it only in a cluster)
    assert made == [
        "control.creds",
        "node-a.creds",
        "node-b.creds",
        "reclaimer.creds",
        "relay-admin.creds",
        "relay-sync.creds",
    ], made
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in relay.creds.rglob("*.*"))
    # the configuration nats-server -t accepts, the resolver's directory made before it (its owner the relay's)
    check = subprocess.run([*relay.unit("ExecStart"), "-t"], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    assert (tmp_path / "store" / "accounts").owner() == "sco-nats"

    # role hall hands node a's agent its creds in operator mode
    show = run_playbook(
        tmp_path, SHOW,
        {"sco_hall": HALL, "sco_relay_url": relay.url, "sco_credentials_dir": str(relay.creds.parent),
         "notice_relay_auth_mode": "operator", "node_agent_node": "a"},
    )  # fmt: skip
    assert show.returncode == 0, show.stdout + show.stderr
    given = json.loads(json.loads(show.stdout.split('"msg": ', 1)[1].split("\n}", 1)[0]))
    assert given["creds"] == (relay.creds / "node-a.creds").read_text().rstrip("\n")

    relay.start()
    try:
        # the stream tool as the unit's ExecStartPost runs it, on the creds the role copied
        post = relay.unit("ExecStartPost")
        assert post[post.index("--creds") + 1] == str(admin)
        stream = subprocess.run(post, capture_output=True, text=True, timeout=60)
        assert [json.loads(x) for x in stream.stdout.splitlines()] == [
            {"stream": "SCO_EVENTS", "action": "created"}, {"stream": "SCO_HEARTBEATS", "action": "created"},
        ], stream.stderr  # fmt: skip
        before = relay.varz()
        pid = relay.proc.pid if relay.proc else 0

        # an inventory node on the creds the role minted; a node enrolled at run time on its own
        node_a = relay.creds / "node-a.creds"
        node_c = enrol_at_run_time(relay, "c")
        reclaimer = relay.creds / "reclaimer.creds"
        got = asyncio.run(notices_reach(relay.url, reclaimer, {"a": node_a, "c": node_c}))
        assert got == {"a": [b"notice for a"], "c": [b"notice for c"]}, got
        assert asyncio.run(event_acked(relay.url, node_a, "a")) == 1
        assert asyncio.run(event_acked(relay.url, node_c, "c")) == 2
        # node c may not listen to node a's notices
        refused = asyncio.run(cross_subscription(relay.url, node_c, "c", "a"))
        assert "permissions violation" in refused.lower() and f"sco.notice.{HALL}.a" in refused, refused
        # bare nkeys (static mode's identity) are refused in operator mode
        bare = asyncio.run(relay_refusal(relay.url, nkeys_seed=str(relay.creds / "node-b.nk")))
        assert "authorization violation" in bare.lower(), bare

        # the inventory grows while the relay runs: the role's next run pushes the new node's account, no restart
        second = relay.apply(["a", "b", "d"])
        assert "RUNNING HANDLER" not in second.stdout, second.stdout[-4000:]
        assert re.search(r"TASK \[sco\.orchestrator\.notice_relay : Push the changed accounts[^\n]*\n"
                         r"changed: \[localhost", second.stdout), second.stdout[-4000:]  # fmt: skip
        got = asyncio.run(notices_reach(relay.url, reclaimer, {"d": relay.creds / "node-d.creds", "c": node_c}))
        assert got == {"d": [b"notice for d"], "c": [b"notice for c"]}, got
        # the same server all along: never restarted nor reloaded
        after = relay.varz()
        assert relay.proc is not None and relay.proc.pid == pid and relay.proc.poll() is None
        assert (after["start"], after["config_load_time"]) == (before["start"], before["config_load_time"])
        # once converged, a run changes nothing
        third = relay.apply(["a", "b", "d"]).stdout
        assert recap_changed(third) == 0, [t for t in third.split("\n\nTASK ") if "\nchanged:" in t]
    finally:
        relay.stop()


def test_the_role_in_operator_mode_takes_a_hall_with_no_inventory_node(tmp_path: Path) -> None:
    """A hall whose every node is launched by the control loop (molecule hall-lifecycle) lists none in the
    inventory: in operator mode they enrol at run time, so the role must not ask for one (it refused: 'list the
    nodes in notice_relay_nodes'). Its relay starts, and a node enrolled at run time hears its notice."""
    relay = Deployed(tmp_path)
    relay.apply([])
    assert sorted(p.name for p in relay.creds.glob("*.creds")) == [
        "control.creds",
        "reclaimer.creds",
        "relay-admin.creds",
        "relay-sync.creds",
    ]
    check = subprocess.run([*relay.unit("ExecStart"), "-t"], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    relay.start()
    try:
        stream = subprocess.run(relay.unit("ExecStartPost"), capture_output=True, text=True, timeout=60)
        assert stream.returncode == 0, stream.stderr
        node_c = enrol_at_run_time(relay, "c")
        got = asyncio.run(notices_reach(relay.url, relay.creds / "reclaimer.creds", {"c": node_c}))
        assert got == {"c": [b"notice for c"]}, got
    finally:
        relay.stop()


def test_a_relay_with_tls_off_needs_no_hall_ca(tmp_path: Path) -> None:
    """sco_relay_tls false (a plaintext relay, as a hall upgraded from a release before TLS runs it until its
    clients have the CA): the role never reads the hall's CA, which such a hall does not have. It failed on the copy
    of the certificate files, whose loop (templated before the task's when) looked the CA up."""
    relay = Deployed(tmp_path)
    out = run_playbook(tmp_path, OPERATOR_PLAY, {**relay.vars([]), "notice_relay_tls": False})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert not relay.ca.exists() and not (tmp_path / "relay-tls").exists()
    text = (relay.etc / "nats-server.conf").read_text()
    assert not re.search(r"^\s*tls\s*\{", text, re.M), text


def test_an_image_build_in_an_operator_mode_hall_gets_no_node_identity(tmp_path: Path) -> None:
    """sco.orchestrator.bake_image in a hall whose relay is in operator mode (molecule hall-lifecycle): the image
    has no node (its instances enrol at first boot), so role hall must hand it no creds; it looked up
    node-<build host>.creds on the controller and failed the build ('Unable to access the file')."""
    creds = tmp_path / "state" / "credentials" / "nats"
    creds.mkdir(parents=True)
    show = run_playbook(
        tmp_path, SHOW,
        {"sco_hall": HALL, "sco_relay_url": "nats://127.0.0.1:4222", "sco_credentials_dir": str(creds.parent),
         "notice_relay_auth_mode": "operator", "node_agent_node": "build-vm", "node_agent_image_build": True},
    )  # fmt: skip
    assert show.returncode == 0, show.stdout[-3000:] + show.stderr[-3000:]
    given = json.loads(json.loads(show.stdout.split('"msg": ', 1)[1].split("\n}", 1)[0]))
    assert given["creds"] == "", given


def test_a_static_relay_switched_to_operator_mode_keeps_its_stream(tmp_path: Path) -> None:
    """What a running static-mode hall's relay does on the site run that makes it operator mode (role hall's default
    for a hall with control hosts): the events already in the stream (the reclaimer may not have read them) are
    there after the switch, in the operator's events account, and the node goes on with its creds."""
    relay = Deployed(tmp_path)
    static = run_playbook(tmp_path, OPERATOR_PLAY, {**relay.vars(["a"]), "notice_relay_auth_mode": "static"})
    assert static.returncode == 0, static.stdout[-6000:] + static.stderr[-3000:]
    relay.start()
    try:
        post = subprocess.run(relay.unit("ExecStartPost"), capture_output=True, text=True, timeout=60)
        assert post.returncode == 0, post.stderr

        async def event_on_seed() -> int:
            nc = await nats.connect(relay.url, nkeys_seed=str(relay.creds / "node-a.nk"),
                                    inbox_prefix=ri.node_inbox(HALL, "a"), **tls_for(relay.url))  # fmt: skip
            try:
                ack = await nc.jetstream(timeout=5).publish(f"sco.events.{HALL}.a", b'{"event": "before"}')
                return int(ack.seq)
            finally:
                await nc.close()

        assert asyncio.run(event_on_seed()) == 1
    finally:
        relay.stop()

    relay.apply(["a"])  # operator mode
    events = (relay.creds / "operator" / "events.pub").read_text().strip()
    assert sorted(p.name for p in (tmp_path / "store" / "jetstream").iterdir()) == [events]
    relay.start()
    try:
        post = subprocess.run(relay.unit("ExecStartPost"), capture_output=True, text=True, timeout=60)
        assert post.returncode == 0, post.stderr
        assert {"stream": "SCO_EVENTS", "action": "unchanged"} in [json.loads(x) for x in post.stdout.splitlines()]
        # the event from before the switch is the stream's first; the node's next, on its creds, the second
        assert asyncio.run(event_acked(relay.url, relay.creds / "node-a.creds", "a")) == 2
        bare = asyncio.run(relay_refusal(relay.url, nkeys_seed=str(relay.creds / "node-a.nk")))
        assert "authorization violation" in bare.lower(), bare
    finally:
        relay.stop()
