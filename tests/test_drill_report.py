"""The drill's report, from a real drill: the drill (`sco drill`) sends signed notices through a relay configured by the
notice_relay role's template, two real node agents drain (one pod held by a PodDisruptionBudget until its budget is
spent, then deleted) and a third node has no agent. The report's timeline and figures are checked against the
agents' own spools, its live progress is read while the nodes drain, and the HTML is rendered in Debian's headless
Chromium: the screenshot must show every node's row, drawn and distinct, with the deadline and the outcome marks in
it (the same check on a page whose rows are not drawn fails)."""

from __future__ import annotations

import io
import itertools
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from sco.contract.signing import write_keypair
from sco.control.drill import COLORS, DrillReport, fold, render_html
from sco_devkit.standins.kube_apiserver import KubeApiStandIn
from tests.browser import Chromium
from tests.harness import AgentEnv, add_pod
from tests.relays import agent_identity, start_relay

REPO = Path(__file__).resolve().parents[1]
DRILL = ["-m", "sco.cli", "drill"]  # `sco drill`, as drill.yml runs it
NODES = ["node-1", "node-2", "node-3"]  # node-3: nobody answers
WINDOW_S = 12


@pytest.fixture(scope="module")
def drill(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("drill")
    kube = KubeApiStandIn().start()
    srv, creds = start_relay(tmp, NODES)
    agents = []
    try:
        for node in NODES[:2]:
            a = AgentEnv(tmp / node, kube, srv, node=node, **agent_identity(creds, node))
            write_keypair(a.notice_key, tmp / f"{node}-notice.key", tmp / f"{node}-notice.pub")
            agents.append(a)
        add_pod(kube, "web", "web-0", "node-1", grace=30, prestop=0.3)
        add_pod(kube, "web", "web-1", "node-1", grace=30, prestop=0.6)
        # held by a PDB that never allows: refused until the guarded contract's 3 s budget is spent, then deleted
        add_pod(kube, "guarded", "db-0", "node-1", grace=30, prestop=0.2, labels={"app": "db"})
        kube.cluster.create_pdb("guarded", {"metadata": {"name": "db"}, "spec": {"minAvailable": 1,
                                "selector": {"matchLabels": {"app": "db"}}}})  # fmt: skip
        add_pod(kube, "batch", "job-0", "node-2", grace=30, prestop=1.0)
        for a in agents:
            a.start().wait_subscribed()
        report_dir = tmp / "reports"
        cmd = [sys.executable, *DRILL, "run", "--server", srv.url, "--hall", "local", "--id", "drill-test",
               "--report-dir", str(report_dir), "--reader-credentials", str(creds / "control.nk"),
               "--reclaimer-credentials", str(creds / "reclaimer.nk"), "--notice-seconds", str(WINDOW_S),
               "--grace-seconds", "1", "--ca-file", str(tmp / "tls" / "ca.crt"), *(f"--node={n}" for n in NODES),
               *(f"--signing-key={tmp / n}-notice.key" for n in NODES[:2])]  # fmt: skip
        progress: list[str] = []
        stop = threading.Event()

        def watch() -> None:  # what drill.yml prints while the nodes drain
            while not stop.is_set():
                out = subprocess.run(
                    [sys.executable, *DRILL, "watch", "--report-dir", str(report_dir), "--id", "drill-test",
                     "--wait", "0.3"],
                    capture_output=True, text=True, timeout=30,
                )  # fmt: skip
                progress.extend(out.stdout.splitlines())

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=WINDOW_S + 60)
        finally:
            stop.set()
            watcher.join()
        yield {"run": run, "dir": report_dir, "agents": agents, "progress": progress, "kube": kube}
    finally:
        for a in agents:
            a.stop()
        srv.stop()
        kube.stop()


def _report(drill: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = json.loads((drill["dir"] / "drill-test.json").read_text())
    return body


def test_the_report_tells_each_node_and_pod_from_the_agents_own_events(drill: dict[str, Any]) -> None:
    run = drill["run"]
    assert run.returncode == 1, run.stderr  # node-3 did not drain: the report says so, the drill ran
    out = json.loads(run.stdout)
    assert out["drained"] == ["node-1", "node-2"] and out["not_drained"] == ["node-3"]
    body = _report(drill)
    n1, n2, n3 = (body["nodes"][n] for n in NODES)
    assert n3["outcome"] == "no answer" and n3["marks"] == []
    for node, agent in zip(NODES[:2], drill["agents"], strict=True):
        spooled = {e["type"]: e for e in agent.events() if e.get("notice") == f"drill-test-{node}"}
        got = body["nodes"][node]
        # the figures are the agent's own: when it accepted the notice, tainted, verified
        assert got["notice_at"] == spooled["notice.accepted"]["received_at"]
        assert got["terminate_at"] == spooled["notice.accepted"]["terminate_at"]
        drained = spooled["drain.drained"]
        assert got["seconds_after_notice"] == round(drained["at"] - got["notice_at"], 3)
        assert got["left_at_t_s"] == round(got["terminate_at"] - drained["at"], 3) > 0
        assert [m["kind"] for m in got["marks"]] == ["notice", "taint", "verified"]
    assert sorted(n1["items"]) == ["guarded/db-0", "web/web-0", "web/web-1"] and n1["pods"] == 3
    db = n1["items"]["guarded/db-0"]
    kinds = [m["kind"] for m in db["marks"]]
    # refused by the PDB (the first refusal is a mark; every 429 is counted), deleted at the budget's end, gone
    assert kinds[0] == "pdb" and "forced" in kinds and kinds[-1] == "gone", db
    assert db["pdb_refusals"] >= 2 and n1["pdb_refusals"] == db["pdb_refusals"] and n1["forced"] == 1
    forced_at = next(m["at"] for m in db["marks"] if m["kind"] == "forced")
    assert forced_at - n1["notice_at"] >= 3 - 0.3  # not before the guarded contract's 3 s budget was spent
    for key in ("web/web-0", "web/web-1"):
        assert [m["kind"] for m in n1["items"][key]["marks"]] == ["evict", "gone"]
    assert n2["items"]["batch/job-0"]["outcome"] == "gone" and n2["forced"] == 0
    # every event of the drill's notices is kept in the JSON, as the agents sent them
    assert len(body["events"]["node-1"]) >= len([e for e in drill["agents"][0].events() if e.get("notice")])


def test_live_progress_shows_notice_taint_evictions_outcome_and_time_left(drill: dict[str, Any]) -> None:
    lines = drill["progress"]
    node1 = [ln.strip() for ln in lines if ln.strip().startswith("node-1:")]
    # while draining: tainted, evicting n/m with the PDB's hold, seconds to T; then the outcome with time left at T
    assert any("tainted" in ln and "evicting" in ln and "/3" in ln and "s to T" in ln for ln in node1), lines
    assert any("held by a PodDisruptionBudget" in ln for ln in node1), lines
    assert any(ln.startswith("node-1: drained in") and "s left at T" in ln for ln in node1), lines
    assert any(ln.strip().startswith("node-3: no answer yet") for ln in lines), lines
    assert any("finished" in ln for ln in lines if ln.startswith("drill drill-test:")), lines


def _drawn(png: bytes, boxes: dict[str, dict[str, float]], expect: dict[str, list[str]]) -> list[str]:
    """What is wrong with each node's row in the screenshot: its box must hold many distinct colours (drawn, not
    a flat fill), the deadline's colour and the colour of each mark expected in it, and differ from every other
    row's pixels."""
    img = Image.open(io.BytesIO(png)).convert("RGB")
    problems, crops = [], {}
    for node, b in boxes.items():
        if b["width"] < 200 or b["height"] < 30:
            problems.append(f"{node}: row box {b} is too small to show a timeline")
            continue
        crop = img.crop((int(b["x"]), int(b["y"]), int(b["x"] + b["width"]), int(b["y"] + b["height"])))
        crops[node] = crop
        colours = crop.getcolors(maxcolors=1 << 20) or []
        if len(colours) < 20:
            problems.append(f"{node}: row has {len(colours)} colours: not drawn")
        present = {c for _, c in colours}
        for kind in ["deadline", *expect.get(node, [])]:
            want = tuple(int(COLORS[kind][i : i + 2], 16) for i in (1, 3, 5))
            if want not in present:
                problems.append(f"{node}: no {kind} mark ({COLORS[kind]}) in its row")
    names = sorted(crops)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if crops[a].size == crops[b].size and crops[a].tobytes() == crops[b].tobytes():
                problems.append(f"{a} and {b}: rows are pixel-identical")
    return problems


def _render(page: Path) -> tuple[bytes, dict[str, dict[str, float]], list[str]]:
    with Chromium() as browser:
        browser.open(page.as_uri())
        boxes = browser.evaluate(
            "Object.fromEntries([...document.querySelectorAll('section.node')].map(e => {"
            "const r = e.getBoundingClientRect(); return [e.dataset.node,"
            "{x: r.x + scrollX, y: r.y + scrollY, width: r.width, height: r.height}]}))"
        )
        rows = browser.evaluate("[...document.querySelectorAll('table.outcomes tbody tr')].map(r => r.innerText)")
        return browser.screenshot(), boxes, rows


def test_the_report_renders_every_nodes_row_in_headless_chromium(drill: dict[str, Any], tmp_path: Path) -> None:
    page = drill["dir"] / "drill-test.html"
    html = page.read_text()
    assert "<script" not in html and "http://" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")
    png, boxes, rows = _render(page)
    (tmp_path / "drill-test.png").write_bytes(png)  # kept with the test's files for a person to look at
    assert sorted(boxes) == NODES, boxes
    assert [r.split("\t")[:2] for r in rows] == [["node-1", "drained"], ["node-2", "drained"], ["node-3", "no answer"]]
    expect = {"node-1": ["notice", "taint", "evict", "pdb", "forced", "gone", "verified"],
              "node-2": ["notice", "taint", "evict", "gone", "verified"]}  # fmt: skip
    assert _drawn(png, boxes, expect) == []
    # the rows stand one under the other, not on top of each other
    ys = sorted((b["y"], b["y"] + b["height"]) for b in boxes.values())
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(ys)), ys


def test_the_screenshot_check_fails_on_a_page_that_does_not_draw_the_rows(
    drill: dict[str, Any], tmp_path: Path
) -> None:
    """The check must not pass on a blank page: the same report with its timelines hidden, and an empty page."""
    hidden = tmp_path / "hidden.html"
    hidden.write_text(
        (drill["dir"] / "drill-test.html").read_text().replace("</style>", "svg{visibility:hidden}</style>")
    )
    png, boxes, _ = _render(hidden)
    assert sorted(boxes) == NODES  # the boxes are there, the pixels are not
    problems = _drawn(png, boxes, {"node-1": ["verified"]})
    # headings and borders are there, the timelines are not: no row passes
    assert {p.split(":")[0] for p in problems if "no deadline mark" in p} == set(NODES), problems
    blank = tmp_path / "blank.html"
    blank.write_text("<!DOCTYPE html><html><body></body></html>")
    png, _, _ = _render(blank)
    fake = {n: {"x": 0.0, "y": 40.0 * i, "width": 1100.0, "height": 40.0} for i, n in enumerate(NODES)}
    problems = _drawn(png, fake, {})
    assert len([p for p in problems if "not drawn" in p]) == 3, problems
    assert any("pixel-identical" in p for p in problems), problems


def test_an_overrun_and_a_refusal_are_drawn_with_their_reasons(drill: dict[str, Any], tmp_path: Path) -> None:
    """Folding: the node-2 agent's events, cut before its outcome and given an overrun as the agent writes one; a
    refusal of the drill's own message; junk refused on the subject is not the drill's."""
    agent = drill["agents"][1]
    evs = [e for e in agent.events() if e.get("notice") == "drill-test-node-2" and not e["type"].startswith("drain.")]
    last = max(e["at"] for e in evs)
    overrun = {"type": "drain.overrun", "seq": 999, "at": last + 1, "notice": "drill-test-node-2", "pods": 1,
               "reasons": ["1 pod(s) not verifiably gone"],
               "remaining": [{"pod": "batch/job-0", "uid": "u", "why": "slow preStop (grace 9 s)"}]}  # fmt: skip
    tl = fold("node-2", [*evs, overrun], "drill-test-node-2")
    assert tl.outcome == "overrun" and tl.items["batch/job-0"].outcome == "remaining"
    assert "slow preStop (grace 9 s)" in tl.items["batch/job-0"].detail and tl.reason == "1 pod(s) not verifiably gone"
    refused = {"type": "notice.refused", "seq": 5, "at": last, "kind": "untrusted", "reason": "signed by abc",
               "sha256": "mine"}  # fmt: skip
    junk = {**refused, "sha256": "someone-else", "kind": "unsigned"}
    assert fold("node-3", [junk], "drill-test-node-3", "mine").outcome == "no answer"
    r = fold("node-3", [junk, refused], "drill-test-node-3", "mine")
    assert r.outcome == "refused" and "untrusted" in r.reason
    t0 = min(e["at"] for e in evs) - 0.05
    rep = DrillReport("local", "d", t0, tl.terminate_at or t0 + WINDOW_S, {"node-2": tl, "node-3": r}, True)
    page = tmp_path / "r.html"
    page.write_text(render_html(rep))
    png, boxes, rows = _render(page)
    assert [r.split("\t")[1] for r in rows] == ["overrun", "refused"]
    assert _drawn(png, boxes, {"node-2": ["overrun"], "node-3": ["refused"]}) == []
    assert "node-2: overrun in" in rep.progress(time.time())[0]


def test_the_demo_drills_its_local_hall_with_progress_and_a_report(tmp_path: Path) -> None:
    """`make demo`: the local hall's reclaim shows the node's progress as it drains and leaves the drill's report
    in the state directory (here $SCO_STATE_DIR), its row drawn."""
    import os

    demo = Path(sys.executable).parent / "sco-demo"
    p = subprocess.run(
        [str(demo)], capture_output=True, text=True, timeout=120, env={**os.environ, "SCO_STATE_DIR": str(tmp_path)}
    )
    assert p.returncode == 0, p.stdout + p.stderr
    progress = [ln for ln in p.stdout.splitlines() if ln.startswith("[ progress]")]
    assert any("tainted, evicting 5/5" in ln for ln in progress), p.stdout
    assert "local-node-1: drained in" in progress[-1] and "s left at T" in progress[-1], progress
    (page,) = (tmp_path / "drills/local").glob("demo-*.html")
    assert f"report] the drill's report (timeline per node and pod, the deadline drawn): {page}" in p.stdout
    body = json.loads(page.with_suffix(".json").read_text())
    node = body["nodes"]["local-node-1"]
    assert node["outcome"] == "drained" and node["pods"] == 5 and len(node["items"]) == 5
    png, boxes, _ = _render(page)
    assert _drawn(png, boxes, {"local-node-1": ["notice", "taint", "evict", "gone", "verified"]}) == []


def test_a_nodes_junk_events_are_left_out_not_a_crash(drill: dict[str, Any], tmp_path: Path) -> None:
    """A node may publish only on its own subject, but what it says is its word: times that are no times (NaN,
    infinity, 1e300, text, true), fields of the wrong shape and markup in its strings are left out or escaped; the
    drill's account of its real events stands."""
    agent = drill["agents"][1]
    real = [e for e in agent.events() if e.get("notice") == "drill-test-node-2"]
    n = "drill-test-node-2"
    junk = [
        {"type": "pod.gone", "at": float("nan"), "notice": n, "pod": "x/y"},
        {"type": "pod.gone", "at": float("inf"), "notice": n, "pod": "x/y"},
        {"type": "pod.gone", "at": 1e300, "notice": n, "pod": "x/y"},
        {"type": "pod.gone", "at": "soon", "notice": n, "pod": "x/y"},
        {"type": "pod.gone", "at": True, "notice": n, "pod": "x/y"},
        {"type": "eviction.requested", "at": real[-1]["at"], "notice": n},  # no pod
        {"type": "notice.deadline", "at": real[-1]["at"], "notice": n, "terminate_at": float("nan")},
        {"type": "eviction.blocked", "at": real[-1]["at"], "notice": n, "pod": "web/<script>x</script>"},
        {"type": "eviction.blocked", "at": real[-1]["at"], "notice": n, "pod": "web/a", "reason": "<img src=x>"},
    ]
    tl = fold("node-2", [*real, *junk], n)
    assert tl.outcome == "drained" and tl.malformed == 7, tl.malformed
    assert tl.terminate_at == next(e["terminate_at"] for e in real if e["type"] == "notice.accepted")
    rep = DrillReport("local", "d", tl.notice_at or 0.0, tl.terminate_at or 0.0, {"node-2": tl}, True)
    page = render_html(rep)
    assert "<script>" not in page and "<img" not in page and "&lt;script&gt;" in page and "&lt;img" in page
    assert "7 malformed event(s) left out" in page and rep.as_json()["nodes"]["node-2"]["malformed_events"] == 7
