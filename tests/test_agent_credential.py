"""The credential: the node's bound token renewed through TokenRequest with no manual step,
never another node's; the preflight repeated when the credential changes; both shown in status and metrics.

Against the Kubernetes API stand-in, which issues TokenRequest tokens as JWTs and refuses them (401) once
expired or once their node is gone. Lifetimes here are seconds (``max_token_expiration_s``, the upstream
``--service-account-max-token-expiration`` clamp), so renewals happen within a test.
"""

from __future__ import annotations

import asyncio
import json
import stat
import subprocess
import time
from pathlib import Path

import pytest

from sco.agent.kube.credential import NotRenewable, jwt_claims, token_info
from sco.schedulers.kube import KubeClient, KubeCredentialError, KubeError
from sco_devkit.standins.kube_apiserver import Identity, KubeApiStandIn, _token_id
from tests.harness import BIN, AgentEnv, NatsServer, add_pod, wait_for
from tests.kyverno_engine import agent_request, apply_rule, load_policies, rule
from tests.prom import samples, scrape

NS, SA = "sco-system", "sco-agent"


def status(env: AgentEnv) -> dict:  # type: ignore[type-arg]
    p = subprocess.run(
        [str(BIN / "sco-agent"), "status", "--state-dir", str(env.state)], capture_output=True, text=True, timeout=30
    )
    assert p.returncode == 0, p.stderr
    return dict(json.loads(p.stdout))


def test_the_agent_renews_its_token_bound_to_its_own_node_before_it_expires(
    tmp_path: Path, nats_server: NatsServer
) -> None:
    kube = KubeApiStandIn(tokens={}).start()
    kube.max_token_expiration_s = 5  # every token the agent gets lives 5 s: renewed at 4 s
    kube.cluster.add_node("node-1")
    # the hand-made first token: 10 s (renewed at 8 s), time enough for the agent to start on a loaded machine
    first, first_exp = kube.issue_token(NS, SA, node="node-1", seconds=10, audiences=["https://kube.example"])
    tok = tmp_path / "token"
    tok.write_text(first + "\n")
    env = AgentEnv(tmp_path / "a", kube, nats_server, kube_token_file=str(tok), preflight_seconds=3600)
    try:
        env.start().wait_subscribed()
        wait_for(lambda: len(env.of("credential.renewed")) >= 2, 30, "two renewals")
        assert time.time() > first_exp  # the hand-made token is dead by now; the agent's is not
        uid = kube.cluster.nodes["node-1"]["metadata"]["uid"]
        for r in kube.token_requests:
            assert (r["namespace"], r["name"]) == (NS, SA)
            assert r["spec"]["boundObjectRef"] == {"kind": "Node", "apiVersion": "v1", "name": "node-1", "uid": uid}
            assert r["spec"]["expirationSeconds"] == 600  # the lifetime asked: the API server's minimum
            assert r["spec"]["audiences"] == ["https://kube.example"]  # the first token's, kept
        # the agent's own TokenRequest, as admission sees it, passes the own-node policy for node-1's token and
        # is refused for a token bound to another node
        pol = rule(load_policies(), "sco-agent-own-node-only", "agent-requests-tokens-only-for-its-node")
        for r in kube.token_requests:
            obj = {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "metadata": {"name": SA, "namespace": NS},
                "spec": r["spec"],
            }
            assert apply_rule(pol, agent_request("CREATE", obj, node="node-1")).status == "pass"
            assert apply_rule(pol, agent_request("CREATE", obj, node="node-2")).status == "fail"
        # each renewal was asked before the token in use expired, not after a 401
        issued = sorted(kube.issued.items(), key=lambda kv: kv[1]["exp"])
        asked = sorted(r["at"] for r in kube.token_requests)
        for (_, prev), at in zip(issued, asked, strict=False):
            assert at < prev["exp"], (at, prev["exp"])
        assert stat.S_IMODE(tok.stat().st_mode) == 0o600
        current = tok.read_text().strip()
        assert current in kube.issued and jwt_claims(current)["kubernetes.io"]["node"]["name"] == "node-1"  # type: ignore[index]
        # the agent drains with the renewed token, long past the first one's expiry, with no 401 ever
        add_pod(kube, "web", "w", "node-1", prestop=0.2)
        env.send(env.notice("after-renewal", 15))
        out = env.outcome(15)
        assert out["type"] == "drain.drained", out
        assert kube.unauthorized == [], kube.unauthorized
        patched = [a for a in kube.authenticated if a["method"] == "PATCH" and a["at"] > first_exp]
        assert patched and _token_id(first) not in {a["token"] for a in patched}
        # the preflight ran again with each new token; status and metrics say when the token expires
        # (waited for: on a loaded machine the preflight after the last renewal lands after the drain's outcome)
        st = wait_for(
            lambda: (s := status(env))["scheduler"] and s["scheduler"]["preflight"]["at"] > first_exp - 1 and s,
            15,
            "a preflight with a renewed token",
        )["scheduler"]
        assert st["preflight"]["ok"] is True and st["preflight"]["at"] > first_exp - 1
        cred = st["credential"]
        assert cred["token_file"] == str(tok) and cred["expiry"] > first_exp
        assert cred["renewal"]["bound_node"] == "node-1" and cred["renewal"]["renewals"] >= 2
        assert cred["renewal"]["service_account"] == f"{NS}/{SA}" and cred["renewal"]["failures"] == 0
        m = samples(scrape(env.metrics_url))
        assert m["sco_agent_credential_expiry_timestamp_seconds"] > first_exp
        assert m["sco_agent_scheduler_preflight_ok"] == 1.0
        assert m["sco_agent_credential_renewal_failures"] == 0.0
        assert m["sco_agent_credential_renew_timestamp_seconds"] > first_exp
    finally:
        env.stop()
        kube.stop()


def test_a_token_bound_to_another_node_is_not_renewed_and_a_refused_renewal_is_critical(
    tmp_path: Path, nats_server: NatsServer
) -> None:
    kube = KubeApiStandIn(tokens={}).start()
    kube.cluster.add_node("node-1")
    kube.cluster.add_node("node-2")
    other, _ = kube.issue_token(NS, SA, node="node-2", seconds=60)  # node-2's credential, copied here
    tok = tmp_path / "token"
    tok.write_text(other)
    env = AgentEnv(tmp_path / "a", kube, nats_server, kube_token_file=str(tok), preflight_seconds=3600)
    try:
        env.start()
        (ev,) = wait_for(lambda: env.of("credential.not_renewable"), 10, "the refusal to renew")
        assert 'bound to node "node-2"' in ev["reason"] and '"node-1"' in ev["reason"]
        assert kube.token_requests == [] and tok.read_text() == other
        renewal = wait_for(lambda: (status(env)["scheduler"] or {}).get("credential"), 5, "scheduler.json")["renewal"]
        assert "node-2" in renewal["problem"] and renewal["renewals"] == 0
        # a patch of node-1 with node-2's token: refused (NodeRestriction), found by the preflight
        pre = wait_for(lambda: env.of("scheduler.preflight"), 10, "the preflight's problem")
        assert any("node-1" in p for p in pre[0]["problems"]), pre
    finally:
        env.stop()
    # its own node's token, but the account may not create tokens: a CRITICAL record, and retries
    # 20 s: the renewal falls due at 16 s (80 %), while the token is still good, so the API's answer is the denial
    # (403), not an expiry; with 3 s an agent slow to start under CI's load asked with a dead token and got 401
    own, _ = kube.issue_token(NS, SA, node="node-1", seconds=20, deny=("create serviceaccounts/token",))
    tok.write_text(own)
    env = AgentEnv(tmp_path / "b", kube, nats_server, kube_token_file=str(tok), preflight_seconds=3600)
    try:
        env.start()
        failed = wait_for(lambda: env.of("credential.renew_failed"), 30, "the failed renewal")
        assert "403" in failed[0]["error"] and "serviceaccounts/token" in failed[0]["error"], failed
        assert failed[0]["failures"] == 1 and 0 < failed[0]["expires_in_s"] <= 4.5, failed  # due at 80 % of 20 s
        renewal = wait_for(
            lambda: ((status(env)["scheduler"] or {}).get("credential") or {}).get("renewal", {}).get("failures"),
            5,
            "the failure in scheduler.json",
        )
        assert renewal >= 1
    finally:
        env.stop()
        kube.stop()


def test_the_preflight_runs_again_at_once_when_the_credential_file_changes(
    tmp_path: Path, nats_server: NatsServer
) -> None:
    kube = KubeApiStandIn(tokens={"ro": Identity("viewer", deny=("patch nodes",))}).start()
    tok = tmp_path / "token"
    tok.write_text("ro\n")
    env = AgentEnv(tmp_path / "a", kube, nats_server, kube_token_file=str(tok), preflight_seconds=3600)
    try:
        env.start()
        (bad,) = wait_for(lambda: env.of("scheduler.preflight"), 10, "the preflight's problem")
        assert "may not patch" in bad["problems"][0]
        assert status(env)["scheduler"]["preflight"]["ok"] is False
        assert samples(scrape(env.metrics_url))["sco_agent_scheduler_preflight_ok"] == 0.0
        kube.tokens["rw"] = Identity("system:node:node-1")  # type: ignore[index]
        tok.write_text("rw\n")
        changed = time.time()
        (ok,) = wait_for(lambda: env.of("scheduler.preflight_ok"), 5, "the preflight again")
        assert ok["at"] > changed  # the hour's period was not waited for
        assert status(env)["scheduler"]["preflight"] == {
            "at": pytest.approx(ok["at"], abs=1),
            "ok": True,
            "problems": [],
        }
        assert len(env.of("scheduler.preflight")) == 1  # said once, when it changed
    finally:
        env.stop()
        kube.stop()


def test_standin_token_request_follows_upstream_validation(tmp_path: Path) -> None:
    kube = KubeApiStandIn(tokens={}).start()
    kube.cluster.add_node("node-1")
    mine, _ = kube.issue_token(NS, SA, node="node-1", seconds=60)
    tok = tmp_path / "t"
    tok.write_text(mine)
    uid = kube.cluster.nodes["node-1"]["metadata"]["uid"]

    async def go() -> None:
        c = KubeClient(kube.url, token_file=tok)
        try:
            with pytest.raises(KubeError) as e:
                await c.request_token(NS, SA, seconds=599, bound_node=("node-1", uid))
            assert e.value.status == 422 and "less than 10 minutes" in e.value.message
            with pytest.raises(KubeError) as e:
                await c.request_token(NS, SA, seconds=600, bound_node=("node-1", "not-its-uid"))
            assert e.value.status == 409 and "does not match the UID" in e.value.message
            with pytest.raises(KubeError) as e:
                await c.request_token(NS, SA, seconds=600, bound_node=("node-9", "x"))
            assert e.value.status == 404
            with pytest.raises(KubeError) as e:
                await c.request_token(NS, "someone-else", seconds=600)
            assert e.value.status == 404 and "serviceaccounts" in e.value.message
            token, exp = await c.request_token(NS, SA, seconds=3600, bound_node=("node-1", uid))
            assert exp == pytest.approx(time.time() + 3600, abs=5)
            info = token_info(token, 0)
            assert (info.namespace, info.service_account, info.bound_node) == (NS, SA, "node-1")
            # the node deleted and recreated under its name: every token bound to the old object is dead
            with kube.cluster.lock:
                del kube.cluster.nodes["node-1"]
            kube.cluster.add_node("node-1")
            with pytest.raises(KubeCredentialError) as ce:
                await c.get_node("node-1")
            assert ce.value.status == 401
        finally:
            await c.close()

    try:
        asyncio.run(go())
        short, _ = kube.issue_token(NS, SA, seconds=1)
        tok.write_text(short)

        async def expired() -> None:
            c = KubeClient(kube.url, token_file=tok)
            try:
                await c.get_node("node-1")
                await asyncio.sleep(1.2)
                with pytest.raises(KubeCredentialError) as ce:
                    await c.get_node("node-1")
                assert ce.value.status == 401
            finally:
                await c.close()

        asyncio.run(expired())
    finally:
        kube.stop()


def test_token_info_refuses_what_it_cannot_renew() -> None:
    with pytest.raises(NotRenewable, match="not a JWT"):
        token_info("static-token", 0)
    import base64

    def jwt(claims: dict) -> str:  # type: ignore[type-arg]
        return "h." + base64.urlsafe_b64encode(json.dumps(claims).encode()).decode().rstrip("=") + ".s"

    with pytest.raises(NotRenewable, match="not a service account"):
        token_info(jwt({"sub": "system:node:node-1", "exp": 10}), 0)
    with pytest.raises(NotRenewable, match="no exp"):
        token_info(jwt({"sub": "system:serviceaccount:a:b"}), 0)
    i = token_info(jwt({"sub": "system:serviceaccount:a:b", "iat": 100, "exp": 200, "aud": "x"}), 0)
    assert (i.renew_at, i.lifetime, i.audiences, i.bound_node) == (180, 600, ("x",), None)
    ext = {"sub": "system:serviceaccount:a:b", "iat": 0, "exp": 31536000, "kubernetes.io": {"warnafter": 3607}}
    assert token_info(jwt(ext), 0).expiry == 3607  # an extended token is renewed as if it expired at warnafter


def test_failed_renewals_retry_jittered_not_in_step(tmp_path: Path) -> None:
    """A hall's tokens are issued together, so after an API outage their renewals all fail at once: each retry
    wait is drawn from [w/2, w] (sco._retry.jitter), not w for every node (one retry pacing with
    jitter for the agent's loops; the renewal's waited exactly max(5 s, time left / 10) everywhere)."""
    from sco.agent.kube.credential import TokenRenewer
    from sco.agent.spool import Spool, read_events

    kube = KubeApiStandIn(tokens={}).start()
    try:
        kube.cluster.add_node("node-1")
        token, _ = kube.issue_token(NS, SA, node="node-1", seconds=600, deny=("create serviceaccounts/token",))

        async def one(i: int) -> float:
            tok = tmp_path / f"token-{i}"
            tok.write_text(token)
            spool = Spool(tmp_path / f"spool-{i}")
            stop = asyncio.Event()
            client = KubeClient(kube.url, token_file=tok)
            # due now (past 80% of its life): renewal is asked for at once and refused (403)
            renewer = TokenRenewer(client, tok, "node-1", spool, clock=lambda: time.time() + 590, on_change=stop.set)
            try:
                await asyncio.wait_for(renewer.run(stop), 10)
            finally:
                await client.close()
            (failed,) = [e for e in read_events(tmp_path / f"spool-{i}") if e["type"] == "credential.renew_failed"]
            return float(failed["retry_in_s"])

        async def all_of_them() -> list[float]:
            return await asyncio.gather(*(one(i) for i in range(8)))

        waits = asyncio.run(all_of_them())
    finally:
        kube.stop()
    # 10 s left, so the step is RETRY_MIN_S (5 s): each wait in its upper half, and not all the same
    assert all(2.5 <= w <= 5.0 for w in waits), waits
    assert len(set(waits)) > 1, waits
