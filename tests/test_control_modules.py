"""The control-loop modules through real ansible-runner runs: ansible-doc renders them, check mode changes nothing,
a real run does, a second run is unchanged; shared options come from the action group's module_defaults."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from sco.contract.signing import generate, write_keypair
from sco_devkit.standins.kube_apiserver import KubeApiStandIn
from tests.harness import hall_bundle

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
COLLECTIONS = ROOT / "collections"
MODULES = ("demand", "reconcile", "plan", "arbitrate", "acquire", "reclaim")
ENV = {"ANSIBLE_COLLECTIONS_PATH": str(COLLECTIONS), "PATH": f"{BIN}:{os.environ['PATH']}"}

POOLS = [
    {
        "name": "spot-a",
        "kind": "reclaimable",
        "flavor": "m1.large",
        "vcpus": 8,
        "ramMiB": 32768,
        "cap": 4,
        "group": "r1",
    },
    {
        "name": "spot-b",
        "kind": "reclaimable",
        "flavor": "m1.large",
        "vcpus": 8,
        "ramMiB": 32768,
        "cap": 4,
        "group": "r2",
    },
    {
        "name": "od",
        "kind": "on-demand",
        "flavor": "m1.large",
        "vcpus": 8,
        "ramMiB": 32768,
        "cap": 4,
        "pricePerHour": "3.00",
    },
]

PLAY = """
- name: Control loop steps
  hosts: localhost
  gather_facts: false
  module_defaults:
    group/sco.orchestrator.control:
      hall: local
      bundle: "{{ bundle }}"
      trust_dir: "{{ trust_dir }}"
      cloud: sco-loopback
  tasks:
    - name: Demand
      sco.orchestrator.demand:
        kubernetes: {url: "{{ kube_url }}"}
      register: demand
    - name: Plan
      sco.orchestrator.plan:
        demand: "{{ demand }}"
        pools: "{{ pools }}"
        fleet: "{{ fleet }}"
        now: 1764400000
        settings: {shares: {3: "1/2"}}
    - name: Arbitrate
      sco.orchestrator.arbitrate:
        plan: {shortfall_milli: {web: 20000, batch: 8000}}
        pools: "{{ pools }}"
        fleet: []
        ceiling_per_hour: "10.00"
"""


def run(tmp: Path, extra: dict[str, Any], *flags: str, play: str = PLAY) -> dict[str, dict[str, Any]]:
    import ansible_runner

    pdd = tmp / f"runner-{len(list(tmp.glob('runner-*')))}"
    (pdd / "project").mkdir(parents=True)
    (pdd / "project" / "play.yml").write_text(play)
    r = ansible_runner.run(
        private_data_dir=str(pdd),
        playbook="play.yml",
        extravars={**extra, "ansible_python_interpreter": sys.executable},
        cmdline=" ".join(flags) or None,
        envvars=ENV,
        quiet=True,
    )
    out = {
        e["event_data"]["task"]: e["event_data"]["res"]
        for e in r.events
        if e.get("event") in ("runner_on_ok", "runner_on_failed")
    }
    assert r.rc == 0, (r.rc, out)
    return out


@pytest.fixture
def hall(tmp_path: Path) -> dict[str, Any]:
    key = generate()
    trust = tmp_path / "trusted"
    trust.mkdir()
    write_keypair(key, tmp_path / "k.key", trust / "k.pub")
    (tmp_path / "bundle.json").write_bytes(hall_bundle(tmp_path, key))
    return {"bundle": str(tmp_path / "bundle.json"), "trust_dir": str(trust), "pools": POOLS}


@pytest.mark.parametrize("module", MODULES)
def test_ansible_doc_renders(module: str) -> None:
    p = subprocess.run(
        [str(BIN / "ansible-doc"), "-t", "module", f"sco.orchestrator.{module}"],
        capture_output=True,
        text=True,
        env={**os.environ, **ENV},
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert "OPTIONS" in p.stdout and "RETURN VALUES" in p.stdout and "cloud" in p.stdout
    assert "check_mode" in p.stdout


def test_steps_check_then_real_then_unchanged(tmp_path: Path, hall: dict[str, Any]) -> None:
    kube = KubeApiStandIn().start()
    try:
        tol = [{"key": "sco.dev/reclaim", "operator": "Exists"}]
        for i in range(5):
            kube.cluster.create_pod(
                "web",
                {
                    "metadata": {"name": f"w{i}"},
                    "spec": {
                        "tolerations": tol,
                        "containers": [{"name": "c", "resources": {"requests": {"cpu": "3"}}}],
                    },
                },
            )
        kube.cluster.create_pod("nobody", {"metadata": {"name": "stray"}, "spec": {"tolerations": tol}})
        extra = {**hall, "kube_url": kube.url, "fleet": []}
        check = run(tmp_path, extra, "--check")
        assert check["Demand"]["changed"] is False and check["Demand"]["units"] == {"web": 15.0}
        assert check["Demand"]["uncontracted"] == 1
        plan = check["Plan"]
        assert plan["changed"] is True and "plan_id" not in plan  # check mode records nothing
        launches = {p["pool"]: p["launch"] for p in plan["plan"]["pools"]}
        assert launches == {"spot-a": 1, "spot-b": 1, "od": 0}  # 15 units, half per group at most
        assert any(line.startswith("launch     pool:spot-a") for line in plan["explain"])
        arb = check["Arbitrate"]["arbitration"]
        # batch allows no fallback; web (tier 3 in the test bundle) neither
        assert [r["reason"] for r in arb["refusals"]] == ["its contract does not allow on-demand fallback"] * 2
        # the instances that plan asked for now exist (launched just now): the same demand plans nothing new
        fleet = [
            {"id": f"{pool}-0", "name": f"{pool}-0", "pool": pool, "contracts": ["web"], "launchedAt": 1764400000}
            for pool in ("spot-a", "spot-b")
        ]
        again = run(tmp_path, {**extra, "fleet": fleet})
        assert again["Plan"]["changed"] is False
        assert all(p["launch"] == 0 and not p["delete"] for p in again["Plan"]["plan"]["pools"])
    finally:
        kube.stop()


def test_bad_options_fail_with_every_problem(tmp_path: Path, hall: dict[str, Any]) -> None:
    import ansible_runner

    bad = [{**POOLS[0], "cap": -1}, {**POOLS[1], "kind": "spot"}]
    pdd = tmp_path / "bad"
    (pdd / "project").mkdir(parents=True)
    play = [
        {
            "name": "bad",
            "hosts": "localhost",
            "gather_facts": False,
            "tasks": [
                {
                    "name": "Plan",
                    "sco.orchestrator.plan": {
                        "hall": "local",
                        "bundle": hall["bundle"],
                        "trust_dir": hall["trust_dir"],
                        "demand": {},
                        "pools": bad,
                        "fleet": [],
                    },
                }
            ],
        }
    ]
    (pdd / "project" / "play.yml").write_text(yaml.safe_dump(play))
    r = ansible_runner.run(
        private_data_dir=str(pdd),
        playbook="play.yml",
        extravars={"ansible_python_interpreter": sys.executable},
        envvars=ENV,
        quiet=True,
    )
    res = next(e["event_data"]["res"] for e in r.events if e.get("event") == "runner_on_failed")
    assert r.rc != 0
    assert "module options: pools.0.cap: Input should be greater than or equal to 0" in res["problems"]
    assert any(p.startswith("module options: pools.1.kind:") for p in res["problems"])


STATE_PLAY = """
- name: Plan, arbitrate and acquire against the fleet state
  hosts: localhost
  gather_facts: false
  module_defaults:
    group/sco.orchestrator.control:
      hall: local
      bundle: "{{ bundle }}"
      trust_dir: "{{ trust_dir }}"
      state_dsn: "{{ dsn }}"
  tasks:
    - name: Plan
      sco.orchestrator.plan:
        demand: {demand: [{contract: web, units_milli: 12000}, {contract: guarded, units_milli: 80000}]}
        pools: "{{ pools }}"
      register: plan
    - name: Arbitrate
      sco.orchestrator.arbitrate:
        plan: "{{ plan }}"
        pools: "{{ pools }}"
        ceiling_per_hour: "10.00"
      register: arbitration
    - name: Acquire
      sco.orchestrator.acquire:
        plan: "{{ plan }}"
        arbitration: "{{ arbitration }}"
        pools: "{{ pools }}"
    - name: Reclaim
      sco.orchestrator.reclaim:
        nodes: []
"""


def test_check_mode_records_nothing_in_the_fleet_state_a_real_run_does(
    tmp_path: Path, hall: dict[str, Any], fleet_dsn: str
) -> None:
    from sco.control.record import PgFleetStore

    check = run(tmp_path, {**hall, "dsn": fleet_dsn}, "--check", play=STATE_PLAY)
    with PgFleetStore(fleet_dsn) as store:
        assert store.plans("local") == [] and store.arbitrations("local") == []
    assert check["Plan"]["changed"] is True and "plan_id" not in check["Plan"]
    # 80 units of guarded (tier 2) and 12 of web do not fit two pools of 4 x 8 units: short, neither may fall back
    assert [r["contract"] for r in check["Arbitrate"]["arbitration"]["refusals"]] == ["guarded", "web"]
    acq = check["Acquire"]
    assert acq["changed"] is True and acq["launched"] == sum(e["launch"] for e in acq["entries"]) > 0
    assert check["Reclaim"]["changed"] is False
    od_only = [p for p in POOLS if p["kind"] != "reclaimable"]
    real = run(tmp_path, {**hall, "dsn": fleet_dsn, "pools": od_only}, play=STATE_PLAY)
    with PgFleetStore(fleet_dsn) as store:
        plans = store.plans("local")
        arbs = store.arbitrations("local")
    assert [p["id"] for p in plans] == [real["Plan"]["plan_id"]]
    assert plans[0]["digest"] == real["Plan"]["plan"]["digest"] and plans[0]["decisions"]
    assert {(a["contract"], a["outcome"]) for a in arbs} == {("web", "refuse"), ("guarded", "refuse")}
    assert all(a["reason"] for a in arbs)
    assert real["Acquire"]["changed"] is False and real["Acquire"]["entries"] == []  # nothing to launch


def test_an_unreachable_scheduler_fails_the_step_with_a_clear_message(tmp_path: Path, hall: dict[str, Any]) -> None:
    """No plan from half the demand: planning without a scheduler's pending work would scale its instances down."""
    import ansible_runner

    from tests.harness import free_port

    pdd = tmp_path / "down"
    (pdd / "project").mkdir(parents=True)
    play = [
        {
            "name": "down",
            "hosts": "localhost",
            "gather_facts": False,
            "tasks": [
                {
                    "name": "Demand",
                    "sco.orchestrator.demand": {
                        "hall": "local",
                        "bundle": hall["bundle"],
                        "trust_dir": hall["trust_dir"],
                        "kubernetes": {"url": f"http://127.0.0.1:{free_port()}"},
                    },
                }
            ],
        }
    ]
    (pdd / "project" / "play.yml").write_text(yaml.safe_dump(play))
    r = ansible_runner.run(
        private_data_dir=str(pdd),
        playbook="play.yml",
        extravars={"ansible_python_interpreter": sys.executable},
        envvars=ENV,
        quiet=True,
    )
    res = next(e["event_data"]["res"] for e in r.events if e.get("event") == "runner_on_failed")
    assert r.rc != 0
    assert res["msg"].startswith("kubernetes: listing pods:"), res
    assert "Traceback" not in json.dumps(res)


def test_a_pool_the_fleet_state_marks_unavailable_is_skipped(
    tmp_path: Path, hall: dict[str, Any], fleet_dsn: str
) -> None:
    from sco.state.fleet import FleetState
    from sco.state.fleet import Pool as StatePool

    with FleetState(fleet_dsn) as st:
        st.ensure_pool(StatePool("local", "spot-a", flavor="m1.large", image="img"))
        st.mark_unavailable("local", "spot-a", 300, "quota: instances exceeded")
    res = run(tmp_path, {**hall, "dsn": fleet_dsn}, "--check", play=STATE_PLAY)["Plan"]
    pools = {p["pool"]: p for p in res["plan"]["pools"]}
    assert pools["spot-a"]["launch"] == 0 and pools["spot-b"]["launch"] > 0
    (skip,) = [d for d in res["plan"]["decisions"] if d["kind"] == "skip_pool"]
    assert skip["subject"] == "pool:spot-a" and "quota: instances exceeded (for " in skip["reason"]


def test_the_reclaim_steps_options_are_parsed_once_and_bad_ones_named() -> None:
    """The reclaim step reads one typed object, as the other steps do (its options were read with params.get in
    five places of steps.py); a bad option is refused by name before anything runs."""
    from sco.control.options import ReclaimOptions, parse_options
    from sco.errors import ConfigError

    o = parse_options("reclaim", {"hall": "h", "nodes": ["a", "b"], "window": "30", "nats_url": "nats://x:1, nats://y:2",
                                  "nats_user": "reclaimer", "nats_password": "pw", "lock_wait": 0})  # fmt: skip
    assert isinstance(o, ReclaimOptions)
    assert (o.hall.hall, o.nodes, o.window, o.lock_wait, o.retry_for) == ("h", ("a", "b"), 30.0, 0.0, 120.0)
    assert o.nats_servers == ["nats://x:1", "nats://y:2"] and o.nats_auth == {"user": "reclaimer", "password": "pw"}
    bads: list[tuple[dict[str, Any], str]] = [
        ({"window": "soon"}, "window"),
        ({"lock_wait": -1}, "lock_wait"),
        ({"retry_for": -1}, "retry_for"),
        ({"retry_for": 86401}, "retry_for"),
        ({"lock_wait": 3601}, "lock_wait"),
        ({"nats_nkey_seed": "/nonexistent/seed.nk"}, "nats_nkey_seed"),
    ]
    for bad, where in bads:
        with pytest.raises(ConfigError, match=where):
            parse_options("reclaim", {"hall": "h", **bad})


def test_the_reclaim_step_and_sco_reclaim_read_one_rule_for_retry_for() -> None:
    """retry_for 0 (one attempt, no retries) is what ``sco reclaim --retry-for 0`` takes (ReclaimSettings); the
    step refused it (two option types for one reclaim that disagreed). Both read
    sco.provider.reclaim_job.limit_problems now."""
    from sco.control.options import ReclaimOptions, parse_options
    from sco.errors import ConfigError
    from sco.provider.reclaim_job import ReclaimSettings

    def settings(**kw: float) -> ReclaimSettings:
        return ReclaimSettings(hall="h", nodes=(), window_s=30, nats_url="", signing_keys=[], dsn="", **kw)

    for retry_for in (0, 0.5, 86400):
        o = parse_options("reclaim", {"hall": "h", "retry_for": retry_for})
        assert isinstance(o, ReclaimOptions) and o.retry_for == retry_for
        assert settings(retry_for_s=retry_for).retry_for_s == retry_for
    for retry_for in (-1, 86401, float("inf")):
        with pytest.raises(ConfigError, match="retry_for"):
            parse_options("reclaim", {"hall": "h", "retry_for": retry_for})
        with pytest.raises(ConfigError, match="retry_for"):
            settings(retry_for_s=retry_for)


def test_sco_reclaim_and_the_reclaim_module_refuse_the_same_values_with_the_same_lines(tmp_path: Path) -> None:
    """``sco reclaim`` and the collection's reclaim module parse into one options type: every bad value is refused
    by both, at once, with the same line; only the option's spelling follows the interface (the CLI's flag, the
    module's key). Both run as their users run them (a process each, the module as Ansible runs it)."""
    from tests.cli_run import run_module, sco

    spelled = {
        "hall": "--hall", "nodes": "node", "window": "--window", "lock_wait": "--lock-wait",
        "retry_for": "--retry-for", "call_timeout": "--call-timeout", "reconnect_for": "--reconnect-for",
        "nats_nkey_seed": "--nkey-seed",
    }  # fmt: skip
    cases: list[tuple[list[str], dict[str, Any]]] = [
        (
            ["--hall", "Bad_Hall", "--window", "0.001", "--lock-wait=-1", "--retry-for", "86401", "--call-timeout",
             "0", "--reconnect-for", "3601", "n 0"],
            {"hall": "Bad_Hall", "nodes": ["n 0"], "window": 0.001, "lock_wait": -1, "retry_for": 86401,
             "call_timeout": 0, "reconnect_for": 3601},
        ),
        (["--hall", "h", "--nkey-seed", "/nonexistent/seed.nk", "n-0"],
         {"hall": "h", "nodes": ["n-0"], "nats_nkey_seed": "/nonexistent/seed.nk"}),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SCO_", "OS_"))}
    for cli_args, module_args in cases:
        cli = sco("reclaim", *cli_args, env=env)
        assert cli.returncode == 5 and "Traceback" not in cli.stderr, cli.stderr
        cli_lines = [x.removeprefix("sco: error: ") for x in cli.stderr.splitlines() if x.strip()]
        mod = run_module("reclaim", module_args, tmp_path, env={"SCO_DB_DSN": ""})
        assert mod.get("failed"), mod
        mod_lines = list(mod["problems"])
        assert len(mod_lines) == len(cli_lines) and len(cli_lines) >= (7 if len(module_args) > 3 else 1), (
            cli_lines,
            mod_lines,
        )
        for c, m in zip(cli_lines, mod_lines, strict=True):
            key = m.split(" ", 1)[0].split(":", 1)[0]
            assert c == spelled[key] + m[len(key) :], (c, m)


SECRET_PLAY = """
- name: Acquire with a cloud given as a dict and a node environment, both holding secrets
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Acquire
      sco.orchestrator.acquire:
        hall: local
        bundle: "{{ bundle }}"
        trust_dir: "{{ trust_dir }}"
        cloud:
          auth: {auth_url: "http://127.0.0.1:9/v3", username: sco, password: "{{ cloud_secret }}", project_name: p}
        node_env: {SCO_AGENT_NATS_URL: "nats://relay:4222", SCO_AGENT_ENROL_TOKEN: "{{ node_secret }}"}
        plan: {plan: {pools: [], entries: []}}
        pools: "{{ pools }}"
      ignore_errors: true
    - name: Acquire from a cloud named by its clouds.yaml entry
      sco.orchestrator.acquire:
        hall: local
        bundle: "{{ bundle }}"
        trust_dir: "{{ trust_dir }}"
        cloud: sco-named-cloud
        plan: {plan: {pools: [], entries: []}}
        pools: "{{ pools }}"
      ignore_errors: true
"""


def test_acquire_never_shows_its_cloud_dict_or_node_env(tmp_path: Path, hall: dict[str, Any]) -> None:
    """node_env (it becomes user-data: enrolment tokens, relay passwords) and a cloud given as a
    dict (its auth) were not no_log, so -vvv's result and ansible-runner's events carried them verbatim."""
    import ansible_runner

    from tests.secrets_watch import files_showing

    cloud_secret, node_secret = "cloud-" + os.urandom(8).hex(), "node-" + os.urandom(8).hex()
    pdd = tmp_path / "secrets"
    (pdd / "project").mkdir(parents=True)
    (pdd / "project" / "play.yml").write_text(SECRET_PLAY)
    r = ansible_runner.run(
        private_data_dir=str(pdd),
        playbook="play.yml",
        extravars={**hall, "cloud_secret": cloud_secret, "node_secret": node_secret,
                   "ansible_python_interpreter": sys.executable},
        cmdline="-vvv --diff",
        envvars=ENV,
        quiet=True,
    )  # fmt: skip
    res = {
        e["event_data"]["task"]: e["event_data"]["res"]
        for e in r.events
        if e.get("event") in ("runner_on_ok", "runner_on_failed")
    }
    assert "invocation" in res["Acquire"], res  # the module ran and reported its arguments
    out = r.stdout.read()
    assert cloud_secret not in out and node_secret not in out, out[-3000:]
    assert files_showing(Path(r.config.artifact_dir), cloud_secret, node_secret) == []
    # of a cloud given as a dict, what is no secret stays readable: the cloud's message names its address
    assert "127.0.0.1:9" in res["Acquire"]["invocation"]["module_args"]["cloud"]["auth"]["auth_url"], res["Acquire"]
    assert res["Acquire"]["invocation"]["module_args"]["cloud"]["auth"]["username"] == "sco", res["Acquire"]
    # a cloud named by a clouds.yaml entry is no secret: its name stays readable in what the module says
    named = res["Acquire from a cloud named by its clouds.yaml entry"]
    assert named["invocation"]["module_args"]["cloud"] == "sco-named-cloud", named
