"""Enrolment (issue 28): from an instance's launch record to its node connected to the relay under its own identity.

Real parts: an embedded PostgreSQL (the fleet state, fsync off), an operator-mode nats-server with a full resolver,
the Kubernetes API stand-in (TokenRequest bound to the Node), the enrolment service (``sco.control.enrolment``) over
HTTP. Per enrolment: the acquirer's record and token (``Acquirer._user_data``, the launch's own call) and the server
id recorded (launch); the node's key made, ``POST /v1/enrol`` (the service's transaction, the Node read, the
TokenRequest, the account pushed to the relay), the creds file written (exchange); ``nats.connect`` with the creds,
its notice subscription flushed (connect). No VM boots here: the figure is what enrolment adds to a boot.
Two runs: 20 enrolments one after another, then 20 at once (a batch's first boots together).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import statistics
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.harness import free_port
from tests.relays import HALL, ca_for, start_jwt_relay, tls_for

from sco.contract.enrolment import creds_text
from sco.control.acquirer import ENROL_TOKEN, Acquirer
from sco.control.enrolment import EnrolmentServer, Issuer, KubeSettings, Settings
from sco.provider import relay_identity as ri
from sco.state.fleet import FleetState, Pool

N = 20


def _pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def _ms(values: list[float]) -> dict[str, float]:
    return {"p50_ms": round(statistics.median(values) * 1000, 1), "p99_ms": round(_pct(values, 99) * 1000, 1)}


def _one(
    url: str, relay_url: str, dsn: str, tmp: Path, kube: Any, slot: int, envs: dict[str, dict[str, str]]
) -> dict[str, float]:
    import nats

    t0 = time.monotonic()
    with FleetState(dsn) as state:  # the acquirer's connection (one per launch thread here)

        def render(name: str, own: dict[str, str] | None = None) -> str:
            envs[name] = dict(own or {})
            return "#cloud-config\n"

        acq = Acquirer(None, state, render, enrol_url=url)
        name = f"{HALL}-p-e-{slot}"
        inst = state.request(HALL, "p", "e", slot, name)
        acq._user_data(inst)
        server_id = str(uuid.uuid4())
        state.transition(inst.id, "launching", "launch.requested", server_id=server_id, name=name)
    kube.cluster.add_node(name)
    t1 = time.monotonic()
    key = ri.NKey.generate("user")
    doc = {"hall": HALL, "node": name, "instance_id": server_id, "token": envs[name][ENROL_TOKEN]}
    req = urllib.request.Request(
        f"{url}/v1/enrol", data=json.dumps({**doc, "nkey_public": key.public}).encode(), method="POST"
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        answer = json.loads(r.read())
    creds = tmp / f"{name}.creds"
    creds.write_text(creds_text(answer["nats_user_jwt"], key.seed))
    creds.chmod(0o600)
    t2 = time.monotonic()

    async def connect() -> None:
        nc = await nats.connect(
            relay_url,
            user_credentials=str(creds),
            inbox_prefix=ri.node_inbox(HALL, name),
            connect_timeout=5,
            **tls_for(relay_url),
        )
        await nc.subscribe(f"sco.notice.{HALL}.{name}")
        await nc.flush(timeout=5)
        await nc.close()

    asyncio.run(connect())
    t3 = time.monotonic()
    return {"launch": t1 - t0, "exchange": t2 - t1, "connect": t3 - t2, "total": t3 - t0}


def bench_enrolment() -> Iterator[dict[str, Any]]:
    from sco.state.db import connect, migrate
    from sco.state.embedded import EmbeddedPostgres
    from sco_devkit.standins.kube_apiserver import KubeApiStandIn

    with tempfile.TemporaryDirectory(prefix="sco-enrol-") as d:
        tmp = Path(d)
        pg = EmbeddedPostgres().start()
        relay = start_jwt_relay(tmp)
        kube = KubeApiStandIn().start()
        issuer: Issuer | None = None
        server: EnrolmentServer | None = None
        try:
            pg.create_database("fleet")
            dsn = pg.dsn("fleet")
            with connect(dsn) as c:
                migrate(c)
            with FleetState(dsn) as st:
                st.ensure_pool(Pool(HALL, "p", "m1.small", "img"))
            token, _ = kube.issue_token("sco-system", "sco-enrol")
            kube.add_serviceaccount("sco-system", "sco-agent")
            (tmp / "kube-token").write_text(token)
            issuer = Issuer(
                Settings(
                    hall=HALL, dsn=dsn, relay_keys=tmp / "hall-keys", nats_url=relay.url,
                    nats_ca_file=str(ca_for(relay.url)),
                    kube=KubeSettings(kube.url, str(tmp / "kube-token")), rate_per_s=1000, burst=1000,
                )
            )  # fmt: skip
            # every node of a hall comes from an address of its own; here all 20 "at once" come from 127.0.0.1,
            # past the listener's 16 per address (they would be refused and retried, which is not what is measured)
            server = EnrolmentServer(issuer, ("127.0.0.1", free_port()), max_per_client=2 * N)
            concurrent.futures.ThreadPoolExecutor(1).submit(server.serve_forever)
            envs: dict[str, dict[str, str]] = {}
            runs = {
                "sequential": [_one(server.url, relay.url, dsn, tmp, kube, i, envs) for i in range(N)],
            }
            with concurrent.futures.ThreadPoolExecutor(N) as ex:
                runs["at_once"] = list(
                    ex.map(lambda i: _one(server.url, relay.url, dsn, tmp, kube, N + i, envs), range(N))
                )
            for mode, samples in runs.items():
                yield {
                    "mode": mode,
                    "enrolments": len(samples),
                    "launch_to_connected": _ms([s["total"] for s in samples]),
                    "launch_record": _ms([s["launch"] for s in samples]),
                    "exchange": _ms([s["exchange"] for s in samples]),
                    "connect": _ms([s["connect"] for s in samples]),
                }
            yield {"mode": "metrics", "issued": issuer.metrics.issued, "refused": sum(issuer.metrics.refused.values())}
        finally:
            if server is not None:
                server.shutdown()
                server.server_close()
            if issuer is not None:
                issuer.close()
            kube.stop()
            relay.srv.stop()
            pg.destroy()


BENCHES = {"enrolment": bench_enrolment}
