"""The drill in a hall whose relay runs in operator mode. The relay is role notice_relay's (operator mode,
applied to this machine as in test_relay_operator_role.py), started as its unit says; the node agent holds the creds
the role minted for it; playbook sco.orchestrator.drill reads the reader's and the reclaimer's creds files (the relay
refuses their bare nkey seeds), sends the notice, and reports the node drained."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from sco.contract.signing import write_keypair
from sco_devkit.standins.kube_apiserver import KubeApiStandIn
from tests.harness import AgentEnv, NatsServer, add_pod
from tests.relays import REPO, Deployed, run_playbook


def test_the_drill_presents_creds_files_to_an_operator_mode_relay(tmp_path: Path, kube: KubeApiStandIn) -> None:
    relay = Deployed(tmp_path)
    assert relay.creds == tmp_path / "controller" / "nats"  # <sco_credentials_dir>/nats, where the drill reads
    relay.apply(["node-1"])
    relay.start()
    agent = None
    try:
        stream = subprocess.run(relay.unit("ExecStartPost"), capture_output=True, text=True, timeout=60)
        assert stream.returncode == 0, stream.stderr
        srv = NatsServer(tmp_path / "relay", relay.port)  # the role's relay, for the harness's agent
        agent = AgentEnv(
            tmp_path / "agent", kube, srv, nats_creds_file=str(relay.creds / "node-node-1.creds"),
            nats_ca_file=str(relay.ca),
        )  # fmt: skip
        add_pod(kube, "web", "web-0", agent.node, grace=30, prestop=0.5)
        agent.start().wait_subscribed()
        write_keypair(agent.notice_key, tmp_path / "notice.key", tmp_path / "notice.pub")  # the hall trusts it
        ev = {
            "sco_hall": "local", "sco_relay_url": relay.url, "sco_credentials_dir": str(relay.creds.parent),
            "notice_relay_auth_mode": "operator", "drill_nodes": [agent.node],
            "drill_notice_keys": [str(tmp_path / "notice.key")], "drill_notice_seconds": 20,
            "drill_grace_seconds": 5, "drill_report_dir": str(tmp_path / "reports"), "drill_progress_seconds": 1,
        }  # fmt: skip
        out = run_playbook(tmp_path, REPO / "playbooks/drill.yml", ev)
        assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-2000:]
        assert f"{agent.node}: drained" in out.stdout, out.stdout[-3000:]
        (drained,) = agent.of("drain.drained")
        assert drained["notice"].startswith("drill-")
        (page,) = (tmp_path / "reports").glob("drill-*.html")
        report = json.loads(page.with_suffix(".json").read_text())
        # the agent's account reached the drill through the stream (the reader's creds)
        assert report["nodes"][agent.node]["outcome"] == "drained", report
    finally:
        if agent is not None:
            agent.stop()
        relay.stop()
