"""The reclaim drill's run (``sco drill``; playbook ``sco.orchestrator.drill``): reclaim chosen nodes through the
hall's relay and follow what each node's agent did. The report it writes is ``sco.control.drill``'s.

* ``find_keys``: find (or make) the drill's notice keys and check the hall's published bundle trusts one;
* ``Drill.run``: send the signed notices as the reclaimer (or, observing, follow a reclaim the provider's reclaimer
  sends) and follow each agent's events on ``sco.events.<hall>.<node>`` until every node has its final account or
  T + grace; progress in ``<dir>/<id>.progress.json``, the report in ``<dir>/<id>.html`` and ``.json``;
* ``watch``: the progress lines of a running drill; ``load_drill`` + ``Drill.finish``: the reclaimer's account of
  the instances added to a finished drill's report.

The notice is the real one, signed with the hall's notice key (its public half is in the hall policy's noticeKeys,
so nodes trust it through their bundle): the agents drain for real.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sco._fs import atomic_write
from sco._tls import client_context
from sco.contract.notice import sign_notice
from sco.contract.signing import Keyring, PrivateKey, generate, load_private, verify, write_keypair
from sco.control.drill import DrillReport, NodeTimeline, fold, save
from sco.errors import ScoError

STALE_S = 8
MAX_EVENTS = 10_000  # per node; a drain of 110 pods writes about 350
WRITE_EVERY_S = 0.25


class DrillError(ScoError):
    """The drill cannot run (a key, a relay, a setting): one line for the job's output. Never exit 1, which says
    a node did not drain."""

    exit_code = 5


class DrillRelayError(DrillError):
    """The relay or the hall's distributor refused or did not answer."""

    exit_code = 6


# --- notice keys ---------------------------------------------------------------------------------------


def notice_entry(key: PrivateKey) -> str:
    return f"{{keyid: '{key.keyid}', public: '{bytes(key.signing_key.verify_key).hex()}'}}"


def hall_notice_keys(bundle_url: str, trusted: list[str], ca_file: str = "") -> tuple[set[str], int]:
    """The keyids the published bundle's hall policy trusts for notices (what the nodes check), and its serial."""
    try:
        # the hall's own distributor; over https its certificate checked against the hall's CA (ca_file)
        ctx = client_context(ca_file) if bundle_url.startswith("https:") else None
        with urllib.request.urlopen(bundle_url, timeout=10, context=ctx) as r:
            raw = r.read(64 * 1024 * 1024)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise DrillRelayError(f"the hall's bundle {bundle_url}: {getattr(e, 'reason', e)}") from None
    try:
        payload = verify(raw, Keyring.from_files(Path(p) for p in trusted), bundle_url).payload
    except ScoError as e:
        raise DrillError(f"the hall's bundle {bundle_url}: {e}") from None
    keys = {str(k.get("keyid")) for k in (payload.get("policy") or {}).get("noticeKeys") or []}
    return keys, int(payload.get("serial") or 0)


def find_keys(
    paths: list[str], make: bool, bundle_url: str | None, trusted: list[str], bundle_ca_file: str = ""
) -> list[dict[str, Any]]:
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
        trusted_ids, serial = hall_notice_keys(bundle_url, trusted, bundle_ca_file)
        if not any(k["keyid"] in trusted_ids for k in out):
            k = out[0]
            raise DrillError(
                f"notice key {k['path']} (keyid {k['keyid']}{', just made' if k['made'] else ''}) is not in the "
                f"noticeKeys of the hall's bundle (serial {serial}, {bundle_url}): its nodes would refuse the drill's "
                f"notices; add {k['entry']} to hall.yaml spec.noticeKeys and run site.yml --tags contract_distributor"
            )
    return out


# --- following the agents --------------------------------------------------------------------------------


async def connect(servers: list[str], user: str, credentials_file: str, ca_file: str = "") -> Any:
    """Connect as relay user ``user`` (``sco._nats``): its creds file (user JWT and seed: the notice_relay role's
    ``<user>.creds`` in operator mode, where a bare seed is refused), its nkey seed file (``<user>.nk``, SU...) or a
    password file; 10 s at most. ``ca_file``: the hall's CA the relay's TLS certificate must chain to."""
    from sco import _nats

    try:
        secret = Path(credentials_file).read_text().strip()
    except OSError as e:
        raise DrillError(f"the credentials of relay user {user}: {credentials_file}: {e.strerror}") from None
    if "-----BEGIN NATS USER JWT-----" in secret:
        auth = _nats.auth_options(creds_file=credentials_file, ca_file=ca_file or None)
    elif secret.startswith("SU"):
        auth = _nats.auth_options(nkey_seed_file=credentials_file, ca_file=ca_file or None)
    else:
        auth = _nats.auth_options(user=user, password=secret, ca_file=ca_file or None)
    errors: list[str] = []

    async def on_error(e: Exception) -> None:  # the last attempt's reason is the drill's line
        errors.append(str(e) or type(e).__name__)

    try:
        return await _nats.connect(servers, auth=auth, deadline_s=10, connect_timeout=3, error_cb=on_error)
    except Exception as e:
        why = errors[-1] if errors else (str(e) or type(e).__name__)
        raise DrillRelayError(f"relay {', '.join(servers)} as {user}: {why}") from None


def write_atomic(path: Path, text: str) -> None:
    atomic_write(path, text.encode(), 0o644, exact_mode=True)  # the product's one atomic write


@dataclass
class DrillSettings:
    """One drill (``sco drill run``'s flags)."""

    hall: str
    nodes: list[str]
    report_dir: Path
    id: str = ""
    server: str = ""
    """The relay's URL(s), comma-separated."""
    notice_seconds: float = 120.0
    grace_seconds: float = 10.0
    observe: bool = False
    """Send nothing: follow the notices the provider's reclaimer sends."""
    signing_keys: list[str] = field(default_factory=list)
    reader: str = "control"
    reader_credentials: str = ""
    reclaimer: str = "reclaimer"
    reclaimer_credentials: str = ""
    ca_file: str = ""
    """The hall's CA the relay's TLS certificate must chain to."""

    def check(self) -> None:
        if not self.observe and not (self.signing_keys and self.reclaimer_credentials):
            raise DrillError("sending the notices needs --signing-key and --reclaimer-credentials")
        if not (0 < self.notice_seconds <= 3600 and 0 <= self.grace_seconds <= 600):  # also refuses NaN
            raise DrillError(
                f"--notice-seconds must be in (0, 3600] and --grace-seconds in [0, 600], got "
                f"{self.notice_seconds} and {self.grace_seconds}"
            )


class Drill:
    def __init__(self, settings: DrillSettings) -> None:
        self.s = settings
        self.dir = Path(settings.report_dir)
        self.id = settings.id or f"drill-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:6]}"
        self.events: dict[str, list[dict[str, Any]]] = {n: [] for n in settings.nodes}
        self.notice: dict[str, str | None] = dict.fromkeys(settings.nodes)  # node -> the notice id it was sent
        self.sha: dict[str, str] = {}
        self.sent_at = time.time()
        self.terminate_at = self.sent_at + settings.notice_seconds
        self.changed = asyncio.Event()
        self.listening = False
        self.dropped: dict[str, int] = {}

    def report(self, finished: bool = False) -> DrillReport:
        nodes = {n: fold(n, evs, self.notice[n], self.sha.get(n)) for n, evs in self.events.items()}
        return DrillReport(self.s.hall, self.id, self.sent_at, self.terminate_at, nodes, finished, time.time())

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
        a = self.s
        servers = [s.strip() for s in a.server.split(",") if s.strip()]
        keys = [load_private(Path(k)) for k in a.signing_keys]  # checked by `keys` first; again, cheaply
        reader = await connect(servers, a.reader, a.reader_credentials, a.ca_file)
        sender = None if a.observe else await connect(servers, a.reclaimer, a.reclaimer_credentials, a.ca_file)
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
                notice_id = f"{self.id}-{node}"
                notice: dict[str, Any] = {
                    "id": notice_id,
                    "hall": a.hall,
                    "node": node,
                    "terminateAt": self.terminate_at,
                    "issuedAt": self.sent_at,
                }
                data = sign_notice(notice, keys)
                self.notice[node], self.sha[node] = notice_id, hashlib.sha256(data).hexdigest()
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


def load_drill(report_dir: Path, drill_id: str) -> Drill:
    """A finished observer's drill, from its report, to add the reclaimer's account."""
    path = Path(report_dir) / f"{drill_id}.json"
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DrillError(f"{path}: no report of drill {drill_id} ({e})") from None
    settings = DrillSettings(
        body["hall"], list(body["events"]), Path(report_dir), drill_id,
        notice_seconds=body["terminate_at"] - body["sent_at"],
    )  # fmt: skip
    d = Drill(settings)
    d.events = body["events"]
    d.sent_at, d.terminate_at = body["sent_at"], body["terminate_at"]
    d.notice = {n: v.get("notice") for n, v in body["nodes"].items()}
    return d


def watch(report_dir: Path, drill_id: str, wait_s: float) -> list[str]:
    """A running drill's progress lines, once its progress file changes (at most ``wait_s`` from now)."""
    path = Path(report_dir) / f"{drill_id}.progress.json"
    end = time.monotonic() + wait_s
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
        return [f"drill {drill_id}: starting"]
    if "error" in body:
        return [f"drill {drill_id}: stopped: {body['error']}"]
    left = body["terminate_at"] - time.time()
    state = "finished" if body.get("finished") else f"{left:.0f} s to T"
    if not body.get("finished") and age > STALE_S:  # the drill rewrites it every second while it runs
        state = f"stopped (no progress for {age:.0f} s: the drill's process ended)"
    lines = [f"drill {drill_id}: {len(body['drained'])}/{len(body['nodes'])} drained, {state}"]
    return lines + [f"  {line}" for line in body.get("progress") or []]
