"""The control loop end to end on real parts.

Pending pods on the Kubernetes API **stand-in** and pending jobs on a real slurmctld -> the private data directory
laid out by role sco.orchestrator.control_loop -> the command its systemd unit runs (``sco-control-loop``: the
fleet-state lock, ansible-runner, control_loop.yml: demand -> plan -> arbitrate -> acquire) -> instances on the
real Nova (fake virt driver) with their signed contract subset -> a second run changes nothing -> the demand goes
-> the idle instances are scaled down. The fleet state is a real PostgreSQL.
"""

from __future__ import annotations

import base64
import getpass
import grp
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from sco.contract.bundle import Bundle
from sco.contract.compiler import compile_repo
from sco.contract.signing import Keyring, delegate, delegation_text, generate, sign, write_keypair
from sco.contract.userdata import CACHE_PATH
from sco.control.record import PgFleetStore
from sco.state.db import connect, hall_lock
from sco.state.fleet import FleetState
from sco_devkit.demo import sample_repo
from sco_devkit.devcluster.slurm import SlurmCluster
from sco_devkit.standins.kube_apiserver import KubeApiStandIn
from tests.control_loop_run import BIN, CONTRACTS, ROOT, lay_out, run_loop
from tests.harness import TEST_POLICY, wait_for

pytestmark = pytest.mark.slow

HALL = "local"


@pytest.fixture
def slurm(tmp_path: Path) -> Iterator[SlurmCluster]:
    c = SlurmCluster(tmp_path / "slurm", nodes=("n1",))
    c.start()
    # the marker says the script runs under its stepd (RUNNING in squeue comes before the batch launch, which
    # may still fail under load and put the job back to pending)
    (c.root / "job.sh").write_text(f"#!/bin/bash\ntouch {c.root}/started.$SLURM_JOB_ID\nsleep 300 & wait $!\n")
    yield c
    c.run("scancel", "--user=root", check=False)
    c.stop()


def cleanup(conn: Any) -> None:
    for s in conn.compute.servers(tags=f"sco-hall={HALL}"):
        conn.compute.delete_server(s.id, ignore_missing=True)


def test_control_loop_end_to_end(openstack_cloud, fleet_dsn, slurm: SlurmCluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    conn = openstack_cloud.connect()
    kube = KubeApiStandIn().start()
    try:
        # the hall's contracts, signed by its root key (on the controller only); the launch key that signs launch
        # subsets on the control host, under the root's delegation (as site.yml makes them)
        key, launch = generate(), generate()
        trust = tmp_path / "trusted"
        trust.mkdir()
        controller = tmp_path / "controller"
        controller.mkdir()
        write_keypair(key, controller / "hall.key", trust / "hall.pub")
        write_keypair(launch, controller / "launch.key", controller / "launch.pub")
        now = int(time.time())
        delegation = delegate(key, launch.public, HALL, issued_at=now - 60, expires_at=now + 14 * 86_400, serial=1)
        (controller / "launch.delegation").write_text(delegation_text(delegation))
        repo = tmp_path / "repo"
        shutil.copytree(sample_repo(), repo)
        shutil.rmtree(repo / "contracts")
        (repo / "hall.yaml").write_text(TEST_POLICY)
        (repo / "contracts.yaml").write_text(CONTRACTS)
        (tmp_path / "bundle.json").write_bytes(sign(compile_repo(repo), [key]))

        # pending work: 3 x 2 CPUs of web (tier 3), 2 x 1 CPU of guarded (tier 2), a pod no contract selects
        tol = [{"key": "sco.dev/reclaim", "operator": "Equal", "value": "reclaimable", "effect": "NoSchedule"}]

        def pod(name: str, cpu: str) -> dict[str, Any]:
            res = {"requests": {"cpu": cpu, "memory": "1Gi"}}
            return {
                "metadata": {"name": name},
                "spec": {"tolerations": tol, "containers": [{"name": "c", "resources": res}]},
            }

        for i in range(3):
            kube.cluster.create_pod("web", pod(f"web-{i}", "2"))
        for i in range(2):
            kube.cluster.create_pod("guarded", pod(f"guarded-{i}", "1"))
        kube.cluster.create_pod("nobody", pod("stray", "1"))
        # real Slurm: a job fills the only node, so these stay pending: climate 2 CPUs, genomics 2 x 2 CPUs
        script = slurm.root / "job.sh"
        filler = slurm.sbatch(script, "-A", "genomics", "--comment=sco-contract=genomics-ckpt", "-c", "2")
        wait_for(lambda: (slurm.root / f"started.{filler}").exists(), 60, "the filler job's script running")
        assert slurm.job(filler).get("JobState") == "RUNNING"
        jobs = [slurm.sbatch(script, "-A", "climate", "-c", "2")]
        jobs += [
            slurm.sbatch(script, "-A", "genomics", "--comment=sco-contract=genomics-ckpt", "-c", "2") for _ in range(2)
        ]

        large = openstack_cloud.flavors["sco.large"]  # 4 vCPUs, 4 GiB: 4 units
        # the loopback cloud has no network to allocate ports on (see sco.devcluster.openstack.NetworkEndpoint)
        pool = {"flavor": large, "image": openstack_cloud.image_id, "vcpus": 4, "ramMiB": 4096,
                "launch": {"networks": "none"}}  # fmt: skip
        pools = [
            {"name": "spot-a", "kind": "reclaimable", "cap": 1, "group": "rack-1", **pool},
            {"name": "spot-b", "kind": "reclaimable", "cap": 1, "group": "rack-2", **pool},
            {"name": "od", "kind": "on-demand", "cap": 2, "pricePerHour": "2.00", **pool},
        ]
        clouds = openstack_cloud.write_clouds_yaml(tmp_path / "clouds.yaml")
        argv, env = lay_out(
            tmp_path,
            {
                "control_loop_hall": HALL,
                "control_loop_interval": "2min",
                "control_loop_venv": str(Path(sys.executable).parent.parent),
                "control_loop_collections_path": str(ROOT / "collections"),
                "control_loop_data_dir": str(tmp_path / "runner"),
                "control_loop_state_dsn": fleet_dsn,
                "control_loop_cloud": "sco-loopback",
                "control_loop_clouds_yaml": str(clouds),
                "control_loop_bundle": str(tmp_path / "bundle.json"),
                "control_loop_trust_dir": str(trust),
                "control_loop_trusted_keys": [],  # the test fills its trust directory itself
                "control_loop_launch_key": str(controller / "launch.key"),
                "control_loop_launch_delegation": str(controller / "launch.delegation"),
                "_control_loop_launch_dir": str(tmp_path / "etc" / "control-loop"),
                "control_loop_kubernetes": {"url": kube.url},
                "control_loop_slurm": {"slurm_conf": str(slurm.conf), "reclaimable_partitions": ["spot"]},
                "control_loop_pools": pools,
                "control_loop_settings": {"shares": {1: "1/2", 2: "1/2", 3: 1}, "idleGraceSeconds": 0},
                "control_loop_ceiling_per_hour": "3.00",
                "control_loop_timer_enabled": False,
                # the test runs the loop itself, as this user: no system user made on the test machine
                "control_loop_user": getpass.getuser(),
                "control_loop_group": grp.getgrgid(os.getgid()).gr_name,
                "control_loop_create_user": False,
                "_control_loop_unit_dir": str(tmp_path / "units"),
                "_control_loop_env_file": str(tmp_path / "etc" / "control-loop.env"),
            },
        )
        assert argv[0] == str(BIN / "sco-control-loop") and "--private-data-dir" in argv
        # the control host's files: the launch key (the unit user's, 0600) and its delegation, no root key anywhere
        launch_dir = tmp_path / "etc" / "control-loop"
        assert sorted(f.name for f in launch_dir.iterdir()) == ["launch.delegation", "launch.key"]
        assert (launch_dir / "launch.key").stat().st_mode & 0o777 == 0o600
        root_seed = bytes(key.signing_key).hex()
        on_host = [f for d in (tmp_path / "etc", tmp_path / "runner", tmp_path / "units") for f in d.rglob("*")]
        assert not [f for f in on_host if f.is_file() and root_seed in f.read_text(errors="replace")]
        assert env == {"SCO_DB_DSN": fleet_dsn}

        # run 1: demand -> plan -> arbitrate -> acquire
        rc, first, out = run_loop(argv, env)
        assert rc == 0, out
        print(out)  # the run's summary, for the record (pytest -s)
        assert first["demand_units"] == {"climate-sims": 2.0, "genomics-ckpt": 4.0, "guarded": 2.0, "web": 6.0}
        assert first["uncontracted"] == 1
        assert first["plan_changed"] is True
        assert first["planned"] == {
            "spot-a": {"target": 1, "launch": 1, "delete": 0},
            "spot-b": {"target": 1, "launch": 1, "delete": 0},
        }
        # tier 3 does not fit the capped reclaimable pools: web may fall back (one od instance within the
        # hall ceiling of 3.00/h), genomics may not
        assert first["granted"] == ["web: 1 x od (2.00/h)"]
        assert [r.split(":")[0] for r in first["refused"]] == ["genomics-ckpt"]
        assert "its contract does not allow on-demand fallback" in first["refused"][0]
        assert (first["launched"], first["deleted"], first["launch_failed"]) == (3, 0, 0)

        servers = {s.name: s for s in conn.compute.servers(details=True, tags=f"sco-hall={HALL}")}
        assert len(servers) == 3 and {s.status for s in servers.values()} == {"ACTIVE"}
        with PgFleetStore(fleet_dsn) as store:
            fleet = store.fleet(HALL)
            plans = store.plans(HALL)
            arbs = store.arbitrations(HALL)
            runs = store.runs(HALL)
        assert {i.pool for i in fleet} == {"spot-a", "spot-b", "od"}
        launched_with = {p["pool"]: p["launch_contracts"] for p in plans[-1]["body"]["pools"] if p["launch"]}
        for inst in fleet:
            # each server carries the signed subset of exactly the contracts its entry was planned for
            full = conn.compute.get_server(servers[inst.name].id)
            files = {f["path"]: f for f in yaml.safe_load(base64.b64decode(full.user_data).decode())["write_files"]}
            # signed by the launch key under the root's delegation; the node is given the root to trust, no other key
            raw = base64.b64decode(files[CACHE_PATH]["content"])
            subset = Bundle.from_bytes(raw, Keyring([key.public]), delegated=True)
            assert subset.verified.keyid == launch.keyid and subset.delegation is not None
            assert subset.delegation.issuer == key.keyid and subset.delegation.serial == 1
            assert [f for f in files if f.startswith("/etc/sco/trusted/")] == [f"/etc/sco/trusted/{key.keyid}.pub"]
            assert sorted(subset.contracts) == list(inst.contracts)
            assert list(inst.contracts) == (["web"] if inst.pool == "od" else launched_with[inst.pool])
        assert plans[-1]["run_id"] == first["run_id"] and any(d["kind"] == "launch" for d in plans[-1]["decisions"])
        assert {(a["contract"], a["outcome"]) for a in arbs} == {("web", "grant"), ("genomics-ckpt", "refuse")}
        assert runs[-1]["status"] == "ok" and runs[-1]["summary"]["launched"] == 3

        # run 2: the same pending work; the instances launched for it are there: nothing changes
        rc, second, out = run_loop(argv, env)
        assert rc == 0, out
        print(out)
        assert second["plan_changed"] is False and second["planned"] == {}
        assert (second["launched"], second["deleted"]) == (0, 0) and second["granted"] == []
        assert {s.id for s in conn.compute.servers(tags=f"sco-hall={HALL}")} == {s.id for s in servers.values()}

        # one run at a time: while another holder has the hall's control-loop lock, a run refuses to start
        with connect(fleet_dsn) as other, hall_lock(other, f"{HALL}/control-loop"):
            rc, _, out = run_loop(argv, env)
        assert rc == 8 and "another writer holds the fleet-state lock" in out

        # the demand goes: pods deleted, jobs cancelled
        for ns, names in (("web", [f"web-{i}" for i in range(3)]), ("guarded", ["guarded-0", "guarded-1"])):
            for name in names:
                kube.cluster.delete_pod(ns, name, 0)
        slurm.run("scancel", *map(str, jobs))
        rc, third, out = run_loop(argv, env)
        assert rc == 0, out
        print(out)
        assert third["demand_units"] == {}
        assert third["planned"] == {
            "spot-a": {"target": 0, "launch": 0, "delete": 1},
            "spot-b": {"target": 0, "launch": 0, "delete": 1},
            "od": {"target": 0, "launch": 0, "delete": 1},
        }
        assert (third["launched"], third["deleted"]) == (0, 3)
        wait_for(lambda: not list(conn.compute.servers(tags=f"sco-hall={HALL}")), 60, "the idle servers gone")
        with FleetState(fleet_dsn) as st:
            assert st.instances(HALL) == []  # no live instance left
            assert any(e["kind"] == "instance.deleted" for e in st.events(hall=HALL))
    finally:
        kube.stop()
        cleanup(conn)
        conn.close()


RECLAIM_PLAY = """
- name: Launch, then reclaim
  hosts: localhost
  gather_facts: false
  module_defaults:
    group/sco.orchestrator.control:
      hall: reclaimtest
      cloud: sco-loopback
      bundle: "{{ bundle }}"
      trust_dir: "{{ trust_dir }}"
  tasks:
    - name: Plan
      sco.orchestrator.plan:
        demand: {demand: [{contract: web, units_milli: 3000}]}
        pools: "{{ pools }}"
      register: plan
      when: nodes | length == 0
    - name: Acquire
      sco.orchestrator.acquire:
        plan: "{{ plan }}"
        pools: "{{ pools }}"
        signing_keys: ["{{ signing_key }}"]
      when: nodes | length == 0
    - name: Reclaim
      sco.orchestrator.reclaim:
        nodes: "{{ nodes }}"
        nats_url: "{{ nats_url }}"
        notice_keys: ["{{ signing_key }}"]
        window: 10  # the bundle's floor: web's 6 s budget + 2 s final write + the 2 s margin
      when: nodes | length > 0
"""


def test_reclaim_module_notices_then_deletes_at_the_deadline(  # type: ignore[no-untyped-def]
    openstack_cloud, fleet_dsn, nats_server, tmp_path: Path
) -> None:
    import ansible_runner

    key = generate()
    trust = tmp_path / "trusted"
    trust.mkdir()
    write_keypair(key, tmp_path / "signing.key", trust / "signing.pub")
    repo = tmp_path / "repo"
    shutil.copytree(sample_repo(), repo)
    shutil.rmtree(repo / "contracts")
    (repo / "hall.yaml").write_text(TEST_POLICY)
    (repo / "contracts.yaml").write_text(CONTRACTS)
    (tmp_path / "bundle.json").write_bytes(sign(compile_repo(repo), [key]))
    pool = {"flavor": openstack_cloud.flavors["sco.large"], "image": openstack_cloud.image_id, "vcpus": 4,
            "launch": {"networks": "none"}}  # fmt: skip
    extra = {
        "bundle": str(tmp_path / "bundle.json"),
        "trust_dir": str(trust),
        "signing_key": str(tmp_path / "signing.key"),
        "pools": [{"name": "spot", "kind": "reclaimable", "cap": 2, "ramMiB": 4096, **pool}],
        "nats_url": nats_server.url,
        "ansible_python_interpreter": sys.executable,
    }
    clouds = openstack_cloud.write_clouds_yaml(tmp_path / "clouds.yaml")
    env = {
        "ANSIBLE_COLLECTIONS_PATH": str(ROOT / "collections"),
        "PATH": f"{BIN}:{os.environ['PATH']}",
        "OS_CLIENT_CONFIG_FILE": str(clouds),
        "SCO_DB_DSN": fleet_dsn,
    }

    def play(nodes: list[str], *flags: str) -> dict[str, Any]:
        pdd = tmp_path / f"r{len(list(tmp_path.glob('r*')))}"
        (pdd / "project").mkdir(parents=True)
        (pdd / "project" / "play.yml").write_text(RECLAIM_PLAY)
        r = ansible_runner.run(
            private_data_dir=str(pdd),
            playbook="play.yml",
            extravars={**extra, "nodes": nodes},
            envvars=env,
            cmdline=" ".join(flags) or None,
            quiet=True,
        )
        res = {e["event_data"]["task"]: e["event_data"]["res"] for e in r.events if e.get("event") == "runner_on_ok"}
        assert r.rc == 0, r.stdout.read()
        return res

    conn = openstack_cloud.connect()
    try:
        assert play([])["Acquire"]["launched"] == 1
        with FleetState(fleet_dsn) as st:
            (inst,) = st.instances("reclaimtest")
        check = play([inst.name], "--check")["Reclaim"]
        assert check["changed"] is True and check["would_reclaim"] == [inst.name] and check["reclaimed"] == []
        with FleetState(fleet_dsn) as st:
            assert st.instance(inst.id).state == "active"  # check mode sent nothing
        done = play([inst.name])["Reclaim"]
        (r,) = done["reclaimed"]
        assert r["name"] == inst.name and r["published"] is True and r["state"] == "deleted"
        with FleetState(fleet_dsn) as st:
            kinds = [e["kind"] for e in st.events(instance_id=inst.id)]
        assert "reclaim.scheduled" in kinds and "notice.published" in kinds and kinds[-1] == "instance.deleted"
        assert conn.compute.find_server(inst.server_id, ignore_missing=True) is None
    finally:
        for s in conn.compute.servers(tags="sco-hall=reclaimtest"):
            conn.compute.delete_server(s.id, ignore_missing=True)
        conn.close()


BLAZAR_PLAY = """
- name: Plan with committed capacity from Blazar
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Plan
      sco.orchestrator.plan:
        hall: blazartest
        cloud: sco-loopback
        bundle: "{{ bundle }}"
        trust_dir: "{{ trust_dir }}"
        demand: {demand: []}
        pools: "{{ pools }}"
        fleet: []
        now: "{{ now }}"
        reservations_from: blazar
"""


def test_floors_are_held_on_capacity_read_from_blazar_leases(blazar, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A tier-1 floor of 24 units on a committed pool whose lease (one host of 8 x 4-unit instances) is read from
    the real Blazar: 6 instances launched for the floor, none beyond."""
    import time
    from datetime import UTC, datetime

    import ansible_runner

    key = generate()
    trust = tmp_path / "trusted"
    trust.mkdir()
    write_keypair(key, tmp_path / "signing.key", trust / "signing.pub")
    repo = tmp_path / "repo"
    shutil.copytree(sample_repo(), repo)
    shutil.rmtree(repo / "contracts")
    (repo / "hall.yaml").write_text(TEST_POLICY)
    (repo / "contracts.yaml").write_text(
        CONTRACTS
        + """---
apiVersion: sco.dev/v1
kind: WorkloadContract
metadata: {name: api}
spec:
  scheduler: kubernetes
  selector: {namespace: api}
  tier: 1
  drainBudgetSeconds: 6
  checkpoint: {mode: none}
  requeue: {policy: always}
  floor: {vcpus: 24, memoryGiB: 16}
"""
    )
    (tmp_path / "bundle.json").write_bytes(sign(compile_repo(repo), [key]))
    conn = blazar.connect()
    ep = {"service_type": "reservation"}
    # only an ACTIVE lease is committed capacity: one that starts now (no server of this test is on the host)
    start = int(time.time())
    name = f"floor-{os.urandom(2).hex()}"
    fmt = "%Y-%m-%d %H:%M"
    body = {
        "name": name,
        "start_date": "now",
        "end_date": datetime.fromtimestamp(start + 7200, UTC).strftime(fmt),
        "reservations": [
            {
                "resource_type": "physical:host",
                "min": 1,
                "max": 1,
                "hypervisor_properties": "",
                "resource_properties": "",
            }
        ],
        "events": [],
    }
    resp = conn.session.post("/leases", json=body, endpoint_filter=ep, raise_exc=False)
    assert resp.status_code in (200, 201, 202), resp.text
    lease = resp.json()["lease"]

    def status() -> str:
        got = conn.session.get(f"/leases/{lease['id']}", endpoint_filter=ep, raise_exc=False)
        return str(got.json()["lease"]["status"]) if got.status_code == 200 else f"HTTP {got.status_code}"

    try:
        wait_for(lambda: status() == "ACTIVE", 120, "the lease ACTIVE", 1.0)
        pool = {"flavor": "f", "image": "i", "vcpus": 4, "ramMiB": 4096}
        pools = [
            {"name": "committed", "kind": "committed", "cap": 20, "lease": name, "instancesPerHost": 8, **pool},
            {"name": "spot", "kind": "reclaimable", "cap": 4, **pool},
        ]
        pdd = tmp_path / "runner"
        (pdd / "project").mkdir(parents=True)
        (pdd / "project" / "play.yml").write_text(BLAZAR_PLAY)
        clouds = blazar.write_clouds_yaml(tmp_path / "clouds.yaml")
        r = ansible_runner.run(
            private_data_dir=str(pdd),
            playbook="play.yml",
            extravars={
                "bundle": str(tmp_path / "bundle.json"),
                "trust_dir": str(trust),
                "pools": pools,
                "now": time.time(),
                "ansible_python_interpreter": sys.executable,
            },
            envvars={
                "ANSIBLE_COLLECTIONS_PATH": str(ROOT / "collections"),
                "PATH": f"{BIN}:{os.environ['PATH']}",
                "OS_CLIENT_CONFIG_FILE": str(clouds),
            },
            quiet=True,
        )
        res = next(e["event_data"]["res"] for e in r.events if e.get("event") in ("runner_on_ok", "runner_on_failed"))
        assert r.rc == 0, res
        plan = res["plan"]
        assert plan["floors_milli"] == {"api": 24_000}
        committed = next(p for p in plan["pools"] if p["pool"] == "committed")
        assert (committed["launch"], committed["launch_contracts"]) == (6, ["api"])
        assert any(d["kind"] == "floor" and "24 units on committed" in d["reason"] for d in plan["decisions"])
    finally:
        conn.session.delete(f"/leases/{lease['id']}", endpoint_filter=ep, raise_exc=False)
        # Blazar ends a lease by deleting what runs on its hosts: let it finish before another test launches
        wait_for(lambda: status() == "HTTP 404", 120, "the lease gone", 1.0)
        conn.close()
