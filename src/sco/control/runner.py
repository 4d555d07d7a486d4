"""``sco-control-loop``: one control-loop run through ansible-runner, one run at a time per hall.

What ``sco-control-loop.service`` (role ``sco.orchestrator.control_loop``) runs on its timer:

1. takes the hall's **control-loop lock** in the fleet state (a PostgreSQL advisory lock on its own key, held
   on this process's connection for the whole run: a second run, from any host, gets exit 8 naming the
   holder; a crashed run's lock goes with its connection);
2. records the run (``control_run``) and runs ``control_loop.yml`` from the private data directory with
   ``ansible_runner.run``, passing the run's id as ``sco_run_id`` so every step records under it;
3. summarises the run from the runner's events - what was demanded, planned, launched, deleted, granted and
   refused - into ``control_run.summary`` and on stdout (one line per item, then the summary as JSON).

No secret reaches ansible-runner's files: it writes the environment it hands the playbook into
``artifacts/<id>/command`` on every run, so the playbook gets the DSN without its password and ``PGPASSFILE``
naming a 0600 libpq password file that lives only for the run (``_secretless``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from sco import __version__
from sco import _logging as sco_logging
from sco.errors import ConfigError, ScoError
from sco.provider import heartbeats

_STEPS = {
    "sco.orchestrator.demand": "demand",
    "sco.orchestrator.reconcile": "reconcile",
    "sco.orchestrator.plan": "plan",
    "sco.orchestrator.arbitrate": "arbitrate",
    "sco.orchestrator.acquire": "acquire",
    "sco.orchestrator.reclaim": "reclaim",
}


def summarise(events: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """What a run did, from ansible-runner's events (each step's module result)."""
    res: dict[str, dict[str, Any]] = {}
    failed: list[str] = []
    for e in events:
        data = e.get("event_data") or {}
        step = _STEPS.get(str(data.get("task_action", "")))
        if e.get("event") == "runner_on_failed":
            failed.append(f"{data.get('task', '?')}: {(data.get('res') or {}).get('msg', 'failed')}")
        if step and e.get("event") == "runner_on_ok":
            got = data.get("res") or {}
            # two reclaim tasks: finishing earlier runs' reclaims, and a Blazar hall's before-leases reclaim
            if step == "reclaim" and ((got.get("invocation") or {}).get("module_args") or {}).get("before_leases"):
                step = "reclaim_leases"
            res[step] = got
    demand = res.get("demand", {})
    plan = (res.get("plan") or {}).get("plan") or {}
    arb = (res.get("arbitrate") or {}).get("arbitration") or {}
    acq = res.get("acquire") or {}
    rec = (res.get("reconcile") or {}).get("reconciliation") or {}
    fin = res.get("reclaim") or {}
    return {
        # reclaims an earlier run noticed and this one deleted (its control host stopped before T)
        "finished_reclaims": [
            {"name": f["name"], "late_s": f.get("late_s", 0), "state": f.get("state")} for f in fin.get("finished", [])
        ],
        "reclaim_busy": fin.get("busy"),
        "unnoticed_reclaims": [f"{u['name']}: {u['why']}" for u in fin.get("unnoticed", [])],
        # a Blazar hall: the instances on hosts a host lease takes soon, noticed and deleted before it starts
        "reclaimed_before_leases": [r["name"] for r in (res.get("reclaim_leases") or {}).get("reclaimed", [])],
        "demand_units": demand.get("units", {}),
        "uncontracted": demand.get("uncontracted", 0),
        "plan_digest": plan.get("digest", ""),
        "plan_changed": bool(plan.get("changed", False)),
        "planned": {
            p["pool"]: {"target": p["target"], "launch": p["launch"], "delete": len(p["delete"])}
            for p in plan.get("pools", [])
            if p.get("launch") or p.get("delete")
        },
        "shortfall_units": {c: m / 1000 for c, m in (plan.get("shortfall_milli") or {}).items()},
        "granted": [
            f"{g['contract']}: {g['instances']} x {g['pool']} ({g['cost_per_hour']}/h)" for g in arb.get("grants", [])
        ],
        "refused": [f"{r['contract']}: {r['reason']}" for r in arb.get("refusals", [])],
        "launched": int(acq.get("launched", 0)),
        "deleted": int(acq.get("deleted", 0)),
        "launch_failed": int(acq.get("launch_failures", 0)),
        "reconcile": {
            "drift": int(rec.get("drift", 0)),
            **{k: [x["name"] for x in rec.get(k, [])] for k in ("adopted", "settled", "lost", "surplus") if rec.get(k)},
        },
        "failed_tasks": failed,
    }


def summary_lines(s: dict[str, Any]) -> list[str]:
    lines = [
        f"demand: {', '.join(f'{c} {u:g} units' for c, u in sorted(s['demand_units'].items())) or 'none'}"
        + (f"; {s['uncontracted']} uncontracted (not counted)" if s["uncontracted"] else ""),
    ]
    for f in s.get("finished_reclaims", []):
        late = f"{f['late_s']:.1f} s after its T" if f["late_s"] > 1.0 else "at its T"
        lines.append(f"finished the reclaim of {f['name']}: deleted {late} ({f['state']})")
    lines += [f"NOT finished the reclaim of {u}" for u in s.get("unnoticed_reclaims", [])]
    if s.get("reclaimed_before_leases"):
        lines.append(f"reclaimed before Blazar host leases: {', '.join(s['reclaimed_before_leases'])}")
    rec = s.get("reconcile") or {}
    if rec.get("drift"):
        lines.append(
            f"reconciled with Nova: drift {rec['drift']}"
            + "".join(f"; {k} {', '.join(v)}" for k, v in rec.items() if k != "drift" and v)
        )
    lines.append(f"plan {s['plan_digest'][:16]}: {'changes' if s['plan_changed'] else 'unchanged'}")
    lines += [
        f"  {pool}: target {p['target']}, +{p['launch']} -{p['delete']}" for pool, p in sorted(s["planned"].items())
    ]
    lines += [f"  shortfall {c}: {u:g} units" for c, u in sorted(s["shortfall_units"].items())]
    lines += [f"granted {g}" for g in s["granted"]] + [f"refused {r}" for r in s["refused"]]
    lines.append(f"launched {s['launched']}, deleted {s['deleted']}, failed launches {s['launch_failed']}")
    lines += [f"FAILED {t}" for t in s["failed_tasks"]]
    lines += [f"  | {line}" for line in s.get("stdout_tail", [])]
    return lines


def _pgpass_field(v: str) -> str:
    return v.replace("\\", "\\\\").replace(":", "\\:")  # libpq's passfile escapes


@contextlib.contextmanager
def _secretless(dsn: str) -> Iterator[tuple[str, dict[str, str]]]:
    """(the DSN without its password, the environment that supplies it): a libpq password file, 0600 in a 0700
    directory of its own, removed when the run ends. A DSN without a password is passed as it is."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    params = {k: str(v) for k, v in conninfo_to_dict(dsn).items()}
    password = params.pop("password", "")
    if not password:
        yield dsn, {}
        return
    user = params.get("user") or os.environ.get("PGUSER") or ""
    d = Path(tempfile.mkdtemp(prefix="sco-pgpass-"))  # 0700
    try:
        fd = os.open(d / "pgpass", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:  # any host, port and database of the DSN (a Patroni DSN lists several)
            f.write(f"*:*:*:{_pgpass_field(user) if user else '*'}:{_pgpass_field(password)}\n")
        yield make_conninfo(**params), {"PGPASSFILE": str(d / "pgpass")}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def run_loop(
    private_data_dir: Path, hall: str, dsn: str, *, playbook: str = "control_loop.yml", lock_wait_s: float = 0.0
) -> tuple[int, dict[str, Any]]:
    """One run; returns (exit code, summary). Raises HallBusy (exit 8) when another run holds the lock."""
    import ansible_runner

    from sco.control.record import PgFleetStore
    from sco.state.db import hall_lock

    if not (private_data_dir / "project" / playbook).is_file():
        raise ConfigError(
            f"{private_data_dir}: no project/{playbook} (lay it out with role sco.orchestrator.control_loop)"
        )
    from sco.control import metrics

    with PgFleetStore(dsn) as store, hall_lock(store.conn, f"{hall}/control-loop", wait_s=lock_wait_s):
        started = time.time()
        run_id = store.begin_run(hall)
        summary: dict[str, Any] = {"run_id": run_id}
        status = "failed"
        try:
            with _secretless(dsn) as (run_dsn, secret_env):
                r = ansible_runner.run(
                    private_data_dir=str(private_data_dir),
                    playbook=playbook,
                    extravars={"sco_run_id": run_id, "sco_hall": hall},
                    # systemd gives the unit a bare PATH: ansible-playbook is beside this interpreter, in the venv
                    envvars={
                        "SCO_DB_DSN": run_dsn,
                        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
                        **secret_env,
                    },
                    quiet=True,
                )
            summary.update(summarise(r.events))
            summary["runner_ident"] = str(r.config.ident)
            status = "ok" if r.rc == 0 else "failed"
            summary["rc"] = r.rc
            if r.rc != 0:  # say why where the journal shows it, not only in the artifacts
                summary["stdout_tail"] = r.stdout.read().splitlines()[-15:]
        finally:
            store.finish_run(run_id, status, summary)
            # the agents' last heartbeats into the fleet state (sco hall status, sco_agents_silent); never fails the run
            heartbeats.collect_for_loop(store.conn, hall, os.environ)
            gauges = []
            if os.environ.get(metrics.ENV):
                try:
                    gauges = metrics.fleet_gauges(store, hall)
                except Exception as e:  # the run's own lines still go out
                    metrics.log.error("fleet gauges: %s", e)
            metrics.write_step("loop", status, started, time.time(), gauges)
    return (0 if status == "ok" else 1), summary


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sco-control-loop", description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="version", version=f"sco-control-loop {__version__}")
    p.add_argument("--private-data-dir", default=os.environ.get("SCO_CONTROL_LOOP_DIR"), help="[$SCO_CONTROL_LOOP_DIR]")
    p.add_argument("--hall", default=os.environ.get("SCO_HALL"), help="[$SCO_HALL]")
    p.add_argument("--dsn", default=os.environ.get("SCO_DB_DSN"), help="fleet state [$SCO_DB_DSN]")
    p.add_argument("--playbook", default="control_loop.yml")
    p.add_argument("--lock-wait", type=float, default=0.0, metavar="SECONDS", help="wait this long for the lock")
    p.add_argument(
        "--log-format", choices=sco_logging.FORMATS, help="text or json (one object a line) [$SCO_LOG_FORMAT]"
    )
    a = p.parse_args(argv)
    try:
        try:  # the reclaimer's and acquirer's INFO lines reach the journal (no handler dropped them before)
            sco_logging.setup(None, a.log_format)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        missing = [
            f for f, v in (("--private-data-dir", a.private_data_dir), ("--hall", a.hall), ("--dsn", a.dsn)) if not v
        ]
        if missing:
            raise ConfigError(f"give {', '.join(missing)} (or their environment variables)")
        rc, summary = run_loop(Path(a.private_data_dir), a.hall, a.dsn, playbook=a.playbook, lock_wait_s=a.lock_wait)
    except ScoError as e:
        for line in e.lines():
            print(f"sco-control-loop: error: {line}", file=sys.stderr)
        return e.exit_code
    print(f"control loop run {summary['run_id']} for hall {a.hall}: {'ok' if rc == 0 else 'FAILED'}")
    for line in summary_lines(summary):
        print(line)
    print(json.dumps({"control_loop_summary": summary}, sort_keys=True))
    return rc


if __name__ == "__main__":
    sys.exit(main())
