"""The control loop converges on a real cloud: the loop's steps in the order
of ``control_loop.yml``, run in-process as its modules run them (``sco.control.steps.run``), against real Nova
(fake virt driver), Keystone, Placement and Glance on loopback, a real PostgreSQL fleet state and the Kubernetes
API **stand-in** holding a fixed demand. Faults between runs: kill -9 mid-launch, a server deleted behind the
product's back, OpenStack cut off; after each, the next run brings the fleet state and Nova into agreement.

Each test checks agreement itself (``drift``: every live record has its server, no record stuck while Nova has
the server ACTIVE, no tagged server without a record), not through the product's own reconciliation report.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml

from sco.contract.signing import generate, write_keypair
from sco.control import steps
from sco_devkit.standins.kube_apiserver import KubeApiStandIn
from tests.harness import hall_bundle, wait_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PLAYBOOK = ROOT / "collections/ansible_collections/sco/orchestrator/playbooks/control_loop.yml"
LIVE = ("requested", "launching", "active", "notified", "draining", "drained", "overrun", "deleting")
TOL = [{"key": "sco.dev/reclaim", "operator": "Equal", "value": "reclaimable", "effect": "NoSchedule"}]


def playbook_steps() -> list[str]:
    """The sco.orchestrator steps of the control-loop playbook, in its order."""
    tasks = yaml.safe_load(PLAYBOOK.read_text())[0]["tasks"]
    return [k.split(".")[-1] for t in tasks for k in t if k.startswith("sco.orchestrator.")]


def call(step: str, params: dict[str, Any], check: bool = False) -> dict[str, Any]:
    return dict(steps.run(step, params, check))


class Hall:
    """A hall's control loop as its timer runs it, with the options control_loop.yml passes each module."""

    def __init__(self, name: str, tmp: Path, openstack_cloud: Any, dsn: str, kube: KubeApiStandIn, cap: int = 4):
        key = generate()
        trust = tmp / "trusted"
        trust.mkdir(exist_ok=True)
        write_keypair(key, tmp / "signing.key", trust / "signing.pub")
        (tmp / "bundle.json").write_bytes(hall_bundle(tmp, key))
        self.name = name
        self.kube = kube
        self.common = {
            "hall": name,
            "cloud": openstack_cloud.cloud_config,
            "state_dsn": dsn,
            "bundle": str(tmp / "bundle.json"),
            "trust_dir": str(trust),
            "api_timeout": 10.0,
        }
        # flavor and image by name, as a hall writes them; the loopback cloud has no network to allocate
        self.pools = [
            {"name": "spot", "kind": "reclaimable", "flavor": "sco.large", "image": "sco-node", "vcpus": 4,
             "ramMiB": 4096, "cap": cap, "launch": {"networks": "none"}},
        ]  # fmt: skip
        self.key = str(tmp / "signing.key")
        self.settings = {"shares": {1: 1, 2: 1, 3: 1}}

    def pods(self, n: int, cpu: str = "2", start: int = 0) -> None:
        for i in range(start, start + n):
            res = {"requests": {"cpu": cpu, "memory": "1Gi"}}
            pod = {
                "metadata": {"name": f"web-{i}"},
                "spec": {"tolerations": TOL, "containers": [{"name": "c", "resources": res}]},
            }
            self.kube.cluster.create_pod("web", pod)

    def args(self, step: str, out: dict[str, dict[str, Any]]) -> dict[str, Any]:
        p = {**self.common}
        if step == "demand":
            p["kubernetes"] = {"url": self.kube.url}
        elif step == "plan":
            p |= {"demand": out["demand"], "pools": self.pools, "settings": self.settings}
        elif step == "arbitrate":
            p |= {"plan": out["plan"], "pools": self.pools, "settings": self.settings, "ceiling_per_hour": "0"}
        elif step == "acquire":
            p |= {"plan": out["plan"], "arbitration": out["arbitrate"], "pools": self.pools, "signing_keys": [self.key]}
        return p

    def run(self, *, cloud: Any = None) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for step in playbook_steps():
            params = self.args(step, out)
            if cloud is not None:
                params["cloud"] = cloud
            out[step] = call(step, params)
        return out


def tagged(conn: Any, hall: str) -> dict[str, Any]:
    return {s.id: s for s in conn.compute.servers(details=True, tags=f"sco-hall={hall}") if s.status != "DELETED"}


def records(dsn: str, hall: str) -> list[tuple[str, str | None, str, int]]:
    with psycopg.connect(dsn) as c:
        return list(
            c.execute(
                "SELECT name, server_id, state, slot FROM instance WHERE hall = %s AND state = ANY(%s) ORDER BY name",
                (hall, list(LIVE)),
            )
        )


def drift(conn: Any, dsn: str, hall: str) -> list[str]:
    """Where the fleet state and Nova disagree (empty: they agree)."""
    servers = tagged(conn, hall)
    out = []
    known = set()
    for name, sid, state, _ in records(dsn, hall):
        known.add(sid)
        if sid is None or sid not in servers:
            out.append(f"record {name} ({state}) has no server in Nova")
        elif state in ("requested", "launching") and servers[sid].status == "ACTIVE":
            out.append(f"record {name} stuck {state}; Nova has it ACTIVE")
        elif state == "active" and servers[sid].status != "ACTIVE":
            out.append(f"record {name} active; Nova says {servers[sid].status}")
    out += [f"server {s.name} ({sid}) has no live record" for sid, s in servers.items() if sid not in known]
    return out


def cleanup(conn: Any, hall: str) -> None:
    for s in conn.compute.servers(tags=f"sco-hall={hall}"):
        conn.compute.delete_server(s.id, ignore_missing=True)


@pytest.fixture
def cloud(openstack_cloud):  # type: ignore[no-untyped-def]
    conn = openstack_cloud.connect()
    yield conn
    conn.close()


@pytest.fixture
def kube():  # type: ignore[no-untyped-def]
    k = KubeApiStandIn().start()
    yield k
    k.stop()


def launched(out: dict[str, dict[str, Any]]) -> int:
    return int(out["acquire"].get("launched", 0))


# --- the loop ten times, then faults -------------------------------------------------------------------------------


def test_ten_runs_against_a_fixed_demand_launch_only_in_the_first(  # type: ignore[no-untyped-def]
    openstack_cloud, cloud, fleet_dsn, kube, tmp_path
) -> None:
    hall = Hall("ten", tmp_path, openstack_cloud, fleet_dsn, kube)
    hall.pods(3)  # 3 x 2 CPUs of web: two 4-unit instances
    try:
        counts, digests = [], []
        for _ in range(10):
            out = hall.run()
            counts.append(launched(out))
            digests.append(out["plan"]["plan"]["digest"])
            assert drift(cloud, fleet_dsn, "ten") == [], out
        assert counts == [2] + [0] * 9, counts
        assert len(set(digests[1:])) == 1  # the same plan every time the fleet holds it
        assert len(tagged(cloud, "ten")) == 2
    finally:
        cleanup(cloud, "ten")


CHILD = """
import json, sys
from tests.test_reconcile import child_run
child_run(json.loads(open(sys.argv[1]).read()))
"""


def child_run(spec: dict[str, Any]) -> None:
    """A control-loop run in its own process (the test kills it with SIGKILL)."""
    out: dict[str, dict[str, Any]] = {}
    for step in spec["steps"]:
        params = dict(spec["common"])
        if step == "demand":
            params["kubernetes"] = {"url": spec["kube"]}
        elif step in ("plan", "arbitrate"):
            params |= {"pools": spec["pools"], "settings": spec["settings"]}
            params |= {"demand": out["demand"]} if step == "plan" else {"plan": out["plan"], "ceiling_per_hour": "0"}
        elif step == "acquire":
            params |= {"plan": out["plan"], "arbitration": out["arbitrate"], "pools": spec["pools"]}
            params |= {"signing_keys": [spec["key"]], "concurrency": 2}
        out[step] = call(step, params)


def killed_mid_launch(hall: Hall, tmp: Path, dsn: str, when: str, n: int) -> None:
    """Start a loop run that launches ``n`` in a child and kill -9 it: ``when`` = "creating" (some servers
    recorded, not all) or "waiting" (every create answered, the run waiting for ACTIVE)."""
    spec = {"steps": playbook_steps(), "common": hall.common, "kube": hall.kube.url, "pools": hall.pools,
            "settings": hall.settings, "key": hall.key}  # fmt: skip
    f = tmp / f"child-{when}.json"
    f.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (os.environ.get("PYTHONPATH"), str(ROOT))))}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(f)], env=env, cwd=ROOT, stderr=subprocess.PIPE)
    before = {r[0] for r in records(dsn, hall.name) if r[1]}

    def moment() -> bool:
        rows = [r for r in records(dsn, hall.name) if r[0] not in before]
        with_server = [r for r in rows if r[1]]
        if when == "creating":
            return 0 < len(with_server) < n
        return len(with_server) == len(rows) == n and any(r[2] == "launching" for r in rows)

    try:
        wait_for(lambda: moment() or proc.poll() is not None, 120, f"the child run {when}", interval=0.02)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_faults_between_runs_and_the_next_run_agrees_with_nova(  # type: ignore[no-untyped-def]
    openstack_cloud, cloud, fleet_dsn, kube, tmp_path
) -> None:
    hall = Hall("faults", tmp_path, openstack_cloud, fleet_dsn, kube, cap=8)
    try:
        # 1. kill -9 while every create is answered and the run waits for ACTIVE: records left `launching`
        hall.pods(6)  # 12 units: three 4-unit instances
        killed_mid_launch(hall, tmp_path, fleet_dsn, "waiting", 3)
        wait_for(lambda: all(s.status == "ACTIVE" for s in tagged(cloud, "faults").values()), 60, "ACTIVE")
        out = hall.run()
        assert drift(cloud, fleet_dsn, "faults") == [], out
        assert len(tagged(cloud, "faults")) == 3 and launched(out) == 0
        # 2. kill -9 in the middle of the creates (more demand): servers Nova made that were never recorded
        hall.pods(6, start=6)  # 24 units: six instances
        killed_mid_launch(hall, tmp_path, fleet_dsn, "creating", 3)
        out = hall.run()
        assert drift(cloud, fleet_dsn, "faults") == [], out
        assert len(tagged(cloud, "faults")) == 6
        slots = sorted(r[3] for r in records(fleet_dsn, "faults"))
        assert len(slots) == len(set(slots)) == 6  # no slot twice, no duplicate server
        assert launched(hall.run()) == 0 and drift(cloud, fleet_dsn, "faults") == []

        # 3. a server deleted behind the product's back (an operator, Blazar's preemption): lost, and replaced
        victim_name, victim_id, _, _ = records(fleet_dsn, "faults")[0]
        cloud.compute.delete_server(victim_id)
        cloud.compute.wait_for_delete(cloud.compute.get_server(victim_id), interval=0.5, wait=60)
        out = hall.run()
        with psycopg.connect(fleet_dsn) as c:
            (state,) = c.execute("SELECT state FROM instance WHERE server_id = %s", (victim_id,)).fetchall()[0]
            ev = c.execute(
                "SELECT e.detail FROM lifecycle_event e JOIN instance i ON i.id = e.instance_id"
                " WHERE i.server_id = %s AND e.kind = 'instance.lost'",
                (victim_id,),
            ).fetchall()
        assert state == "lost", state
        assert len(ev) == 1 and "no longer in Nova" in ev[0][0]["why"] and ev[0][0]["last_seen"] is not None
        assert [x["name"] for x in out["reconcile"]["reconciliation"]["lost"]] == [victim_name]
        assert launched(out) == 1  # the demand is still there: a replacement, not the lost record counted as room
        assert drift(cloud, fleet_dsn, "faults") == [] and len(tagged(cloud, "faults")) == 6

        # 4. OpenStack cut off: the run fails at reconciliation with the cloud's message, and changes nothing
        before = records(fleet_dsn, "faults")
        nova = openstack_cloud.process_group("nova-api")
        os.killpg(nova, signal.SIGSTOP)  # a silent Nova: every call runs into its deadline
        try:
            t0 = time.monotonic()
            with pytest.raises(Exception) as e:
                hall.run(cloud={**openstack_cloud.cloud_config, "api_timeout": 3})
            took = time.monotonic() - t0
        finally:
            os.killpg(nova, signal.SIGCONT)
        assert "Nova" in str(e.value) and ("timed out" in str(e.value).lower() or "timeout" in str(e.value).lower())
        assert took < 60, took  # the deadline held (a bound on hanging, not a speed figure)
        assert records(fleet_dsn, "faults") == before
        refused = {**openstack_cloud.cloud_config, "auth": {**openstack_cloud.cloud_config["auth"]}}
        refused["auth"]["auth_url"] = "http://127.0.0.1:9/v3"  # nothing listens: connection refused
        with pytest.raises(Exception, match=r"127\.0\.0\.1:9"):
            hall.run(cloud=refused)
        out = hall.run()
        assert launched(out) == 0 and drift(cloud, fleet_dsn, "faults") == []

        # 5. a server's tags removed by hand: it is not "lost" and replaced (it would run unseen for ever), its tags
        # are put back
        sid = sorted(tagged(cloud, "faults"))[0]
        cloud.compute.put(f"/servers/{sid}/tags", json={"tags": []}, microversion="2.26")
        out = hall.run()
        assert [x["server_id"] for x in out["reconcile"]["reconciliation"]["retagged"]] == [sid], out["reconcile"]
        assert not out["reconcile"]["reconciliation"]["lost"] and launched(out) == 0
        assert sid in tagged(cloud, "faults") and len(tagged(cloud, "faults")) == 6
        assert drift(cloud, fleet_dsn, "faults") == []

        # 6. the fleet state's connections cut in the middle of a launch (PostgreSQL restarting): the step fails
        # with the fleet state's own error (exit 11), not a driver traceback; the next run settles what it left
        from sco.state.db import StateError

        hall.pods(2, start=12)  # 4 units more: one instance
        n0 = len(records(fleet_dsn, "faults"))
        box: dict[str, BaseException] = {}

        def run() -> None:
            try:
                hall.run()
            except BaseException as e:
                box["err"] = e

        t = threading.Thread(target=run)
        t.start()
        wait_for(lambda: len(records(fleet_dsn, "faults")) > n0 or not t.is_alive(), 120, "the new record")
        with psycopg.connect(fleet_dsn, autocommit=True) as c:
            c.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        t.join(180)
        assert isinstance(box.get("err"), StateError), box
        assert box["err"].exit_code == 11 and "lost during the acquire step" in str(box["err"])
        out = hall.run()
        assert drift(cloud, fleet_dsn, "faults") == [] and len(tagged(cloud, "faults")) == 7, out
        assert launched(hall.run()) == 0
    finally:
        cleanup(cloud, "faults")


def test_a_reclaimed_slot_is_not_launched_again(openstack_cloud, cloud, fleet_dsn, kube, tmp_path) -> None:  # type: ignore[no-untyped-def]
    hall = Hall("refill", tmp_path, openstack_cloud, fleet_dsn, kube)
    hall.pods(3)
    try:
        assert launched(hall.run()) == 2
        # the reclaimer takes slot 0 back (its record deleted, its server gone) and the demand shrinks with it
        with psycopg.connect(fleet_dsn) as c:
            iid, sid = c.execute(
                "SELECT id, server_id FROM instance WHERE hall = 'refill' AND slot = 0 AND state = 'active'"
            ).fetchall()[0]
            c.execute("UPDATE instance SET state = 'deleted' WHERE id = %s", (iid,))
        cloud.compute.delete_server(sid)
        cloud.compute.wait_for_delete(cloud.compute.get_server(sid), interval=0.5, wait=60)
        kube.cluster.delete_pod("web", "web-0", 0)
        kube.cluster.delete_pod("web", "web-1", 0)  # 2 CPUs left: the remaining instance covers it
        out = hall.run()
        assert out["plan"]["plan"]["pools"][0]["launch"] == 0
        assert launched(out) == 0, out["acquire"]
        assert len(tagged(cloud, "refill")) == 1 and drift(cloud, fleet_dsn, "refill") == []
    finally:
        cleanup(cloud, "refill")


def test_surplus_is_deleted_in_parallel_until_gone(openstack_cloud, cloud, fleet_dsn) -> None:  # type: ignore[no-untyped-def]
    from sco.control.acquirer import Acquirer, PlanEntry
    from sco.state.fleet import FleetState, Pool

    spans: list[tuple[float, float]] = []
    real = cloud.compute.delete_server
    lock = threading.Lock()

    def timed(*a: Any, **kw: Any) -> Any:
        t0 = time.monotonic()
        try:
            return real(*a, **kw)
        finally:
            with lock:
                spans.append((t0, time.monotonic()))

    with FleetState(fleet_dsn) as st:
        st.ensure_pool(Pool("par", "spot", flavor=openstack_cloud.flavors["sco.small"], image=openstack_cloud.image_id))
        try:
            Acquirer(cloud, st, lambda n: "#cloud-config\n").apply(PlanEntry("par", "spot", "e1", 6))
            cloud.compute.delete_server = timed
            out = Acquirer(cloud, st, lambda n: "").apply(PlanEntry("par", "spot", "e1", 0))
        finally:
            cloud.compute.delete_server = real
            cleanup(cloud, "par")
    assert out.deleted == 6 and len(spans) == 6
    overlapping = max(sum(1 for a, b in spans if a <= t < b) for t, _ in spans)
    assert overlapping >= 2, spans  # sent together, not one after the other
    assert not tagged(cloud, "par")  # the acquirer returned once Nova no longer listed them


def test_a_create_still_inside_nova_when_its_run_died_is_waited_for_not_failed(
    openstack_cloud, cloud, fleet_dsn
) -> None:  # type: ignore[no-untyped-def]
    from sco.control.acquirer import Acquirer, PlanEntry
    from sco.control.nova import TAG, Meter
    from sco.control.reconcile import Reconciler
    from sco.state.fleet import FleetState, Pool

    flavor, image = openstack_cloud.flavors["sco.small"], openstack_cloud.image_id
    entry = PlanEntry("flight", "spot", "e1", 1)
    with FleetState(fleet_dsn) as st:
        st.ensure_pool(Pool("flight", "spot", flavor=flavor, image=image))
        # What a run killed between recording a create and Nova's answer leaves: a requested record, and the server
        # nova-api creates moments later all the same (it finishes a request whose client went away).
        rec = st.request("flight", "spot", "e1", 0, entry.name(0))

        def late_create() -> None:
            time.sleep(3)
            conn = openstack_cloud.connect()
            try:
                conn.compute.create_server(
                    name=entry.name(0), flavor_id=flavor, image_id=image, networks="none",
                    tags=[*entry.tags(), TAG.format("slot", 0)],
                )  # fmt: skip
            finally:
                conn.close()

        t = threading.Thread(target=late_create)
        t.start()
        try:
            with st.writer("flight"):
                r = Reconciler(cloud, st, Meter(st)).hall("flight")
            t.join()
            assert [a["name"] for a in r.adopted] == [entry.name(0)] and not r.never_launched, r.to_dict()
            (inst,) = st.instances("flight")
            assert inst.id == rec.id and inst.state == "active" and inst.server_id in tagged(cloud, "flight")
            out = Acquirer(cloud, st, lambda n: "#cloud-config\n").apply(entry)
            assert out.launched == 0 and len(tagged(cloud, "flight")) == 1
            assert drift(cloud, fleet_dsn, "flight") == []
            # past its window, a requested record with no server never reached Nova: failed, its slot free
            late = st.request("flight", "spot", "e1", 1, entry.name(1))
            with psycopg.connect(fleet_dsn) as c:
                c.execute("UPDATE instance SET updated_at = now() - interval '2 minutes' WHERE id = %s", (late.id,))
            with st.writer("flight"):
                r = Reconciler(cloud, st, Meter(st)).hall("flight")
            assert [x["name"] for x in r.never_launched] == [entry.name(1)], r.to_dict()
            assert st.instance(late.id).state == "failed"
        finally:
            t.join()
            cleanup(cloud, "flight")


# --- launch parameters, the preflight, and what the modules say -------------------------------------------------------


def test_the_acquirer_waits_for_a_create_of_its_entry_still_inside_nova(openstack_cloud, cloud, fleet_dsn) -> None:  # type: ignore[no-untyped-def]
    """The acquire step alone (no hall reconciliation before it, as after a crash in the middle of a launch) kept a
    requested record's slot and launched nothing for it, so its run ended one short (29 of 30 in CI) until a later
    run. It now waits, for its own entry's records, until the server shows or the create window ends."""
    from sco.control.acquirer import Acquirer, PlanEntry
    from sco.control.nova import TAG
    from sco.state.fleet import FleetState, Pool

    flavor, image = openstack_cloud.flavors["sco.small"], openstack_cloud.image_id
    entry = PlanEntry("flight2", "spot", "e1", 2)
    with FleetState(fleet_dsn) as st:
        st.ensure_pool(Pool("flight2", "spot", flavor=flavor, image=image))
        rec = st.request("flight2", "spot", "e1", 0, entry.name(0))

        def late_create() -> None:
            time.sleep(3)
            conn = openstack_cloud.connect()
            try:
                conn.compute.create_server(
                    name=entry.name(0), flavor_id=flavor, image_id=image, networks="none",
                    tags=[*entry.tags(), TAG.format("slot", 0)],
                )  # fmt: skip
            finally:
                conn.close()

        t = threading.Thread(target=late_create)
        t.start()
        try:
            out = Acquirer(cloud, st, lambda n: "#cloud-config\n").apply(entry)
            t.join()
            assert out.adopted == 1 and out.launched == 1 and out.active == 2, out
            assert st.instance(rec.id).state == "active"
            assert len(tagged(cloud, "flight2")) == 2 and drift(cloud, fleet_dsn, "flight2") == []
        finally:
            t.join()
            cleanup(cloud, "flight2")


def test_launch_parameters_reach_nova_and_anti_affinity_no_valid_host_is_told(  # type: ignore[no-untyped-def]
    openstack_cloud, cloud, fleet_dsn, kube, tmp_path
) -> None:
    hall = Hall("params", tmp_path, openstack_cloud, fleet_dsn, kube)
    kp = f"sco-{os.urandom(3).hex()}"
    group = f"params-{os.urandom(3).hex()}"
    cloud.compute.create_keypair(name=kp)
    hall.pools[0] |= {"flavor": "sco.small", "vcpus": 1, "ramMiB": 512}
    hall.pools[0]["launch"] = {
        "networks": "none", "keyName": kp, "availabilityZone": "nova",
        "serverGroup": {"name": group, "policy": "anti-affinity"},
    }  # fmt: skip
    # One launch first, then a second: two creates at once into an anti-affinity group race in Nova (each may pass
    # the scheduler before the other has a host, and the compute host's late check then refuses one or both), so
    # the refusal is made certain by launching the second once the first is ACTIVE.
    hall.pods(1, cpu="1")
    try:
        out = hall.run()
        acq = out["acquire"]
        assert "failed" not in acq and "skipped" not in acq, acq  # no key Ansible reads as the task's status
        assert acq["launched"] == 1 and acq["launch_failures"] == 0, acq
        (srv,) = tagged(cloud, "params").values()
        assert srv.status == "ACTIVE" and srv.key_name == kp and srv.availability_zone == "nova"
        assert srv.image.id == openstack_cloud.image_id and srv.flavor.original_name == "sco.small"
        (g,) = [x for x in cloud.compute.server_groups() if x.name == group]
        assert srv.id in g.member_ids and (g.policy or g.policies[0]) == "anti-affinity"
        # a second unit: the loopback cloud has one compute host, which holds the group's member already
        hall.pods(1, cpu="1", start=1)
        acq = hall.run()["acquire"]
        assert acq["launched"] == 1 and acq["launch_failures"] == 1, acq
        assert any("Exhausted all hosts" in e or "No valid host" in e for e in acq["errors"]), acq["errors"]
        # the scheduler's filter refuses it (NoValidHost), or the compute host's late check after retries
        said = [w.lower() for w in acq["warnings"] if "no launches for" in w]
        assert any("no valid host" in w or "no host left" in w for w in said), acq["warnings"]
        assert acq["unavailable"] and acq["preflight"]["spot"]["flavor_id"] == openstack_cloud.flavors["sco.small"]
        assert list(tagged(cloud, "params")) == [srv.id]
        # the next run: the pool is unavailable for now (the plan sees it so): nothing launched into it
        again = hall.run()["acquire"]
        assert again["launched"] == 0 and len(tagged(cloud, "params")) == 1, again
    finally:
        cleanup(cloud, "params")
        cloud.compute.delete_keypair(kp, ignore_missing=True)
        for x in cloud.compute.server_groups():
            if x.name == group:
                cloud.compute.delete_server_group(x.id)


def test_preflight_names_every_problem_and_what_to_change_before_any_launch(  # type: ignore[no-untyped-def]
    openstack_cloud, cloud, fleet_dsn, kube, tmp_path
) -> None:
    hall = Hall("preflight", tmp_path, openstack_cloud, fleet_dsn, kube)
    hall.pools[0] |= {"flavor": "m1.nope", "image": "no-such-image", "cap": 2}
    hall.pools[0]["launch"] = {
        "networks": ["sco-net", "nope-net", "twin"], "ports": ["sco-port-used"], "securityGroups": ["nope-sg"],
        "keyName": "nope-key", "availabilityZone": "nope-az", "bootVolume": {"sizeGiB": 10},
    }  # fmt: skip
    hall.pods(1)
    from sco.errors import ConfigError

    for check in (True, False):
        out: dict[str, dict[str, Any]] = {}
        for step in ("demand", "plan", "arbitrate"):
            out[step] = call(step, hall.args(step, out))
        with pytest.raises(ConfigError) as e:
            call("acquire", hall.args("acquire", out), check=check)
        lines = e.value.lines()
        text = "\n".join(lines)
        for needle in (
            "flavor: no flavor 'm1.nope' in this cloud (its flavors: ",
            "sco.large",
            "image: no image 'no-such-image'",
            "launch.networks[1]: no network 'nope-net'",
            "launch.networks[2]: 2 networks are named 'twin': give its id",
            "launch.ports: a port attaches to one server and this pool's cap is 2",
            "port 5d1f0e1c-0000-4000-8000-000000000022 is attached to a-server already",
            "launch.securityGroups[0]: no security group 'nope-sg' in this cloud",
            "(its security groups: default, sco-node)",
            "launch.keyName: no keypair 'nope-key'",
            "launch.availabilityZone: no zone 'nope-az' in this cloud (its zones: ",
            "launch.bootVolume: this cloud's catalog has no block-storage (Cinder) service",
        ):
            assert needle in text, (needle, lines)
        assert all(line.startswith("preflight: pools: spot: ") for line in lines), lines
    assert not tagged(cloud, "preflight")
    # fixed: the names resolve to ids once, and the check-mode preflight says what they resolved to
    hall.pools[0] |= {"flavor": "sco.large", "image": "sco-node", "cap": 1}
    hall.pools[0]["launch"] = {"networks": ["sco-net"], "securityGroups": ["sco-node"]}
    out = {}
    for step in ("demand", "plan", "arbitrate"):
        out[step] = call(step, hall.args(step, out))
    res = call("acquire", hall.args("acquire", out), check=True)
    assert res["preflight"]["spot"]["networks"] == [{"uuid": "5d1f0e1c-0000-4000-8000-000000000001"}], res
    assert res["launched"] == 1 and not tagged(cloud, "preflight")


def _preflight_out(hall: Hall) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for step in ("demand", "plan", "arbitrate"):
        out[step] = call(step, hall.args(step, out))
    return out


def test_auto_with_no_network_in_sight_fails_the_preflight_before_any_create(  # type: ignore[no-untyped-def]
    openstack_cloud, cloud, fleet_dsn, kube, tmp_path, monkeypatch
) -> None:
    """``launch.networks: auto`` while the project sees no network, and Neutron cannot allocate
    one (the loopback cloud's network endpoint answers the auto-allocated-topology dry run with a 404, as a Neutron
    without the extension does). The preflight passed it; every create then failed in Nova (a 500 here). Now the
    preflight says so, naming the pool and the setting, and no create is sent."""
    if openstack_cloud.network is None:
        pytest.skip("an attached cloud's network endpoint runs in its owner's process")
    from openstack.compute.v2._proxy import Proxy

    from sco.errors import ConfigError

    creates: list[dict[str, Any]] = []
    real_create = Proxy.create_server

    def create_server(self: Any, **kw: Any) -> Any:
        creates.append(kw)
        return real_create(self, **kw)

    monkeypatch.setattr(Proxy, "create_server", create_server)
    # no network in sight, for Nova as for the preflight (the endpoint reads its seeded lists on every request)
    monkeypatch.setitem(openstack_cloud.network.SEEDED, "networks", [])
    hall = Hall("autonet", tmp_path, openstack_cloud, fleet_dsn, kube, cap=2)
    hall.pools[0]["launch"] = {"networks": "auto"}
    hall.pods(2)
    try:
        out = _preflight_out(hall)
        with pytest.raises(ConfigError) as e:
            call("acquire", hall.args("acquire", out))
        (line,) = e.value.lines()
        assert line.startswith("preflight: pools: spot: launch.networks: auto: the project sees no network, and "), line
        assert "this cloud's Neutron has no auto-allocated-topology extension" in line, line
        assert "(HTTP 404: " in line and 'give launch.networks (a network\'s name or id) or "none"' in line, line
        assert creates == [] and not tagged(cloud, "autonet") and records(fleet_dsn, "autonet") == []
    finally:
        cleanup(cloud, "autonet")


class _Neutron(ThreadingHTTPServer):
    """A Neutron's answers to the reads the preflight of ``auto`` makes, as a test's own endpoint (the loopback
    cloud's network endpoint answers every auto-allocated-topology request with a 404): one external network that
    every project sees in its plain list but that Nova does not choose from (not shared, another project's), and
    the dry run (``GET /v2.0/auto-allocated-topology/{project}?fields=dry-run``) answered with ``dry_run``: (status,
    Neutron's message), or ``None`` for never (until ``close``)."""

    daemon_threads = True
    PUBLIC = {"id": "5d1f0e1c-0000-4000-8000-0000000000e1", "name": "public", "status": "ACTIVE", "shared": False,
              "router:external": True, "project_id": "c0ffee", "tenant_id": "c0ffee", "admin_state_up": True,
              "subnets": []}  # fmt: skip

    def __init__(
        self, dry_run: tuple[int, str] | None, own: tuple[dict[str, Any], ...] = (), networks_silent: bool = False
    ) -> None:
        from http.server import BaseHTTPRequestHandler
        from urllib.parse import parse_qs, urlsplit

        self.asked: list[str] = []
        self.release = threading.Event()
        server, nets_all = self, [self.PUBLIC, *own]

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _send(self, code: int, doc: dict[str, Any]) -> None:
                body = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                url = urlsplit(self.path)
                path = url.path.rstrip("/").removeprefix("/v2.0")
                if not path:
                    self._send(200, {"versions": [{"id": "v2.0", "status": "CURRENT", "links": []}]})
                elif path == "/networks":  # filtered as Neutron filters: every attribute given must match
                    if networks_silent:
                        server.release.wait(120)
                        return
                    q = {k: {x.lower() for x in v} for k, v in parse_qs(url.query).items() if k != "fields"}
                    nets = [n for n in nets_all if all(str(n.get(k)).lower() in v for k, v in q.items())]
                    self._send(200, {"networks": nets})
                elif path.startswith("/auto-allocated-topology/"):
                    server.asked.append(self.path)
                    if dry_run is None:
                        server.release.wait(120)
                    elif dry_run[0] == 200:
                        project = path.rsplit("/", 1)[1]
                        self._send(200, {"auto_allocated_topology": {"id": "dry-run=pass", "tenant_id": project}})
                    else:
                        err = {"type": "AutoAllocationFailure", "message": dry_run[1], "detail": ""}
                        self._send(dry_run[0], {"NeutronError": err})
                else:
                    self._send(404, {"NeutronError": {"type": "HTTPNotFound", "message": path, "detail": ""}})

            def log_message(self, *a: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), H)
        threading.Thread(target=self.serve_forever, daemon=True, name="neutron-autonet").start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def close(self) -> None:
        self.release.set()
        self.shutdown()
        self.server_close()


@pytest.mark.parametrize("answer", ["deployment-error", "can-allocate", "silent", "own-network-down", "no-list"])
def test_auto_is_checked_against_neutrons_dry_run_once_per_run(  # type: ignore[no-untyped-def]
    openstack_cloud, cloud, fleet_dsn, kube, tmp_path, answer
) -> None:
    """The project sees only an external network (Nova does not choose from those: ``auto`` then asks Neutron for
    a network): Neutron's dry run decides, once per run for every pool; its words reach the line; a Neutron that
    never answers costs the connection's deadline, not the run. The project's own network that is down is not one
    Nova chooses from either (it asks for admin_state_up; the preflight counted it, found one, and passed); a
    network list that never answers fails the line naming launch.networks (it named no setting)."""
    dry_run = {
        "deployment-error": (409, "Deployment error: No default router:external network."),
        "can-allocate": (200, ""),
        "silent": None,
        "own-network-down": (409, "Deployment error: No default router:external network."),
        "no-list": (200, ""),
    }[answer]
    down = {"id": "5d1f0e1c-0000-4000-8000-0000000000d0", "name": "half-built", "status": "DOWN", "shared": False,
            "router:external": False, "project_id": cloud.current_project_id, "tenant_id": cloud.current_project_id,
            "admin_state_up": False, "subnets": []}  # fmt: skip
    neutron = _Neutron(
        dry_run, own=(down,) if answer == "own-network-down" else (), networks_silent=answer == "no-list"
    )
    from sco.errors import ConfigError

    hall = Hall("autonet-" + answer, tmp_path, openstack_cloud, fleet_dsn, kube, cap=1)
    hall.common |= {"cloud": {**openstack_cloud.cloud_config, "network_endpoint_override": neutron.url}}
    hall.common["api_timeout"] = 3.0
    hall.pools[0]["launch"] = {"networks": "auto"}
    hall.pools.append({**hall.pools[0], "name": "spot-b", "launch": {"networks": "auto"}})
    hall.pods(2, cpu="3")  # one pod to a 4-vCPU instance, one instance to a pool: both pools launch
    try:
        out = _preflight_out(hall)
        launching = sorted({p["pool"] for p in out["plan"]["plan"]["pools"] if p["launch"]})
        assert launching == ["spot", "spot-b"], out["plan"]
        started = time.monotonic()
        if answer == "can-allocate":
            res = call("acquire", hall.args("acquire", out), check=True)
            assert {p: res["preflight"][p]["networks"] for p in launching} == dict.fromkeys(launching, "auto"), res
        else:
            with pytest.raises(ConfigError) as e:
                call("acquire", hall.args("acquire", out), check=True)
            lines = e.value.lines()
            assert [line.split(": launch.networks: ")[0] for line in lines] == [
                f"preflight: pools: {p}" for p in launching
            ], lines
            said = {
                "silent": ": auto: the project sees no network, and Neutron did not answer its auto-allocation check (",
                "no-list": ": launch.networks: auto: the cloud did not answer the network lookup: ",
            }.get(
                answer,
                ": auto: the project sees no network, and Neutron cannot allocate one (HTTP 409: Deployment error:"
                " No default router:external network.): give launch.networks",
            )
            assert all(said in line for line in lines), lines
        assert time.monotonic() - started < 20  # the silent dry run (list) is given up at the 3 s deadline
        if answer == "no-list":
            assert neutron.asked == []  # no dry run without the list: what auto would choose from is not known
        else:
            assert len(neutron.asked) == 1 and neutron.asked[0].endswith("?fields=dry-run"), neutron.asked
        assert not tagged(cloud, hall.name)
    finally:
        neutron.close()


def _run_module(name: str, args: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    """A module of the collection as Ansible runs it (its args in a file), its JSON answer."""
    collections = Path(steps.__file__).resolve().parents[3] / "collections"  # the collection of the code under test
    module = collections / f"ansible_collections/sco/orchestrator/plugins/modules/{name}.py"
    argf = tmp_path / f"{name}-args.json"
    argf.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": {**args, "_ansible_check_mode": False}}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (os.environ.get("PYTHONPATH"), str(collections))))}
    p = subprocess.run([sys.executable, str(module), str(argf)], capture_output=True, text=True, env=env, timeout=300)
    return dict(json.loads(p.stdout))


def test_modules_fail_with_the_clouds_message_and_warn_through_ansible(  # type: ignore[no-untyped-def]
    openstack_cloud, cloud, fleet_dsn, kube, tmp_path
) -> None:
    hall = Hall("modules", tmp_path, openstack_cloud, fleet_dsn, kube)
    hall.pods(1)
    out: dict[str, dict[str, Any]] = {}
    for step in ("demand", "plan", "arbitrate"):
        out[step] = call(step, hall.args(step, out))
    try:
        # a flavor the cloud does not have: the task fails with what to change, never "Unknown error"
        bad = {**hall.args("acquire", out), "pools": [{**hall.pools[0], "flavor": "m1.large"}]}
        res = _run_module("acquire", bad, tmp_path)
        assert res.get("failed") is True and "no flavor 'm1.large' in this cloud" in res["msg"], res
        assert any("no flavor 'm1.large'" in p for p in res["problems"]), res
        # a launch NoValidHost refuses: the task is ok, the user is warned, no status key is misused
        huge = cloud.compute.find_flavor("sco.nohost") or cloud.compute.create_flavor(
            name="sco.nohost", vcpus=1, ram=1_000_000, disk=1
        )
        res = _run_module("acquire", {**hall.args("acquire", out), "pools": [{**hall.pools[0], "flavor": huge.id}]},
                          tmp_path)  # fmt: skip
        assert "failed" not in res and "skipped" not in res, res
        assert res["launch_failures"] == 1 and any("No valid host" in e for e in res["errors"]), res
        assert "NoValidHost" in json.dumps(res.get("warnings")), res  # module.warn: Ansible shows it
        # the reconcile module: a Nova that cannot be reached fails with the cloud's own words
        cut = {**hall.common, "cloud": {**openstack_cloud.cloud_config, "auth": {
            **openstack_cloud.cloud_config["auth"], "auth_url": "http://127.0.0.1:9/v3"}}}  # fmt: skip
        res = _run_module("reconcile", cut, tmp_path)
        assert res.get("failed") is True and "127.0.0.1:9" in res["msg"] and "Unknown error" not in res["msg"], res
        res = _run_module("reconcile", hall.common, tmp_path)
        assert "failed" not in res and res["reconciliation"]["drift"] == 0, res
    finally:
        cleanup(cloud, "modules")


def test_sco_acquire_and_sco_reconcile_outside_ansible(openstack_cloud, cloud, fleet_dsn, kube, tmp_path) -> None:  # type: ignore[no-untyped-def]
    hall = Hall("cli", tmp_path, openstack_cloud, fleet_dsn, kube)
    doc = {
        **{k: v for k, v in hall.common.items() if k != "state_dsn"},
        "pools": hall.pools,
        "plan": {"pools": [{"pool": "spot", "launch": 1, "launch_contracts": ["web"], "delete": []}]},
        "signing_keys": [hall.key],
    }
    f = tmp_path / "acquire.json"
    sco = [str(Path(sys.executable).parent / "sco")]

    clouds = openstack_cloud.write_clouds_yaml(tmp_path / "clouds.yaml")
    env = {**os.environ, "OS_CLIENT_CONFIG_FILE": str(clouds)}

    def run(*args: str, data: dict[str, Any] | None = None) -> subprocess.CompletedProcess[str]:
        if data is not None:
            f.write_text(json.dumps(data))
        return subprocess.run([*sco, *args], capture_output=True, text=True, timeout=300, env=env)

    try:
        p = run("acquire", "--input", str(f), "--dsn", fleet_dsn, "--check", data=doc)
        assert p.returncode == 0 and "would launch 1, deleted 0" in p.stdout, p
        assert not tagged(cloud, "cli")
        p = run("acquire", "--input", str(f), "--dsn", fleet_dsn, "--json")
        assert p.returncode == 0 and json.loads(p.stdout)["launched"] == 1, p
        assert len(tagged(cloud, "cli")) == 1
        with psycopg.connect(fleet_dsn) as c:  # a record stuck as a killed run leaves it
            c.execute("UPDATE instance SET state = 'launching' WHERE hall = 'cli'")
        p = run("reconcile", "--hall", "cli", "--dsn", fleet_dsn, "--os-cloud", "sco-loopback", "--check")
        assert p.returncode == 0 and "settled cli-spot-" in p.stdout and ": launching -> active" in p.stdout, p
        p = run("reconcile", "--hall", "cli", "--dsn", fleet_dsn, "--os-cloud", "sco-loopback", "--json")
        assert p.returncode == 0 and json.loads(p.stdout)["reconciliation"]["drift"] == 1, p
        assert drift(cloud, fleet_dsn, "cli") == []
        bad = {**doc, "pools": [{**hall.pools[0], "flavor": "m1.nope"}]}
        p = run("acquire", "--input", str(f), "--dsn", fleet_dsn, data=bad)
        assert p.returncode == 5 and "sco: error: preflight: pools: spot: flavor: no flavor 'm1.nope'" in p.stderr, p
        cut = {**doc, "cloud": {**openstack_cloud.cloud_config, "auth": {
            **openstack_cloud.cloud_config["auth"], "auth_url": "http://127.0.0.1:9/v3"}}}  # fmt: skip
        p = run("acquire", "--input", str(f), "--dsn", fleet_dsn, data=cut)
        assert p.returncode in (5, 9) and "127.0.0.1:9" in p.stderr and "Traceback" not in p.stderr, p
    finally:
        cleanup(cloud, "cli")
