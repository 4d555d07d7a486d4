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


def _bundle_ca_checked(ca_file: str | None) -> str:
    """The CA file as given, once it is known to load (a bad one is a configuration error, not a failed fetch)."""
    if not ca_file:
        return ""
    from sco._tls import TlsSettingError, client_context

    try:
        client_context(ca_file)
    except TlsSettingError as e:
        raise ConfigError(f"--bundle-ca-file: {e}") from None
    return ca_file


def _add_bundle_ca(x: Any) -> None:
    x.add_argument(
        "--bundle-ca-file",
        default=_env("SCO_BUNDLE_CA_FILE"),
        help="the CA an https distributor's certificate must chain to (default: the system's) [$SCO_BUNDLE_CA_FILE]",
    )


def _bundle_from_url(url: str, cache_dir: Path, keyring: Any, ca_file: str = "") -> Callable[[], Any]:
    """A loader of the distributor's bundle through the node's cache (conditional GET, verified, never rolled back);
    a refused or failed refresh keeps the cached serial and says so. ``ca_file``: an https distributor's CA."""
    from sco.agent.bundle_cache import BundleCache, BundleFetcher

    cache = BundleCache(cache_dir, keyring)
    fetcher = BundleFetcher(cache, url, ca_file=_bundle_ca_checked(ca_file))

    def load() -> Any:
        offer = fetcher.refresh()
        if offer.outcome in ("refused", "error"):
            print(f"sco: warning: {offer.outcome}: {offer.reason}; keeping serial {offer.serial}", file=sys.stderr)
        if cache.bundle is None:
            raise ConfigError(f"{url}: no verified bundle yet")
        return cache.bundle

    return load
