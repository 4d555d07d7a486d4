"""What every noun of the ``sco`` command shares: environment fallbacks, trusted keys, reading a file."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sco.errors import ConfigError

Handler = Callable[[argparse.Namespace], int]


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


def _keyring(args: argparse.Namespace) -> Any:
    from sco.contract.signing import Keyring, load_public

    keys = [load_public(Path(p)) for p in args.trust or []]
    if getattr(args, "trust_dir", None):
        keys += [load_public(p) for p in sorted(Path(args.trust_dir).glob("*.pub"))]
    if not keys:
        raise ConfigError("no trusted key: give --trust PUBKEY (repeatable) or --trust-dir DIR")
    return Keyring(keys)


def _add_trust(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trust", action="append", metavar="PUBKEY", help="trusted public key file (repeatable)")
    p.add_argument(
        "--trust-dir",
        default=_env("SCO_TRUST_DIR"),
        metavar="DIR",
        help="directory of *.pub [$SCO_TRUST_DIR]",
    )


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: {e.strerror}") from None


def _bundle_from_url(url: str, cache_dir: Path, keyring: Any) -> Callable[[], Any]:
    """A loader of the distributor's bundle through the node's cache (conditional GET, verified, never rolled back);
    a refused or failed refresh keeps the cached serial and says so."""
    from sco.agent.bundle_cache import BundleCache, BundleFetcher

    cache = BundleCache(cache_dir, keyring)
    fetcher = BundleFetcher(cache, url)

    def load() -> Any:
        offer = fetcher.refresh()
        if offer.outcome in ("refused", "error"):
            print(f"sco: warning: {offer.outcome}: {offer.reason}; keeping serial {offer.serial}", file=sys.stderr)
        if cache.bundle is None:
            raise ConfigError(f"{url}: no verified bundle yet")
        return cache.bundle

    return load
