"""The node agent's configuration as an operator gets it wrong: an empty node, a misspelt SCO_AGENT_ variable, no
cached bundle yet; each said once, plainly."""

from __future__ import annotations

import os
from pathlib import Path

from tests.harness import AgentEnv, NatsServer, minimal_agent_config, run_sco_agent


def test_agent_refuses_an_explicitly_empty_node(tmp_path: Path) -> None:
    cfg = minimal_agent_config(tmp_path)
    p = run_sco_agent("check-config", "--config", str(cfg), env={"SCO_AGENT_NODE": ""})
    assert p.returncode == 5 and "Traceback" not in p.stderr, p.stdout + p.stderr
    assert "SCO_AGENT_NODE" in p.stderr and "empty" in p.stderr, p.stderr
    p = run_sco_agent("check-config", "--config", str(cfg), env={})
    assert p.returncode == 0 and "node n1" in p.stdout, p.stdout + p.stderr


def test_agent_warns_about_unknown_sco_agent_variables(tmp_path: Path) -> None:
    cfg = minimal_agent_config(tmp_path)
    env = {"SCO_AGENT_NATSURL": "nats://relay:4222", "SCO_AGENT_CONFIG": str(cfg), "SCO_AGENT_HALL": "local"}
    p = run_sco_agent("check-config", env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    warn = [x for x in p.stderr.splitlines() if "SCO_AGENT_NATSURL" in x]
    assert len(warn) == 1 and "warning" in warn[0] and "unknown" in warn[0], p.stderr
    assert "SCO_AGENT_CONFIG" not in p.stderr and "SCO_AGENT_HALL" not in p.stderr


def test_agent_start_warns_about_unknown_variables_and_no_cached_bundle(
    tmp_path: Path, nats_server: NatsServer
) -> None:
    from sco_devkit.standins.kube_apiserver import KubeApiStandIn

    kube = KubeApiStandIn().start()
    env = AgentEnv(tmp_path / "a", kube, nats_server)
    (env.state / "bundle" / "bundle.json").unlink()  # cloud-init wrote none; no distributor yet
    os.environ["SCO_AGENT_NATSURL"] = "nats://typo:4222"
    try:
        env.start()
    finally:
        del os.environ["SCO_AGENT_NATSURL"]
    try:
        text = env.logtext()
        assert "SCO_AGENT_NATSURL" in text and "unknown" in text, text
        nob = [x for x in text.splitlines() if "no bundle" in x]
        assert len(nob) == 1 and nob[0].startswith("WARNING") and "refused" in nob[0], text
    finally:
        env.stop()
        kube.stop()
