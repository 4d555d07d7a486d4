"""Bundle freshness: a signed expiresAt (set by the compiler from the hall policy), checked by the node. A bundle past
it is never taken up (a stale mirror or a replayed copy); the one a node holds stays when it expires and its budgets
drain the work already there, reported by sco_agent_bundle_expired (alert ScoBundleExpired, in the promtool suite of
test_alert_rules); once a node holds a dated bundle an undated one is older-dated and refused; the signer re-dates
an unchanged bundle past half its lifetime and nodes take the re-dated one at the same serial. Over real HTTPS, from a
mirror the hall's CA vouches for (TLS lets it through), an old, expired or undated bundle is still refused."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest

from sco._fs import atomic_write
from sco._tls import ServerTls
from sco.agent.bundle_cache import BundleCache
from sco.contract.bundle import DEFAULT_BUNDLE_LIFETIME_S, Bundle, Succession, peek_payload, successor
from sco.contract.compiler import compile_repo
from sco.contract.distributor import DistributorServer, bundle_path, publish
from sco.contract.signing import Keyring, PrivateKey, sign
from sco.errors import BundleError, ContractError, RollbackError
from sco_devkit.standins.kube_apiserver import KubeApiStandIn
from tests.conftest import SAMPLE
from tests.harness import AgentEnv, NatsServer, add_pod, make_tls, wait_for
from tests.prom import samples, scrape

WINDOW = 20.0


def _payload(repo: Path, expires_in: float, **kw: object) -> dict[str, object]:
    """The compiler's payload for ``repo``, signed as if ``expires_in`` seconds before it expires."""
    return compile_repo(repo, now=time.time() + expires_in - DEFAULT_BUNDLE_LIFETIME_S, **kw)  # type: ignore[arg-type]


def test_the_compiler_sets_expiry_keeps_it_while_fresh_and_re_dates_past_half(tmp_path: Path) -> None:
    now = 2_000_000_000.0
    first = compile_repo(SAMPLE, now=now)
    assert first["expiresAt"] == int(now) + DEFAULT_BUNDLE_LIFETIME_S  # 7 days: the hall policy sets none
    again = compile_repo(SAMPLE, previous=first, now=now + 3 * 86_400)
    assert again == first  # unchanged, more than half left: the same bytes (an idempotent site run)
    redated = compile_repo(SAMPLE, previous=first, now=now + 4 * 86_400)
    assert redated["serial"] == first["serial"] and redated["expiresAt"] == int(now) + 4 * 86_400 + 7 * 86_400
    repo = tmp_path / "repo"
    import shutil

    shutil.copytree(SAMPLE, repo)
    hall = repo / "hall.yaml"
    hall.write_text(hall.read_text().replace("spec:\n", "spec:\n  bundleLifetimeSeconds: 7200\n", 1))
    assert compile_repo(repo, now=now)["expiresAt"] == int(now) + 7200
    hall.write_text(hall.read_text().replace("bundleLifetimeSeconds: 7200", "bundleLifetimeSeconds: 60"))
    with pytest.raises(ContractError) as refused:
        compile_repo(repo, now=now)
    assert any("bundleLifetimeSeconds" in line for line in refused.value.lines()), refused.value.lines()


def test_succession_by_expiry(key: PrivateKey, keyring: Keyring) -> None:
    now = time.time()

    def bundle(payload: dict[str, object]) -> Bundle:
        return Bundle.from_bytes(sign(payload, [key]), keyring)

    fresh = compile_repo(SAMPLE, now=now)
    dated = bundle(fresh)
    stale = bundle({**fresh, "serial": 2, "expiresAt": int(now) - 1})
    with pytest.raises(BundleError, match="expired at"):
        successor(dated, stale, now)  # a stale copy, whatever its serial
    with pytest.raises(BundleError, match="expired at"):
        successor(None, stale, now)  # nor on a node that has none
    undated = {k: v for k, v in fresh.items() if k != "expiresAt"}  # a compiler of an older release
    with pytest.raises(RollbackError, match="older-dated"):
        successor(dated, bundle({**undated, "serial": 3}), now)  # even at a later serial
    assert successor(bundle(undated), dated, now) is Succession.REPLACE  # the same bundle, now dated: taken up
    later = bundle({**fresh, "expiresAt": fresh["expiresAt"] + 3600})  # type: ignore[operator]
    assert successor(dated, later, now) is Succession.REPLACE  # re-dated at the same serial and content
    assert successor(later, dated, now) is Succession.UNCHANGED  # an earlier expiry changes nothing


def test_a_cached_bundle_that_expires_stays_and_says_so(tmp_path: Path, key: PrivateKey, keyring: Keyring) -> None:
    clock = [time.time()]
    cache = BundleCache(tmp_path / "cache", keyring, clock=lambda: clock[0])
    assert cache.offer(sign(compile_repo(SAMPLE, now=clock[0] - DEFAULT_BUNDLE_LIFETIME_S + 10), [key])).outcome == (
        "accepted"
    )
    clock[0] += 11
    st = cache.status()
    assert st["expired"] is True and st["serial"] == 1 and st["expires_in_s"] == pytest.approx(-1, abs=1)
    # a restart keeps it: the node's only budgets for the work on it
    again = BundleCache(tmp_path / "cache", keyring, clock=lambda: clock[0])
    assert again.bundle is not None and again.bundle.serial == 1 and again.status()["expired"] is True


def test_the_agent_past_expiry(
    tmp_path: Path, kube: KubeApiStandIn, nats_server: NatsServer, distributor: DistributorServer
) -> None:
    """The real agent against the real distributor: its bundle expires under it (metric 1), a stale copy the
    distributor serves is refused, a drain still runs with the last budgets, a fresh bundle clears it."""
    url = f"{distributor.url}/v1/halls/local/bundle.json"
    env = AgentEnv(tmp_path / "agent", kube, nats_server, bundle_url=url, bundle_refresh_seconds=1)
    repo, keyring = env.root / "repo", Keyring([env.key.public])
    first = _payload(repo, 8)  # expires 8 s from now
    raw = sign(first, [env.key])
    (env.state / "bundle" / "bundle.json").write_bytes(raw)  # as cloud-init writes it
    publish(raw, distributor.files.root, keyring)
    for i in range(6):
        add_pod(kube, "web", f"w-{i}", env.node, prestop=0.2)
    try:
        env.start().wait_subscribed()
        m = samples(scrape(env.metrics_url))
        assert (
            m["sco_agent_bundle_expired"] == 0 and m["sco_agent_bundle_expiry_timestamp_seconds"] == first["expiresAt"]
        )
        wait_for(lambda: samples(scrape(env.metrics_url))["sco_agent_bundle_expired"] == 1, 15, "expired", 0.2)
        # a stale mirror: a later serial, but past its expiry; the distributor file replaced as a mirror would
        stale = sign(_payload(repo, -60, previous=first, serial=2), [env.key])
        atomic_write(bundle_path(distributor.files.root, "local"), stale)
        refused = wait_for(lambda: env.of("bundle.refused"), 10, "the stale copy refused", 0.2)
        assert "expired at" in refused[0]["reason"] and samples(scrape(env.metrics_url))["sco_agent_bundle_serial"] == 1
        # work already on the node drains with the expired bundle's budgets (web: 6 s)
        t0 = env.send(env.notice("past-expiry", WINDOW))
        out = env.outcome(WINDOW)
        assert out["type"] == "drain.drained" and out["at"] < t0 + WINDOW
        evicting = env.of("eviction.requested")
        assert evicting and all(e.get("contract") == "web" for e in evicting), evicting[:2]
        # the hall re-signs: taken up at once, fresh again
        publish(sign(compile_repo(repo, previous=first, serial=3), [env.key]), distributor.files.root, keyring)
        wait_for(lambda: samples(scrape(env.metrics_url))["sco_agent_bundle_serial"] == 3, 10, "fresh bundle", 0.2)
        assert samples(scrape(env.metrics_url))["sco_agent_bundle_expired"] == 0
    finally:
        env.stop()


def test_a_launch_after_the_full_bundle_aged_boots_a_node_with_fresh_budgets(
    tmp_path: Path, key: PrivateKey, keyring: Keyring
) -> None:
    """The launch subset is dated at the launch: a hall whose full bundle was signed 6 days ago (or 8: expired, its
    signer not run since) still gives a new node a subset it takes up, with its whole lifetime ahead; the node then
    takes the full bundle from the distributor while it is fresh, and keeps the subset when it is not."""
    import base64

    import yaml

    from sco.contract.userdata import CACHE_PATH, render

    now = time.time()
    for age_days, full_expired in ((6, False), (8, True)):
        signed_at = now - age_days * 86_400
        full_raw = sign(compile_repo(SAMPLE, now=signed_at), [key])
        full = Bundle.from_bytes(full_raw, keyring)
        assert full.expired(now) is full_expired
        doc = yaml.safe_load(render(full, [key], [key.public], schedulers=["kubernetes"], now=now))
        (f,) = [f for f in doc["write_files"] if f["path"] == CACHE_PATH]
        subset_raw = base64.b64decode(f["content"])
        subset = Bundle.from_bytes(subset_raw, keyring)
        assert subset.serial == full.serial and subset.subset_of == full.content_digest
        assert subset.expires_at == int(now) + DEFAULT_BUNDLE_LIFETIME_S
        cache = BundleCache(tmp_path / f"node-{age_days}", keyring, clock=lambda: now)
        assert cache.offer(subset_raw).outcome == "accepted"  # the node's first second: budgets known
        taken = cache.offer(full_raw).outcome
        if full_expired:  # a stale full bundle is refused; the node keeps the launch's subset and its budgets
            assert taken != "accepted" and cache.bundle is not None and cache.bundle.serial == subset.serial
            assert cache.status()["expired"] is False
        else:
            assert taken == "accepted" and cache.bundle is not None
            assert cache.bundle.content_digest == full.content_digest


def test_a_mirror_the_hall_trusts_serving_old_stale_or_undated_bundles_over_tls_is_refused(
    tmp_path: Path, kube: KubeApiStandIn, nats_server: NatsServer
) -> None:
    """The real agent fetching over real HTTPS from a mirror whose certificate the hall's CA signed: TLS lets it
    through, so only the bundle's own serial and dates stand between the node and what it serves. The hall's own
    previous bundle replayed (a lower serial, issued earlier, not expired, other budgets), a later serial that
    expired an hour ago, a later serial without an expiry: each refused, its reason in the spool and in the agent's
    log, the bundle in use (file, serial, budgets) kept. Controls: a fresh bundle through the same mirror is taken,
    before the attacks and after them."""
    ca, crt, key = make_tls(tmp_path / "hall-ca")
    mirror = DistributorServer(tmp_path / "mirror", ("127.0.0.1", 0), tls=ServerTls(str(crt), str(key)))
    threading.Thread(target=mirror.serve_forever, daemon=True).start()
    url = f"{mirror.url}/v1/halls/local/bundle.json"
    assert url.startswith("https://127.0.0.1:")
    (tmp_path / "agent-ca").mkdir()
    shutil.copy(ca, tmp_path / "agent-ca" / "ca.crt")  # the hall's CA, as role node_agent gives it
    env = AgentEnv(
        tmp_path / "agent",
        kube,
        nats_server,
        bundle_url=url,
        bundle_ca_file=str(tmp_path / "agent-ca" / "ca.crt"),
        bundle_refresh_seconds=1,
    )
    repo = env.root / "repo"
    now = time.time()
    # the node's first bundle, issued an hour ago (web drains in 6 s), as cloud-init writes it
    first = compile_repo(repo, issued_at=int(now) - 3600, now=now - 3600)
    old = sign(first, [env.key])
    (env.state / "bundle" / "bundle.json").write_bytes(old)
    # the hall's next one: the budgets changed (web 8 s), issued now
    contracts = repo / "contracts.yaml"
    contracts.write_text(contracts.read_text().replace("drainBudgetSeconds: 6", "drainBudgetSeconds: 8", 1))
    current = sign(compile_repo(repo, previous=first, serial=2, issued_at=int(now), now=now), [env.key])
    served = bundle_path(mirror.files.root, "local")
    served.parent.mkdir(parents=True, exist_ok=True)

    def serve(raw: bytes) -> None:
        atomic_write(served, raw)  # the mirror's file replaced as a mirror would (publish would refuse these)

    def serial() -> float:
        return samples(scrape(env.metrics_url))["sco_agent_bundle_serial"]

    def taken(s: int) -> None:
        wait_for(lambda: any(e.get("serial") == s for e in env.of("bundle.accepted")), 15, f"serial {s} taken", 0.2)

    def refused(raw: bytes, what: str) -> dict[str, object]:
        """``raw`` served, and the agent's next refusal (counted before: a refresh may come at once)."""
        n = len(env.of("bundle.refused"))
        serve(raw)
        got = wait_for(lambda: env.of("bundle.refused")[n:], 15, f"the {what} refused", 0.2)
        return dict(got[0])

    def web_budget() -> object:
        payload = peek_payload((env.state / "bundle" / "bundle.json").read_bytes()) or {}
        return next(c["drainBudgetSeconds"] for c in payload["contracts"] if c["name"] == "web")

    serve(current)
    try:
        env.start()
        taken(2)  # control: the mirror over TLS reaches the agent
        assert serial() == 2 and web_budget() == 8 and not env.of("bundle.error"), env.of("bundle.error")

        # the hall's own previous bundle, replayed: signed, not expired, but older (serial 1, issued an hour ago)
        rollback = refused(old, "replayed older bundle")
        # a later serial, signed by the hall, expired an hour ago (a stale mirror of a bundle since replaced)
        expired = refused(sign(_payload(repo, -3600, previous=first, serial=3), [env.key]), "expired bundle")
        # a later serial without an expiry (older-dated: as a release before expiry signed them)
        undated = {k: v for k, v in compile_repo(repo, previous=first, serial=4).items() if k != "expiresAt"}
        no_expiry = refused(sign(undated, [env.key]), "undated bundle")

        assert "serial 1 is lower than the cached serial 2 (rollback)" in str(rollback["reason"]), rollback
        assert "bundle serial 3 expired at" in str(expired["reason"]), expired
        assert "carries no expiry" in str(no_expiry["reason"]) and "older-dated" in str(no_expiry["reason"])
        # the bundle in use kept: its serial, its bytes, its budgets
        assert serial() == 2 and (env.state / "bundle" / "bundle.json").read_bytes() == current
        assert web_budget() == 8
        assert samples(scrape(env.metrics_url))["sco_agent_bundle_expired"] == 0
        # each refusal said once in the agent's own log, with its reason
        warned = [ln for ln in env.logtext().splitlines() if "WARNING" in ln and "bundle refused, serial 2 kept" in ln]
        assert len(warned) == 3 and "(rollback)" in warned[0] and "expired at" in warned[1], warned
        assert "older-dated" in warned[2], warned

        # control: a fresh one through the same mirror is taken
        serve(sign(compile_repo(repo, previous=first, serial=5), [env.key]))
        taken(5)
        assert serial() == 5
    finally:
        env.stop()
        mirror.shutdown()
        mirror.server_close()
