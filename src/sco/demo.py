"""The main job on the embedded ``local`` hall: compile, sign, publish, serve and fetch the sample bundle.

Prints each step as it happens, then shows that the node refuses a tampered bundle and keeps its last
good one. Everything runs on loopback in a working directory (temporary unless given).
"""

from __future__ import annotations

import tempfile
import threading
from importlib import resources
from pathlib import Path

from sco.agent.bundle_cache import BundleCache, BundleFetcher
from sco.contract.bundle import Bundle
from sco.contract.compiler import compile_repo
from sco.contract.distributor import DistributorServer, bundle_path, publish
from sco.contract.signing import Keyring, generate, sign, write_keypair


def sample_repo() -> Path:
    return Path(str(resources.files("sco") / "samples" / "local"))


def _say(step: str, text: str) -> None:
    print(f"[{step:>9}] {text}", flush=True)


def run_demo(workdir: Path | None = None) -> int:
    with tempfile.TemporaryDirectory(prefix="sco-demo-") as tmp:
        work = Path(workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        repo = sample_repo()
        key = generate()
        keydir = work / "keys"
        keydir.mkdir(exist_ok=True)
        if not (keydir / "demo.key").exists():
            write_keypair(key, keydir / "demo.key", keydir / "demo.pub")
        else:
            from sco.contract.signing import load_private

            key = load_private(keydir / "demo.key")
        keyring = Keyring([key.public])
        _say("keygen", f"signing key {key.keyid} in {keydir}")

        payload = compile_repo(repo)
        raw = sign(payload, [key])
        (work / "bundle.json").write_bytes(raw)
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
        _say("publish", f"serial {published.serial} at {bundle_path(root, published.hall)}")

        server = DistributorServer(root, ("127.0.0.1", 0))
        thread = threading.Thread(target=server.serve_forever, name="distributor", daemon=True)
        thread.start()
        url = f"{server.url}/v1/halls/{published.hall}/bundle.json"
        _say("serve", url)
        try:
            cache = BundleCache(work / "node" / "bundle", keyring)
            fetcher = BundleFetcher(cache, url)
            first = fetcher.refresh()
            _say("fetch", f"node: {first.outcome} serial {first.serial} (verified, cached atomically)")
            again = fetcher.refresh()
            _say("fetch", f"node: {again.outcome} (HTTP 304 Not Modified via If-None-Match)")

            budget = cache.bundle.budget("genomics-align") if cache.bundle else None
            if budget:
                _say(
                    "budget",
                    f"genomics-align on this node: drain {budget.drain_seconds} s, "
                    f"final write {budget.final_write_seconds} s, checkpoint {budget.checkpoint_mode}",
                )

            tampered = bytearray(raw)
            i = raw.index(b'"drainBudgetSeconds":') + len(b'"drainBudgetSeconds":')
            tampered[i] = ord("9") if tampered[i] != ord("9") else ord("8")
            bundle_path(root, published.hall).write_bytes(bytes(tampered))
            bad = fetcher.refresh()
            _say("tamper", f"node: {bad.outcome}: {bad.reason}")
            kept = cache.bundle
            assert isinstance(kept, Bundle)
            _say("keep", f"node still holds serial {kept.serial}; status {cache.status()}")
        finally:
            server.shutdown()
            server.server_close()
        ok = first.outcome == "accepted" and again.outcome == "unchanged" and bad.outcome == "refused"
        _say("done", "ok" if ok else "FAILED")
        return 0 if ok else 1
