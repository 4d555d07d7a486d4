"""``sco keygen``: the Ed25519 key pairs bundles and notices are signed with; ``sco delegate``: the hall root key's
delegation to the control host's launch key (``sco.contract.signing.Delegation``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from sco.cli._common import _env
from sco.errors import ConfigError, ScoError


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


DEFAULT_DELEGATION_DAYS = 14


def cmd_delegate(args: argparse.Namespace) -> int:
    """Write the delegation, or leave a good one: same root, key and hall, and more than half its lifetime left
    (so a site run every few days keeps one in force and changes nothing in between). A renewal or a new key is the
    next serial."""
    import time

    from sco._fs import atomic_write
    from sco.contract.signing import Delegation, Keyring, delegate, delegation_text, load_private, load_public

    if not 1 <= args.days <= 366:
        raise ConfigError(f"--days {args.days}: expected 1 to 366")
    root, launch = load_private(Path(args.root_key)), load_public(Path(args.launch_key))
    if root.keyid == launch.keyid:
        raise ConfigError(f"--launch-key {args.launch_key}: is the root key itself; give another key (sco keygen)")
    out, now = Path(args.out), int(time.time())
    serial, old = 0, None
    if out.exists():
        try:
            old = Delegation.load(out, Keyring([root.public]))
        except ScoError as e:  # another root's, or damaged: replaced, its serial kept when it can be read
            print(f"replacing {out}: {e}")
            try:
                old_any = Delegation.load(out)
                serial = old_any.serial
            except ScoError:
                pass
    if old is not None:
        serial = old.serial
        half = (old.expires_at - old.issued_at) / 2
        if (old.keyid, old.hall) == (launch.keyid, args.hall) and old.expires_at - now > half and not args.force:
            print(f"unchanged: delegation serial {old.serial} of launch key {old.keyid} for hall {old.hall} until"
                  f" {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(old.expires_at))}")  # fmt: skip
            return 0
    d = delegate(root, launch, args.hall, issued_at=now - 60,
                 expires_at=now + args.days * 86_400, serial=serial + 1)  # fmt: skip
    atomic_write(out, delegation_text(d).encode(), 0o644, exact_mode=True)
    print(f"changed: delegation serial {d.serial} of launch key {d.keyid} for hall {d.hall} by root {d.issuer} until"
          f" {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(d.expires_at))}: {out}")  # fmt: skip
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
    d = sub.add_parser(
        "delegate",
        help="the hall root key's delegation to a launch key (the control host signs launch subsets with it)",
    )
    d.add_argument("--root-key", required=True, help="the hall's root private key (nodes trust its .pub)")
    d.add_argument("--launch-key", required=True, help="the launch key's PUBLIC key file (.pub)")
    d.add_argument("--hall", required=True, help="the hall the launch key may sign launch subsets for")
    d.add_argument("--out", "-o", required=True, help="the delegation file (replaced atomically)")
    d.add_argument("--days", type=int, default=DEFAULT_DELEGATION_DAYS, help="lifetime (default 14)")
    d.add_argument("--force", action="store_true", help="issue the next serial even when the current one is good")
    d.set_defaults(func=cmd_delegate)
