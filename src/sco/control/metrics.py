"""The control loop's metrics, for node_exporter's textfile collector (docs/METRICS.md).

The control loop is timer-run one-shot processes (one per step through Ansible, and ``sco-control-loop`` around
them), so there is nothing to scrape: each run writes ``<dir>/sco_control_<step>.prom`` atomically (a temporary
file, then rename, as the textfile collector asks) at its end. ``$SCO_METRICS_TEXTFILE_DIR`` names the directory;
unset: no files. A counter of runs would restart at every process, so a run leaves the time of its last result
(``sco_control_last_run_timestamp_seconds{step,result}``; the other results' times are carried over from the
previous file) and its duration. The hall-wide gauges (instances, pools, reclaims, agents heard) come from the
fleet state the step had open and go to one file of their own, ``FLEET_FILE``, the newest read.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sco._fs import atomic_write

log = logging.getLogger("sco.control.metrics")

ENV = "SCO_METRICS_TEXTFILE_DIR"
FLEET_FILE = "sco_control_fleet.prom"
"""The hall-wide gauges, rewritten by whichever step (or the loop) read the fleet state last. In each step's own
file they would be the same series in several files, which node_exporter's textfile collector refuses ("was
collected before with the same name and label values") instead of taking the newest."""
SILENT_ENV = "SCO_AGENT_SILENT_AFTER_SECONDS"
SILENT_AFTER_S = 900.0
"""An agent not heard for this long counts in ``sco_agents_silent`` (``sco hall status --stale``'s default)."""
RESULTS = ("ok", "failed")
_LAST = re.compile(r'^sco_control_last_run_timestamp_seconds\{step="([a-z_]+)",result="([a-z]+)"\} (\S+)$')


@dataclass
class Gauge:
    name: str
    help: str
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)
    hall_wide: bool = False
    """What the fleet state says of the hall, not of this step's run: written to ``FLEET_FILE`` (below)."""

    def set(self, value: float, **labels: str) -> Gauge:
        self.samples.append((labels, float(value)))
        return self


def _fmt(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return str(int(v)) if v == int(v) and abs(v) < 1e15 else repr(float(v))


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render(gauges: Iterable[Gauge]) -> str:
    lines: list[str] = []
    for g in gauges:
        if not g.samples:
            continue
        lines += [f"# HELP {g.name} {g.help}", f"# TYPE {g.name} gauge"]
        for labels, v in sorted(g.samples, key=lambda s: sorted(s[0].items())):
            lab = ",".join(f'{k}="{_esc(val)}"' for k, val in labels.items())
            lines.append(f"{g.name}{{{lab}}} {_fmt(v)}" if lab else f"{g.name} {_fmt(v)}")
    return "\n".join(lines) + "\n"


def _previous(path: Path, step: str) -> dict[str, float]:
    """The last-run times per result from the file a previous run left (missing or torn: none)."""
    out: dict[str, float] = {}
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return out
    for line in text.splitlines():
        m = _LAST.match(line)
        if m and m.group(1) == step and m.group(2) in RESULTS:
            try:
                out[m.group(2)] = float(m.group(3))
            except ValueError:
                continue
    return out


def write_step(
    step: str,
    result: str,
    started: float,
    finished: float,
    extra: Iterable[Gauge] = (),
    directory: str | None = None,
) -> Path | None:
    """Write the step's textfile; never raises (metrics must not fail a control-loop run): logs and returns None."""
    d = directory if directory is not None else os.environ.get(ENV, "")
    if not d:
        return None
    path = Path(d) / f"sco_control_{step}.prom"
    extra = list(extra)
    try:
        last = _previous(path, step)
        last[result] = finished
        run = Gauge(
            "sco_control_last_run_timestamp_seconds",
            "When a control-loop step (or the whole loop: step=loop) last finished with this result.",
        )
        for res, at in sorted(last.items()):
            run.set(at, step=step, result=res)
        dur = Gauge("sco_control_run_duration_seconds", "How long the step's last run took.")
        dur.set(max(0.0, finished - started), step=step)
        hall_wide = [g for g in extra if g.hall_wide]
        if any(g.samples for g in hall_wide):
            _replace(Path(d) / FLEET_FILE, render(hall_wide).encode())
            _drop_from_step_files(Path(d), {g.name for g in hall_wide})
        _replace(path, render([run, dur, *(g for g in extra if not g.hall_wide)]).encode())
        return path
    except OSError as e:
        log.error("metrics textfile %s: %s", path, e)
        return None


def _drop_from_step_files(d: Path, names: set[str]) -> None:
    """Files of an earlier version carried the hall-wide gauges in every step's file: a step that seldom runs (the
    reclaim step of a drill) would keep them there beside ``FLEET_FILE``, which node_exporter refuses."""
    for path in d.glob("sco_control_*.prom"):
        if path.name == FLEET_FILE:
            continue
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            continue

        def hall_wide(line: str) -> bool:
            name = line.split()[2] if line.startswith("# ") and len(line.split()) > 2 else re.split(r"[{ ]", line)[0]
            return name in names

        kept = [x for x in lines if not hall_wide(x)]
        if len(kept) != len(lines):
            _replace(path, ("\n".join(kept) + "\n").encode())


def _replace(path: Path, body: bytes) -> None:
    # 0644 whatever the loop's umask: node_exporter's textfile collector reads it as another user
    atomic_write(path, body, 0o644, exact_mode=True)


def fleet_gauges(store: object, hall: str) -> list[Gauge]:
    """Instances by pool and state, reclaims under way, deletes pending (and past T), pools available."""
    fm = getattr(store, "fleet_metrics", None)
    if fm is None:
        return []
    m = fm(hall)
    inst = Gauge("sco_fleet_instances", "Instances in the fleet state, by pool and lifecycle state.", hall_wide=True)
    for (pool, state), n in sorted(m["instances"].items()):
        inst.set(n, pool=pool, state=state)
    avail = Gauge(
        "sco_pool_available", "1 if the pool may be launched into; 0 while marked unavailable.", hall_wide=True
    )
    for pool, ok in sorted(m["pools"].items()):
        avail.set(1 if ok else 0, pool=pool)
    gauges = [
        inst,
        avail,
        Gauge("sco_reclaims_in_progress", "Instances notified, draining, drained or overrun, not yet deleting.").set(
            m["reclaiming"]
        ),
        Gauge("sco_reclaim_deletes_pending", "Reclaimed instances whose delete is not yet confirmed.").set(
            m["deleting"]
        ),
        Gauge(
            "sco_reclaim_deletes_past_deadline",
            "Reclaimed instances still not deleted after their terminate time T.",
        ).set(m["past_deadline"]),
    ]
    conn = getattr(store, "conn", None)
    if conn is not None:
        gauges += heartbeat_gauges(conn, hall)
    for g in gauges:
        g.hall_wide = True
    return gauges


def heartbeat_gauges(conn: Any, hall: str, after_s: float | None = None) -> list[Gauge]:
    """Agents not heard (their heartbeats, as last read into the fleet state) and when they were last read;
    nothing before the hall's heartbeats were first read (every agent would count as silent)."""
    from sco.state import heartbeats

    read = heartbeats.collection(conn, hall)
    if read is None or read["collected_at"] is None:
        return []
    if after_s is None:
        try:
            after_s = float(os.environ.get(SILENT_ENV) or SILENT_AFTER_S)
        except ValueError:
            log.error("$%s: not a number of seconds; using %g", SILENT_ENV, SILENT_AFTER_S)
            after_s = SILENT_AFTER_S
    return [
        Gauge(
            "sco_agents_silent",
            f"Instances whose agent should beat (active, notified, draining) and was not heard for {after_s:g} s.",
        ).set(len(heartbeats.silent(conn, hall, after_s))),
        Gauge(
            "sco_agent_heartbeats_read_timestamp_seconds",
            "When the agents' heartbeats were last read from the relay into the fleet state.",
        ).set(read["collected_at"].timestamp()),
        Gauge("sco_agent_heartbeats_nodes", "Nodes with a heartbeat on the relay at that read.").set(read["nodes"]),
    ]


def spend_gauges(per_tier: dict[int, tuple[float, float]]) -> list[Gauge]:
    """On-demand spend per hour and the spend authority per contract tier (from the arbiter's view)."""
    spend = Gauge("sco_on_demand_spend_per_hour", "On-demand spend per hour of the running fleet, by contract tier.")
    auth = Gauge("sco_on_demand_authority_per_hour", "Spend authority per hour (sum of spend caps), by contract tier.")
    for tier, (s, a) in sorted(per_tier.items()):
        spend.set(s, tier=str(tier))
        auth.set(a, tier=str(tier))
    return [spend, auth]


def relay_gauge(up: bool | None) -> list[Gauge]:
    if up is None:
        return []
    return [Gauge("sco_relay_up", "1 if the hall's NATS relay accepted a connection from the control loop.").set(up)]


__all__ = [
    "ENV",
    "FLEET_FILE",
    "Gauge",
    "fleet_gauges",
    "heartbeat_gauges",
    "relay_gauge",
    "render",
    "spend_gauges",
    "write_step",
]
