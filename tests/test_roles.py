"""The collection's roles (node_agent, slurm_admission) through real Ansible runs over SSH to a test host: a Debian
rootfs in its own network namespace. Check mode, for real, and again (idempotent); then what they installed runs."""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sco import __version__
from sco.contract.signing import generate, write_keypair
from sco.control.steps import node_environment
from tests.testhosts import REPO, TestHost


@pytest.fixture(scope="module")
def wheelhouse(node_wheelhouse: Path) -> Path:
    """sco and its run-time dependencies as wheels at agent/constraints.txt's pins: what an air-gapped hall or an image
    build installs from (built once per session, tests/node_install.py)."""
    return node_wheelhouse


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestHost]:
    h = TestHost(tmp_path_factory.mktemp("hosts"), "spot-a").create()
    yield h
    h.destroy()


def play(
    tmp: Path, host: TestHost, extravars: dict[str, Any], check: bool = False, playbook: str = "node_agent.yml"
) -> Any:
    import ansible_runner

    pdd = tmp / f"runner-{len(list(tmp.glob('runner-*')))}"
    (pdd / "project").mkdir(parents=True)
    (pdd / "project" / playbook).write_text((REPO / "playbooks" / playbook).read_text())
    hosts = {"hosts": {host.name: host.inventory_vars()}}
    inventory = {"all": {"children": {"sco_nodes": hosts, "slurm_controllers": hosts}}}
    return ansible_runner.run(
        private_data_dir=str(pdd),
        playbook=playbook,
        inventory=inventory,
        extravars=extravars,
        cmdline="--check" if check else None,
        quiet=True,
        envvars={
            "ANSIBLE_COLLECTIONS_PATH": str(REPO / "collections"),
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
            "ANSIBLE_HOST_KEY_CHECKING": "False",
        },
    )


def test_node_agent_role_check_real_again(tmp_path: Path, host: TestHost, wheelhouse: Path) -> None:
    key = generate()
    write_keypair(key, tmp_path / "hall.key", tmp_path / "hall.pub")
    ev = {
        "node_agent_hall": "local",
        "node_agent_wheelhouse": str(wheelhouse),
        "node_agent_trusted_keys": [str(tmp_path / "hall.pub")],
        "node_agent_kube_url": "http://127.0.0.1:6443",
        "node_agent_metadata_url": "",
        "node_agent_nats_url": "nats://127.0.0.1:4222",
    }

    r = play(tmp_path, host, ev, check=True)
    assert r.rc == 0, r.stdout.read()
    assert r.stats["changed"].get(host.name, 0) > 0
    assert host.ssh("test", "-e", "/opt/sco", check=False).returncode != 0  # check mode did nothing

    # what an agent of an older release, running as root, left: a spool with an event not yet published
    from sco.agent.spool import CRITICAL, Spool

    old = Spool(host.root / "var/lib/sco/spool")
    old.append("drain.drained", CRITICAL, notice="from-the-root-days")
    old.close()

    r = play(tmp_path, host, ev)
    assert r.rc == 0, r.stdout.read()
    assert r.stats["changed"].get(host.name, 0) > 0

    r = play(tmp_path, host, ev)
    assert r.rc == 0 and r.stats["changed"].get(host.name, 0) == 0  # idempotent

    # the agent's own system user, which owns its state (the old spool given over, kept) and reads
    # its config through its group; the unit runs as it, with no capability on a Kubernetes node
    assert host.ssh("getent", "passwd", "sco-agent").stdout.split(":")[6].strip() == "/usr/sbin/nologin"
    # (ssh joins the arguments into one command line: a format without spaces)
    st = host.ssh("stat", "-c", "%U:%G:%a:%n", "/var/lib/sco", "/var/lib/sco/spool",
                  "/var/lib/sco/spool/events.spool", "/etc/sco/agent.toml", check=False)  # fmt: skip
    assert st.returncode == 0, st.stderr
    owners = [line.rsplit(":", 2) for line in st.stdout.split()]
    assert [o[0] for o in owners] == ["sco-agent:sco-agent"] * 3 + ["root:sco-agent"], owners
    assert owners[0][1] == "750" and owners[3][1] == "640", owners
    unit = host.ssh("cat", "/etc/systemd/system/sco-agent.service.d/10-ansible.conf").stdout
    assert "User=sco-agent" in unit and "Group=sco-agent" in unit and "CAP_KILL" not in unit
    assert "polkit.Result.YES" in host.ssh("cat", "/etc/polkit-1/rules.d/60-sco-agent.rules").stdout

    # what the role left behaves: the config passes the agent's own check, the unit is enabled and points
    # at the virtual environment, and the agent starts and spools from it
    out = host.ssh("/opt/sco/bin/sco-agent", "check-config", "--config", "/etc/sco/agent.toml").stdout
    assert f"node {host.name}, hall local, kubernetes" in out
    assert host.ssh("systemctl", "is-enabled", "sco-agent.service").stdout.strip() == "enabled"
    dropin = host.ssh("cat", "/etc/systemd/system/sco-agent.service.d/10-ansible.conf").stdout
    assert "ExecStart=/opt/sco/bin/sco-agent run --config /etc/sco/agent.toml" in dropin
    assert host.ssh("stat", "-c", "%a", "/etc/sco/trusted/hall.pub").stdout.strip() == "644"
    # a launched instance's first boot: cloud-init writes the launch's bundle as root; the unit's first
    # ExecStartPre ("+", as root) gives it to the agent's user before check-config (systemd's "$$" is "$")
    host.ssh("sh", "-c", "rm -rf /var/lib/sco/bundle; mkdir /var/lib/sco/bundle; echo {} >/var/lib/sco/bundle/b.json")
    pre = [line.split("=", 1)[1] for line in dropin.splitlines() if line.startswith("ExecStartPre=+")]
    assert len(pre) == 1 and dropin.index("ExecStartPre=+") < dropin.index("check-config"), dropin
    script = pre[0].removeprefix("+").removeprefix("/bin/sh -c ").strip("'").replace("$$", "$")
    host.ssh("sh", "-c", shlex.quote(script))  # ssh hands the remote shell one line: quoted once for it
    owned = host.ssh("stat", "-c", "%U:%G", "/var/lib/sco/bundle", "/var/lib/sco/bundle/b.json").stdout.split()
    assert owned == ["sco-agent:sco-agent"] * 2, owned
    # as the unit runs it: its user, no capability (systemd does not run in a test host)
    as_agent = ["setpriv", "--reuid=sco-agent", "--regid=sco-agent", "--init-groups", "--inh-caps=-all",
                "--bounding-set=-all", "--no-new-privs"]  # fmt: skip
    run = host.ssh("timeout", "4", *as_agent, "/opt/sco/bin/sco-agent", "run", "--config", "/etc/sco/agent.toml",
                   check=False)  # fmt: skip
    assert run.returncode == 124, run.stderr  # still running when the timeout stopped it
    events = host.ssh("/opt/sco/bin/sco-agent", "events", "--state-dir", "/var/lib/sco").stdout
    assert '"type": "agent.started"' in events and "from-the-root-days" in events

    # the agent's user owns the state directory, and the role works in it as root: links the user put there (to
    # files it must never own) are not followed on the next run, neither at the top nor inside the spool
    host.ssh("sh", "-c", shlex.quote(
        "echo secret >/etc/victim-top; echo secret >/etc/victim-spool; chmod 600 /etc/victim-top /etc/victim-spool;"
        " ln -s /etc/victim-top /var/lib/sco/scheduler.json; ln -s /etc/victim-spool /var/lib/sco/spool/link"
    ))  # fmt: skip
    r = play(tmp_path, host, ev)
    assert r.rc == 0, r.stdout.read()
    owned = host.ssh("stat", "-c", "%U:%G", "/etc/victim-top", "/etc/victim-spool").stdout.split()
    assert owned == ["root:root"] * 2, owned
    host.ssh("rm", "-f", "/etc/victim-top", "/etc/victim-spool", "/var/lib/sco/scheduler.json")
    host.ssh("rm", "-f", "/var/lib/sco/spool/link")
    pkgs = host.ssh("/opt/sco/bin/python", "-m", "pip", "list", "--format=freeze").stdout.lower()
    # the pinned release of the collection, under the distribution's own name
    assert f"spot-capacity-orchestrator=={__version__}" in pkgs and "aiohttp" not in pkgs  # the agent's env stays lean


def test_node_agent_role_runs_slurm_nodes_as_slurm_user(tmp_path: Path, host: TestHost, wheelhouse: Path) -> None:
    """Slurm decides by uid who may DRAIN: with node_agent_user unset a Slurm node's agent runs as the cluster's
    SlurmUser from slurm.conf (keys case-insensitive), the account left as it is; no SlurmUser there: root."""
    key = generate()
    write_keypair(key, tmp_path / "hall.key", tmp_path / "hall.pub")
    ev = {
        "node_agent_hall": "local",
        "node_agent_scheduler": "slurm",
        "node_agent_slurm_conf": "/etc/slurm/slurm.conf",
        "node_agent_wheelhouse": str(wheelhouse),
        "node_agent_trusted_keys": [str(tmp_path / "hall.pub")],
        "node_agent_metadata_url": "",
        "node_agent_nats_url": "nats://127.0.0.1:4222",
    }
    # the cluster's SlurmUser as Slurm's packages make it: a login shell and a home the role must not touch
    if host.ssh("getent", "passwd", "slurm", check=False).returncode != 0:
        host.ssh("useradd", "--system", "--shell", "/bin/bash", "--home-dir", "/var/lib/slurm", "slurm")
    before = host.ssh("getent", "passwd", "slurm").stdout
    host.ssh("mkdir", "-p", "/etc/slurm")
    conf = "ClusterName=hall\n# SlurmUser=nobody\nslurmuser = slurm\nSlurmctldHost=ctl\n"
    host.ssh(f"printf {shlex.quote(conf)} > /etc/slurm/slurm.conf")
    dropin = "/etc/systemd/system/sco-agent.service.d/10-ansible.conf"
    try:
        r = play(tmp_path, host, ev)
        assert r.rc == 0, r.stdout.read()
        unit = host.ssh("cat", dropin).stdout
        assert "User=slurm\n" in unit and "Group=slurm\n" in unit and "AmbientCapabilities=CAP_KILL" in unit, unit
        assert host.ssh("getent", "passwd", "slurm").stdout == before  # shell and home untouched
        st = host.ssh("stat", "-c", "%U:%G", "/var/lib/sco", "/etc/sco/agent.toml").stdout.split()
        assert st == ["slurm:slurm", "root:slurm"], st
        again = play(tmp_path, host, ev)
        assert again.rc == 0 and again.stats["changed"].get(host.name, 0) == 0  # idempotent

        # no SlurmUser= in slurm.conf: Slurm's own default, root
        host.ssh(f"printf {shlex.quote('ClusterName=hall' + chr(10))} > /etc/slurm/slurm.conf")
        r = play(tmp_path, host, ev)
        assert r.rc == 0, r.stdout.read()
        unit = host.ssh("cat", dropin).stdout
        assert "User=root\n" in unit and "Group=root\n" in unit and "AmbientCapabilities=CAP_KILL" in unit, unit
        assert host.ssh("getent", "passwd", "slurm").stdout == before

        # a cluster that made sco-agent an operator says so: the role makes that user
        r = play(tmp_path, host, {**ev, "node_agent_user": "sco-agent"})
        assert r.rc == 0, r.stdout.read()
        unit = host.ssh("cat", dropin).stdout
        assert "User=sco-agent\n" in unit and "Group=sco-agent\n" in unit, unit
    finally:
        host.ssh("rm", "-rf", "/etc/slurm/slurm.conf")
        # back to a Kubernetes node, as the module's other tests expect it
        r = play(tmp_path, host, {**ev, "node_agent_scheduler": "kubernetes", "node_agent_slurm_conf": "",
                                  "node_agent_kube_url": "http://127.0.0.1:6443"})  # fmt: skip
        assert r.rc == 0, r.stdout.read()
    unit = host.ssh("cat", dropin).stdout
    assert "User=sco-agent\n" in unit and "CAP_KILL" not in unit, unit


def test_node_agent_role_refuses_a_token_it_cannot_renew(tmp_path: Path, host: TestHost) -> None:
    """The unit writes only the state directory: a renewed token elsewhere could never replace the file."""
    key = generate()
    write_keypair(key, tmp_path / "hall.key", tmp_path / "hall.pub")
    ev = {
        "node_agent_hall": "local",
        "node_agent_trusted_keys": [str(tmp_path / "hall.pub")],
        "node_agent_kube_url": "http://127.0.0.1:6443",
        "node_agent_kube_token_file": "/etc/sco/kube-token",
    }
    r = play(tmp_path, host, ev)
    assert r.rc != 0
    failed = [e for e in r.events if e.get("event") == "runner_on_failed"]
    msg = failed[0]["event_data"]["res"]["msg"] if failed else ""
    assert "/etc/sco/kube-token" in msg and "/var/lib/sco" in msg and "\n" not in msg.strip(), msg
    assert failed[0]["event_data"]["task"] == "Check the Kubernetes token file is where the agent may renew it"
    # renewed by something else, the agent only reads it: allowed there
    host.ssh("mkdir -p /etc/sco && echo t > /etc/sco/kube-token")
    try:
        r = play(tmp_path, host, {**ev, "node_agent_kube_token_renew": False}, check=True)
        assert r.rc == 0, r.stdout.read()
    finally:
        host.ssh("rm", "-f", "/etc/sco/kube-token")


def _revocation(tmp_path: Path, host: TestHost, role: str, playbook: str, trust_dir: str, ev: dict[str, Any]) -> None:
    """A key taken off the list stops verifying on the next run; a key file someone put in
    the trust directory by hand is not trusted either: the role owns the directory."""
    from tests.harness import hall_bundle

    old, new = generate(), generate()
    write_keypair(old, tmp_path / "old.key", tmp_path / "old.pub")
    write_keypair(new, tmp_path / "new.key", tmp_path / "new.pub")
    (host.root / "root" / "by-old.json").write_bytes(hall_bundle(tmp_path / "o", old))
    (host.root / "root" / "by-new.json").write_bytes(hall_bundle(tmp_path / "n", new))
    keys = {f"{role}_trusted_keys": [str(tmp_path / "old.pub"), str(tmp_path / "new.pub")]}
    r = play(tmp_path, host, {**ev, **keys}, playbook=playbook)
    assert r.rc == 0, r.stdout.read()
    verify = ("/opt/sco/bin/sco", "contract", "verify", "/root/by-old.json", "--trust-dir", trust_dir)
    assert host.ssh(*verify, check=False).returncode == 0

    (host.root / trust_dir.lstrip("/") / "stray.pub").write_bytes((tmp_path / "old.pub").read_bytes())
    r = play(tmp_path, host, {**ev, f"{role}_trusted_keys": [str(tmp_path / "new.pub")]}, playbook=playbook)
    assert r.rc == 0, r.stdout.read()
    assert host.ssh("ls", trust_dir).stdout.split() == ["new.pub"]
    refused = host.ssh(*verify, check=False)
    assert refused.returncode == 3, refused.stderr
    assert host.ssh(*verify[:3], "/root/by-new.json", *verify[4:], check=False).returncode == 0


def test_node_agent_role_revokes_keys(tmp_path: Path, host: TestHost, wheelhouse: Path) -> None:
    ev = {
        "node_agent_hall": "local",
        "node_agent_wheelhouse": str(wheelhouse),
        "node_agent_kube_url": "http://127.0.0.1:6443",
        "node_agent_metadata_url": "",
    }
    _revocation(tmp_path, host, "node_agent", "node_agent.yml", "/etc/sco/trusted", ev)


def test_slurm_admission_role_revokes_keys(tmp_path: Path, host: TestHost, wheelhouse: Path) -> None:
    ev = {
        "slurm_admission_bundle_file": "/root/by-new.json",
        "slurm_admission_wheelhouse": str(wheelhouse),
        "slurm_admission_reclaimable_partitions": ["spot"],
        "slurm_admission_plugin_check": "warn",
    }
    _revocation(tmp_path, host, "slurm_admission", "slurm_admission.yml", "/etc/slurm/sco-trusted", ev)


def test_node_agent_role_refuses_bad_settings(tmp_path: Path, host: TestHost) -> None:
    r = play(tmp_path, host, {"node_agent_hall": "Bad Hall", "node_agent_trusted_keys": []})
    assert r.rc != 0
    failed = [e for e in r.events if e.get("event") == "runner_on_failed"]
    assert failed and "set node_agent_hall" in failed[0]["event_data"]["res"]["msg"]


def test_slurm_admission_role(tmp_path: Path, host: TestHost, wheelhouse: Path) -> None:
    from tests.harness import hall_bundle

    key = generate()
    write_keypair(key, tmp_path / "hall.key", tmp_path / "hall.pub")
    (host.root / "root" / "bundle.json").write_bytes(hall_bundle(tmp_path, key))  # as the distributor would
    ev = {
        "slurm_admission_bundle_file": "/root/bundle.json",
        "slurm_admission_wheelhouse": str(wheelhouse),
        "slurm_admission_trusted_keys": [str(tmp_path / "hall.pub")],
        "slurm_admission_reclaimable_partitions": ["spot", "preempt"],
        "slurm_admission_plugin_check": "warn",  # this host has no slurm.conf
    }
    r = play(tmp_path, host, ev, playbook="slurm_admission.yml")
    assert r.rc == 0, r.stdout.read()
    again = play(tmp_path, host, ev, playbook="slurm_admission.yml")
    assert again.rc == 0 and again.stats["changed"].get(host.name, 0) == 0
    table = host.ssh("cat", "/etc/slurm/sco_contracts.lua").stdout
    assert 'reclaimable = {["preempt"] = true, ["spot"] = true}' in table and '["genomics-ckpt"]' in table
    assert host.ssh("cat", "/etc/slurm/sco_contracts.serial").stdout == "1\n"
    assert (REPO / "slurm_plugins" / "job_submit.lua").read_text() == host.ssh(
        "cat", "/etc/slurm/job_submit.lua"
    ).stdout
    # a tampered bundle is refused and the table on disk stays as it was
    raw = (host.root / "root" / "bundle.json").read_bytes()
    (host.root / "root" / "bundle.json").write_bytes(raw.replace(b'"drainBudgetSeconds":6', b'"drainBudgetSeconds":9'))
    bad = play(tmp_path, host, ev, playbook="slurm_admission.yml")
    assert bad.rc != 0
    assert host.ssh("cat", "/etc/slurm/sco_contracts.lua").stdout == table


def test_slurm_admission_role_wants_the_lua_plugin_loaded(tmp_path: Path, host: TestHost, wheelhouse: Path) -> None:
    """Without JobSubmitPlugins=lua job_submit.lua never runs: the role stops and says what to add."""
    from tests.harness import hall_bundle

    key = generate()
    write_keypair(key, tmp_path / "hall.key", tmp_path / "hall.pub")
    (host.root / "root" / "b.json").write_bytes(hall_bundle(tmp_path, key))
    conf = host.root / "etc" / "slurm" / "slurm.conf"
    conf.parent.mkdir(parents=True, exist_ok=True)
    ev = {
        "slurm_admission_bundle_file": "/root/b.json",
        "slurm_admission_wheelhouse": str(wheelhouse),
        "slurm_admission_trusted_keys": [str(tmp_path / "hall.pub")],
    }
    try:
        conf.write_text("ClusterName=hall\n#JobSubmitPlugins=lua\nJobSubmitPlugins=job_submit/require_timelimit\n")
        r = play(tmp_path, host, ev, playbook="slurm_admission.yml")
        assert r.rc != 0
        failed = [e for e in r.events if e.get("event") == "runner_on_failed"]
        assert failed and "add JobSubmitPlugins=lua" in failed[0]["event_data"]["res"]["msg"]

        warned = play(tmp_path, host, {**ev, "slurm_admission_plugin_check": "warn"}, playbook="slurm_admission.yml")
        assert warned.rc == 0, warned.stdout.read()
        assert "WARNING slurm_admission" in warned.stdout.read()

        conf.write_text("ClusterName=hall\njobsubmitplugins = require_timelimit,lua # SCO\nCliFilterPlugins=lua\n")
        ok = play(tmp_path, host, ev, playbook="slurm_admission.yml")
        assert ok.rc == 0, ok.stdout.read()
        assert "WARNING slurm_admission" not in ok.stdout.read()
    finally:
        conf.unlink()


def test_bake_image_installs_and_enables_without_host_state(tmp_path: Path, host: TestHost, wheelhouse: Path) -> None:
    """playbooks/bake_image.yml (node_agent_image_build): enabled, never started even where systemd seems to run,
    and nothing of the build host left: no node name, no credentials, no spool or bundle cache, no wheelhouse."""
    key = generate()
    write_keypair(key, tmp_path / "hall.key", tmp_path / "hall.pub")
    # what an earlier life of this machine left behind
    host.ssh("mkdir", "-p", "/var/lib/sco/spool", "/var/lib/sco/bundle", "/etc/sco", "/run/systemd/system")
    host.ssh("sh", "-c", "echo x > /var/lib/sco/spool/events.log; echo SCO_AGENT_HALL=old > /etc/sco/agent.env")
    ev = {
        "node_agent_hall": "local",
        "node_agent_wheelhouse": str(wheelhouse),
        "node_agent_trusted_keys": [str(tmp_path / "hall.pub")],
        "node_agent_nats_password": "must-not-be-baked",
        "node_agent_metadata_url": "",
    }
    try:
        r = play(tmp_path, host, ev, playbook="bake_image.yml")
        assert r.rc == 0, r.stdout.read()
        started = [
            e
            for e in r.events
            if e["event"] in ("runner_on_ok", "runner_on_skipped", "runner_on_failed")
            and e.get("event_data", {}).get("task") == "Start the agent"
        ]
        # skipped although /run/systemd/system is there: the image build is the condition that held it back
        assert [e["event"] for e in started] == ["runner_on_skipped"]
    finally:
        host.ssh("rmdir", "/run/systemd/system")
    assert host.ssh("systemctl", "is-enabled", "sco-agent.service").stdout.strip() == "enabled"
    # the unit names the agent's user: the image holds it
    assert host.ssh("id", "-u", "sco-agent").stdout.strip().isdigit()
    cfg = host.ssh("cat", "/etc/sco/agent.toml").stdout
    assert "node =" not in cfg and "must-not-be-baked" not in cfg and "node-spot-a" not in cfg
    assert host.ssh("ls", "-A", "/var/lib/sco").stdout == ""
    assert host.ssh("test", "-e", "/opt/sco-wheelhouse", check=False).returncode != 0
    assert host.ssh("test", "-e", "/etc/sco/agent.env", check=False).returncode != 0
    # at first boot the node takes its name from its hostname (here the machine's: a chroot has no UTS namespace)
    out = host.ssh("/opt/sco/bin/sco-agent", "check-config", "--config", "/etc/sco/agent.toml").stdout
    hostname = host.ssh("hostname", "-s").stdout.strip()
    assert f"node {hostname}, hall local, kubernetes" in out
    # the instance the control loop launches: cloud-init writes the acquire step's agent.env, which names the node
    # by its Nova server (the agent reads only SCO_AGENT_* keys: SCO_NODE used to be ignored, the node misnamed)
    env = node_environment({"SCO_AGENT_BUNDLE_URL": "http://distributor:8470/v1/halls/local/bundle.json"},
                           "local", "local-spot-e1-3")  # fmt: skip
    text = "".join(f"{k}={v}\n" for k, v in env.items())
    host.ssh(f"printf %s {shlex.quote(text)} > /etc/sco/agent.env")  # ssh hands the remote shell one line
    try:
        out = host.ssh(
            "set -a; . /etc/sco/agent.env; /opt/sco/bin/sco-agent check-config --config /etc/sco/agent.toml"
        ).stdout
        assert "node local-spot-e1-3, hall local, kubernetes" in out, out
    finally:
        host.ssh("rm", "-f", "/etc/sco/agent.env")


def test_node_agent_role_without_systemd_runs_the_agent_as_its_user(
    tmp_path: Path, host: TestHost, wheelhouse: Path
) -> None:
    """node_agent_run_without_systemd (a host without systemd, as molecule's): the daemon runs as the unit would, as
    the agent's user after its state entries are given to it (the unit's ExecStartPre "+"), also on the restart after
    an agent of an older release that ran as root left root's files in its spool. Before, the daemon ran as root, and
    the files it wrote were given to the agent's user again on the next run (changed on every run)."""
    key = generate()
    write_keypair(key, tmp_path / "hall.key", tmp_path / "hall.pub")
    ev = {
        "node_agent_hall": "local",
        "node_agent_wheelhouse": str(wheelhouse),
        "node_agent_trusted_keys": [str(tmp_path / "hall.pub")],
        "node_agent_kube_url": "http://127.0.0.1:6443",
        "node_agent_metadata_url": "",
        "node_agent_run_without_systemd": True,
    }

    def agent_user() -> str:
        pid = (host.root / "run/sco-agent.pid").read_text().strip()
        return host.ssh("ps", "-o", "user=", "-p", pid).stdout.strip()

    try:
        r = play(tmp_path, host, ev)
        assert r.rc == 0, r.stdout.read()
        assert agent_user() == "sco-agent"
        # what a root agent left since the last run: a file in the spool; a changed setting restarts the agent
        host.ssh("sh", "-c", shlex.quote("echo x >/var/lib/sco/spool/left-by-root"))
        r = play(tmp_path, host, {**ev, "node_agent_log_level": "debug"})
        assert r.rc == 0, r.stdout.read()
        assert agent_user() == "sco-agent"
        assert host.ssh("stat", "-c", "%U", "/var/lib/sco/spool/left-by-root").stdout.strip() == "sco-agent"
    finally:
        host.ssh(
            "start-stop-daemon --stop --oknodo --retry TERM/15/KILL/5 --pidfile /run/sco-agent.pid --remove-pidfile"
        )


def test_node_agent_role_restarts_an_agent_older_than_its_files(
    tmp_path: Path, host: TestHost, wheelhouse: Path
) -> None:
    """A run that changed the agent's files and then stopped before its handlers, with no failure of its own (a
    batch-mate's failure ends the batch under max_fail_percentage, and Ansible drops the handlers of every host in
    it), left the agent running the old release or settings and no restart-pending marker: the next run found nothing
    to change and restarted nothing. The role now compares the running agent's start with the
    files it reads at start. Here agent.toml is touched (same bytes, newer time) after the agent started, as that run
    left it; the next run restarts the agent, and the run after it changes nothing."""
    key = generate()
    write_keypair(key, tmp_path / "hall.key", tmp_path / "hall.pub")
    ev = {
        "node_agent_hall": "local",
        "node_agent_wheelhouse": str(wheelhouse),
        "node_agent_trusted_keys": [str(tmp_path / "hall.pub")],
        "node_agent_kube_url": "http://127.0.0.1:6443",
        "node_agent_metadata_url": "",
        "node_agent_run_without_systemd": True,
    }

    def agent_pid() -> str:
        return (host.root / "run/sco-agent.pid").read_text().strip()

    try:
        r = play(tmp_path, host, ev)
        assert r.rc == 0, r.stdout.read()
        before = agent_pid()
        # more than /proc/stat's whole-second boot time after the agent's start
        host.ssh("sh", "-c", shlex.quote("sleep 2.5; touch /etc/sco/agent.toml"))
        assert host.ssh("test", "-e", "/var/lib/sco/restart-pending", check=False).returncode != 0
        r = play(tmp_path, host, ev)
        out = r.stdout.read()
        assert r.rc == 0, out
        assert "the running agent started before /etc/sco/agent.toml changed" in out, out[-4000:]
        after = agent_pid()
        assert after != before, "the agent older than its settings was not restarted"
        r = play(tmp_path, host, ev)
        assert r.rc == 0, r.stdout.read()
        assert r.stats["changed"].get(host.name, 0) == 0, r.stats
        assert agent_pid() == after
    finally:
        host.ssh(
            "start-stop-daemon --stop --oknodo --retry TERM/15/KILL/5 --pidfile /run/sco-agent.pid --remove-pidfile"
        )


def test_node_agent_role_refuses_a_downgrade(tmp_path: Path, host: TestHost, wheelhouse: Path) -> None:
    """pip installs `==version` whatever the venv holds, an older release included: the role refused nothing, and a
    hall could run an older agent on a newer one's spool. Refused, naming both releases, the
    venv left as it was; sco_allow_downgrade lets it go on to pip (which then finds no such release here)."""
    key = generate()
    write_keypair(key, tmp_path / "hall.key", tmp_path / "hall.pub")
    ev = {
        "node_agent_hall": "local",
        "node_agent_wheelhouse": str(wheelhouse),
        "node_agent_trusted_keys": [str(tmp_path / "hall.pub")],
        "node_agent_kube_url": "http://127.0.0.1:6443",
        "node_agent_metadata_url": "",
    }
    r = play(tmp_path, host, ev)
    assert r.rc == 0, r.stdout.read()
    record = "stat -c %Y /opt/sco/lib/python3*/site-packages/spot_capacity_orchestrator-*.dist-info/RECORD"
    installed = host.ssh("sh", "-c", shlex.quote(record)).stdout
    r = play(tmp_path, host, {**ev, "node_agent_version": "0.0.1"})
    out = r.stdout.read()
    assert r.rc != 0, out
    assert f"node_agent: /opt/sco on {host.name} holds spot-capacity-orchestrator {__version__}, newer than the 0.0.1" \
        " asked for" in out, out[-4000:]  # fmt: skip
    assert "The venv is left as it is" in out
    assert host.ssh("sh", "-c", shlex.quote(record)).stdout == installed
    r = play(tmp_path, host, {**ev, "node_agent_version": "0.0.1", "sco_allow_downgrade": True})
    out = r.stdout.read()
    assert r.rc != 0 and "spot-capacity-orchestrator==0.0.1" in out, out[-4000:]  # pip's own refusal, not ours
    assert "newer than the 0.0.1" not in out


def _wheel(directory: Path, name: str, version: str) -> Path:
    """A minimal pure-Python wheel: a release of `name` the tests never ran with (no code, only metadata)."""
    import base64
    import hashlib
    import zipfile

    dist = f"{name}-{version}.dist-info"
    files = {
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }

    def digest(text: str) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()

    record = "".join(f"{n},sha256={digest(t)},{len(t.encode())}\n" for n, t in files.items()) + f"{dist}/RECORD,,\n"
    path = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for n, t in {**files, f"{dist}/RECORD": record}.items():
            z.writestr(n, t)
    return path


def _index_with_a_newer_jeepney(host: TestHost, wheelhouse: Path) -> None:
    """The host's "index": pip's global configuration pointing at the wheelhouse and a jeepney newer than the pin."""
    index = host.root / "srv/index"
    index.mkdir(parents=True, exist_ok=True)
    for w in wheelhouse.glob("*.whl"):
        (index / w.name).write_bytes(w.read_bytes())
    _wheel(index, "jeepney", "99.0")
    (host.root / "etc/pip.conf").write_text("[global]\nno-index = true\nfind-links = /srv/index\n")


def test_node_agent_role_holds_an_index_install_to_the_tested_versions(
    tmp_path: Path, host: TestHost, wheelhouse: Path
) -> None:
    """Without a wheelhouse the role installs from the index, where the product's dependencies have open ranges
    (jeepney>=0.8): a host got whatever was newest that day, not what was tested. The role now
    gives pip the collection's constraints (constraints/control.txt's pins). The host's "index" here is pip's global
    configuration pointing at a directory with the wheelhouse and a jeepney newer than the pin."""
    from sco_devkit.constraints import read

    pin = read()["jeepney"]
    _index_with_a_newer_jeepney(host, wheelhouse)
    key = generate()
    write_keypair(key, tmp_path / "hall.key", tmp_path / "hall.pub")
    ev = {
        "node_agent_hall": "local",
        "node_agent_venv": "/opt/sco-index",
        "node_agent_wheelhouse": "",
        "node_agent_trusted_keys": [str(tmp_path / "hall.pub")],
        "node_agent_kube_url": "http://127.0.0.1:6443",
        "node_agent_metadata_url": "",
    }
    try:
        r = play(tmp_path, host, ev)
        assert r.rc == 0, r.stdout.read()
        got = [p.name for p in (host.root / "opt/sco-index/lib").glob("python3*/site-packages/jeepney-*.dist-info")]
        assert got == [f"jeepney-{pin}.dist-info"], f"{got} installed, the constraints pin jeepney {pin}"
        shipped = REPO / "collections/ansible_collections/sco/orchestrator/roles/node_agent/files/constraints.txt"
        assert (host.root / "opt/sco-index-constraints.txt").read_text() == shipped.read_text()
        r = play(tmp_path, host, ev)
        assert r.rc == 0, r.stdout.read()
        assert r.stats["changed"].get(host.name, 0) == 0, r.stats
    finally:
        (host.root / "etc/pip.conf").unlink(missing_ok=True)


def test_node_agent_role_waits_for_a_drain_before_pip_moves_anything(
    tmp_path: Path, host: TestHost, wheelhouse: Path
) -> None:
    """The wait before pip ran only when the release pinned changed: dependencies moved to new pins under the same
    release (a hall's first run with the constraints, its hosts having resolved open ranges), a local label or an
    unpinned requirement's newer release were put under a draining agent. While a drain
    is open pip is now asked what it would install, and anything waits. Here the venv got jeepney 99.0 from an index
    without the pins; with the pins pip would move it back while the spool shows a drain open: the run waits and fails
    past node_agent_drain_wait_s with the venv untouched, and installs once the drain has its outcome. A run with
    nothing for pip to do does not wait for an open drain."""
    import time

    from sco.agent.spool import CRITICAL, Spool
    from sco_devkit.constraints import read

    pin = read()["jeepney"]
    _index_with_a_newer_jeepney(host, wheelhouse)
    key = generate()
    write_keypair(key, tmp_path / "hall.key", tmp_path / "hall.pub")
    ev = {
        "node_agent_hall": "local",
        "node_agent_venv": "/opt/sco-repin",
        "node_agent_wheelhouse": "",
        "node_agent_trusted_keys": [str(tmp_path / "hall.pub")],
        "node_agent_kube_url": "http://127.0.0.1:6443",
        "node_agent_metadata_url": "",
        "node_agent_drain_wait_s": 4,
        "node_agent_drain_poll_s": 2,
    }

    def jeepney() -> list[str]:
        site = host.root / "opt/sco-repin/lib"
        return [p.name for p in site.glob("python3*/site-packages/jeepney-*.dist-info")]

    spool: Spool | None = None
    try:
        r = play(tmp_path, host, {**ev, "sco_pip_constraints": False})
        assert r.rc == 0, r.stdout.read()
        assert jeepney() == ["jeepney-99.0.dist-info"]
        spool = Spool(host.root / "var/lib/sco/spool")
        now = time.time()
        notice = {"terminate_at": now + 600, "issued_at": now, "source": "test", "received_at": now}
        spool.append("notice.accepted", CRITICAL, notice="n-repin", **notice)
        r = play(tmp_path, host, ev)  # the same release, the pins on: pip would move jeepney to the pin
        out = r.stdout.read()
        assert r.rc != 0, out[-4000:]
        assert "the drain of notice n-repin" in out and "is still open" in out, out[-4000:]
        assert jeepney() == ["jeepney-99.0.dist-info"]  # pip did not run
        spool.append("drain.drained", CRITICAL, notice="n-repin")
        r = play(tmp_path, host, ev)
        assert r.rc == 0, r.stdout.read()
        assert jeepney() == [f"jeepney-{pin}.dist-info"]
        # nothing for pip to do: an open drain is not waited for (pip's dry run installs nothing)
        spool.append("notice.accepted", CRITICAL, notice="n-idle", **notice)
        r = play(tmp_path, host, ev)
        out = r.stdout.read()
        assert r.rc == 0, out[-4000:]
        assert "Wait for the agent's drain to end" not in out, out[-4000:]
    finally:
        if spool is not None:  # no drain left open for the module's later tests
            spool.append("drain.drained", CRITICAL, notice="n-idle")
        (host.root / "etc/pip.conf").unlink(missing_ok=True)


def test_node_agent_role_purge_leaves_no_owed_restart(tmp_path: Path, host: TestHost, wheelhouse: Path) -> None:
    """node_agent_state absent with node_agent_purge_data after a run whose drain wait failed the host: the marker that
    run left in the state directory (restart-pending: the restart owed to the next run) goes with the rest, and the
    state directory with it. Runs last: it removes the agent from the module's test host."""
    key = generate()
    write_keypair(key, tmp_path / "hall.key", tmp_path / "hall.pub")
    ev = {
        "node_agent_hall": "local",
        "node_agent_wheelhouse": str(wheelhouse),
        "node_agent_trusted_keys": [str(tmp_path / "hall.pub")],
        "node_agent_kube_url": "http://127.0.0.1:6443",
        "node_agent_metadata_url": "",
    }
    r = play(tmp_path, host, ev)
    assert r.rc == 0, r.stdout.read()
    # what the role's handler leaves before a drain wait that then fails the host
    host.ssh("sh", "-c", shlex.quote("echo owed >/var/lib/sco/restart-pending; chmod 600 /var/lib/sco/restart-pending"))
    r = play(tmp_path, host, {**ev, "node_agent_state": "absent", "node_agent_purge_data": True})
    assert r.rc == 0, r.stdout.read()
    assert host.ssh("test", "-e", "/var/lib/sco", check=False).returncode != 0, host.ssh(
        "ls", "-A", "/var/lib/sco"
    ).stdout
