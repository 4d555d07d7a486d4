"""What release N+1 reads of what release N writes, and the rules each wire format and the fleet state's schema keep
within a major release (docs/UPGRADE.md): tested on the real readers. A field N+1 adds must be one N ignores;
a field N+1 needs must have a default for what N sent without it.

Not tested here (said in docs/UPGRADE.md): the heartbeat reader (it keeps the body's object as it is) and the
reclaimer's folding of events of a type it does not know (dropped before the fleet state is asked)."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest

from sco.agent.bundle_cache import BundleCache
from sco.agent.main import status
from sco.agent.notices import notice_from_nats
from sco.agent.resume import unfinished_drain
from sco.agent.spool import CRITICAL, Spool
from sco.contract import canonical
from sco.contract.bundle import Bundle
from sco.contract.compiler import compile_repo
from sco.contract.notice import sign_notice, verify_notice
from sco.contract.signing import Keyring, PrivateKey, sign
from sco.errors import BundleError

MIGRATIONS = Path(__file__).resolve().parents[1] / "src" / "sco" / "state" / "migrations"


def test_a_bundle_payload_with_fields_n_does_not_know_is_read(tmp_path: Path, repo: Path, key: PrivateKey) -> None:
    """Rule: new bundle fields go into the signed payload (top level, the policy, a contract), never the header; a
    reader ignores what it does not know, and a node's cache takes such a bundle."""
    payload = compile_repo(repo, serial=1)
    payload["rolloutHint"] = {"from": "N+1"}
    payload["policy"]["somethingNew"] = 7
    for c in payload["contracts"]:
        c["newKnob"] = True
    raw = sign(payload, [key])
    b = Bundle.from_bytes(raw, Keyring([key.public]))
    name = payload["contracts"][0]["name"]
    assert b.serial == 1 and b.budget(name) is not None
    assert BundleCache(tmp_path / "cache", Keyring([key.public])).offer(raw).outcome == "accepted"


def test_a_bundle_header_is_fixed_within_a_major_release(repo: Path, key: PrivateKey) -> None:
    """Rule: the header's keys are exactly N's (a node refuses any other: the header is what the signature does not
    cover); a change there is a major release, with both bundles published side by side."""
    raw = sign(compile_repo(repo, serial=1), [key])
    head, rest = raw.split(b"\n", 1)
    header = canonical.loads(head)
    header["compression"] = "none"
    with pytest.raises(BundleError, match="header: expected exactly"):
        Bundle.from_bytes(canonical.dumps(header) + b"\n" + rest, Keyring([key.public]))


def test_a_notice_with_fields_n_does_not_know_is_verified_and_read(key: PrivateKey) -> None:
    """Rule: a notice's new fields are signed with the rest and ignored by an agent that does not know them; the
    fields N reads (id, hall, node, terminateAt, issuedAt) keep their meaning."""
    now = time.time()
    doc = {"id": "n-1", "hall": "local", "node": "node-1", "issuedAt": now, "terminateAt": now + 120,
           "priority": "high", "reason": {"lease": "x"}}  # fmt: skip
    raw = sign_notice(doc, [key])
    verified = verify_notice(raw, Keyring([key.public]))
    n = notice_from_nats(verified, hall="local", node="node-1", now=now, window=120)
    assert (n.id, n.terminate_at) == ("n-1", now + 120)


def _spool(tmp_path: Path) -> Spool:
    return Spool(tmp_path / "state" / "spool")


def test_the_spool_n_wrote_is_read_by_n_plus_1_with_records_it_does_not_know(tmp_path: Path) -> None:
    """Rule: the spool (what a restarted agent resumes from, and what `sco-agent status` reads for the upgrade's
    drain wait) keeps its records' meaning; a type or field a reader does not know is skipped, never an error."""
    sp = _spool(tmp_path)
    sp.append("agent.started", CRITICAL, boot_id="b")
    sp.append("notice.accepted", CRITICAL, notice="n-1", terminate_at=2000.0, issued_at=1880.0, source="nats",
              received_at=1881.0, new_field={"x": 1})  # fmt: skip
    sp.append("drain.phase_of_release_n_plus_2", CRITICAL, notice="n-1", anything=[1, 2])
    sp.append("notice.deadline", CRITICAL, notice="n-1", terminate_at=1990.0, from_notice="n-2", source="metadata")
    sp.close()
    st = status(tmp_path / "state")
    assert st["drain"] == {"notice": "n-1", "terminate_at": 1990.0}
    sp = _spool(tmp_path)
    sp.append("drain.drained", CRITICAL, notice="n-1", outcome="drained")
    sp.close()
    assert status(tmp_path / "state")["drain"] is None


def test_an_outcome_of_another_notice_does_not_close_the_drain() -> None:
    def accepted(nid: str, t: float) -> dict[str, Any]:
        return {"type": "notice.accepted", "notice": nid, "terminate_at": t, "issued_at": t - 120, "source": "nats",
                "received_at": t - 119}  # fmt: skip

    events: list[dict[str, Any]] = [
        accepted("a", 10.0),
        {"type": "drain.drained", "notice": "a"},
        accepted("b", 20.0),
        {"type": "drain.error", "notice": "a"},
    ]
    _, n = unfinished_drain(events, "h", "n")
    assert n is not None and (n.id, n.terminate_at) == ("b", 20.0)
    assert unfinished_drain([*events, {"type": "drain.overrun", "notice": "b"}], "h", "n")[1] is None


# What N's code may still run against once N+1's migrations ran: tables and columns stay, with their types.
_NOT_ADDITIVE = re.compile(
    r"\bDROP\s+(TABLE|COLUMN|SCHEMA|VIEW|FUNCTION)\b|\bRENAME\b|\bALTER\s+COLUMN\s+\S+\s+(SET\s+DATA\s+)?TYPE\b"
    r"|\bSET\s+NOT\s+NULL\b|\bTRUNCATE\b",
    re.IGNORECASE,
)


@pytest.mark.parametrize("migration", sorted(p.name for p in MIGRATIONS.glob("*.sql")))
def test_every_migration_is_additive(migration: str) -> None:
    """Rule: the fleet state's schema only grows within a major release (new tables, new nullable or defaulted
    columns, new indexes, constraints widened), so N's control loop and reclaims keep working while the control
    hosts move to N+1 after `sco db migrate` ran."""
    sql = re.sub(r"--[^\n]*", "", (MIGRATIONS / migration).read_text())
    assert _NOT_ADDITIVE.findall(sql) == []
    for m in re.finditer(r"ADD\s+COLUMN\s+(IF\s+NOT\s+EXISTS\s+)?(\w+)\s+([^,;]*)", sql, re.IGNORECASE):
        col = m.group(3).upper()
        assert "NOT NULL" not in col or "DEFAULT" in col, f"{migration}: column {m.group(2)} NOT NULL without a default"


def test_an_enrolment_request_with_fields_the_service_does_not_know_is_read() -> None:
    """Rule 6: a node baked with a later release sends fields this service does not know; they are ignored, and the
    fields it knows are checked as always."""
    from sco.contract.enrolment import Malformed, parse_request

    request = {
        "hall": "h", "node": "n1", "instance_id": "0b2c7f7e-0d4b-4a51-9b43-1f0c7e1e6a11", "token": "t" * 43,
        "nkey_public": "U" + "A" * 55,
    }  # fmt: skip
    got = parse_request({**request, "rolloutHint": {"from": "N+1"}, "zone": "b"})
    assert got == request
    with pytest.raises(Malformed, match="node"):
        parse_request({**request, "node": "", "rolloutHint": 1})
