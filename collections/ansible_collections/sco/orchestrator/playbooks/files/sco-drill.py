"""Reclaim drill: reclaim chosen nodes through the hall's relay and report what each node's agent did.

  keys    find (or, with --make, make) the drill's notice keys and check the hall trusts them; one line when not
  run     send the signed notices as the reclaimer (or, with --observe, follow a reclaim the provider's reclaimer
          sends) and follow each agent's events on sco.events.<hall>.<node> until every node has its final
          account or T + grace; progress in <dir>/<id>.progress.json, the report in <dir>/<id>.html and .json
  watch   print the progress lines of a running drill (waits up to --wait s for news)
  finish  add the reclaimer's account of the instances (the reclaim module's `reclaimed`) and write the report

The notice is the real one, signed with the hall's notice key (its public half is in the hall policy's noticeKeys,
so nodes trust it through their bundle): the agents drain for real. Exit 0 when every node drained (and, with the
reclaimer, was deleted); 1 when one did not (the report says which and why); 2 when the drill could not run, with
one line on stderr saying why (a key, a relay, a setting); 70 on an internal error (one line; never read as 1).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import sys
import time
import traceback
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from sco._fs import atomic_write
from sco.contract.notice import sign_notice
from sco.contract.signing import Keyring, PrivateKey, generate, load_private, verify, write_keypair
from sco.control.drill import DrillReport, NodeTimeline, fold, save
from sco.errors import ScoError

STALE_S = 8
MAX_EVENTS = 10_000  # per node; a drain of 110 pods writes about 350
WRITE_EVERY_S = 0.25


class DrillError(Exception):
    """The drill cannot run: one line for the job's output."""


# --- notice keys ---------------------------------------------------------------------------------------


def notice_entry(key: PrivateKey) -> str:
    return f"{{keyid: '{key.keyid}', public: '{bytes(key.signing_key.verify_key).hex()}'}}"


def hall_notice_keys(bundle_url: str, trusted: list[str]) -> tuple[set[str], int]:
    """The keyids the published bundle's hall policy trusts for notices (what the nodes check), and its serial."""
    try:
        with urllib.request.urlopen(bundle_url, timeout=10) as r:  # the hall's own distributor
            raw = r.read(64 * 1024 * 1024)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise DrillError(f"the hall's bundle {bundle_url}: {getattr(e, 'reason', e)}") from None
    try:
        payload = verify(raw, Keyring.from_files(Path(p) for p in trusted), bundle_url).payload
    except ScoError as e:
        raise DrillError(f"the hall's bundle {bundle_url}: {e}") from None
    keys = {str(k.get("keyid")) for k in (payload.get("policy") or {}).get("noticeKeys") or []}
    return keys, int(payload.get("serial") or 0)


def find_keys(paths: list[str], make: bool, bundle_url: str | None, trusted: list[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for p in map(Path, paths):
        made = False
        if make and not p.exists() and not p.is_symlink():
            try:
                p.parent.mkdir(parents=True, exist_ok=True)
                write_keypair(generate(), p, p.with_suffix(".pub"))
            except (OSError, ScoError) as e:
                raise DrillError(f"notice key {p}: cannot make it: {e}") from None
            made = True
        try:
            key = load_private(p)
        except ScoError as e:
            how = (
                f"make one (sco keygen --out-dir {p.parent} --name {p.stem} --for notice), list it in hall.yaml "
                "spec.noticeKeys and run site.yml --tags contract_distributor, or give drill_notice_keys"
            )
            raise DrillError(f"notice key {e}: {how}" if "no such key file" in str(e) else f"notice key {e}") from None
        out.append({"path": str(p), "keyid": key.keyid, "made": made, "entry": notice_entry(key)})
    if bundle_url:
        trusted_ids, serial = hall_notice_keys(bundle_url, trusted)
        if not any(k["keyid"] in trusted_ids for k in out):
            k = out[0]
            raise DrillError(
                f"notice key {k['path']} (keyid {k['keyid']}{', just made' if k['made'] else ''}) is not in the "
                f"noticeKeys of the hall's bundle (serial {serial}, {bundle_url}): its nodes would refuse the drill's "
                f"notices; add {k['entry']} to hall.yaml spec.noticeKeys and run site.yml --tags contract_distributor"
            )
    return out


# --- following the agents --------------------------------------------------------------------------------


async def connect(servers: list[str], user: str, credentials_file: str) -> Any:
    """Connect as relay user ``user``: its nkey seed file (the notice_relay role's, SU...) or a password file."""
    import nats

    try:
        secret = Path(credentials_file).read_text().strip()
    except OSError as e:
        raise DrillError(f"the credentials of relay user {user}: {credentials_file}: {e.strerror}") from None
    auth: dict[str, Any] = (
        {"nkeys_seed_str": secret} if secret.startswith("SU") else {"user": user, "password": secret}
    )
    errors: list[str] = []

    async def on_error(e: Exception) -> None:  # nats-py would log a traceback per attempt: keep the reason
        errors.append(str(e) or type(e).__name__)

    try:
        # nats-py keeps retrying a refused first connection whatever its options say: bound it
        return await asyncio.wait_for(
            nats.connect(
                servers=servers,
                connect_timeout=3,
                max_reconnect_attempts=0,
                allow_reconnect=False,
                error_cb=on_error,
                **auth,
            ),
            10,
        )
    except Exception as e:
        why = errors[-1] if errors else (str(e) or type(e).__name__)
        raise DrillError(f"relay {', '.join(servers)} as {user}: {why}") from None


def write_atomic(path: Path, text: str) -> None:
    atomic_write(path, text.encode(), 0o644, exact_mode=True)  # the product's one atomic write


class Drill:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dir = Path(args.report_dir)
        self.id = args.id or f"drill-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:6]}"
        self.events: dict[str, list[dict[str, Any]]] = {n: [] for n in args.node}
        self.notice: dict[str, str | None] = dict.fromkeys(args.node)  # node -> the notice id it was sent
        self.sha: dict[str, str] = {}
        self.sent_at = time.time()
        self.terminate_at = self.sent_at + args.notice_seconds
        self.changed = asyncio.Event()
        self.listening = False
        self.dropped: dict[str, int] = {}

    def report(self, finished: bool = False) -> DrillReport:
        nodes = {n: fold(n, evs, self.notice[n], self.sha.get(n)) for n, evs in self.events.items()}
        return DrillReport(self.args.hall, self.id, self.sent_at, self.terminate_at, nodes, finished, time.time())

    def done(self) -> bool:
        return all(t.outcome not in ("no answer", "draining") for t in self.report().nodes.values())

    def write_progress(self, finished: bool = False) -> DrillReport:
        rep = self.report(finished)
        body = {**rep.as_json(), "listening": self.listening, "progress": rep.progress(time.time()),
                "dropped_events": self.dropped}  # fmt: skip
        write_atomic(self.dir / f"{self.id}.progress.json", json.dumps(body, sort_keys=True))
        return rep

    def on_event(self, node: str, ev: dict[str, Any]) -> None:
        if len(self.events[node]) >= MAX_EVENTS:  # a node's word: a flood costs a counter, not the controller
            self.dropped[node] = self.dropped.get(node, 0) + 1
            return
        self.events[node].append(ev)
        if self.notice[node] is None and ev.get("type") in ("notice.accepted", "notice.absorbed"):
            self.notice[node] = str(ev.get("notice"))  # --observe: the reclaimer's notice, the first one seen
        self.changed.set()

    async def run(self) -> DrillReport:
        a = self.args
        servers = [s.strip() for s in a.server.split(",") if s.strip()]
        keys = [load_private(Path(k)) for k in a.signing_key or []]  # checked by `keys` first; again, cheaply
        reader = await connect(servers, a.reader, a.reader_credentials)
        sender = None if a.observe else await connect(servers, a.reclaimer, a.reclaimer_credentials)
        prefix = f"sco.events.{a.hall}."

        async def on_msg(msg: Any) -> None:
            node = msg.subject.removeprefix(prefix)  # node names may hold dots
            if node not in self.events:
                return
            try:
                ev = json.loads(msg.data)
            except ValueError:
                return
            if isinstance(ev, dict):
                self.on_event(node, ev)

        # subscribe before the notices go out, so no event is missed
        for node in self.events:
            await reader.subscribe(f"{prefix}{node}", cb=on_msg)
        await reader.flush(timeout=3)
        self.listening = True
        self.sent_at = time.time()
        self.terminate_at = self.sent_at + a.notice_seconds
        if sender is not None:
            for node in self.events:
                notice = {
                    "id": f"{self.id}-{node}",
                    "hall": a.hall,
                    "node": node,
                    "terminateAt": self.terminate_at,
                    "issuedAt": self.sent_at,
                }
                data = sign_notice(notice, keys)
                self.notice[node], self.sha[node] = notice["id"], hashlib.sha256(data).hexdigest()
                await sender.publish(f"sco.notice.{a.hall}.{node}", data)
            await sender.flush(timeout=3)
        self.write_progress()
        stop_at = self.terminate_at + a.grace_seconds
        while time.time() < stop_at and not self.done():
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), 1.0)
            await asyncio.sleep(WRITE_EVERY_S)  # events come in bursts: fold them once
            self.write_progress()
        await reader.close()
        if sender is not None:
            await sender.close()
        return self.finish()

    def finish(self, reclaimed: list[dict[str, Any]] | None = None) -> DrillReport:
        rep = self.report(finished=True)
        for r in reclaimed or []:
            tl = rep.nodes.setdefault(str(r["name"]), NodeTimeline(str(r["name"])))
            tl.instance = str(r.get("state"))
            if tl.outcome == "no answer" and r.get("agent") in ("drained", "overrun"):
                tl.outcome = str(r["agent"])  # the reclaimer's account (fleet state) when the relay said nothing here
        save(self.dir, rep, self.events)
        self.listening = False
        self.write_progress(finished=True)
        return rep


def load_drill(args: argparse.Namespace) -> Drill:
    """A finished observer's drill, from its report, to add the reclaimer's account."""
    path = Path(args.report_dir) / f"{args.id}.json"
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DrillError(f"{path}: no report of drill {args.id} ({e})") from None
    args.node, args.hall = list(body["events"]), body["hall"]
    args.notice_seconds = body["terminate_at"] - body["sent_at"]
    d = Drill(args)
    d.events = body["events"]
    d.sent_at, d.terminate_at = body["sent_at"], body["terminate_at"]
    d.notice = {n: v.get("notice") for n, v in body["nodes"].items()}
    return d


def watch(args: argparse.Namespace) -> int:
    path = Path(args.report_dir) / f"{args.id}.progress.json"
    end = time.monotonic() + args.wait
    seen = path.stat().st_mtime_ns if path.exists() else 0
    while time.monotonic() < end:
        time.sleep(0.25)
        now = path.stat().st_mtime_ns if path.exists() else 0
        if now != seen:
            break
    try:
        body = json.loads(path.read_text())
        age = time.time() - path.stat().st_mtime
    except (OSError, ValueError):
        print(f"drill {args.id}: starting")
        return 0
    if "error" in body:
        print(f"drill {args.id}: stopped: {body['error']}")
        return 0
    left = body["terminate_at"] - time.time()
    state = "finished" if body.get("finished") else f"{left:.0f} s to T"
    if not body.get("finished") and age > STALE_S:  # the drill rewrites it every second while it runs
        state = f"stopped (no progress for {age:.0f} s: the drill's process ended)"
    print(f"drill {args.id}: {len(body['drained'])}/{len(body['nodes'])} drained, {state}")
    for line in body.get("progress") or []:
        print(f"  {line}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("keys", help="find or make the notice keys; check the hall trusts one")
    k.add_argument("--signing-key", action="append", required=True, help="notice key file (repeatable)")
    k.add_argument("--make", action="store_true", help="make a missing key file (and its .pub)")
    k.add_argument("--bundle-url", default="", help="the hall's published bundle: check its noticeKeys")
    k.add_argument("--trust", action="append", default=[], help="public key the bundle must be signed by")
    r = sub.add_parser("run", help="send the notices (or --observe) and follow the agents")
    r.add_argument("--server", required=True, help="relay URL(s), comma-separated")
    r.add_argument("--hall", required=True)
    r.add_argument("--node", action="append", required=True, help="repeatable")
    r.add_argument("--id", default="", help="the drill's id (names its report files)")
    r.add_argument("--report-dir", required=True)
    r.add_argument("--observe", action="store_true", help="send nothing: follow the provider's reclaimer")
    r.add_argument("--reclaimer", default="reclaimer")
    # a user's nkey seed file (the notice_relay role's <user>.nk), or a password file; the old names still work
    r.add_argument("--reclaimer-credentials", "--reclaimer-password-file", dest="reclaimer_credentials")
    r.add_argument("--reader", default="control")
    r.add_argument("--reader-credentials", "--reader-password-file", dest="reader_credentials", required=True)
    r.add_argument("--signing-key", action="append", help="notice key file (repeatable)")
    r.add_argument("--notice-seconds", type=float, default=120)
    r.add_argument("--grace-seconds", type=float, default=10)
    w = sub.add_parser("watch", help="print a running drill's progress")
    w.add_argument("--report-dir", required=True)
    w.add_argument("--id", required=True)
    w.add_argument("--wait", type=float, default=5)
    f = sub.add_parser("finish", help="add the reclaimer's account and write the report")
    f.add_argument("--report-dir", required=True)
    f.add_argument("--id", required=True)
    f.add_argument("--from-reclaim", required=True, metavar="JSON", help="the reclaim module's `reclaimed` list")
    args = p.parse_args()
    logging.getLogger("nats").setLevel(logging.CRITICAL)  # failures are reported once, below
    try:
        if args.cmd == "keys":
            found = find_keys(args.signing_key, args.make, args.bundle_url or None, args.trust)
            print(json.dumps({"keys": found}, sort_keys=True))
            return 0
        if args.cmd == "watch":
            return watch(args)
        if args.cmd == "run":
            if not args.observe and not (args.signing_key and args.reclaimer_credentials):
                raise DrillError("sending the notices needs --signing-key and --reclaimer-credentials")
            if not (0 < args.notice_seconds <= 3600 and 0 <= args.grace_seconds <= 600):  # also refuses NaN
                raise DrillError(
                    f"--notice-seconds must be in (0, 3600] and --grace-seconds in [0, 600], got "
                    f"{args.notice_seconds} and {args.grace_seconds}"
                )
            Path(args.report_dir).mkdir(parents=True, exist_ok=True)
            drill = Drill(args)
            try:
                rep = asyncio.run(drill.run())
            except (DrillError, ScoError, OSError) as e:  # said where the playbook waits for the drill to listen
                line = f"drill: {e}" if not isinstance(e, OSError) else f"drill: {e.filename or ''} {e.strerror or e}"
                write_atomic(drill.dir / f"{drill.id}.progress.json", json.dumps({"error": line, "listening": False}))
                raise
        else:
            try:
                reclaimed = json.loads(args.from_reclaim)
            except ValueError as e:
                raise DrillError(f"--from-reclaim: not JSON ({e})") from None
            rep = load_drill(args).finish(reclaimed if isinstance(reclaimed, list) else [])
    except (DrillError, ScoError) as e:
        print(f"drill: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"drill: {e.filename or ''}{': ' if e.filename else ''}{e.strerror or e}", file=sys.stderr)
        return 2
    except Exception as e:  # one line for the job; the traceback below it for whoever debugs the script
        traceback.print_exc()
        print(f"drill: internal error: {type(e).__name__}: {e}", file=sys.stderr)
        return 70
    print(json.dumps({**rep.as_json(), "html": str(Path(args.report_dir) / f"{rep.drill}.html")}, sort_keys=True))
    return 0 if not rep.not_drained and not rep.not_deleted else 1


if __name__ == "__main__":
    sys.exit(main())
