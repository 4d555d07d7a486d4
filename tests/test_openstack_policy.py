"""The before-leases reclaim with the credential docs/OPENSTACK-POLICY.md describes, against the
tests' real Blazar and Nova. A project member alone is refused with one line naming the call and the rule (Blazar's
own words); with the role sco-control and docs/policy/blazar-policy.yaml loaded into the running Blazar (nothing
else: no admin role, no Nova rule), the step sees another project's host lease and reclaims the hall's instance on
its host. The lease is deleted before it starts (the cloud's one compute host is shared with the other tests)."""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sco.contract.signing import generate
from sco.control.acquirer import Acquirer, PlanEntry
from sco.provider.reclaim_job import ReclaimSettings, reclaim
from sco.provider.relay_identity import NKey
from sco.provider.reservations import ReservationError
from sco.state.fleet import FleetState, Pool
from tests.blazar_leases import EP, blazar_lease

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTED = (ROOT / "docs/policy/blazar-policy.yaml").read_text()


def connect(cfg: dict[str, Any]) -> Any:
    import openstack

    return openstack.connect(auth=cfg["auth"], region_name=cfg["region_name"], identity_api_version="3")


@pytest.fixture
def documented_rules(blazar: Any) -> Iterator[None]:
    before = blazar.load_policy("blazar", DOCUMENTED)
    try:
        yield
    finally:
        blazar.load_policy("blazar", before)


def settings(hall: str, dsn: str, nats_url: str) -> ReclaimSettings:
    return ReclaimSettings(
        hall=hall, nodes=(), window_s=10.0, nats_url=nats_url, signing_keys=[generate()], dsn=dsn,
        before_leases=True, lease_lookahead_s=110.0, retry_for_s=30, call_timeout_s=10,
    )  # fmt: skip


def test_a_members_credential_is_refused_with_the_call_and_the_rule(
    blazar: Any, fleet_dsn: str, nats_server: Any
) -> None:
    member = connect(blazar.make_project(f"member-{os.urandom(3).hex()}", roles=("member",)))
    try:
        with pytest.raises(ReservationError) as e:
            asyncio.run(reclaim(settings("policy-member", fleet_dsn, nats_server.url), member))
        said = str(e.value)
        assert "GET /os-hosts answered 403" in said and "blazar:oshosts:get" in said, said
        assert "docs/OPENSTACK-POLICY.md" in said and "\n" not in said
    finally:
        member.close()


def test_the_documented_rules_are_enough_to_clear_another_projects_host_lease(  # type: ignore[no-untyped-def]
    blazar, fleet_dsn, nats_server, documented_rules
) -> None:
    hall = f"policy-{os.urandom(2).hex()}"
    admin = blazar.connect()
    cfg = blazar.make_project(f"granted-{os.urandom(3).hex()}", roles=("member", "sco-control"))
    conn = connect(cfg)
    lease: dict[str, Any] | None = None
    try:
        with FleetState(fleet_dsn) as st:
            st.ensure_pool(Pool(hall, "spot", flavor=blazar.flavors["sco.small"], image=blazar.image_id))
            Acquirer(conn, st, lambda n: "#cloud-config\n").apply(PlanEntry(hall, "spot", "e1", 1))
            (inst,) = st.instances(hall)
            srv = conn.compute.get_server(inst.server_id)
            assert not srv.compute_host  # a member is not shown the host: the step matches Nova's hostId
            # another project's (the admin's) host lease, starting at a minute boundary within the look-ahead
            start = math.ceil((time.time() + 40) / 60) * 60
            lease = blazar_lease(admin, f"other-{os.urandom(2).hex()}", start, 5)
            # the granted credential does not see that lease in /leases: its allocations say it all
            mine = conn.session.get("/leases", endpoint_filter=EP).json()["leases"]
            assert lease["id"] not in {x["id"] for x in mine}
            seen = asyncio.run(reclaim(settings(hall, fleet_dsn, nats_server.url), conn))
            assert [r["name"] for r in seen] == [inst.name], seen
            assert seen[0]["state"] == "deleted" and seen[0]["terminate_at"] <= start - 10
            # the only host lease in sight is the other project's: it is what had the instance reclaimed
            kinds = [e["kind"] for e in st.events(instance_id=inst.id)]
            assert "reclaim.scheduled" in kinds and "instance.delete_requested" in kinds
    finally:
        if lease is not None:
            admin.session.delete(f"/leases/{lease['id']}", endpoint_filter=EP, raise_exc=False)
        for s in conn.compute.servers(tags=f"sco-hall={hall}"):
            conn.compute.delete_server(s, ignore_missing=True)
        conn.close()


def lay_out_blazar_hall(tmp: Path, blazar: Any, cfg: dict[str, Any], fleet_dsn: str, nats_url: str, kube_url: str):  # type: ignore[no-untyped-def]
    """Role control_loop laid out for a Blazar hall (as site.yml would) with ``cfg``'s credential: the unit's command
    line and environment."""
    import getpass
    import grp
    import shutil
    import sys

    import yaml

    from sco.contract.compiler import compile_repo
    from sco.contract.signing import sign, write_keypair
    from sco_devkit.demo import sample_repo
    from tests.control_loop_run import CONTRACTS, lay_out
    from tests.harness import TEST_POLICY

    key, notice = generate(), generate()
    trust = tmp / "trusted"
    trust.mkdir()
    write_keypair(key, tmp / "signing.key", trust / "signing.pub")
    write_keypair(notice, tmp / "notice.key", tmp / "notice.pub")
    repo = tmp / "repo"  # the loop test's short contracts: a 10 s window covers their drains
    shutil.copytree(sample_repo(), repo)
    shutil.rmtree(repo / "contracts")
    (repo / "hall.yaml").write_text(TEST_POLICY)
    (repo / "contracts.yaml").write_text(CONTRACTS)
    (tmp / "bundle.json").write_bytes(sign(compile_repo(repo), [key]))
    cloud = {k: v for k, v in cfg.items() if k != "project_id"}
    (tmp / "clouds.yaml").write_text(yaml.safe_dump({"clouds": {"hall": cloud}}))
    seed = NKey.generate("user").seed.decode()  # the relay's reclaimer (the test's relay takes anyone)
    pool = {"flavor": blazar.flavors["sco.small"], "image": blazar.image_id, "vcpus": 1, "ramMiB": 512,
            "launch": {"networks": "none"}}  # fmt: skip
    return lay_out(
        tmp,
        {
            "control_loop_hall": tmp.name.replace("_", "-")[-20:].strip("-").lower(),
            "control_loop_interval": "2min",
            "control_loop_venv": str(Path(sys.executable).parent.parent),
            "control_loop_collections_path": str(ROOT / "collections"),
            "control_loop_data_dir": str(tmp / "runner"),
            "control_loop_state_dsn": fleet_dsn,
            "control_loop_cloud": "hall",
            "control_loop_clouds_yaml": str(tmp / "clouds.yaml"),
            "control_loop_bundle": str(tmp / "bundle.json"),
            "control_loop_trust_dir": str(trust),
            "control_loop_trusted_keys": [],  # the test fills its trust directory itself
            "control_loop_signing_keys": [str(tmp / "signing.key")],
            "control_loop_launch_key": "",  # signing as before the launch key (test_control_loop_e2e has it)
            "control_loop_kubernetes": {"url": kube_url},
            "control_loop_pools": [{"name": "spot", "kind": "reclaimable", "cap": 1, **pool}],
            "control_loop_timer_enabled": False,
            "control_loop_configmap_enabled": False,
            "control_loop_reservations_from": "blazar",
            "control_loop_nats_url": nats_url,
            "sco_relay_tls": False,  # the test's relay serves plaintext
            "control_loop_reclaim_nkey_seed": seed,
            "control_loop_notice_keys": [str(tmp / "notice.key")],
            "control_loop_reclaim_window": 10,
            "control_loop_reclaim_lookahead": 110,
            "control_loop_metrics_textfile_dir": "",
            "control_loop_user": getpass.getuser(),
            "control_loop_group": grp.getgrgid(os.getgid()).gr_name,
            "control_loop_create_user": False,
            "_control_loop_unit_dir": str(tmp / "units"),
            "_control_loop_env_file": str(tmp / "etc" / "control-loop.env"),
            "_control_loop_nats_seed_file": str(tmp / "etc" / "reader.nk"),
            "_control_loop_reclaim_seed_file": str(tmp / "etc" / "reclaimer.nk"),
        },
    )


def test_the_timers_loop_clears_a_host_lease_and_fails_naming_the_rule_without_it(  # type: ignore[no-untyped-def]
    blazar, fleet_dsn, nats_server, documented_rules, tmp_path
) -> None:
    from sco_devkit.standins.kube_apiserver import KubeApiStandIn
    from tests.control_loop_run import run_loop

    kube = KubeApiStandIn().start()
    admin = blazar.connect()
    lease: dict[str, Any] | None = None
    conns = []
    try:
        # a project member alone: the run fails, with Blazar's line naming the call and the rule
        member = blazar.make_project(f"m-{os.urandom(3).hex()}", roles=("member",))
        (tmp_path / "m").mkdir()
        argv, env = lay_out_blazar_hall(tmp_path / "m", blazar, member, fleet_dsn, nats_server.url, kube.url)
        rc, summary, out = run_loop(argv, env)
        assert rc == 1, out
        (failed,) = summary["failed_tasks"]
        assert failed.startswith("Reclaim the instances on hosts a Blazar host lease takes within a window:"), failed
        assert "GET /os-hosts answered 403" in failed and "blazar:oshosts:get" in failed, failed

        # the documented rules: the run reclaims the hall's instance on the host another project's lease takes
        granted = blazar.make_project(f"g-{os.urandom(3).hex()}", roles=("member", "sco-control"))
        (tmp_path / "g").mkdir()
        argv, env = lay_out_blazar_hall(tmp_path / "g", blazar, granted, fleet_dsn, nats_server.url, kube.url)
        hall = argv[argv.index("--hall") + 1]
        conn = connect(granted)
        conns.append(conn)
        with FleetState(fleet_dsn) as st:
            st.ensure_pool(Pool(hall, "spot", flavor=blazar.flavors["sco.small"], image=blazar.image_id))
            Acquirer(conn, st, lambda n: "#cloud-config\n").apply(PlanEntry(hall, "spot", "e1", 1))
            (inst,) = st.instances(hall)
            start = math.ceil((time.time() + 40) / 60) * 60
            lease = blazar_lease(admin, f"other-{os.urandom(2).hex()}", start, 5)
            rc, summary, out = run_loop(argv, env)
            assert rc == 0, out
            assert summary["reclaimed_before_leases"] == [inst.name], out
            assert f"reclaimed before Blazar host leases: {inst.name}" in out
            assert st.instance(inst.id).state == "deleted"
    finally:
        if lease is not None:
            admin.session.delete(f"/leases/{lease['id']}", endpoint_filter=EP, raise_exc=False)
        for c in conns:
            for s in c.compute.servers():
                c.compute.delete_server(s, ignore_missing=True)
            c.close()
        kube.stop()
