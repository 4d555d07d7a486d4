"""A launched instance exchanges its one-time token (made by the acquirer, only its hash in the
fleet state) for its own relay identity and a Kubernetes token bound to its Node, once. Real parts: PostgreSQL (the
fleet state), an operator-mode nats-server (tests/test_relay_jwt.py's), the Kubernetes API stand-in, and the real
sco-agent for the node's side."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import ssl
import stat
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import pytest
import yaml

from sco._tls import ServerTls
from sco.contract.enrolment import creds_text
from sco.control.acquirer import ENROL_TOKEN, ENROL_URL, Acquirer
from sco.control.enrolment import EnrolmentServer, Issuer, KubeSettings, MetricsServer, Settings
from sco.provider import relay_identity as ri
from sco.state.fleet import FleetState, Pool
from sco_devkit.standins.kube_apiserver import KubeApiStandIn
from tests.enrol_client import post, request
from tests.harness import BIN, AgentEnv, MetadataServer, free_port, make_tls, plaintext_answer, wait_for
from tests.relays import (
    HALL,
    JwtRelay,
    ca_for,
    publish_until,
    relay_refusal,
    start_jwt_relay,
    stream_subjects,
    tls_for,
)


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[JwtRelay]:
    r = start_jwt_relay(tmp_path)
    yield r
    r.srv.stop()


@pytest.fixture
def kube_auth(tmp_path: Path) -> Iterator[tuple[KubeApiStandIn, Path]]:
    """The stand-in with authentication on: the service's own credential (a service account of the control host,
    not node-bound) and the agent's service account, sco-system/sco-agent."""
    srv = KubeApiStandIn().start()
    token, _ = srv.issue_token("sco-system", "sco-enrol")
    srv.add_serviceaccount("sco-system", "sco-agent")
    path = tmp_path / "enrol-kube-token"
    path.write_text(token)
    yield srv, path
    srv.stop()


@dataclass
class Hall:
    relay: JwtRelay
    kube: KubeApiStandIn
    state: FleetState
    issuer: Issuer
    server: EnrolmentServer
    acquirer: Acquirer
    envs: dict[str, dict[str, str]]

    @property
    def url(self) -> str:
        return self.server.url

    def launch(self, slot: int) -> tuple[str, str, str]:
        """As the acquirer launches: the record (requested), the user-data with the instance's own token (its hash
        bound to the record), the server created (launching, its id). Returns (node, server id, token)."""
        name = f"{HALL}-p-e-{slot}"
        inst = self.state.request(HALL, "p", "e", slot, name)
        self.acquirer._user_data(inst)  # the launch's own call: the render callback gets the instance's env
        server_id = str(uuid.uuid4())
        self.state.transition(inst.id, "launching", "launch.requested", server_id=server_id, name=name)
        self.kube.cluster.add_node(name)  # kubelet registered it
        return name, server_id, self.envs[name][ENROL_TOKEN]

    def metrics(self, ca: Path | None = None) -> dict[str, float]:
        ctx = ssl.create_default_context(cafile=str(ca)) if ca else None
        text = urllib.request.urlopen(f"{self.url}/metrics", timeout=5, context=ctx).read().decode()
        return {k: float(v) for k, v in re.findall(r"^(sco_enrol_\S+) (\S+)$", text, re.M)}


@pytest.fixture
def make_hall(relay: JwtRelay, kube_auth: tuple[KubeApiStandIn, Path], fleet_dsn: str) -> Iterator[Callable[..., Hall]]:
    made: list[Hall] = []
    kube, token_file = kube_auth

    def make(api: tuple[KubeApiStandIn, Path] | None = None, tls: ServerTls | None = None, **more: Any) -> Hall:
        k, tf = api or (kube, token_file)
        state = FleetState(fleet_dsn)
        state.ensure_pool(Pool(HALL, "p", "m1.small", "img"))
        s = Settings(
            hall=HALL, dsn=fleet_dsn, relay_keys=relay.dir / "hall-keys", nats_url=relay.url,
            nats_ca_file=str(ca_for(relay.url)),
            kube=KubeSettings(k.url, str(tf), token_seconds=3600), **more,
        )  # fmt: skip
        issuer = Issuer(s)
        server = EnrolmentServer(issuer, ("127.0.0.1", free_port()), tls=tls)
        concurrent.futures.ThreadPoolExecutor(1).submit(server.serve_forever)
        envs: dict[str, dict[str, str]] = {}

        def render(name: str, own: dict[str, str] | None = None) -> str:
            envs[name] = dict(own or {})
            return "#cloud-config\n"

        acquirer = Acquirer(None, state, render, enrol_url=server.url)
        h = Hall(relay, k, state, issuer, server, acquirer, envs)
        made.append(h)
        return h

    yield make
    for h in made:
        h.server.shutdown()
        h.server.server_close()
        h.issuer.close()
        h.state.close()


def test_an_instance_enrols_once_and_speaks_for_itself_alone(make_hall: Callable[..., Hall], tmp_path: Path) -> None:
    h = make_hall()
    node, server_id, token = h.launch(0)
    env = h.envs[node]
    assert env[ENROL_URL] == h.url and len(token) >= 43
    # only the hash is stored, bound to this instance's record
    row = h.state.conn.execute(
        "SELECT e.token_sha256, i.name FROM enrolment e JOIN instance i ON i.id = e.instance_id"
    ).fetchall()
    assert len(row) == 1 and row[0][1] == node and token not in row[0][0] and len(row[0][0]) == 64

    key = ri.NKey.generate("user")  # made on the node; only its public half is sent
    status, body = post(h.url, request(node, server_id, token, key.public))
    assert status == 200, body
    answer = json.loads(body)
    assert key.seed.decode() not in body.decode() and answer["kube_token"] and answer["kube_expires"] > time.time()
    creds = tmp_path / "node.creds"
    creds.write_text(creds_text(answer["nats_user_jwt"], key.seed))

    async def speak() -> tuple[list[bytes], str]:
        got: list[bytes] = []
        nc = await nats.connect(
            h.relay.url,
            user_credentials=str(creds),
            inbox_prefix=ri.node_inbox(HALL, node),
            connect_timeout=3,
            **tls_for(h.relay.url),
        )
        reclaimer = await nats.connect(
            h.relay.url, user_credentials=str(h.relay.users["reclaimer"]), **tls_for(h.relay.url)
        )
        try:

            async def on_msg(msg: Any) -> None:
                got.append(msg.data)

            await nc.subscribe(f"sco.notice.{HALL}.{node}", cb=on_msg)
            await nc.flush(timeout=5)
            ack = await nc.jetstream(timeout=5).publish(f"sco.events.{HALL}.{node}", b'{"type": "agent.started"}')
            mine = (f"sco.notice.{HALL}.{node}", b"your notice")
            await publish_until(reclaimer, [(f"sco.notice.{HALL}.other", b"someone else's"), mine], got)
            await asyncio.sleep(0.3)  # a moment for a foreign notice, were it delivered
            return got, ack.stream
        finally:
            await nc.close()
            await reclaimer.close()

    got, stream = asyncio.run(speak())
    assert got and set(got) == {b"your notice"} and stream == ri.STREAM
    assert f"sco.events.{HALL}.{node}" in asyncio.run(stream_subjects(h.relay))
    # the Kubernetes token is the agent's service account's, bound to this node's Node
    issued = h.kube.issued[answer["kube_token"]]
    assert issued["node"] == node and issued["sa"] == ("sco-system", "sco-agent")
    assert h.kube.issued_valid(issued)
    recorded = h.state.conn.execute("SELECT used_at IS NOT NULL, account, nkey_public FROM enrolment").fetchone()
    assert recorded == (True, answer["nats_account"], key.public)
    assert [e["kind"] for e in h.state.events(hall=HALL) if e["kind"] == "instance.enrolled"] == ["instance.enrolled"]
    assert h.metrics()["sco_enrol_issued_total"] == 1


def test_every_bad_request_is_refused_with_one_line_and_counted(make_hall: Callable[..., Hall]) -> None:
    h = make_hall(rate_per_s=100.0, burst=100)  # the flood's own test below
    a, a_id, a_token = h.launch(0)
    b, b_id, b_token = h.launch(1)
    c, c_id, c_token = h.launch(2)
    pub = ri.NKey.generate("user").public
    assert post(h.url, request(a, a_id, a_token, pub))[0] == 200
    c_inst = h.state.by_server(c_id)
    assert c_inst is not None
    h.state.transition(c_inst.id, "deleted", "instance.deleted", reason="plan shrank")
    cases = {
        "unknown_instance": (404, request(b, str(uuid.uuid4()), b_token, pub)),
        "wrong_node": (403, request(a, b_id, b_token, pub)),  # b's instance and token, a's name
        "wrong_token": (403, request(b, b_id, a_token, pub)),
        "replay": (409, request(a, a_id, a_token, pub)),
        "not_live": (410, request(c, c_id, c_token, pub)),
        "malformed": (400, {**request(b, b_id, b_token, pub), "nkey_public": "SU-not-a-public-key"}),
        "wrong_hall": (404, {**request(b, b_id, b_token, pub), "hall": "elsewhere"}),
    }
    for reason, (code, doc) in cases.items():
        status, body = post(h.url, doc)
        assert status == code, (reason, status, body)
        assert body.count(b"\n") == 1 and body.endswith(b"\n") and len(body) < 200, (reason, body)
    assert post(h.url, None, raw=b"{not json")[0] == 400
    assert post(h.url, None, raw=b"x" * 5000)[0] == 413
    m = h.metrics()
    for reason in cases:
        want = 2 if reason == "malformed" else 1
        assert m[f'sco_enrol_refused_total{{reason="{reason}"}}'] == want, (reason, m)
    assert m['sco_enrol_refused_total{reason="too_large"}'] == 1
    assert m["sco_enrol_issued_total"] == 1
    # b's token still works after all that: refusals used nothing
    assert post(h.url, request(b, b_id, b_token, pub))[0] == 200


def test_a_flood_from_one_address_is_answered_429_and_counted(make_hall: Callable[..., Hall]) -> None:
    h = make_hall(rate_per_s=1.0, burst=5)
    junk = request(f"{HALL}-p-e-9", str(uuid.uuid4()), "x" * 43, ri.NKey.generate("user").public)
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        codes = list(ex.map(lambda _: post(h.url, junk)[0], range(60)))
    assert codes.count(429) >= 50 and set(codes) <= {404, 429}, codes
    status, body = post(h.url, junk)
    assert status == 429 and body.count(b"\n") == 1, body
    m = h.metrics()
    assert m['sco_enrol_refused_total{reason="rate_limited"}'] == codes.count(429) + 1
    # the database never saw the flood: only the bucket's few
    assert m['sco_enrol_refused_total{reason="unknown_instance"}'] == codes.count(404) <= 6


def test_forty_instances_behind_one_snat_address_enrol_at_once_and_a_flood_is_still_429(
    make_hall: Callable[..., Hall],
) -> None:
    """Instances booting together behind SNAT reach the service from one address: with the defaults (sized for the
    acquire step's burst of creates) 40 enrolments at once all succeed, first time; past the bucket a flood is
    still answered 429."""
    from sco.contract.enrolment import BURST, MAX_PER_ADDRESS

    h = make_hall()
    assert h.server.max_per_client == MAX_PER_ADDRESS >= 40 and h.issuer.limit.burst == BURST >= 40
    launched = [h.launch(i) for i in range(40)]
    keys = [ri.NKey.generate("user").public for _ in launched]
    start = threading.Barrier(40)

    def enrol(i: int) -> int:
        node, server_id, token = launched[i]
        start.wait(10)  # all 40 connections open together, as a hall's launch boots them
        return post(h.url, request(node, server_id, token, keys[i]))[0]

    with concurrent.futures.ThreadPoolExecutor(40) as ex:
        codes = list(ex.map(enrol, range(40)))
    assert codes == [200] * 40, codes
    assert h.server.refused_connections == 0
    m = h.metrics()
    assert m["sco_enrol_issued_total"] == 40
    # the bucket still works: the address has spent 40 of its burst; a flood of junk drains the rest and is refused
    junk = request(f"{HALL}-p-e-99", str(uuid.uuid4()), "x" * 43, ri.NKey.generate("user").public)
    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        flood = list(ex.map(lambda _: post(h.url, junk)[0], range(2 * BURST)))
    assert flood.count(429) >= BURST - 40 and set(flood) <= {404, 429}, flood
    assert h.metrics()['sco_enrol_refused_total{reason="rate_limited"}'] == flood.count(429)


def test_concurrent_duplicate_requests_mint_once(make_hall: Callable[..., Hall]) -> None:
    h = make_hall(rate_per_s=100.0, burst=100)
    node, server_id, token = h.launch(0)
    keys = [ri.NKey.generate("user").public for _ in range(12)]
    with concurrent.futures.ThreadPoolExecutor(12) as ex:
        answers = list(ex.map(lambda k: post(h.url, request(node, server_id, token, k)), keys))
    codes = sorted(a[0] for a in answers)
    assert codes == [200] + [409] * 11, answers
    assert h.metrics()["sco_enrol_issued_total"] == 1
    (winner,) = [json.loads(a[1]) for a in answers if a[0] == 200]
    recorded = h.state.conn.execute("SELECT account FROM enrolment WHERE used_at IS NOT NULL").fetchall()
    assert recorded == [(winner["nats_account"],)]
    assert len(h.kube.token_requests) == 1


def test_a_deleted_instance_loses_its_identity(make_hall: Callable[..., Hall], tmp_path: Path) -> None:
    h = make_hall(revoke_every_s=0.2)
    h.issuer.start_sweeper()
    node, server_id, token = h.launch(0)
    other, other_id, other_token = h.launch(1)
    files = {}
    for n, sid, tok in ((node, server_id, token), (other, other_id, other_token)):
        key = ri.NKey.generate("user")
        status, body = post(h.url, request(n, sid, tok, key.public))
        assert status == 200, body
        files[n] = tmp_path / f"{n}.creds"
        files[n].write_text(creds_text(json.loads(body)["nats_user_jwt"], key.seed))

    async def scenario() -> tuple[float, str, str]:
        closed = asyncio.Event()

        async def on_closed() -> None:
            closed.set()

        async def quiet(e: Exception) -> None:
            pass

        nc = await nats.connect(
            h.relay.url, user_credentials=str(files[node]), allow_reconnect=False, closed_cb=on_closed,
            error_cb=quiet, connect_timeout=3, **tls_for(h.relay.url),
        )  # fmt: skip
        assert nc.is_connected
        inst = h.state.by_server(server_id)
        assert inst is not None
        started = time.monotonic()
        await asyncio.to_thread(h.state.transition, inst.id, "deleted", "instance.deleted", reason="reclaimed")
        await asyncio.wait_for(closed.wait(), 15)
        took = time.monotonic() - started
        return (
            took,
            await relay_refusal(h.relay.url, user_credentials=str(files[node])),
            await relay_refusal(h.relay.url, user_credentials=str(files[other])),
        )

    took, again, other_answer = asyncio.run(scenario())
    print(f"instance deleted -> its connected client dropped: {took * 1000:.0f} ms (sweep every 0.2 s)")
    assert "authorization violation" in again.lower()
    assert other_answer == "connected"  # the live neighbour keeps its identity
    assert wait_for(lambda: h.metrics()["sco_enrol_revoked_total"] == 1, 5, "the revocation counted")
    assert h.state.conn.execute("SELECT count(*) FROM enrolment WHERE revoked_at IS NOT NULL").fetchone()[0] == 1
    # idempotent: another sweep revokes nothing more
    assert h.issuer.revoke_deleted() == []


def kube_says(h: Hall, token: str, node: str) -> tuple[int, dict[str, Any]]:
    """What the stand-in answers the node's token: GET its own Node (the status), and TokenReview's status."""
    req = urllib.request.Request(f"{h.kube.url}/api/v1/nodes/{node}", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            status = r.status
    except urllib.error.HTTPError as e:
        status = e.code
    review = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": token}}
    assert h.issuer.s.kube is not None  # the review asked with the service's own credential
    me = Path(h.issuer.s.kube.token_file).read_text().strip()
    url = f"{h.kube.url}/apis/authentication.k8s.io/v1/tokenreviews"
    ask = urllib.request.Request(url, json.dumps(review).encode(), headers={"Authorization": f"Bearer {me}"})
    with urllib.request.urlopen(ask, timeout=5) as r:
        return status, json.loads(r.read())["status"]


def enrolled(h: Hall, slot: int) -> tuple[str, str, str]:
    """An instance launched and enrolled: (node, server id, its Kubernetes token)."""
    node, server_id, token = h.launch(slot)
    status, body = post(h.url, request(node, server_id, token, ri.NKey.generate("user").public))
    assert status == 200, body
    return node, server_id, json.loads(body)["kube_token"]


def test_a_deleted_instances_node_goes_and_its_bound_token_with_it(make_hall: Callable[..., Hall]) -> None:
    """A hall with no cloud controller manager keeps a gone instance's Node object, and a
    token bound to it works as long as it is there. The sweep deletes that Node (the object enrolment bound the
    token to, by its uid), so the token is refused within the sweep's period."""
    h = make_hall(revoke_every_s=0.2)
    node, server_id, token = enrolled(h, 0)
    neighbour, _, neighbour_token = enrolled(h, 1)
    assert kube_says(h, token, node)[0] == 200
    h.issuer.start_sweeper()
    inst = h.state.by_server(server_id)
    assert inst is not None
    started = time.monotonic()
    h.state.transition(inst.id, "deleted", "instance.deleted", reason="reclaimed")
    wait_for(lambda: kube_says(h, token, node)[0] == 401, 10, "the deleted instance's token refused", 0.02)
    took = time.monotonic() - started
    print(f"instance deleted -> its bound Kubernetes token refused: {took * 1000:.0f} ms (sweep every 0.2 s)")
    assert took < 1.0
    status, review = kube_says(h, token, node)
    assert status == 401 and review["authenticated"] is False and "invalidated" in review["error"], review
    assert node not in h.kube.cluster.nodes
    # the live neighbour keeps its Node and its token
    status, review = kube_says(h, neighbour_token, neighbour)
    assert status == 200 and review["authenticated"] is True and review["user"]["username"].endswith(":sco-agent")
    assert wait_for(lambda: h.metrics().get("sco_enrol_nodes_deleted_total") == 1, 5, "the deletion counted")
    (outcome,) = h.state.conn.execute(
        "SELECT node_outcome FROM enrolment WHERE instance_id = %s AND node_done_at IS NOT NULL", (inst.id,)
    ).fetchone()
    assert outcome == "deleted"
    assert h.issuer.revoke_deleted() == []  # idempotent: nothing more to do


def test_nodes_the_api_keeps_refusing_to_delete_never_hold_back_a_relay_revocation(
    make_hall: Callable[..., Hall],
) -> None:
    """The sweep takes a batch of gone instances; one whose relay identity is revoked but whose Node the API keeps
    refusing to delete stays in it. Those must not fill the batch: an identity not revoked yet comes first."""
    from sco.state import enrolment as rows

    h = make_hall()
    _, stuck_server, _ = enrolled(h, 0)
    _, fresh_server, _ = enrolled(h, 1)
    stuck, fresh = h.state.by_server(stuck_server), h.state.by_server(fresh_server)
    assert stuck is not None and fresh is not None and stuck.id < fresh.id
    for inst in (stuck, fresh):
        h.state.transition(inst.id, "deleted", "instance.deleted", reason="reclaimed")
    # the first: revoked on the relay, its Node still there (the API refused the delete)
    h.state.conn.execute("UPDATE enrolment SET revoked_at = clock_timestamp() WHERE instance_id = %s", (stuck.id,))
    both = rows.to_revoke(h.state.conn, HALL, limit=2)  # the stuck one is still due (its Node), the other wholly
    assert {i.instance_id for i in both} == {stuck.id, fresh.id}, both
    (first,) = rows.to_revoke(h.state.conn, HALL, limit=1)
    assert first.instance_id == fresh.id and not first.relay_done


def test_a_node_registered_again_for_another_instance_is_left_alone(make_hall: Callable[..., Hall]) -> None:
    """The Node of the name may belong to someone else by the time the sweep runs: re-created by another kubelet
    (another object: another uid), or taken over by the instance launched into the same slot (the same object, a
    live instance holding the name). Neither is deleted."""
    h = make_hall()
    a, a_id, _ = enrolled(h, 0)
    b, b_id, _ = enrolled(h, 1)
    # a's Node deleted and registered again under the name by another machine: another uid
    h.kube.cluster.delete_node(a)
    again = h.kube.cluster.add_node(a)
    for sid in (a_id, b_id):
        inst = h.state.by_server(sid)
        assert inst is not None
        h.state.transition(inst.id, "deleted", "instance.deleted", reason="reclaimed")
    # b's slot launched again before the sweep ran (its record deleted, a new one live under the same name), and the
    # new kubelet took over the Node object of the name
    b_node_uid = h.kube.cluster.get_node(b)["metadata"]["uid"]
    b2 = h.state.request(HALL, "p", "e", 1, b)
    h.state.transition(b2.id, "launching", "launch.requested", server_id=str(uuid.uuid4()), name=b)
    seen = len(h.kube.cluster.audit)
    assert h.issuer.revoke_deleted() == sorted([a, b])
    assert h.kube.cluster.get_node(a)["metadata"]["uid"] == again["metadata"]["uid"]
    assert h.kube.cluster.get_node(b)["metadata"]["uid"] == b_node_uid
    outcomes = dict(
        h.state.conn.execute(
            "SELECT node, node_outcome FROM enrolment WHERE node_done_at IS NOT NULL AND revoked_at IS NOT NULL"
        ).fetchall()
    )
    assert outcomes == {a: "replaced", b: "replaced"}
    assert not [r for r in h.kube.cluster.audit[seen:] if r["verb"] == "delete" and r["kind"] == "Node"]


ROLE = Path(__file__).resolve().parents[1] / "collections/ansible_collections/sco/orchestrator/roles/kyverno_policies"
PATHS = {
    "Namespace": "/api/v1/namespaces",
    "ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts",
    "Secret": "/api/v1/namespaces/{ns}/secrets",
    "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
    "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
    "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
}


def call(api: KubeApiStandIn, token: str, method: str, path: str, body: Any = None) -> tuple[int, dict[str, Any]]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        f"{api.url}{path}", data=data, method=method,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.fixture
def rbac_api(tmp_path: Path) -> Iterator[tuple[KubeApiStandIn, str]]:
    """The stand-in enforcing RBAC, with role kyverno_policies' RBAC objects applied by a cluster admin (as its
    kubernetes.core.k8s task applies them; the ClusterPolicies are Kyverno's, not modelled by the stand-in)."""
    import yaml

    from sco_devkit.standins.kube_apiserver import Identity

    admin = "admin-" + uuid.uuid4().hex
    api = KubeApiStandIn(tokens={admin: Identity("kubernetes-admin", ("system:masters",))}, rbac=True).start()
    files = yaml.safe_load((ROLE / "vars/main.yml").read_text())["_kyverno_policies_files"]
    for f in files:
        if not f.startswith("rbac/"):
            continue
        obj = yaml.safe_load((ROLE / "files" / f).read_text())
        ns = obj["metadata"].get("namespace", "")
        status, body = call(api, admin, "POST", PATHS[obj["kind"]].format(ns=ns), obj)
        assert status == 201, (f, status, body)
    yield api, admin
    api.stop()


def test_the_enrolment_services_own_identity_does_its_calls_and_nothing_more(
    make_hall: Callable[..., Hall], rbac_api: tuple[KubeApiStandIn, str], tmp_path: Path
) -> None:
    """Role kyverno_policies makes the enrolment service's identity (ServiceAccount sco-system/sco-enrol, get and
    delete Nodes, create tokens for sco-agent only) and its token (a Secret the token controller fills, which the
    role reads back): with that token the service enrols an instance and deletes a gone instance's Node on a server
    enforcing RBAC; anything else is refused 403."""
    import base64

    api, admin = rbac_api
    secret = wait_for(
        lambda: (call(api, admin, "GET", "/api/v1/namespaces/sco-system/secrets/sco-enrol-token")[1].get("data") or {})
        .get("token"), 10, "the token controller's token",
    )  # fmt: skip
    token = base64.b64decode(secret).decode()
    token_file = tmp_path / "enrol.token"
    token_file.write_text(token)
    h = make_hall(api=(api, token_file))
    node, server_id, _ = enrolled(h, 0)  # get nodes, create serviceaccounts/token for sco-agent: allowed
    inst = h.state.by_server(server_id)
    assert inst is not None
    h.state.transition(inst.id, "deleted", "instance.deleted", reason="reclaimed")
    assert h.issuer.revoke_deleted() == [node] and node not in api.cluster.nodes  # delete nodes: allowed
    api.cluster.add_node("other")
    refused = {
        "list nodes": call(api, token, "GET", "/api/v1/nodes"),
        "patch nodes": call(api, token, "PATCH", "/api/v1/nodes/other", {"spec": {"unschedulable": True}}),
        "its own token": call(api, token, "POST", "/api/v1/namespaces/sco-system/serviceaccounts/sco-enrol/token",
                              {"spec": {"expirationSeconds": 3600}}),
        "another account's token": call(
            api, token, "POST", "/api/v1/namespaces/sco-system/serviceaccounts/sco-contract-publisher/token",
            {"spec": {"expirationSeconds": 3600}},
        ),
        "read secrets": call(api, token, "GET", "/api/v1/namespaces/sco-system/secrets/sco-enrol-token"),
        "list pods": call(api, token, "GET", "/api/v1/pods"),
        "make itself a role": call(api, token, "POST", "/apis/rbac.authorization.k8s.io/v1/clusterroles",
                                   {"metadata": {"name": "x"}, "rules": []}),
    }  # fmt: skip
    for what, (status, body) in refused.items():
        assert status == 403, (what, status, body)
        assert 'User "system:serviceaccount:sco-system:sco-enrol" cannot' in body["message"], (what, body)
    assert api.cluster.get_node("other")["spec"] == {}
    # a live instance's agent, with the token it got: the drain's calls pass the role's RBAC, deleting a Node does not
    live, _, agent_token = enrolled(h, 1)
    uid = api.cluster.get_node(live)["metadata"]["uid"]
    renew = {"spec": {"expirationSeconds": 3600, "boundObjectRef": {"kind": "Node", "apiVersion": "v1",
                                                                     "name": live, "uid": uid}}}  # fmt: skip
    allowed = {
        "get its node": call(api, agent_token, "GET", f"/api/v1/nodes/{live}"),
        "taint its node": call(api, agent_token, "PATCH", f"/api/v1/nodes/{live}", {"spec": {"unschedulable": True}}),
        "list pods": call(api, agent_token, "GET", f"/api/v1/pods?fieldSelector=spec.nodeName%3D{live}"),
        "renew its token": call(
            api, agent_token, "POST", "/api/v1/namespaces/sco-system/serviceaccounts/sco-agent/token", renew
        ),
    }  # fmt: skip
    assert {k: v[0] for k, v in allowed.items()} == {k: 201 if "renew" in k else 200 for k in allowed}, allowed
    status, body = call(api, agent_token, "DELETE", f"/api/v1/nodes/{live}")
    assert status == 403 and "cannot delete resource" in body["message"], body
    # deleting the Secret takes the service's token back
    assert call(api, admin, "DELETE", "/api/v1/namespaces/sco-system/secrets/sco-enrol-token")[0] == 200
    assert call(api, token, "GET", "/api/v1/nodes/other")[0] == 401


TOKEN_PLAY = """
- name: Role kyverno_policies' step that keeps the enrolment service's token on the controller
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Read the token back from the cluster
      ansible.builtin.include_role:
        name: sco.orchestrator.kyverno_policies
        tasks_from: enrol_token.yml
"""


def test_the_role_reads_the_enrolment_services_token_back_onto_the_controller(
    rbac_api: tuple[KubeApiStandIn, str], tmp_path: Path
) -> None:
    """kubernetes.core.k8s_info against the stand-in (discovery, the Secret read as the role's admin credential):
    the role waits for the token controller to fill Secret sco-enrol-token and writes the token to the controller,
    0600; the token is the enrolment service's own. Nothing made by hand."""
    import os
    import subprocess
    import sys

    api, admin = rbac_api
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "credentials" / "kubernetes" / "enrol.token"
    (tmp_path / "play.yml").write_text(TOKEN_PLAY)
    ev = {
        "ansible_python_interpreter": sys.executable, "kyverno_policies_host": api.url,
        "kyverno_policies_api_key": admin, "kyverno_policies_enrol_token_file": str(out),
    }  # fmt: skip
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(root / "collections"), "ANSIBLE_NOCOLOR": "1",
           "PATH": f"{bin_dir}:{os.environ['PATH']}"}  # fmt: skip

    def play(**more: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(bin_dir / "ansible-playbook"), "-i", "localhost,", "-c", "local", "play.yml", "-e",
             json.dumps({**ev, **more})],
            capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
        )  # fmt: skip

    p = play()
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    token = out.read_text()
    assert token not in p.stdout and out.stat().st_mode & 0o777 == 0o600
    assert out.parent.stat().st_mode & 0o777 == 0o700
    assert api.tokens is not None and api.tokens[token].user == "system:serviceaccount:sco-system:sco-enrol"
    # no token controller's token (the account gone): one line saying what to look at, nothing written
    assert call(api, admin, "DELETE", "/api/v1/namespaces/sco-system/serviceaccounts/sco-enrol")[0] == 200
    assert call(api, admin, "DELETE", "/api/v1/namespaces/sco-system/secrets/sco-enrol-token")[0] == 200
    names = {"kubernetes.io/service-account.name": "sco-enrol"}
    secret = {
        "metadata": {"name": "sco-enrol-token", "annotations": names},
        "type": "kubernetes.io/service-account-token",
    }
    assert call(api, admin, "POST", "/api/v1/namespaces/sco-system/secrets", secret)[0] == 201
    p = play(kyverno_policies_enrol_token_file=str(tmp_path / "other.token"), kyverno_policies_enrol_token_wait=2)
    assert p.returncode != 0 and not (tmp_path / "other.token").exists()
    assert "Secret sco-system/sco-enrol-token holds no token after 2 s" in p.stdout, p.stdout[-3000:]
    assert "token controller (kube-controller-manager)" in p.stdout


def test_the_agent_enrols_at_first_boot_and_connects(make_hall: Callable[..., Hall], tmp_path: Path) -> None:
    h = make_hall()
    node, server_id, token = h.launch(0)
    metadata = MetadataServer(node)
    metadata.doc["uuid"] = server_id
    agent = AgentEnv(
        tmp_path / "agent", h.kube, h.relay.srv, node=node, metadata=metadata,
        enrol_token=token, enrol_url=h.url, nats_ca_file=str(ca_for(h.relay.url)), hall=HALL,
    )  # fmt: skip
    try:
        agent.start()
        agent.wait_subscribed()
        creds = agent.state / "nats.creds"
        kube_token = agent.state / "kube-token"
        assert stat.S_IMODE(creds.stat().st_mode) == 0o600 and stat.S_IMODE(kube_token.stat().st_mode) == 0o600
        assert h.kube.issued[kube_token.read_text().strip()]["node"] == node
        # the agent's own events reach the stream through its own account
        wait_for(lambda: f"sco.events.{HALL}.{node}" in asyncio.run(stream_subjects(h.relay)), 15, "the agent's events")
        assert [e["type"] for e in agent.of("enrol.done")] == ["enrol.done"]
    finally:
        agent.stop()
        metadata.shutdown()
    # a restart does not enrol again: the creds file is there (the token is spent)
    agent.start()
    try:
        agent.wait_subscribed()
        assert len(agent.of("enrol.done")) == 1 and h.metrics()["sco_enrol_issued_total"] == 1
    finally:
        agent.stop()


def test_the_agent_enrols_over_tls_checked_against_the_ca_its_user_data_gave(
    make_hall: Callable[..., Hall], tmp_path: Path
) -> None:
    """The answer carries the node's Kubernetes token: the enrolment port speaks TLS only (a plaintext request gets
    nothing) and the agent checks the certificate against agent.enrol_ca_file, the hall's CA the acquirer writes into
    the user-data. An agent given another CA sends nothing (its token stays unspent) and says why once; given the
    hall's it enrols."""
    hall_ca, other_ca = make_tls(tmp_path / "hall-ca"), make_tls(tmp_path / "other-ca")
    h = make_hall(tls=ServerTls(str(hall_ca[1]), str(hall_ca[2])))
    assert h.url.startswith("https://"), h.url
    assert plaintext_answer(h.server.server_address[1], "/healthz") == b""
    node, server_id, token = h.launch(0)
    metadata = MetadataServer(node)
    metadata.doc["uuid"] = server_id
    common = {"node": node, "metadata": metadata, "enrol_token": token, "enrol_url": h.url,
              "nats_ca_file": str(ca_for(h.relay.url)), "hall": HALL}  # fmt: skip
    wrong = AgentEnv(tmp_path / "wrong", h.kube, h.relay.srv, enrol_ca_file=str(other_ca[0]), **common)
    try:
        wrong.start()
        log = wrong.root / "agent.log"
        wait_for(lambda: "CERTIFICATE_VERIFY_FAILED" in log.read_text(errors="replace"), 20, "the refused handshake")
        time.sleep(3)  # retries meanwhile: said once
        assert log.read_text(errors="replace").count("CERTIFICATE_VERIFY_FAILED") == 1
        assert not (wrong.state / "nats.creds").exists()
        assert h.metrics(hall_ca[0]).get("sco_enrol_issued_total", 0) == 0
    finally:
        wrong.stop()
    agent = AgentEnv(tmp_path / "agent", h.kube, h.relay.srv, enrol_ca_file=str(hall_ca[0]), **common)
    try:
        agent.start()
        agent.wait_subscribed()
        assert h.kube.issued[(agent.state / "kube-token").read_text().strip()]["node"] == node
        assert h.metrics(hall_ca[0])["sco_enrol_issued_total"] == 1
    finally:
        agent.stop()
        metadata.shutdown()


def test_a_launched_instances_user_data_carries_the_enrolment_services_ca(tmp_path: Path) -> None:
    from sco.contract.bundle import Bundle
    from sco.contract.compiler import compile_repo
    from sco.contract.signing import Keyring, generate, sign
    from sco.contract.userdata import ENROL_CA_PATH, render
    from sco.errors import ConfigError
    from tests.conftest import SAMPLE

    key = generate()
    bundle = Bundle.from_bytes(sign(compile_repo(SAMPLE), [key]), Keyring([key.public]))
    ca = make_tls(tmp_path / "pki")[0].read_text()
    doc = yaml.safe_load(render(bundle, [key], [key.public], node_env={ENROL_URL: "https://ctl:8471"}, enrol_ca=ca))
    files = {f["path"]: f for f in doc["write_files"]}
    assert files[ENROL_CA_PATH]["content"] == ca and files[ENROL_CA_PATH]["permissions"] == "0644"
    assert f"SCO_AGENT_ENROL_CA_FILE={ENROL_CA_PATH}\n" in files["/etc/sco/agent.env"]["content"]
    from sco.agent.config import AgentConfig

    assert "enrol_ca_file" in AgentConfig.__dataclass_fields__
    with pytest.raises(ConfigError, match="enrolment CA: not a PEM certificate"):
        render(bundle, [key], [key.public], enrol_ca="not a certificate")


def test_a_normal_first_boot_logs_no_error_and_says_each_wait_once(
    make_hall: Callable[..., Hall], tmp_path: Path
) -> None:
    """A first boot as it goes on a hall: the agent starts before kubelet has registered the Node, so the service
    answers 503 "try again" several times; the NATS link, the token renewal and the preflight wait for the
    credentials enrolment writes. Each of those waits is said once, at info; nothing is an error or a warning."""
    from sco_devkit.standins.logind import LogindStandIn, PrivateBus

    h = make_hall()
    node, server_id, token = h.launch(0)
    h.kube.cluster.delete_node(node)  # kubelet has not registered it yet
    metadata = MetadataServer(node)
    metadata.doc["uuid"] = server_id
    bus = PrivateBus().start()
    logind = LogindStandIn(bus.address, inhibit_delay_max_s=30).start()  # a node's logind, as on a real host
    agent = AgentEnv(
        tmp_path / "agent", h.kube, h.relay.srv, node=node, metadata=metadata,
        enrol_token=token, enrol_url=h.url, nats_ca_file=str(ca_for(h.relay.url)), hall=HALL, logind_bus=bus.address,
    )  # fmt: skip
    h.kube.cluster.delete_node(node)  # AgentEnv registers it: not yet, on a first boot
    try:
        agent.start()
        wait_for(lambda: h.metrics()['sco_enrol_refused_total{reason="not_ready"}'] >= 3, 20, "three 503s")
        h.kube.cluster.add_node(node)  # kubelet registers the node
        agent.wait_subscribed()
        wait_for(lambda: "preflight: all well again" in agent.logtext(), 15, "the preflight with the enrolled token")
        wait_for(lambda: agent.of("enrol.done"), 5, "enrolled")
        time.sleep(1.5)  # the token renewal's next look (1 s while waiting) finds the token
        text = agent.logtext()
    finally:
        agent.stop()
        metadata.shutdown()
        logind.stop()
        bus.stop()
    print(text)
    levels = [line.split(" ", 1)[0] for line in text.splitlines() if line.strip()]
    assert "ERROR" not in levels and "WARNING" not in levels and "CRITICAL" not in levels, text
    for wait in (
        "enrolment at http://127.0.0.1:",  # the service's 503 while the Node is not registered
        "NATS: waiting for enrolment to write",
        "kubernetes token: waiting for enrolment to write",
        "preflight: waiting for enrolment to write the credential",
    ):
        assert text.count(wait) == 1, (wait, text)
    assert "not registered in Kubernetes yet" in text
    assert text.index("enrolled: relay account") < text.index("subscribed to")


def test_a_wait_longer_than_its_bound_is_warned_once(
    make_hall: Callable[..., Hall], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The Node never registered: the wait is said once at info, then once as a warning past the bound (here 1 s,
    WAIT_WARN_S in sco.agent.enrol), never again however often the service answers 503."""
    import logging

    from sco.agent import enrol
    from sco.agent.spool import Spool

    monkeypatch.setattr(enrol, "WAIT_WARN_S", 1.0)
    monkeypatch.setattr(enrol, "RETRY_S", (0.2, 0.4))
    h = make_hall()
    node, server_id, token = h.launch(0)
    h.kube.cluster.delete_node(node)  # never registered
    metadata = MetadataServer(node)
    metadata.doc["uuid"] = server_id
    e = enrol.Enrolment(
        hall=HALL, node=node, url=h.url, token=token, metadata_url=metadata.url, creds_file=tmp_path / "nats.creds",
        kube_token_file=tmp_path / "kube-token", spool=Spool(tmp_path / "spool"),
    )  # fmt: skip

    async def run() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(e.run(stop))
        await asyncio.sleep(2.5)
        stop.set()
        await task

    caplog.set_level(logging.INFO, "sco.agent.enrol")
    try:
        asyncio.run(run())
    finally:
        metadata.shutdown()
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "sco.agent.enrol"]
    assert h.metrics()['sco_enrol_refused_total{reason="not_ready"}'] >= 5
    assert [lvl for lvl, _ in said] == ["INFO", "WARNING"], said
    assert "still waiting after" in said[1][1] and "not registered in Kubernetes yet" in said[1][1]
    assert e.outcome == "pending" and not (tmp_path / "nats.creds").exists()


def test_a_launched_instances_agent_is_a_prometheus_target_until_its_delete(
    make_hall: Callable[..., Hall], tmp_path: Path
) -> None:
    """A launched instance is in no inventory, so role monitoring's static targets never name its agent. The
    enrolment service keeps a file_sd of the live enrolled agents (the address each agent told when it enrolled), and
    the role's Prometheus (Debian's, from exactly the files the role writes) reads it: the agent appears as a
    target of job sco-agent, up, labelled with its node and pool, and leaves once the instance is deleted."""
    from tests.prom import MonitoringDeployment

    targets = tmp_path / "sd" / "agents.json"
    targets.parent.mkdir()
    prom = MonitoringDeployment(tmp_path / "deployed", monitoring_agent_file_sd=[str(targets)]).start()
    h = make_hall(scrape_targets_file=targets, revoke_every_s=0.2)
    h.issuer.start_sweeper()
    node, server_id, token = h.launch(0)
    metadata = MetadataServer(node)
    metadata.doc["uuid"] = server_id
    port = free_port()
    agent = AgentEnv(
        tmp_path / "agent", h.kube, h.relay.srv, node=node, metadata=metadata, enrol_token=token, enrol_url=h.url,
        nats_ca_file=str(ca_for(h.relay.url)), hall=HALL, metrics_listen=f"0.0.0.0:{port}",
    )  # fmt: skip

    def agent_targets() -> list[dict[str, Any]]:
        return [t for t in prom.api("targets")["activeTargets"] if t["labels"]["job"] == "sco-agent"]

    try:
        assert agent_targets() == []
        agent.start()
        wait_for(lambda: agent.of("enrol.done"), 20, "the enrolment")
        (target,) = wait_for(
            lambda: [t for t in agent_targets() if t["health"] == "up"], 30, "the agent scraped", 0.2
        )  # fmt: skip
        # a wildcard listen is told as the address the node reaches the service from (here the loopback)
        assert target["labels"]["instance"] == f"127.0.0.1:{port}"
        assert (target["labels"]["node"], target["labels"]["pool"], target["labels"]["hall"]) == (node, "p", HALL)
        assert prom.api("query", query=f'up{{job="sco-agent",node="{node}"}}')["result"][0]["value"][1] == "1"
        inst = h.state.by_server(server_id)
        assert inst is not None
        started = time.monotonic()
        h.state.transition(inst.id, "deleted", "instance.deleted", reason="reclaimed")
        wait_for(lambda: agent_targets() == [], 15, "the deleted instance's target gone", 0.1)
        print(f"instance deleted -> its agent no longer a Prometheus target: {time.monotonic() - started:.2f} s")
        assert json.loads(targets.read_text()) == []
    finally:
        agent.stop()
        metadata.shutdown()
        prom.stop()


def test_a_refused_agent_says_so_once_and_keeps_the_metadata_channel(
    make_hall: Callable[..., Hall], tmp_path: Path
) -> None:
    h = make_hall()
    node, server_id, _ = h.launch(0)
    metadata = MetadataServer(node)
    metadata.doc["uuid"] = server_id
    agent = AgentEnv(
        tmp_path / "agent", h.kube, h.relay.srv, node=node, metadata=metadata,
        enrol_token="W" * 43, enrol_url=h.url, nats_ca_file=str(ca_for(h.relay.url)), hall=HALL,
    )  # fmt: skip
    try:
        agent.start()
        wait_for(lambda: agent.of("enrol.refused"), 20, "the refusal")
        (refused,) = agent.of("enrol.refused")
        assert "403" in refused["reason"] and "wrong enrolment token" in refused["reason"]
        assert agent.logtext().count("enrolment refused") == 1
        metadata.reclaim("n-1", time.time() + 15)  # the node still hears a notice and drains
        wait_for(lambda: agent.of("notice.accepted"), 15, "the metadata notice")
    finally:
        agent.stop()
        metadata.shutdown()


def test_an_enrolling_agents_configuration_names_where_enrolment_writes(tmp_path: Path) -> None:
    from sco.agent.config import load
    from sco.errors import ConfigError

    trust = tmp_path / "trusted"
    trust.mkdir()
    (trust / "k.pub").write_text("x")
    base = {
        "SCO_AGENT_HALL": HALL, "SCO_AGENT_NODE": "n-1", "SCO_AGENT_STATE_DIR": str(tmp_path / "state"),
        "SCO_AGENT_TRUST_DIR": str(trust), "SCO_AGENT_KUBE_URL": "http://127.0.0.1:1",
    }  # fmt: skip
    enrolling = {**base, "SCO_AGENT_ENROL_TOKEN": "t" * 43, "SCO_AGENT_ENROL_URL": "http://127.0.0.1:8471"}
    cfg = load(None, enrolling)
    assert cfg.enrols and cfg.nats_creds_file == str(tmp_path / "state" / "nats.creds")
    assert cfg.kube_token_file == str(tmp_path / "state" / "kube-token")
    # enrolled before, by a service with no Kubernetes: a restart with the creds and no token file still starts
    Path(cfg.nats_creds_file).parent.mkdir(parents=True)
    Path(cfg.nats_creds_file).write_text("creds")
    assert load(None, enrolling).kube_token_file == cfg.kube_token_file
    with pytest.raises(ConfigError) as e:
        load(None, {**base, "SCO_AGENT_ENROL_TOKEN": "t" * 43})
    assert "enrolment needs both enrol_token and enrol_url" in " ".join(e.value.lines())
    with pytest.raises(ConfigError) as e:
        load(None, {**enrolling, "SCO_AGENT_ENROL_URL": "ftp://x"})
    assert "is not an http(s) URL" in " ".join(e.value.lines())
    assert load(None, base).nats_creds_file == ""  # no enrolment: nothing defaulted


# --- /metrics over TLS on a listener of its own -----------------------------------------------------------------------


def test_the_metrics_are_served_over_tls_only_on_their_own_listener(
    make_hall: Callable[..., Hall], tmp_path: Path
) -> None:
    """With a /metrics listener of its own given a certificate of the hall's CA (what role control_loop gives the
    unit): a scraper checking the hall's CA reads the counters, a scraper checking another CA is refused, a
    plaintext request gets no answer (each failed handshake counted), and the enrolment listener, still plain HTTP
    for the agents, answers /metrics 404 while it enrols."""
    hall_ca, other_ca = make_tls(tmp_path / "hall-ca"), make_tls(tmp_path / "other-ca")
    h = make_hall()
    metrics = MetricsServer(h.server, ("127.0.0.1", 0), tls=ServerTls(str(hall_ca[1]), str(hall_ca[2])))
    threading.Thread(target=metrics.serve_forever, daemon=True).start()
    port = metrics.server_address[1]
    url = f"https://127.0.0.1:{port}/metrics"
    try:
        assert metrics.url == f"https://127.0.0.1:{port}"
        node, server_id, token = h.launch(0)
        assert post(h.url, request(node, server_id, token, ri.NKey.generate("user").public))[0] == 200

        def scrape(ca: Path) -> str:
            ctx = ssl.create_default_context(cafile=str(ca))
            return urllib.request.urlopen(url, timeout=5, context=ctx).read().decode()

        text = scrape(hall_ca[0])
        assert re.search(r"^sco_enrol_issued_total 1$", text, re.M), text
        assert re.search(r"^sco_enrol_metrics_tls_handshake_failures_total 0$", text, re.M), text
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            scrape(other_ca[0])
        assert plaintext_answer(port, "/metrics") == b""
        # the enrolment listener: no counters there any more, enrolment and health as before
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{h.url}/metrics", timeout=5)
        assert e.value.code == 404
        assert urllib.request.urlopen(f"{h.url}/healthz", timeout=5).status == 200
        assert h.url.startswith("http://")
        failed = re.search(r"^sco_enrol_metrics_tls_handshake_failures_total (\d+)$", scrape(hall_ca[0]), re.M)
        assert failed and int(failed.group(1)) == 2, failed  # the other CA's client and the plaintext one
    finally:
        metrics.shutdown()
        metrics.server_close()


def test_a_metrics_certificate_without_its_listener_is_refused_at_start(tmp_path: Path) -> None:
    hall_ca = make_tls(tmp_path / "hall-ca")
    p = subprocess.run(
        [str(BIN / "sco"), "enrol", "serve", "--hall", HALL, "--nats-url", "nats://127.0.0.1:1",
         "--relay-keys", str(tmp_path), "--dsn", "host=127.0.0.1 dbname=none",
         "--metrics-tls-cert-file", str(hall_ca[1]), "--metrics-tls-key-file", str(hall_ca[2])],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert p.returncode != 0 and "--metrics-listen" in p.stderr, p.stdout + p.stderr


def test_prometheus_scrapes_the_enrolment_service_over_tls_with_the_roles_config(
    make_hall: Callable[..., Hall], tmp_path: Path
) -> None:
    """Debian's Prometheus, run from the configuration role monitoring renders with the enrolment service's TLS on
    (job sco-enrol over https, the hall's CA as tls_config.ca_file), scrapes the service's TLS /metrics: up."""
    from tests.prom import PROMTOOL, MonitoringDeployment

    hall_ca = make_tls(tmp_path / "hall-ca")
    h = make_hall()
    metrics = MetricsServer(h.server, ("127.0.0.1", 0), tls=ServerTls(str(hall_ca[1]), str(hall_ca[2])))
    threading.Thread(target=metrics.serve_forever, daemon=True).start()
    root = tmp_path / "monitoring"
    prom = MonitoringDeployment(
        root, monitoring_enrol_targets=[f"127.0.0.1:{metrics.server_address[1]}"], monitoring_enrol_tls=True,
        monitoring_tls_ca=hall_ca[0].read_text(), monitoring_tls_ca_dest=str(root / "sco-ca.crt"),
    )  # fmt: skip
    try:
        jobs = {j["job_name"]: j for j in yaml.safe_load((root / "prometheus.yml").read_text())["scrape_configs"]}
        assert jobs["sco-enrol"]["scheme"] == "https"
        assert jobs["sco-enrol"]["tls_config"] == {"ca_file": str(root / "sco-ca.crt")}
        check = subprocess.run(
            [PROMTOOL, "check", "config", str(root / "prometheus.yml")], capture_output=True, text=True, timeout=60
        )
        assert check.returncode == 0, check.stdout + check.stderr
        prom.start()
        wait_for(
            lambda: prom.api("query", query='up{job="sco-enrol"} == 1')["result"], 30, "sco-enrol up over TLS", 0.5
        )
        got = prom.api("query", query='sco_enrol_issued_total{job="sco-enrol"}')["result"]
        assert [r["value"][1] for r in got] == ["0"], got
    finally:
        prom.stop()
        metrics.shutdown()
        metrics.server_close()


def test_the_roles_prometheus_has_no_enrolment_job_where_no_service_runs(tmp_path: Path) -> None:
    from tests.prom import MonitoringDeployment

    MonitoringDeployment(tmp_path / "m")  # monitoring_enrol_enabled false: a relay in static mode has no service
    jobs = [j["job_name"] for j in yaml.safe_load((tmp_path / "m" / "prometheus.yml").read_text())["scrape_configs"]]
    assert "sco-enrol" not in jobs and "sco-control" in jobs, jobs


def test_an_enrolment_certificate_without_its_key_or_unreadable_is_refused_at_start(tmp_path: Path) -> None:
    hall_ca = make_tls(tmp_path / "hall-ca")
    base = [str(BIN / "sco"), "enrol", "serve", "--hall", HALL, "--nats-url", "nats://127.0.0.1:1",
            "--relay-keys", str(tmp_path), "--dsn", "host=127.0.0.1 dbname=none"]  # fmt: skip
    p = subprocess.run([*base, "--tls-cert-file", str(hall_ca[1])], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "needs both --tls-cert-file and --tls-key-file" in p.stderr, p.stdout + p.stderr
    p = subprocess.run(
        [*base, "--tls-cert-file", str(hall_ca[1]), "--tls-key-file", str(tmp_path / "missing.key")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert p.returncode != 0 and "enrolment TLS:" in p.stderr and "missing.key" in p.stderr, p.stdout + p.stderr
