"""Bundle freshness: a signed expiresAt (set by the compiler from the hall policy), checked by the node. A bundle past
it is never taken up (a stale mirror or a replayed copy); the one a node holds stays when it expires and its budgets
drain the work already there, reported by sco_agent_bundle_expired (alert ScoBundleExpired, in the promtool suite of
test_alert_rules); once a node holds a dated bundle an undated one is older-dated and refused; the signer re-dates
an unchanged bundle past half its lifetime and nodes take the re-dated one at the same serial."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from sco._fs import atomic_write
from sco.agent.bundle_cache import BundleCache
from sco.contract.bundle import DEFAULT_BUNDLE_LIFETIME_S, Bundle, Succession, successor
from sco.contract.compiler import compile_repo
from sco.contract.distributor import DistributorServer, bundle_path, publish
from sco.contract.signing import Keyring, PrivateKey, sign
from sco.errors import BundleError, ContractError, RollbackError
from sco_devkit.standins.kube_apiserver import KubeApiStandIn
from tests.conftest import SAMPLE
from tests.harness import AgentEnv, NatsServer, add_pod, wait_for
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
