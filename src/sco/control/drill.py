"""The reclaim drill's account: the agents' own events (spooled, then on ``sco.events.<hall>.<node>``) folded into
one timeline per node and per pod or job, the live progress line a platform team watches, and the report (one
self-contained HTML file, no script, no external asset; and JSON with the same facts).

Folding and rendering are pure (no I/O, no clock of their own: ``now`` is given), so a test folds recorded events
and a browser renders the result; :func:`save` writes the two files. Only the standard library and ``sco._fs``: the
drill's script runs it on the controller with whatever Python Ansible uses, and the demo with its own.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sco._fs import atomic_write

Event = Mapping[str, Any]

# the agent's final word on a notice, by event type
FINAL = {"drain.drained": "drained", "drain.overrun": "overrun", "drain.error": "error"}
NOT_DONE = ("no answer", "draining")


@dataclass
class Mark:
    """One thing that happened, at wall-clock time ``at`` (epoch seconds, the agent's clock)."""

    at: float
    kind: str  # notice taint evict pdb forced shortened gone replaced verified overrun error signal requeued ...
    text: str

    def as_json(self) -> dict[str, Any]:
        return {"at": self.at, "kind": self.kind, "text": self.text}


@dataclass
class Item:
    """A pod (``namespace/name``) or a Slurm job of the drained node."""

    key: str
    kind: str  # pod | job
    marks: list[Mark] = field(default_factory=list)
    outcome: str = "in progress"  # gone | replaced | requeued | terminated | remaining | in progress
    detail: str = ""
    refusals: int = 0  # PodDisruptionBudget 429s before the eviction went through (or the delete)

    @property
    def done(self) -> bool:
        return self.outcome in ("gone", "replaced", "requeued", "terminated")

    def as_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "outcome": self.outcome,
            "detail": self.detail,
            "pdb_refusals": self.refusals,
            "marks": [m.as_json() for m in self.marks],
        }


@dataclass
class NodeTimeline:
    node: str
    notice: str | None = None  # the drill's notice id as the agent accepted it
    terminate_at: float | None = None  # T: the instance is gone then
    outcome: str = "no answer"  # no answer | draining | drained | overrun | error | refused | absorbed
    reason: str = ""  # why refused / absorbed / overrun
    marks: list[Mark] = field(default_factory=list)
    items: dict[str, Item] = field(default_factory=dict)
    listed: int | None = None  # evictable pods the agent's first list found
    notice_at: float | None = None  # when the agent accepted the notice
    tainted_at: float | None = None
    finished_at: float | None = None
    final: dict[str, Any] = field(default_factory=dict)  # the drain.* event's fields
    instance: str | None = None  # the instance's end when the provider's reclaimer ran the drill
    events: int = 0  # events of this notice folded
    malformed: int = 0  # events left out: no finite time, or fields of the wrong shape (a node's word, not ours)

    # --- folding the agent's events ----------------------------------------------------------------

    def _item(self, key: str, kind: str) -> Item:
        if key not in self.items:
            self.items[key] = Item(key, kind)
        return self.items[key]

    def take(self, ev: Event) -> None:
        """Fold one of the node's events (those of other notices are left out by :func:`fold`)."""
        t, at = str(ev.get("type")), float(ev.get("at") or 0.0)
        self.events += 1
        if t == "notice.accepted":
            self.notice_at = _at(ev.get("received_at") or at)
            self.terminate_at = _at(ev["terminate_at"]) if ev.get("terminate_at") is not None else None
            self.outcome = "draining"
            self.marks.append(Mark(self.notice_at, "notice", f"notice {ev.get('notice')} ({ev.get('source')})"))
        elif t == "notice.deadline":
            self.terminate_at = _at(ev["terminate_at"])
            self.marks.append(Mark(at, "notice", f"earlier termination from {ev.get('from_notice')}"))
        elif t == "notice.refused":
            self.outcome, self.reason = "refused", f"{ev.get('kind')}: {ev.get('reason')}"
            self.marks.append(Mark(at, "refused", f"notice refused ({ev.get('kind')})"))
        elif t == "notice.absorbed":
            self.outcome = "absorbed"
            self.reason = (
                f"already drained for notice {ev.get('of')} and not back in service (untaint / resume it first)"
                if not ev.get("draining")
                else f"still draining for notice {ev.get('of')}"
            )
            self.marks.append(Mark(at, "refused", "notice absorbed"))
        elif t in ("node.tainted", "node.drain_set"):
            self.tainted_at = at
            self.marks.append(Mark(at, "taint", "tainted" if t == "node.tainted" else "Slurm DRAIN set"))
        elif t == "pods.listed":
            self.listed = int(ev.get("pods") or 0)
        elif t == "eviction.requested":
            it = self._item(str(ev["pod"]), "pod")
            it.refusals = max(it.refusals, int(ev.get("refusals") or 0))
            it.marks.append(Mark(at, "evict", f"eviction requested, grace {ev.get('grace')} s"))
        elif t == "eviction.blocked":
            it = self._item(str(ev["pod"]), "pod")
            it.refusals = max(it.refusals, 1)
            it.marks.append(Mark(at, "pdb", f"PodDisruptionBudget refused: {ev.get('reason')}"))
        elif t == "eviction.forced":
            it = self._item(str(ev["pod"]), "pod")
            it.refusals = max(it.refusals, int(ev.get("refusals") or 0))
            it.marks.append(Mark(at, "forced", f"deleted, grace {ev.get('grace')} s ({ev.get('reason')})"))
        elif t == "grace.shortened":
            self._item(str(ev["pod"]), "pod").marks.append(Mark(at, "shortened", f"grace cut to {ev.get('grace')} s"))
        elif t in ("pod.gone", "pod.replaced"):
            it = self._item(str(ev["pod"]), "pod")
            it.outcome = "gone" if t == "pod.gone" else "replaced"
            it.detail = str(ev.get("how") or "recreated under the same name")
            it.marks.append(Mark(at, "gone", f"{it.outcome} ({it.detail})"))
        elif t == "job.signalled":
            it = self._item(f"job {ev['job']}", "job")
            it.marks.append(Mark(at, "evict", f"{ev.get('signal')} sent ({ev.get('path')})"))
        elif t == "job.checkpointed":
            self._item(f"job {ev['job']}", "job").marks.append(Mark(at, "shortened", "checkpoint written"))
        elif t == "job.requeued":
            for j in ev.get("jobs") or []:
                it = self._item(f"job {j}", "job")
                it.outcome, it.detail = "requeued", "left the node" if ev.get("left_before_requeue") else "requeued"
                it.marks.append(Mark(at, "gone", "requeued"))
        elif t == "job.terminated":
            it = self._item(f"job {ev['job']}", "job")
            it.outcome, it.detail = "terminated", "TERM at the end of its budget (around slurmctld)"
            it.marks.append(Mark(at, "forced", "terminated"))
        elif t == "job.requeue_failed":
            it = self._item(f"job {ev['job']}", "job")
            it.detail = f"requeue refused: {ev.get('error')}"
            it.marks.append(Mark(at, "pdb", it.detail))
        elif t in FINAL:
            self._finish(t, at, ev)

    def _finish(self, t: str, at: float, ev: Event) -> None:
        self.outcome, self.finished_at = FINAL[t], at
        self.final = {k: v for k, v in ev.items() if k not in ("type", "seq", "hall", "node", "notice", "at")}
        kind = {"drained": "verified", "overrun": "overrun", "error": "error"}[self.outcome]
        self.marks.append(Mark(at, kind, "verified drained" if kind == "verified" else self.outcome))
        if self.outcome == "overrun":
            self.reason = "; ".join(str(r) for r in ev.get("reasons") or [])
        for r in ev.get("remaining") or []:
            key = str(r["pod"]) if "pod" in r else f"job {r.get('job')}"
            it = self._item(key, "pod" if "pod" in r else "job")
            it.outcome, it.detail = "remaining", str(r.get("why") or "")
        for j in ev.get("jobs") or []:  # Slurm: a job that left on its own has no requeue of its own to show
            it = self._item(f"job {j}", "job")
            if self.outcome == "drained" and not it.done:
                it.outcome, it.detail = "gone", it.detail or "left the node"

    # --- what a platform team reads ----------------------------------------------------------------

    @property
    def pods_total(self) -> int:
        final = self.final.get("pods")
        return max(int(final) if isinstance(final, int) else 0, self.listed or 0, len(self.items))

    @property
    def after_s(self) -> float | None:
        """Notice to the agent's final account (drained or overrun), seconds."""
        if self.finished_at is None or self.notice_at is None:
            return None
        return round(self.finished_at - self.notice_at, 3)

    @property
    def left_at_t_s(self) -> float | None:
        """How much of the window was left when the drain ended (negative: past T)."""
        if self.finished_at is None or self.terminate_at is None:
            return None
        return round(self.terminate_at - self.finished_at, 3)

    @property
    def workloads(self) -> list[dict[str, Any]]:
        """Lost work per workload on the node's checkpoint socket, as the drain outcome says it: checkpointed or
        not, its save against its budget, the steps it redid when it resumed (agent/CHECKPOINT-PROTOCOL.md)."""
        ws = self.final.get("workloads")
        return [dict(w) for w in ws if isinstance(w, Mapping)] if isinstance(ws, list) else []

    @property
    def refusals(self) -> int:
        return sum(i.refusals for i in self.items.values())

    @property
    def forced(self) -> int:
        return sum(1 for i in self.items.values() if any(m.kind == "forced" for m in i.marks))

    def progress(self, now: float) -> str:
        """One line: notice, tainted, evicting n/m, drained or overrun, time left to T."""
        left = f", {self.terminate_at - now:.0f} s to T" if self.terminate_at is not None else ""
        if self.outcome == "no answer":
            return f"{self.node}: no answer yet (notice sent){left}"
        if self.outcome in ("refused", "absorbed"):
            return f"{self.node}: {self.outcome}: {self.reason}"
        if self.outcome == "draining":
            parts = ["notice accepted", "tainted" if self.tainted_at is not None else "not tainted yet"]
            asked = sum(1 for i in self.items.values() if i.marks and i.marks[0].kind in ("evict", "pdb", "forced"))
            gone = sum(1 for i in self.items.values() if i.done)
            blocked = sum(1 for i in self.items.values() if i.marks and i.marks[-1].kind == "pdb")
            what = "jobs" if any(i.kind == "job" for i in self.items.values()) else "evicting"
            parts.append(f"{what} {asked}/{self.pods_total or '?'}, {gone} gone")
            if blocked:
                parts.append(f"{blocked} held by a PodDisruptionBudget")
            return f"{self.node}: {', '.join(parts)}{left}"
        tail = f" in {self.after_s:.2f} s" if self.after_s is not None else ""
        at_t = f", {self.left_at_t_s:.1f} s left at T" if self.left_at_t_s is not None else ""
        why = f" ({self.reason})" if self.outcome == "overrun" and self.reason else ""
        return f"{self.node}: {self.outcome}{tail}{at_t}{why}"

    @property
    def summary(self) -> str:
        s = self.outcome if self.outcome not in ("refused", "absorbed") else f"{self.outcome} ({self.reason})"
        return f"{s}, {self.instance}" if self.instance else s

    def as_json(self) -> dict[str, Any]:
        return {
            "outcome": self.outcome,
            "summary": self.summary,
            "reason": self.reason,
            "notice": self.notice,
            "notice_at": self.notice_at,
            "terminate_at": self.terminate_at,
            "tainted_after_ms": _ms(self.tainted_at, self.notice_at),
            "seconds_after_notice": self.after_s,
            "left_at_t_s": self.left_at_t_s,
            "pods": self.pods_total,
            "forced": self.forced,
            "pdb_refusals": self.refusals,
            "workloads": self.workloads,
            "instance": self.instance,
            "malformed_events": self.malformed,
            "final": self.final,
            "marks": [m.as_json() for m in self.marks],
            "items": {k: i.as_json() for k, i in sorted(self.items.items())},
        }


def _ms(at: float | None, since: float | None) -> float | None:
    return None if at is None or since is None else round((at - since) * 1000, 1)


def fold(node: str, events: Iterable[Event], notice: str | None = None, sha256: str | None = None) -> NodeTimeline:
    """A node's timeline of one notice: ``notice`` (its id), or the last the node accepted. A refusal counts only
    when it is of the drill's own message (``sha256``): anyone's junk on the subject is not the drill's notice."""
    evs = [e for e in events if isinstance(e, Mapping) and "type" in e]
    bad = [e for e in evs if not _finite(e.get("at")) or not _finite(e.get("seq", 0))]
    evs = [e for e in evs if e not in bad]
    if notice is None:
        accepted = [e for e in evs if e["type"] in ("notice.accepted", "notice.absorbed")]
        notice = str(accepted[-1]["notice"]) if accepted else None
    tl = NodeTimeline(node, notice, malformed=len(bad))
    for ev in sorted(evs, key=lambda e: (float(e["at"]), float(e.get("seq") or 0))):
        if not _ours(ev, tl, notice, sha256):
            continue
        try:
            tl.take(ev)
        except (KeyError, TypeError, ValueError, OverflowError):
            tl.malformed += 1
    return tl


def _ours(ev: Event, tl: NodeTimeline, notice: str | None, sha256: str | None) -> bool:
    """Whether the event is of the drill's notice: a refusal of the drill's own message (anyone's junk on the
    subject is refused too), else an event naming the notice; an absorbed notice counts only as the first word."""
    if ev["type"] == "notice.refused":
        return sha256 is not None and ev.get("sha256") == sha256 and tl.outcome == "no answer"
    if notice is None or ev.get("notice") != notice:
        return False
    return ev["type"] != "notice.absorbed" or tl.outcome == "no answer"


def _at(v: Any) -> float:
    if not _finite(v):
        raise ValueError(f"not a time: {v!r}")
    return float(v)


def _finite(v: Any) -> bool:
    # epoch seconds a datetime can show; bool is an int to Python, never a time
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and abs(v) < 1e11


@dataclass
class DrillReport:
    hall: str
    drill: str
    sent_at: float  # when the drill's notices went out
    terminate_at: float  # T announced
    nodes: dict[str, NodeTimeline]
    finished: bool = False  # every node has its final account, or the drill stopped waiting
    generated_at: float | None = None

    @property
    def drained(self) -> list[str]:
        return sorted(n for n, t in self.nodes.items() if t.outcome == "drained")

    @property
    def not_drained(self) -> list[str]:
        return sorted(n for n, t in self.nodes.items() if t.outcome != "drained")

    @property
    def not_deleted(self) -> list[str]:
        return sorted(n for n, t in self.nodes.items() if t.instance is not None and t.instance != "deleted")

    def progress(self, now: float) -> list[str]:
        return [self.nodes[n].progress(now) for n in sorted(self.nodes)]

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "hall": self.hall,
            "drill": self.drill,
            "sent_at": self.sent_at,
            "terminate_at": self.terminate_at,
            "notice_seconds": round(self.terminate_at - self.sent_at, 3),
            "finished": self.finished,
            "generated_at": self.generated_at,
            "nodes": {n: t.as_json() for n, t in sorted(self.nodes.items())},
            "drained": self.drained,
            "not_drained": self.not_drained,
        }
        if any(t.instance is not None for t in self.nodes.values()):
            out["not_deleted"] = self.not_deleted
        return out


# --- the HTML report -------------------------------------------------------------------------------------

COLORS = {  # one colour per kind of mark; the legend and the screenshot test read the same table
    "notice": "#1f6fd1",
    "taint": "#7b3fb8",
    "evict": "#2e9e5b",
    "pdb": "#e08a00",
    "forced": "#d1361f",
    "shortened": "#b8a100",
    "gone": "#14532d",
    "replaced": "#14532d",
    "verified": "#0a8f8f",
    "overrun": "#b00020",
    "error": "#b00020",
    "refused": "#6b6b6b",
    "signal": "#2e9e5b",
    "deadline": "#c2185b",
}
LEGEND = [
    ("notice", "notice"),
    ("taint", "taint / DRAIN"),
    ("evict", "eviction requested / signal"),
    ("pdb", "PDB refusal"),
    ("forced", "forced delete"),
    ("shortened", "grace cut / checkpoint"),
    ("gone", "gone / requeued"),
    ("verified", "verified drained"),
    ("overrun", "overrun"),
    ("deadline", "deadline T"),
]
OUTCOME_CLASS = {"drained": "ok", "overrun": "bad", "error": "bad", "refused": "bad", "absorbed": "bad"}
WIDTH, LABEL_W, ROW_H, POD_H = 1100, 240, 34, 22
PLOT_W = WIDTH - LABEL_W - 20


class Scale:
    """Seconds after the notice -> x. A drain that ends long before T would be a sliver at the left of a linear
    axis: the drain's span then gets the first 70 % of the width and the rest of the window up to T the last 30 %,
    with a break drawn between them."""

    def __init__(self, busy_s: float, window_s: float) -> None:
        self.window = max(window_s, busy_s, 1.0)
        self.busy = max(busy_s * 1.15, 0.5)
        self.broken = self.busy < 0.5 * self.window
        self.split = 0.7 if self.broken else 1.0

    def x(self, s: float) -> float:
        s = min(max(s, 0.0), self.window * 1.02)
        if not self.broken:
            frac = s / (self.window * 1.02)
        elif s <= self.busy:
            frac = self.split * s / self.busy
        else:
            frac = self.split + (1 - self.split) * (s - self.busy) / (self.window * 1.02 - self.busy)
        return LABEL_W + frac * PLOT_W

    def ticks(self) -> list[float]:
        def nice(span: float) -> float:
            raw = span / 5
            mag = 10.0 ** math.floor(math.log10(raw))
            return float(next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw))

        if not self.broken:
            step = nice(self.window)
            return [i * step for i in range(int(self.window / step) + 1)]
        step = nice(self.busy)
        return [i * step for i in range(int(self.busy / step) + 1)] + [round(self.window)]


def _t(at: float) -> str:
    try:
        return datetime.fromtimestamp(at, UTC).strftime("%H:%M:%S.%f")[:-3] + "Z"
    except (OverflowError, ValueError, OSError):
        return "?"


def _marks_svg(marks: list[Mark], t0: float, sc: Scale, y: float, h: float) -> list[str]:
    out = []
    for m in marks:
        x = sc.x(m.at - t0)
        c = COLORS.get(m.kind, "#333")
        tip = html.escape(f"T0+{m.at - t0:.3f} s ({_t(m.at)}): {m.text}")
        if m.kind == "notice":  # a full-height line: the taint, milliseconds later, must not hide it
            shape = f'<rect x="{x - 1.5:.1f}" y="{y + 1:.1f}" width="3" height="{h - 2:.1f}" fill="{c}"/>'
        elif m.kind in ("verified", "overrun", "error", "gone", "replaced"):
            shape = f'<rect x="{x - 5:.1f}" y="{y + 3:.1f}" width="10" height="{h - 6:.1f}" fill="{c}"/>'
        elif m.kind in ("forced", "pdb"):
            tri = f"M{x:.1f} {y + 2:.1f} L{x + 7:.1f} {y + h - 2:.1f} L{x - 7:.1f} {y + h - 2:.1f} Z"
            shape = f'<path d="{tri}" fill="{c}"/>'
        else:
            shape = f'<circle cx="{x:.1f}" cy="{y + h / 2:.1f}" r="{min(6, h / 2 - 3):.1f}" fill="{c}"/>'
        out.append(f'<g class="mark {m.kind}"><title>{tip}</title>{shape}</g>')
    return out


def _node_svg(tl: NodeTimeline, t0: float, sc: Scale, term: float) -> str:
    items = sorted(tl.items.values(), key=lambda i: i.key)
    height = ROW_H + POD_H * len(items) + 26
    parts = [
        f'<svg class="timeline" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" '
        f'xmlns="http://www.w3.org/2000/svg" role="img" aria-label="timeline of {html.escape(tl.node)}">'
    ]
    # the window: from the notice to T, T drawn across every row of the node
    x0, xt = sc.x(0), sc.x(term - t0)
    parts.append(f'<rect x="{x0:.1f}" y="4" width="{xt - x0:.1f}" height="{height - 30}" fill="#f3f6fa"/>')
    if sc.broken:
        xb = LABEL_W + sc.split * PLOT_W
        parts.append(
            f'<path d="M{xb - 4:.1f} 2 l8 6 M{xb - 4:.1f} 8 l8 6" stroke="#999" fill="none"/>'
            f'<line x1="{xb:.1f}" y1="4" x2="{xb:.1f}" y2="{height - 26}" stroke="#bbb" stroke-dasharray="2 4"/>'
        )
    cls = OUTCOME_CLASS.get(tl.outcome, "open")
    title = f"{html.escape(tl.node)} · {html.escape(tl.outcome)}"
    parts.append(f'<text x="8" y="{ROW_H / 2 + 5:.0f}" class="node {cls}">{title}</text>')
    span_end = tl.finished_at if tl.finished_at is not None else (tl.marks[-1].at if tl.marks else None)
    if tl.notice_at is not None and span_end is not None:
        a, b = sc.x(tl.notice_at - t0), sc.x(span_end - t0)
        parts.append(
            f'<rect x="{a:.1f}" y="{ROW_H / 2 - 3:.1f}" width="{max(b - a, 2):.1f}" height="6" fill="#9fb7d9"/>'
        )
    parts += _marks_svg(tl.marks, t0, sc, 0, ROW_H)
    for i, it in enumerate(items):
        y = ROW_H + i * POD_H
        cls = "ok" if it.done else ("bad" if it.outcome == "remaining" else "open")
        parts.append(f'<text x="22" y="{y + POD_H / 2 + 4:.0f}" class="item {cls}">{html.escape(it.key)}</text>')
        if it.marks:
            a, b = sc.x(it.marks[0].at - t0), sc.x(it.marks[-1].at - t0)
            bar = f'x="{a:.1f}" y="{y + POD_H / 2 - 2:.1f}" width="{max(b - a, 1):.1f}" height="4"'
            parts.append(f'<rect {bar} fill="#c9d3e0"/>')
            for m, nxt in zip(it.marks, [*it.marks[1:], None], strict=True):
                if m.kind == "pdb":  # held by the budget from its first refusal until the next step (or now)
                    end = sc.x((nxt.at if nxt else (tl.finished_at or m.at)) - t0)
                    x = sc.x(m.at - t0)
                    held = f'x="{x:.1f}" y="{y + POD_H / 2 - 3:.1f}" width="{max(end - x, 1):.1f}" height="6"'
                    parts.append(f'<rect {held} fill="{COLORS["pdb"]}" opacity="0.45"/>')
        parts += _marks_svg(it.marks, t0, sc, y, POD_H)
    # the axis and the deadline
    axis_y = height - 22
    parts.append(f'<line x1="{LABEL_W}" y1="{axis_y}" x2="{WIDTH - 20}" y2="{axis_y}" stroke="#888"/>')
    for s in sc.ticks():
        x = sc.x(s)
        parts.append(
            f'<line x1="{x:.1f}" y1="{axis_y}" x2="{x:.1f}" y2="{axis_y + 4}" stroke="#888"/>'
            f'<text x="{x:.1f}" y="{axis_y + 16}" class="tick">{s:g} s</text>'
        )
    parts.append(
        f'<g class="mark deadline"><title>deadline T = {_t(term)}</title>'
        f'<line x1="{xt:.1f}" y1="2" x2="{xt:.1f}" y2="{axis_y}" stroke="{COLORS["deadline"]}" stroke-width="3"/>'
        f'<text x="{xt - 4:.1f}" y="{ROW_H / 2 - 6:.0f}" class="tick t">T</text></g>'
    )
    parts.append("</svg>")
    return "".join(parts)


CSS = """
body{font:14px/1.4 system-ui,-apple-system,"DejaVu Sans",sans-serif;margin:24px;color:#1b1f24;background:#fff}
h1{font-size:20px;margin:0 0 4px} .meta{color:#555;margin:0 0 16px}
table{border-collapse:collapse;margin:8px 0 24px} th,td{border:1px solid #d0d7de;padding:4px 10px;text-align:left}
th{background:#f6f8fa} td.num{text-align:right;font-variant-numeric:tabular-nums}
.ok{color:#116329;font-weight:600} .bad{color:#b00020;font-weight:600} .open{color:#7a5a00;font-weight:600}
section.node{border:1px solid #d0d7de;border-radius:6px;margin:0 0 14px;padding:6px 0 0;width:1100px}
section.node h2{font-size:15px;margin:0 12px 2px} section.node p{margin:0 12px 4px;color:#555}
svg text{font:12px "DejaVu Sans",sans-serif;fill:#1b1f24} svg text.node{font-weight:700;font-size:13px}
svg text.ok{fill:#116329} svg text.bad{fill:#b00020} svg text.open{fill:#7a5a00}
svg text.tick{fill:#555;text-anchor:middle} svg text.t{fill:#c2185b;font-weight:700;text-anchor:end}
.legend span{display:inline-block;margin-right:14px} .legend i{display:inline-block;width:10px;height:10px;
margin-right:4px;border-radius:2px;vertical-align:-1px}
"""


def render_html(report: DrillReport) -> str:
    """The report as one self-contained HTML document (inline CSS and SVG; opens from a file, mails as one)."""
    t0 = report.sent_at
    term_of = {n: (t.terminate_at or report.terminate_at) for n, t in report.nodes.items()}
    last = [m.at for t in report.nodes.values() for m in t.marks + [m for i in t.items.values() for m in i.marks]]
    window = max(term_of.values(), default=report.terminate_at) - t0
    busy = max((a - t0 for a in last if a - t0 <= 2 * window), default=0.0)  # a clock far off would squash the rest
    sc = Scale(busy, window)
    esc = html.escape
    rows = []
    for n in sorted(report.nodes):
        t = report.nodes[n]
        cls = OUTCOME_CLASS.get(t.outcome, "open")
        cells = [
            f'<td class="name">{esc(n)}</td>',
            f'<td class="{cls}">{esc(t.outcome)}</td>',
            f'<td class="num">{_fmt(_ms(t.tainted_at, t.notice_at), " ms")}</td>',
            f'<td class="num">{_fmt(t.after_s, " s")}</td>',
            f'<td class="num">{_fmt(t.left_at_t_s, " s")}</td>',
            f'<td class="num">{sum(1 for i in t.items.values() if i.done)}/{t.pods_total}</td>',
            f'<td class="num">{t.refusals}</td>',
            f'<td class="num">{t.forced}</td>',
            f"<td>{esc(t.instance or '')}</td>",
            f"<td>{esc(t.reason)}</td>",
        ]
        rows.append(f'<tr data-outcome="{esc(n)}">{"".join(cells)}</tr>')
    sections = []
    for n in sorted(report.nodes):
        t = report.nodes[n]
        sub = (
            f"notice {esc(t.notice or '(none accepted)')}; T = {_t(term_of[n])}; "
            f"{len(t.items)} pod(s)/job(s); {t.events} event(s)"
            + (f"; {t.malformed} malformed event(s) left out" if t.malformed else "")
        )
        sections.append(
            f'<section class="node" data-node="{esc(n)}"><h2>{esc(n)}</h2><p>{sub}</p>'
            f"{_node_svg(t, t0, sc, term_of[n])}</section>"
        )
    legend = "".join(f'<span><i style="background:{COLORS[k]}"></i>{esc(v)}</span>' for k, v in LEGEND)
    work = []
    for n in sorted(report.nodes):
        for w in report.nodes[n].workloads:
            ok = w.get("checkpointed") is True
            redone, frm = _num(w.get("steps_redone")), _num(w.get("resumed_from_step"))
            resumed = "" if redone is None else f"{redone:g}" + ("" if frm is None else f" (from step {frm:g})")
            cells = [
                f"<td>{esc(n)}</td>",
                f"<td>{esc(str(w.get('workload', '')))}</td>",
                f"<td>{esc(str(w.get('contract') or ''))}</td>",
                f'<td class="{"ok" if ok else "bad"}">{"yes" if ok else "no"} ({esc(str(w.get("state", "")))})</td>',
                f'<td class="num">{_fmt(_num(w.get("save_s")), " s")}</td>',
                f'<td class="num">{_fmt(_num(w.get("budget_s")), " s")}</td>',
                f'<td class="num">{_fmt(_num(w.get("step")), "")}</td>',
                f'<td class="num">{resumed}</td>',
            ]
            work.append(f'<tr data-workload="{esc(str(w.get("workload", "")))}">{"".join(cells)}</tr>')
    work_table = (
        '<table class="workloads"><thead><tr><th>node</th><th>workload (checkpoint socket)</th><th>contract</th>'
        "<th>checkpointed</th><th>save</th><th>budget</th><th>at step</th><th>steps redone when it resumed</th>"
        f"</tr></thead><tbody>{''.join(work)}</tbody></table>"
        if work
        else ""
    )
    state = "finished" if report.finished else "in progress"
    gen = f", written {_t(report.generated_at)}" if report.generated_at else ""
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>Reclaim drill {esc(report.drill)} - hall {esc(report.hall)}</title><style>{CSS}</style></head><body>"
        f"<h1>Reclaim drill {esc(report.drill)}, hall {esc(report.hall)}</h1>"
        f'<p class="meta">notices sent {_t(t0)}, termination T = {_t(report.terminate_at)} '
        f"(window {report.terminate_at - t0:.0f} s); {len(report.drained)} of {len(report.nodes)} node(s) drained; "
        f"{state}{gen}. Times are the agents' clocks; T0 = the notices sent.</p>"
        '<table class="outcomes"><thead><tr><th>node</th><th>outcome</th><th>notice to taint</th>'
        "<th>notice to drained</th><th>left at T</th><th>pods/jobs gone</th><th>PDB refusals</th>"
        "<th>forced deletes</th><th>instance</th><th>why</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>{work_table}"
        f'<p class="legend">{legend}</p>{"".join(sections)}</body></html>\n'
    )


def _num(v: Any) -> float | None:
    """A figure a node reported, if it is one (its words are shown, never trusted to be numbers)."""
    return float(v) if _finite(v) else None


def _fmt(v: float | None, unit: str) -> str:
    return "" if v is None else f"{v:g}{unit}"


def save(directory: Path, report: DrillReport, events: Mapping[str, Any]) -> Path:
    """``<drill>.json`` (the report's facts and every event it was folded from) and ``<drill>.html`` in
    ``directory``, each replaced atomically; returns the HTML file's path."""
    directory.mkdir(parents=True, exist_ok=True)
    page = directory / f"{report.drill}.html"
    body = {**report.as_json(), "events": events, "html": str(page)}
    atomic_write(directory / f"{report.drill}.json", json.dumps(body, indent=1, sort_keys=True).encode())
    atomic_write(page, render_html(report).encode())
    return page


__all__ = ["COLORS", "DrillReport", "Item", "Mark", "NodeTimeline", "fold", "render_html", "save"]
