"""Separate keys: the hall's root key (nodes trust its .pub, it stays on the controller) signs a
delegation for an online launch key, the only key the control host holds; the launch key signs the subsets in new
instances' user-data. A node takes a bundle signed by the launch key only as its first bundle, only with a root's
delegation in force for its hall and for launch subsets; every other reader (distributor, Slurm admission, control
loop) refuses it. Tested on the real agent reading what cloud-init wrote, and on the real readers."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
import yaml

from sco._fs import atomic_write
from sco.agent.bundle_cache import BundleCache
from sco.contract.bundle import Bundle, Succession, subset_payload, successor
from sco.contract.compiler import compile_repo
from sco.contract.distributor import DistributorServer, bundle_path, publish
from sco.contract.signing import Delegation, Keyring, PrivateKey, delegate, generate, sign, verify
from sco.contract.userdata import CACHE_PATH, TRUST_DIR, render
from sco.errors import BundleError, ConfigError, KeyFileError, SignatureError, UntrustedKeyError
from sco_devkit.standins.kube_apiserver import KubeApiStandIn
from tests.conftest import SAMPLE
from tests.harness import AgentEnv, NatsServer, wait_for
from tests.prom import samples, scrape

DAY = 86_400
ROOT = Path(__file__).resolve().parents[1]


def _subset(full: Bundle, issued_at: int, expires_at: int, hall: str | None = None) -> dict[str, Any]:
    p = subset_payload(full, schedulers=["kubernetes"])
    p["issuedAt"], p["expiresAt"] = issued_at, expires_at
    if hall:
        p["hall"] = hall
    return p


def _cloud_init_bundle(user_data: str) -> tuple[bytes, list[str]]:
    """The bundle cloud-init writes from ``user_data``, and the trusted keys' paths."""
    files = yaml.safe_load(user_data)["write_files"]
    (f,) = [f for f in files if f["path"] == CACHE_PATH]
    return base64.b64decode(f["content"]), [f["path"] for f in files if f["path"].startswith(TRUST_DIR)]


def test_the_agent_takes_a_launch_subset_under_its_roots_delegation_then_only_root_bundles(
    tmp_path: Path, kube: KubeApiStandIn, nats_server: NatsServer, distributor: DistributorServer
) -> None:
    """The real agent at a new instance's first boot: the subset the launch path rendered (user-data, signed by the
    launch key, its delegation from the hall's root key) is taken up; the node trusts the root only. Later bundles
    come from the distributor: one signed by the launch key (a stolen one, served by a man in the middle) is refused,
    the root's full bundle is taken up."""
    url = f"{distributor.url}/v1/halls/local/bundle.json"
    env = AgentEnv(tmp_path / "agent", kube, nats_server, bundle_url=url, bundle_refresh_seconds=1)
    root, launch, now = env.key, generate(), int(time.time())
    keyring = Keyring([root.public])
    full_raw = (env.state / "bundle" / "bundle.json").read_bytes()
    full = Bundle.from_bytes(full_raw, keyring)
    d = delegate(root, launch.public, "local", issued_at=now - 60, expires_at=now + 14 * DAY, serial=3)
    user_data = render(full, [launch], [root.public], schedulers=["kubernetes"], delegation=d, now=now)
    subset_raw, trusted = _cloud_init_bundle(user_data)
    assert trusted == [f"{TRUST_DIR}/{root.keyid}.pub"]  # the root, never the launch key
    assert launch.keyid not in user_data.split("bundle.json")[0]
    (env.state / "bundle" / "bundle.json").write_bytes(subset_raw)  # as cloud-init writes it
    try:
        env.start().wait_subscribed()
        m = samples(scrape(env.metrics_url))
        assert m["sco_agent_bundle_serial"] == full.serial and "is refused" not in env.logtext(), env.logtext()
        # a launch key's bundle at a later serial, from the distributor's URL: refused, the subset stays
        later = _subset(full, now, now + DAY)
        later["serial"] = full.serial + 1
        served = bundle_path(distributor.files.root, "local")
        served.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(served, sign(later, [launch], d))
        refused = wait_for(lambda: env.of("bundle.refused"), 10, "the launch key's bundle refused", 0.2)
        assert "only as its first" in refused[0]["reason"], refused
        assert samples(scrape(env.metrics_url))["sco_agent_bundle_serial"] == full.serial
        # the hall's full bundle, signed by the root: taken up (the subset was cut from it)
        served.unlink()  # the man in the middle gone: the distributor's own copy again
        publish(full_raw, distributor.files.root, keyring)
        wait_for(lambda: env.of("bundle.accepted"), 10, "the full bundle accepted", 0.2)
        state = yaml.safe_load((env.state / "bundle" / "state.json").read_text())
        assert state["sha256"] == full.verified.sha256
    finally:
        env.stop()


def _bad_first_bundles(root: PrivateKey, launch: PrivateKey, full: Bundle, now: int) -> dict[str, tuple[bytes, str]]:
    """Each bundle a new node must refuse at first boot, with the words its one line must say."""
    stranger = generate()
    good = delegate(root, launch.public, "local", issued_at=now - 60, expires_at=now + 14 * DAY, serial=2)
    expired = delegate(root, launch.public, "local", issued_at=now - 20 * DAY, expires_at=now - 6 * DAY, serial=1)
    foreign = delegate(stranger, launch.public, "local", issued_at=now - 60, expires_at=now + 14 * DAY, serial=2)
    hall_b = delegate(root, launch.public, "hall-b", issued_at=now - 60, expires_at=now + 14 * DAY, serial=2)
    fresh = _subset(full, now, now + 7 * DAY)
    return {
        "no delegation": (sign(fresh, [launch]), f"signed by {launch.keyid}, none of which is trusted"),
        "expired delegation": (
            sign(_subset(full, now - 19 * DAY, now - 12 * DAY), [launch], expired),
            f"launch key {launch.keyid} (delegation serial 1 by {root.keyid}): delegation expired at",
        ),
        "untrusted delegation": (
            sign(fresh, [launch], foreign),
            f"delegation of launch key {launch.keyid}: signed by {stranger.keyid}, none of which is trusted",
        ),
        "another hall": (
            sign(_subset(full, now, now + 7 * DAY, hall="hall-b"), [launch], hall_b),
            "is delegated for hall 'hall-b', this node is in hall 'local'",
        ),
        "full bundle": (
            sign({**full.verified.payload, "issuedAt": now, "expiresAt": now + DAY}, [launch], good),
            "may sign only launch subsets",
        ),
        "outlives its delegation": (
            sign(_subset(full, now, now + 15 * DAY), [launch], good),
            "after its delegation",
        ),
    }


def test_the_agent_refuses_a_launch_keys_first_bundle_without_a_good_delegation(
    tmp_path: Path, kube: KubeApiStandIn, nats_server: NatsServer
) -> None:
    """The real agent at first boot, its cached bundle (as cloud-init wrote it) signed by the launch key: without a
    delegation, with an expired one, with one from a key the node does not trust, for another hall, for a full
    bundle, or outliving its delegation: refused, said on one line of the agent's log (and in its state), the node
    left with no budgets rather than with a bundle its root never allowed."""
    launch, now = generate(), int(time.time())
    for i, case in enumerate(
        ("no delegation", "expired delegation", "untrusted delegation", "another hall", "full bundle",
         "outlives its delegation")
    ):  # fmt: skip
        env = AgentEnv(tmp_path / f"agent-{i}", kube, nats_server, node=f"node-{i}")
        full = Bundle.from_bytes((env.state / "bundle" / "bundle.json").read_bytes(), Keyring([env.key.public]))
        raw, words = _bad_first_bundles(env.key, launch, full, now)[case]
        (env.state / "bundle" / "bundle.json").write_bytes(raw)
        try:
            env.start().wait_subscribed()
            said = [line for line in env.logtext().splitlines() if words in line]
            assert len(said) == 1 and "is refused" in said[0], (case, env.logtext())
            state = yaml.safe_load((env.state / "bundle" / "state.json").read_text())
            assert words in state["last_error"] and state["serial"] is None, (case, state)
            assert "sco_agent_bundle_serial" not in samples(scrape(env.metrics_url)), case
        finally:
            env.stop()


def test_a_taken_up_launch_subset_stays_past_its_delegation(tmp_path: Path, key: PrivateKey) -> None:
    """Once a node took the subset up, it keeps it across restarts when the delegation (and so the bundle) expires,
    as any bundle it holds: never left without budgets. A copy it never took up is refused the same day."""
    launch, now = generate(), int(time.time())
    keyring = Keyring([key.public])
    full = Bundle.from_bytes(sign(compile_repo(SAMPLE, now=now), [key]), keyring)
    d = delegate(key, launch.public, full.hall, issued_at=now - 60, expires_at=now + 2 * DAY, serial=1)
    raw = sign(_subset(full, now, now + DAY), [launch], d)
    (tmp_path / "node").mkdir()
    (tmp_path / "node" / "bundle.json").write_bytes(raw)
    assert BundleCache(tmp_path / "node", keyring, lambda: now, hall="local").bundle is not None
    later = BundleCache(tmp_path / "node", keyring, lambda: now + 3 * DAY, hall="local")
    assert later.bundle is not None and later.status()["expired"] is True
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "bundle.json").write_bytes(raw)
    fresh_node = BundleCache(tmp_path / "other", keyring, lambda: now + 3 * DAY, hall="local")
    assert fresh_node.bundle is None and "delegation expired at" in str(fresh_node.state.last_error)


def test_only_a_nodes_cache_takes_a_delegated_bundle(tmp_path: Path, key: PrivateKey) -> None:
    """The distributor, the Slurm admission glue and the control loop read bundles with ``Bundle.from_bytes``: a
    launch key's bundle is refused there whatever its delegation; a node that holds a bundle refuses it too; a
    tampered delegation is a forgery."""
    launch, now = generate(), int(time.time())
    keyring = Keyring([key.public])
    full = Bundle.from_bytes(sign(compile_repo(SAMPLE, now=now), [key]), keyring)
    d = delegate(key, launch.public, full.hall, issued_at=now - 60, expires_at=now + 14 * DAY, serial=1)
    raw = sign(_subset(full, now, now + DAY), [launch], d)
    with pytest.raises(UntrustedKeyError, match="taken by a node agent only"):
        Bundle.from_bytes(raw, keyring)
    with pytest.raises(UntrustedKeyError, match="taken by a node agent only"):
        publish(raw, tmp_path / "dist", keyring)
    subset = Bundle.from_bytes(raw, keyring, delegated=True)
    assert successor(None, subset, now) is Succession.REPLACE
    with pytest.raises(BundleError, match="only as its first"):
        successor(full, subset, now)
    assert successor(subset, full, now) is Succession.REPLACE  # the full bundle it was cut from
    # the launch key's holder widens its own delegation (a later expiry) and signs again: a forgery
    payload = json.loads(raw.split(b"\n")[1])
    payload["delegation"]["cert"]["expiresAt"] += 365 * DAY
    with pytest.raises(SignatureError, match="does not match the delegation"):
        verify(sign(payload, [launch]), keyring, delegated=True)


def test_the_launch_path_refuses_a_delegation_it_cannot_use(key: PrivateKey) -> None:
    """The control host renders no user-data under an expired delegation, one for another launch key, or one whose
    root the new instance would not trust: said with what to do."""
    launch, now = generate(), int(time.time())
    full = Bundle.from_bytes(sign(compile_repo(SAMPLE, now=now), [key]), Keyring([key.public]))
    old = delegate(key, launch.public, full.hall, issued_at=now - 20 * DAY, expires_at=now - DAY, serial=1)
    with pytest.raises(ConfigError, match="renew it on the controller"):
        render(full, [launch], [key.public], delegation=old, now=now)
    good = delegate(key, launch.public, full.hall, issued_at=now - 60, expires_at=now + DAY, serial=2)
    with pytest.raises(ConfigError, match="the signing keys are"):
        render(full, [generate()], [key.public], delegation=good, now=now)
    with pytest.raises(ConfigError, match="not a key the new instances trust"):
        render(full, [launch], [generate().public], delegation=good, now=now)
    # dated inside its delegation: a subset never outlives it
    raw, _ = _cloud_init_bundle(render(full, [launch], [key.public], delegation=good, now=now))
    sub = Bundle.from_bytes(raw, Keyring([key.public]), delegated=True)
    assert sub.issued_at == now and sub.expires_at == good.expires_at


def test_sco_delegate_issues_renews_past_half_and_rotates(tmp_path: Path) -> None:
    """``sco delegate`` (what site.yml runs on the controller): a delegation file the control loop's acquire reads;
    run again it changes nothing while more than half its lifetime is left; a new launch key is the next serial;
    the control loop refuses a delegation from another root."""

    def sco(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "sco.cli", *args], capture_output=True, text=True, timeout=60,
                              env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})  # fmt: skip

    for name in ("hall", "launch", "launch2", "other"):
        assert sco("keygen", "--out-dir", str(tmp_path), "--name", name).returncode == 0
    out = tmp_path / "launch.delegation"
    args = ["delegate", "--root-key", str(tmp_path / "hall.key"), "--hall", "local", "-o", str(out)]
    first = sco(*args, "--launch-key", str(tmp_path / "launch.pub"))
    assert first.returncode == 0 and first.stdout.startswith("changed: delegation serial 1"), first
    again = sco(*args, "--launch-key", str(tmp_path / "launch.pub"))
    assert again.stdout.startswith("unchanged: delegation serial 1"), again
    rotated = sco(*args, "--launch-key", str(tmp_path / "launch2.pub"))
    assert rotated.stdout.startswith("changed: delegation serial 2"), rotated
    from sco.contract.signing import load_public

    d = Delegation.load(out, Keyring([load_public(tmp_path / "hall.pub")]))
    assert d.keyid == load_public(tmp_path / "launch2.pub").keyid and d.expires_at - d.issued_at > 13 * DAY
    with pytest.raises(KeyFileError, match="none of which is trusted"):
        Delegation.load(out, Keyring([load_public(tmp_path / "other.pub")]))
    same = sco(*args, "--launch-key", str(tmp_path / "hall.pub"))
    assert same.returncode == 5 and "is the root key itself" in same.stderr, same


def test_an_agent_of_the_release_before_refuses_a_delegated_subset(key: PrivateKey) -> None:
    """docs/UPGRADE.md: release N's verifier (hall-upgrade's N, commit d68a14c) finds a launch subset signed by a key it
    does not trust and refuses it (it never accepted such a bundle: nothing it accepted changes), while it still
    takes the root-signed full bundle; so images are baked with N+1 before the control loop delegates."""
    code = subprocess.run(["git", "-C", str(ROOT), "show", "d68a14c:src/sco/contract/signing.py"],
                          capture_output=True, text=True, check=True, timeout=60).stdout  # fmt: skip
    old = types.ModuleType("sco_signing_n")
    sys.modules[old.__name__] = old  # its dataclasses look their module up
    try:
        exec(compile(code, "signing@d68a14c", "exec"), old.__dict__)  # release N's own verifier
    finally:
        del sys.modules[old.__name__]
    launch, now = generate(), int(time.time())
    full_raw = sign(compile_repo(SAMPLE, now=now), [key])
    full = Bundle.from_bytes(full_raw, Keyring([key.public]))
    d = delegate(key, launch.public, full.hall, issued_at=now - 60, expires_at=now + DAY, serial=1)
    ring = old.Keyring([old.PublicKey(key.keyid, key.signing_key.verify_key)])
    with pytest.raises(UntrustedKeyError, match=f"signed by {launch.keyid}, none of which is trusted"):
        old.verify(sign(_subset(full, now, now + DAY), [launch], d), ring)
    assert old.verify(full_raw, ring).keyid == key.keyid
