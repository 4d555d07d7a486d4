"""The agent's /metrics endpoint (docs/METRICS.md): a real drain against the Kubernetes API stand-in and a real
nats-server, then the exposition read back, checked by `promtool check metrics`, and the config validated."""

from __future__ import annotations

import contextlib
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from sco.agent.metrics import AgentMetrics, parse_listen, token_expiry
from sco.errors import ConfigError
from sco_devkit.standins.kube_apiserver import KubeApiStandIn
from tests.harness import AgentEnv, NatsServer, add_pod, minimal_agent_config, run_sco_agent, wait_for
from tests.prom import promtool_check, samples, scrape


@pytest.fixture
def agent(tmp_path: Path, kube: KubeApiStandIn, nats_server: NatsServer) -> Iterator[AgentEnv]:
    env = AgentEnv(tmp_path / "agent", kube, nats_server, metrics_probe_seconds=1)
    yield env
    env.stop()


def test_a_drain_and_a_refusal_are_counted_without_node_or_pod_labels(agent: AgentEnv, kube: KubeApiStandIn) -> None:
    for i in range(2):
        add_pod(kube, "web", f"web-{i}", agent.node, prestop=0.2)
    agent.start().wait_subscribed()
    before = samples(scrape(agent.metrics_url))
    assert before['sco_agent_drains_total{outcome="drained"}'] == 0
    assert before["sco_agent_relay_up"] == 1 and before["sco_agent_bundle_serial"] >= 1
    agent.send(agent.notice("m-1", 20))
    assert agent.outcome(20)["type"] == "drain.drained"
    agent.send(b"{not json")
    wait_for(lambda: agent.of("notice.refused"), 10, "the refusal")
    text = scrape(agent.metrics_url)
    s = samples(text)
    assert s['sco_agent_notices_total{channel="nats",verdict="accepted"}'] == 1
    assert s['sco_agent_notices_total{channel="nats",verdict="refused"}'] == 1
    assert s['sco_agent_notice_refusals_total{kind="malformed"}'] == 1
    assert s['sco_agent_drains_total{outcome="drained"}'] == 1
    assert s['sco_agent_drains_total{outcome="overrun"}'] == 0
    assert s["sco_agent_drain_duration_seconds_count"] == 1 and 0 < s["sco_agent_drain_duration_seconds_sum"] < 20
    out = agent.of("drain.drained")[0]
    assert s["sco_agent_drain_seconds_left_sum"] == pytest.approx(out["deadline_in_s"], abs=0.01)
    assert s['sco_agent_evictions_total{code="201"}'] == 2  # the stand-in answers an eviction as the API does
    assert s["sco_agent_forced_deletes_total"] == 0 and s["sco_agent_fallback_engagements_total"] == 0
    assert s["sco_agent_scheduler_api_up"] == 1
    assert s["sco_agent_bundle_age_seconds"] >= 0
    wait_for(lambda: samples(scrape(agent.metrics_url))["sco_agent_spool_backlog_records"] == 0, 10, "published")
    # The termination handler's lesson: nothing names a node, a pod or a notice.
    for bad in ("node-1", "web-0", "m-1", "node=", "pod=", "notice="):
        assert bad not in text
    promtool_check(text)


def test_the_endpoint_answers_only_get_metrics(agent: AgentEnv) -> None:
    agent.start()
    wait_for(lambda: "metrics on http" in agent.logtext(), 10, "the metrics endpoint")
    base = agent.metrics_url.removesuffix("/metrics")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(base + "/", timeout=5)
    assert e.value.code == 404
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(urllib.request.Request(agent.metrics_url, data=b"x", method="POST"), timeout=5)
    assert e.value.code == 405
    # a client that never sends its request does not hold the agent: the next scrape still answers
    import socket

    host, port = parse_listen(agent.metrics_url.split("/")[2])
    with socket.create_connection((host, port), timeout=5):
        assert "sco_agent_drains_total" in scrape(agent.metrics_url)


def test_check_config_names_a_bad_metrics_listen(tmp_path: Path) -> None:
    from sco.agent import config

    cfg = minimal_agent_config(tmp_path)
    for bad in ("9469", "127.0.0.1:0", "127.0.0.1:http", ":9469"):
        with pytest.raises(ConfigError) as e:
            config.load(cfg, env={"SCO_AGENT_METRICS_LISTEN": bad})
        assert [p.field for p in e.value.problems] == ["agent.metrics_listen"], (bad, e.value.problems)
    for ok in ("", "127.0.0.1:9469", "[::1]:9469"):
        assert config.load(cfg, env={"SCO_AGENT_METRICS_LISTEN": ok}).metrics_listen == ok
    # and the CLI says it, naming the key, with a non-zero exit
    p = run_sco_agent("check-config", "--config", str(cfg), env={"SCO_AGENT_METRICS_LISTEN": "127.0.0.1:99999"})
    assert p.returncode != 0 and "agent.metrics_listen" in p.stderr and "65535" in p.stderr, p.stdout + p.stderr
    p = run_sco_agent("check-config", "--config", str(cfg), env={"SCO_AGENT_METRICS_LISTEN": "[::1]:9469"})
    assert p.returncode == 0, p.stdout + p.stderr


def test_histograms_counters_and_unknown_gauges_render_as_promtool_wants(tmp_path: Path) -> None:
    m = AgentMetrics(lambda: 0.0)
    m.gauges = lambda: [
        ("sco_agent_bundle_serial", "x", 3.0),
        ("sco_agent_credential_expiry_timestamp_seconds", "y", None),
    ]
    m.observe({"type": "drain.overrun", "elapsed_s": 9.5, "deadline_in_s": -0.4})
    m.observe({"type": "eviction.forced"})
    for i in range(200):  # a label fed a flood of values stays bounded
        m.eviction(1000 + i)
    text = m.render().decode()
    s = samples(text)
    assert s['sco_agent_drains_total{outcome="overrun"}'] == 1
    assert (
        s['sco_agent_drain_seconds_left_bucket{le="-1"}'] == 0 and s['sco_agent_drain_seconds_left_bucket{le="0"}'] == 1
    )
    assert s["sco_agent_forced_deletes_total"] == 1
    assert len([k for k in s if k.startswith("sco_agent_evictions_total")]) <= 65
    assert "sco_agent_credential_expiry_timestamp_seconds" not in text  # unknown: absent, not 0
    promtool_check(text)
    tok = tmp_path / "token"
    tok.write_text("eyJhbGciOiJSUzI1NiJ9.eyJleHAiOjE4OTM0NTYwMDB9.c2ln")  # {"exp":1893456000}
    assert token_expiry(tok) == 1893456000
    tok.write_text("not-a-jwt")
    assert token_expiry(tok) is None


def test_a_port_in_use_is_recorded_and_the_agent_still_drains(
    tmp_path: Path, kube: KubeApiStandIn, nats_server: NatsServer
) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        env = AgentEnv(tmp_path / "a", kube, nats_server, metrics_listen=f"127.0.0.1:{port}")
        try:
            add_pod(kube, "web", "w-0", env.node, prestop=0.2)
            env.start().wait_subscribed()
            wait_for(lambda: env.of("metrics.unavailable"), 10, "the refused listen recorded")
            env.send(env.notice("busy-1", 15))
            assert env.outcome(15)["type"] == "drain.drained"
        finally:
            env.stop()


def test_idle_connections_cannot_starve_a_scrape(agent: AgentEnv) -> None:
    """16 idle connections took every slot of /metrics (before: each scrape below was closed unanswered).
    A sleeper keeps 100 connections open that never send a request, opening a new one whenever one is closed;
    every scrape meanwhile answers within 2 s (well inside Prometheus' 10 s scrape timeout)."""
    import socket
    import threading
    import time

    agent.start()
    wait_for(lambda: "metrics on http" in agent.logtext(), 10, "the metrics endpoint")
    host, port = parse_listen(agent.metrics_url.split("/")[2])
    stop = threading.Event()
    opened = [0]

    def sleeper() -> None:
        conns: list[socket.socket] = []
        while not stop.is_set():
            for s in list(conns):  # closed by the agent: reopen, as an attacker would
                s.setblocking(False)
                try:
                    if s.recv(1) == b"":
                        conns.remove(s)
                        s.close()
                except BlockingIOError:
                    pass
                except OSError:
                    conns.remove(s)
                    s.close()
            while len(conns) < 100 and not stop.is_set():
                with contextlib.suppress(OSError):
                    conns.append(socket.create_connection((host, port), timeout=2))
                    opened[0] += 1
            stop.wait(0.05)
        for s in conns:
            s.close()

    t = threading.Thread(target=sleeper, daemon=True)
    t.start()
    try:
        wait_for(lambda: opened[0] >= 100, 10, "100 idle connections")
        took = []
        for _ in range(6):  # over 3 s: across the agent's 2 s deadline for a request
            t0 = time.monotonic()
            assert "sco_agent_drains_total" in scrape(agent.metrics_url, timeout=2)
            took.append(time.monotonic() - t0)
            time.sleep(0.5)
        assert max(took) < 2
    finally:
        stop.set()
        t.join(10)
