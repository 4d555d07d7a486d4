"""``sco slurm render-contracts``: the verified bundle as job_submit.lua reads it."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from sco.cli._common import _add_bundle_ca, _add_trust, _bundle_from_url, _env, _keyring, _read
from sco.errors import ConfigError


def cmd_slurm_render(args: argparse.Namespace) -> int:
    from sco.contract.bundle import Bundle
    from sco.schedulers.slurm_admission import render_lua, write

    keyring = _keyring(args)
    if not args.reclaimable_partition:
        raise ConfigError("name at least one --reclaimable-partition")
    out = Path(args.out_dir)
    if args.bundle:

        def load() -> Bundle:
            return Bundle.from_bytes(_read(args.bundle), keyring, args.bundle)

    elif args.url:
        load = _bundle_from_url(args.url, Path(args.cache_dir), keyring, args.bundle_ca_file)

    else:
        raise ConfigError("give a BUNDLE file or --url")
    while True:
        bundle = load()
        text = render_lua(bundle.hall, bundle.serial, bundle.contracts, args.reclaimable_partition)
        changed = write(out, text, bundle.serial)
        n = sum(1 for c in bundle.contracts.values() if c["scheduler"] == "slurm")
        print(
            f"{out}: serial {bundle.serial}, {n} slurm contracts, reclaimable {','.join(args.reclaimable_partition)}"
            f" ({'written' if changed else 'unchanged'})",
            flush=True,
        )
        if not args.watch:
            return 0
        time.sleep(args.interval)


def register(sub: Any) -> None:
    sl = sub.add_parser("slurm", help="Slurm admission glue")
    sls = sl.add_subparsers(dest="slurm_command", required=True)
    x = sls.add_parser("render-contracts", help="render the verified bundle for job_submit.lua (atomically)")
    x.add_argument("bundle", nargs="?", help="bundle file (or --url)")
    x.add_argument("--url", default=_env("SCO_BUNDLE_URL"), help="fetch from the distributor [$SCO_BUNDLE_URL]")
    _add_bundle_ca(x)
    x.add_argument("--cache-dir", default=_env("SCO_CACHE_DIR", "/var/lib/sco/bundle"))
    _add_trust(x)
    x.add_argument("--out-dir", default=_env("SCO_SLURM_DIR", "/etc/slurm"), help="beside slurm.conf")
    x.add_argument("--reclaimable-partition", action="append", metavar="NAME", help="repeatable")
    x.add_argument("--watch", action="store_true")
    x.add_argument("--interval", type=float, default=60.0)
    x.set_defaults(func=cmd_slurm_render)
