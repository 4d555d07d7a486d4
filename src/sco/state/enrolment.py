"""The fleet state's side of enrolment (issue 28): one-time tokens bound to instance records, what each enrolment
issued, and what is still to be taken back.

Only a token's SHA-256 is stored. A claim reads the instance and its token under a row lock (the enrolment row
``FOR UPDATE``, the instance row ``FOR SHARE``: a concurrent duplicate waits and then finds the token used, and the
instance cannot be marked deleted while an enrolment of it is being decided), and the caller records what it issued
in the same transaction: either the token is used and the issue recorded, or nothing happened.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

ENROLLABLE = ("launching", "active")
"""States in which an instance may enrol: its server exists and nothing is taking it away."""


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def offer(conn: Any, instance_id: int, token_sha256: str) -> None:
    """Bind a token (its hash) to an instance record. A create sent again for the record (a crashed run's slot)
    carries a new token, which replaces one never used; a used token is never replaced."""
    conn.execute(
        "INSERT INTO enrolment (instance_id, token_sha256) VALUES (%s, %s) ON CONFLICT (instance_id) DO UPDATE"
        " SET token_sha256 = EXCLUDED.token_sha256, created_at = clock_timestamp() WHERE enrolment.used_at IS NULL",
        (instance_id, token_sha256),
    )


class Refused(Exception):
    """An enrolment request that must not be honoured: ``reason`` is a metric label (a fixed small set), the
    message one line naming what is wrong."""

    def __init__(self, reason: str, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.reason, self.status = reason, status


@dataclass
class Claim:
    """An instance whose token was presented and checked, held under lock until the block ends."""

    conn: Any
    instance_id: int
    hall: str
    node: str
    recorded: bool = False

    def record(
        self,
        *,
        source: str,
        nkey_public: str,
        account: str,
        issued_at: int,
        kube_expires: float | None,
        node_uid: str | None = None,
        metrics_target: str | None = None,
    ) -> None:
        self.conn.execute(
            "UPDATE enrolment SET used_at = clock_timestamp(), used_from = %s, nkey_public = %s, node = %s,"
            " account = %s, account_issued_at = %s, kube_expires_at = to_timestamp(%s), node_uid = %s,"
            " metrics_target = %s WHERE instance_id = %s",
            (source, nkey_public, self.node, account, issued_at, kube_expires, node_uid, metrics_target,
             self.instance_id),
        )  # fmt: skip
        self.conn.execute(
            "INSERT INTO lifecycle_event (hall, instance_id, pool, kind, detail) SELECT hall, id, pool,"
            " 'instance.enrolled', jsonb_build_object('account', %s::text, 'from', %s::text) FROM instance"
            " WHERE id = %s",
            (account, source, self.instance_id),
        )
        self.recorded = True


@contextlib.contextmanager
def claim(conn: Any, *, hall: str, node: str, server_id: str, token: str) -> Iterator[Claim]:
    """Check a request against the fleet state in one transaction with the rows locked; raise :class:`Refused`
    with the reason (its HTTP status is the service's to choose), or yield the :class:`Claim` to record what was
    issued (committed when the block ends without an exception; the token stays unused otherwise)."""
    with conn.transaction():
        row = conn.execute(
            "SELECT i.id, i.name, i.state, e.token_sha256, e.used_at IS NOT NULL FROM instance i"
            " LEFT JOIN enrolment e ON e.instance_id = i.id WHERE i.hall = %s AND i.server_id = %s",
            (hall, server_id),
        ).fetchone()
        if row is None:
            raise Refused("unknown_instance", f"hall {hall}: no instance with server id {server_id}")
        iid, name, _, digest, _ = row
        if name != node:
            raise Refused("wrong_node", f"server {server_id} is not node {node}")
        if digest is None:
            raise Refused("no_token", f"node {node}: launched without an enrolment token")
        # the lock: a concurrent duplicate waits here, then finds the token used
        iid, state, digest, used = conn.execute(
            "SELECT i.id, i.state, e.token_sha256, e.used_at IS NOT NULL FROM instance i JOIN enrolment e"
            " ON e.instance_id = i.id WHERE i.id = %s FOR UPDATE OF e FOR SHARE OF i",
            (iid,),
        ).fetchone()
        if not hmac.compare_digest(digest, token_hash(token)):
            raise Refused("wrong_token", f"node {node}: wrong enrolment token")
        if state not in ENROLLABLE:
            raise Refused("not_live", f"node {node}: instance is {state}, not enrolling")
        if used:
            raise Refused("replay", f"node {node}: enrolment token already used")
        c = Claim(conn, iid, hall, node)
        yield c
        if not c.recorded:
            raise RuntimeError("claim ended without recording what was issued")


@dataclass(frozen=True)
class Issued:
    """An enrolment to take back: the instance, its node, the relay account issued to it (``relay_done``: already
    revoked there) and the Node object its Kubernetes token was bound to (``node_uid``; None: none, or settled)."""

    instance_id: int
    hall: str
    node: str
    account: str
    issued_at: int
    server_id: str = ""
    relay_done: bool = False
    node_uid: str | None = None


GONE = ("deleted", "lost", "failed")
"""States of an instance whose server is gone (or never ran): its identities are taken back."""


def to_revoke(conn: Any, hall: str | None = None, limit: int = 500) -> list[Issued]:
    """Enrolments whose instance is gone (deleted, lost, failed) and whose identities are not all taken back yet:
    the relay account not revoked, or the Node its token was bound to not settled."""
    q = (
        "SELECT e.instance_id, i.hall, e.node, e.account, e.account_issued_at, coalesce(i.server_id, ''),"
        " e.revoked_at IS NOT NULL, CASE WHEN e.node_done_at IS NULL THEN e.node_uid END FROM enrolment e"
        " JOIN instance i ON i.id = e.instance_id WHERE e.used_at IS NOT NULL"
        " AND (e.revoked_at IS NULL OR (e.node_uid IS NOT NULL AND e.node_done_at IS NULL))"
        " AND i.state = ANY(%s)"
    )
    args: list[Any] = [list(GONE)]
    if hall is not None:
        q += " AND i.hall = %s"
        args.append(hall)
    # relay identities not yet revoked first: Nodes the API keeps refusing to delete must not fill the batch
    order = " ORDER BY e.revoked_at IS NOT NULL, e.instance_id LIMIT %s"
    rows = conn.execute(q + order, (*args, limit)).fetchall()
    return [Issued(int(r[0]), r[1], r[2], r[3], int(r[4]), r[5], bool(r[6]), r[7]) for r in rows]


def revoked(conn: Any, item: Issued) -> None:
    with conn.transaction():
        conn.execute(
            "UPDATE enrolment SET revoked_at = clock_timestamp() WHERE instance_id = %s AND revoked_at IS NULL",
            (item.instance_id,),
        )
        conn.execute(
            "INSERT INTO lifecycle_event (hall, instance_id, pool, kind, detail) SELECT hall, id, pool,"
            " 'instance.identity_revoked', jsonb_build_object('account', %s::text) FROM instance WHERE id = %s",
            (item.account, item.instance_id),
        )


def name_in_use(conn: Any, item: Issued) -> bool:
    """Whether another instance of the hall, not gone, holds the node's name now (a slot launched again): its
    kubelet may have taken over the Node object of the name, so the old one's Node is not the sweep's to delete."""
    row = conn.execute(
        "SELECT 1 FROM instance WHERE hall = %s AND name = %s AND id <> %s AND NOT (state = ANY(%s)) LIMIT 1",
        (item.hall, item.node, item.instance_id, list(GONE)),
    ).fetchone()
    return row is not None


def node_settled(conn: Any, item: Issued, outcome: str) -> None:
    """The Node of a gone instance dealt with: ``deleted`` now, ``gone`` already, or ``replaced`` (another object
    or another instance holds the name: left alone)."""
    with conn.transaction():
        conn.execute(
            "UPDATE enrolment SET node_done_at = clock_timestamp(), node_outcome = %s WHERE instance_id = %s"
            " AND node_done_at IS NULL",
            (outcome, item.instance_id),
        )
        conn.execute(
            "INSERT INTO lifecycle_event (hall, instance_id, pool, kind, detail) SELECT hall, id, pool,"
            " 'instance.node_removed', jsonb_build_object('node', %s::text, 'uid', %s::text, 'outcome', %s::text)"
            " FROM instance WHERE id = %s",
            (item.node, item.node_uid, outcome, item.instance_id),
        )


def scrape_targets(conn: Any, hall: str) -> list[tuple[str, str, str]]:
    """(node, pool, metrics address) of every enrolled instance of the hall that is live (launching or active) and
    told where its agent serves metrics: what Prometheus should scrape, in node order."""
    rows = conn.execute(
        "SELECT e.node, i.pool, e.metrics_target FROM enrolment e JOIN instance i ON i.id = e.instance_id"
        " WHERE i.hall = %s AND i.state = ANY(%s) AND e.used_at IS NOT NULL AND e.revoked_at IS NULL"
        " AND e.metrics_target IS NOT NULL ORDER BY e.node",
        (hall, list(ENROLLABLE)),
    ).fetchall()
    return [(str(r[0]), str(r[1]), str(r[2])) for r in rows]
