"""``sco keygen``: the Ed25519 key pairs bundles and notices are signed with."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from sco.cli._common import _env
from sco.errors import ConfigError


def _file_name_problem(name: str) -> str | None:
    """Why ``name`` is not one plain file name inside the directory it is meant for (None: it is)."""
    if not name:
        return "expected a file name, got an empty one"
    if "/" in name or name in (".", ".."):
        return "expected a plain file name, not a path (use --out-dir for the directory)"
    if not name.isprintable():  # C0, DEL, C1 (U+0080-U+009F), line separators: never printed raw
        return "control or unprintable characters in a file name"
    return None


def cmd_keygen(args: argparse.Namespace) -> int:
    from sco.contract.signing import generate, write_keypair

    if args.name is not None and (problem := _file_name_problem(args.name)):
        raise ConfigError(f"--name {args.name!r}: {problem}")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    key = generate()
    name = args.name or key.keyid
    write_keypair(key, out / f"{name}.key", out / f"{name}.pub")
    print(f"keyid {key.keyid}: private {out / (name + '.key')} (0600), public {out / (name + '.pub')}")
    if args.purpose == "notice":
        # Same Ed25519 key; nodes trust it through the bundle, so it goes into the hall policy.
        public = bytes(key.signing_key.verify_key).hex()
        print("add to hall.yaml spec.noticeKeys (then compile and publish the bundle):")
        print(f"  - {{keyid: '{key.keyid}', public: '{public}'}}")
    return 0


def register(sub: Any) -> None:
    k = sub.add_parser("keygen", help="create an Ed25519 signing key pair")
    k.add_argument("--out-dir", default=_env("SCO_KEY_DIR", "."), help="where to write NAME.key/NAME.pub")
    k.add_argument("--name", help="file name stem (default: the key id)")
    k.add_argument(
        "--for",
        dest="purpose",
        choices=["bundle", "notice"],
        default="bundle",
        help="notice: also print the hall policy's noticeKeys entry",
    )
    k.set_defaults(func=cmd_keygen)
