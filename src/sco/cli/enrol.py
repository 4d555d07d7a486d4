"""``sco enrol``: the enrolment service on the control host (a launched instance's one-time token exchanged for its
relay identity and Kubernetes token; the identities of deleted instances taken back)."""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path
from typing import Any

from sco.cli._common import _env
from sco.contract.enrolment import BURST, MAX_PER_ADDRESS, RATE_PER_S
from sco.errors import ConfigError


def _settings(args: argparse.Namespace) -> Any:
    from sco.control.enrolment import KubeSettings, Settings
    from sco.state.db import check_dsn, dsn_from_env

    if not args.hall:
        raise ConfigError("no hall: give --hall HALL or set $SCO_HALL")
    if not args.nats:
        raise ConfigError("no relay: give --nats-url URL or set $SCO_NATS_URL")
    if not args.relay_keys:
        raise ConfigError("no relay keys: give --relay-keys DIR (the hall's operator-mode keys) or $SCO_RELAY_KEYS")
    dsn = dsn_from_env(args.dsn)
    check_dsn(dsn, "--dsn" if args.dsn else "$SCO_DB_DSN")
    kube = None
    if getattr(args, "kube_url", None):
        if not args.kube_token_file:
            raise ConfigError("--kube-url needs --kube-token-file (a credential that may create sco-agent's tokens)")
        kube = KubeSettings(
            args.kube_url, args.kube_token_file, args.kube_ca_file or "", args.kube_namespace,
            args.kube_service_account, args.kube_token_seconds,
        )  # fmt: skip
    return Settings(
        hall=args.hall, dsn=dsn, relay_keys=Path(args.relay_keys), nats_url=args.nats, kube=kube,
        nats_ca_file=getattr(args, "nats_ca_file", None) or "",
        rate_per_s=getattr(args, "rate", RATE_PER_S), burst=getattr(args, "burst", BURST),
        revoke_every_s=getattr(args, "revoke_every", 5.0),
        scrape_targets_file=Path(args.scrape_targets_file) if getattr(args, "scrape_targets_file", None) else None,
    )  # fmt: skip


def _tls_pair(args: argparse.Namespace, prefix: str, what: str) -> Any:
    """A listener's TLS pair from --{prefix}tls-cert-file and --{prefix}tls-key-file (None: plain HTTP)."""
    from sco._tls import ServerTls, TlsSettingError

    attr = prefix.replace("-", "_")
    cert, key = getattr(args, f"{attr}tls_cert_file", None), getattr(args, f"{attr}tls_key_file", None)
    if not cert and not key:
        return None
    if not cert or not key:
        raise ConfigError(f"{what} over TLS needs both --{prefix}tls-cert-file and --{prefix}tls-key-file")
    try:
        return ServerTls(cert, key)
    except TlsSettingError as e:
        raise ConfigError(f"{what} TLS: {e}") from None


def _metrics_tls(args: argparse.Namespace) -> Any:
    """The /metrics listener's TLS pair (None: plain HTTP); a pair without its listener is an error at start-up."""
    if (args.metrics_tls_cert_file or args.metrics_tls_key_file) and not args.metrics_listen:
        raise ConfigError("--metrics-tls-cert-file/--metrics-tls-key-file are for --metrics-listen's listener: give it")
    return _tls_pair(args, "metrics-", "/metrics")


def cmd_enrol_serve(args: argparse.Namespace) -> int:
    from sco.contract.distributor import parse_listen
    from sco.control.enrolment import MAX_CONNECTIONS, EnrolmentServer, Issuer, MetricsServer

    if not 1 <= args.max_per_address <= MAX_CONNECTIONS:
        raise ConfigError(f"--max-per-address {args.max_per_address}: give 1 to {MAX_CONNECTIONS} (the listener's)")
    tls = _metrics_tls(args)
    # TLS only on the enrolment listener too: its answer carries the new node's Kubernetes token
    enrol_tls = _tls_pair(args, "", "enrolment")
    issuer = Issuer(_settings(args))
    metrics: MetricsServer | None = None
    try:
        server = EnrolmentServer(
            issuer, parse_listen(args.listen), verbose=args.verbose, max_per_client=args.max_per_address, tls=enrol_tls
        )
        if args.metrics_listen:
            try:
                metrics = MetricsServer(server, parse_listen(args.metrics_listen), tls=tls)
            except BaseException:
                server.server_close()
                raise
    except BaseException:
        issuer.close()
        raise
    if issuer.s.scrape_targets_file is not None:
        issuer.write_targets()  # at once: Prometheus finds the live agents after a restart too
    issuer.start_sweeper()
    if metrics is not None:
        threading.Thread(target=metrics.serve_forever, name="enrol-metrics", daemon=True).start()

    def stop(*_: object) -> None:  # serve_forever's shutdown must come from another thread
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    where = f"{server.url}/metrics" if metrics is None else f"{metrics.url}/metrics"
    print(f"enrolling hall {args.hall} at {server.url}/v1/enrol (metrics at {where})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        if metrics is not None:
            metrics.shutdown()
            metrics.server_close()
        server.server_close()
        issuer.close()
    return 0


def cmd_enrol_revoke(args: argparse.Namespace) -> int:
    from sco.control.enrolment import Issuer

    issuer = Issuer(_settings(args))
    try:
        done = issuer.revoke_deleted()
    finally:
        issuer.close()
    for node in done:
        print(f"revoked {node}")
    print(f"{len(done)} identit{'y' if len(done) == 1 else 'ies'} revoked")
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hall", default=_env("SCO_HALL"), help="the hall enrolled [$SCO_HALL]")
    p.add_argument("--dsn", default=_env("SCO_DB_DSN"), help="the fleet state's libpq connection string [$SCO_DB_DSN]")
    p.add_argument(
        "--relay-keys", default=_env("SCO_RELAY_KEYS"), metavar="DIR",
        help="the hall's relay keys (operator mode, sco.provider.relay_identity): the seeds operator-signer.nk,"
        " system.nk, system-admin.nk, node-issuer.nk and, each as its .nk or .pub, operator, notices, events"
        " [$SCO_RELAY_KEYS]",
    )  # fmt: skip
    p.add_argument("--nats-url", dest="nats", default=_env("SCO_NATS_URL"), help="the relay(s) [$SCO_NATS_URL]")
    p.add_argument(
        "--nats-ca-file", default=_env("SCO_NATS_CA_FILE"),
        help="the hall's CA the relay's TLS certificate must chain to [$SCO_NATS_CA_FILE]",
    )  # fmt: skip


def register(sub: Any) -> None:
    e = sub.add_parser("enrol", help="launched instances' identities: the enrolment service")
    es = e.add_subparsers(dest="enrol_command", required=True)
    s = es.add_parser("serve", help="answer POST /v1/enrol; revoke deleted instances' identities every few seconds")
    _common(s)
    s.add_argument("--listen", default=_env("SCO_ENROL_LISTEN", "127.0.0.1:8471"), help="HOST:PORT [$SCO_ENROL_LISTEN]")
    s.add_argument(
        "--tls-cert-file", default=_env("SCO_ENROL_TLS_CERT_FILE"), metavar="PATH",
        help="the enrolment listener's certificate (chain): TLS only, a plaintext request gets no answer; read again"
        " when it changes [$SCO_ENROL_TLS_CERT_FILE]",
    )  # fmt: skip
    s.add_argument(
        "--tls-key-file",
        default=_env("SCO_ENROL_TLS_KEY_FILE"),
        metavar="PATH",
        help="its key [$SCO_ENROL_TLS_KEY_FILE]",
    )
    s.add_argument("--kube-url", default=_env("SCO_KUBE_URL"), help="API server; unset: no token [$SCO_KUBE_URL]")
    s.add_argument("--kube-token-file", default=_env("SCO_KUBE_TOKEN_FILE"), help="[$SCO_KUBE_TOKEN_FILE]")
    s.add_argument("--kube-ca-file", default=_env("SCO_KUBE_CA_FILE"), help='CA, or "system" [$SCO_KUBE_CA_FILE]')
    s.add_argument("--kube-namespace", default="sco-system", help="the agent's service account's namespace")
    s.add_argument("--kube-service-account", default="sco-agent", help="the agent's service account")
    s.add_argument("--kube-token-seconds", type=int, default=86400, help="first token's lifetime (the agent renews it)")
    s.add_argument(
        "--rate", type=float, default=RATE_PER_S, help="requests a second from one address (bucket of --burst)"
    )
    s.add_argument("--burst", type=int, default=BURST, help="requests one address may make at once before --rate")
    s.add_argument(
        "--max-per-address", type=int, default=MAX_PER_ADDRESS, metavar="N",
        help="connections open at once from one address (instances behind SNAT share one; more are closed at once)",
    )  # fmt: skip
    s.add_argument("--revoke-every", type=float, default=5.0, help="seconds between revocation sweeps")
    s.add_argument(
        "--metrics-listen", default=_env("SCO_ENROL_METRICS_LISTEN"), metavar="HOST:PORT",
        help="serve /metrics on a listener of its own (the enrolment listener then answers it 404); unset: on the"
        " enrolment listener [$SCO_ENROL_METRICS_LISTEN]",
    )  # fmt: skip
    s.add_argument(
        "--metrics-tls-cert-file", default=_env("SCO_ENROL_METRICS_TLS_CERT_FILE"), metavar="PATH",
        help="the /metrics listener's certificate (chain): TLS only, a plaintext request gets no answer; read again"
        " when it changes [$SCO_ENROL_METRICS_TLS_CERT_FILE]",
    )  # fmt: skip
    s.add_argument(
        "--metrics-tls-key-file", default=_env("SCO_ENROL_METRICS_TLS_KEY_FILE"), metavar="PATH",
        help="its key [$SCO_ENROL_METRICS_TLS_KEY_FILE]",
    )  # fmt: skip
    s.add_argument(
        "--scrape-targets-file", default=_env("SCO_ENROL_SCRAPE_TARGETS_FILE"), metavar="PATH",
        help="Prometheus file_sd of the live launched instances' agents (job sco-agent), kept up to date"
        " [$SCO_ENROL_SCRAPE_TARGETS_FILE]",
    )  # fmt: skip
    s.add_argument("--verbose", action="store_true", help="log every request")
    s.set_defaults(func=cmd_enrol_serve)
    r = es.add_parser("revoke", help="one revocation sweep: deleted instances' relay identities taken back")
    _common(r)
    r.set_defaults(func=cmd_enrol_revoke)
