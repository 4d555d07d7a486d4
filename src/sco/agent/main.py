"""``sco-agent``: the node agent's command.

    sco-agent run --config /etc/sco/agent.toml     run the agent (systemd: Type=notify)
    sco-agent check-config --config FILE [--api]   print every problem, exit 5 if any; asks the Kubernetes
                                                   API whether it knows the node and lets the credential
                                                   patch it (with --api, a refusal exits 5 too)
    sco-agent sample-config                        a commented agent.toml
    sco-agent events --state-dir DIR [--after N] [--unpublished]
                                                   the spooled events, one JSON object per line; the
                                                   unpublished backlog on stderr
    sco-agent status --state-dir DIR               spool, publication backlog, bundle state, the last
                                                   preflight and the credential's expiry as JSON

Every flag has an environment fallback: --config is $SCO_AGENT_CONFIG.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sco import __version__
from sco import _logging as sco_logging
from sco.agent import config
from sco.errors import ConfigError, ScoError


def status(state_dir: Path) -> dict[str, Any]:
    """What the spool and the bundle cache say, read-only (safe beside a running agent)."""
    from sco.agent.resume import unfinished_drain
    from sco.agent.spool import SPOOL_FILE, read_cursor, read_events

    spool_dir = state_dir / "spool"
    if not spool_dir.is_dir():
        raise ConfigError(f"{spool_dir}: no spool here (is --state-dir right?)")
    published = read_cursor(spool_dir)
    last, records, unpublished = 0, 0, 0
    unwritable: dict[str, Any] | None = None
    notices: dict[str, Any] = {"refused_total": {}, "foreign_traffic_total": {}}
    for ev in read_events(spool_dir):
        records += 1
        last = ev["seq"]
        unpublished += ev["seq"] > published
        if ev["type"] == "spool.unwritable":
            unwritable = ev
        elif ev["type"] == "agent.started":  # the agent's counters start again with each run
            notices = {"refused_total": {}, "foreign_traffic_total": {}}
        elif ev["type"] == "notice.refused":
            notices["refused_total"] = ev.get("refused_total", {})
        elif ev["type"] == "notice.foreign_traffic":
            notices["foreign_traffic_total"] = ev.get("foreign_traffic_total", {})
    try:
        size = (spool_dir / SPOOL_FILE).stat().st_size
    except OSError:
        size = 0
    try:
        bundle = json.loads((state_dir / "bundle" / "state.json").read_text())
        bundle = {k: bundle.get(k) for k in ("serial", "last_outcome", "last_error", "refused", "accepted_at")}
    except (OSError, ValueError):
        bundle = None
    try:  # the running agent's last preflight and its credential's expiry (written by it at each preflight)
        scheduler = json.loads((state_dir / "scheduler.json").read_text())
    except (OSError, ValueError):
        scheduler = None
    _, open_ = unfinished_drain(read_events(spool_dir), "", "")
    return {
        "scheduler": scheduler,
        "spool": {"records": records, "last_seq": last, "bytes": size, "last_unwritable": unwritable},
        "events": {"published_seq": published, "unpublished": unpublished},
        "bundle": bundle,
        "notices": notices,  # as of the agent's last record (this run's): refusals, and foreign traffic counted
        # the drain started and not ended, by the rule a restarted agent resumes by: the upgrade waits for it
        "drain": {"notice": open_.id, "terminate_at": open_.terminate_at} if open_ is not None else None,
    }


def _events(state_dir: Path, after: int, only_unpublished: bool) -> int:
    from sco.agent.spool import read_cursor, read_events

    spool_dir = state_dir / "spool"
    if not spool_dir.is_dir():
        raise ConfigError(f"{spool_dir}: no spool here (is --state-dir right?)")
    published = read_cursor(spool_dir)
    n, backlog = 0, 0
    for ev in read_events(spool_dir, after):
        backlog += ev["seq"] > published
        if only_unpublished and ev["seq"] <= published:
            continue
        n += 1
        print(json.dumps(ev, sort_keys=True))
    print(
        f"sco-agent: {n} event(s) shown; {backlog} not yet published to JetStream (acknowledged through seq"
        f" {published})",
        file=sys.stderr,
    )
    return 0


def _config_path(args: argparse.Namespace) -> Path | None:
    value = args.config or os.environ.get("SCO_AGENT_CONFIG")
    return Path(value) if value else None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sco-agent", description="SCO node agent")
    p.add_argument("--version", action="version", version=f"sco-agent {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the agent")
    r.add_argument("--config", help="agent.toml [$SCO_AGENT_CONFIG]")
    r.add_argument("--check-config", action="store_true", help="check the configuration and exit")
    r.add_argument(
        "--log-format", choices=sco_logging.FORMATS, help="text or json (one object a line) [$SCO_LOG_FORMAT]"
    )
    c = sub.add_parser("check-config", help="check the configuration and exit")
    c.add_argument("--config", help="agent.toml [$SCO_AGENT_CONFIG]")
    c.add_argument(
        "--api",
        action="store_true",
        help="fail (exit 5) when the API server does not know the node or refuses the credential",
    )
    sub.add_parser("sample-config", help="print a commented agent.toml")
    e = sub.add_parser("events", help="print spooled events as JSON lines")
    e.add_argument("--state-dir", default=os.environ.get("SCO_AGENT_STATE_DIR", "/var/lib/sco"))
    e.add_argument("--after", type=int, default=0, help="only events with a higher seq")
    e.add_argument("--unpublished", action="store_true", help="only events JetStream has not acknowledged")
    st = sub.add_parser(
        "status", help="spool, publication backlog, bundle state, last preflight and credential expiry as JSON"
    )
    st.add_argument("--state-dir", default=os.environ.get("SCO_AGENT_STATE_DIR", "/var/lib/sco"))
    args = p.parse_args(argv)
    unknown = config.unknown_env() if args.cmd in ("run", "check-config") else []

    try:
        if args.cmd == "sample-config":
            sys.stdout.write(config.SAMPLE)
            return 0
        if args.cmd == "events":
            return _events(Path(args.state_dir), args.after, args.unpublished)
        if args.cmd == "status":
            print(json.dumps(status(Path(args.state_dir)), indent=2, sort_keys=True))
            return 0
        for name in unknown:  # before the configuration's own errors: a typo may be their cause
            print(f"sco-agent: warning: environment: {name}: unknown setting, ignored", file=sys.stderr)
        cfg = config.load(_config_path(args))
        # the trusted keys as run reads them: a corrupt one is exit 4 here as there, one line
        from sco.contract.signing import Keyring

        Keyring.from_dir(cfg.trust_dir)
        if args.cmd == "check-config" or args.check_config:
            print(f"{_config_path(args) or 'environment'}: ok (node {cfg.node}, hall {cfg.hall}, {cfg.scheduler})")
            if cfg.scheduler != "kubernetes":
                return 0
            problems = asyncio.run(_kube_preflight(cfg))
            strict = getattr(args, "api", False)
            for line in problems:
                print(f"sco-agent: {'error' if strict else 'warning'}: kubernetes: {line}", file=sys.stderr)
            if not problems:
                print(f"kubernetes: ok (the API server knows node {cfg.node}; the credential may patch it)")
            return 5 if problems and strict else 0
        try:  # SCO_LOG_FORMAT=json or --log-format json: one JSON object per line
            sco_logging.setup(cfg.log_level, getattr(args, "log_format", None))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        from sco.agent.daemon import Agent

        try:
            agent = Agent(cfg)
        except OSError as e:  # the state directory changed under us since the check: a line, not a traceback
            raise ConfigError(f"{cfg.state_dir}: cannot set up the spool and bundle cache: {e}") from None
        return asyncio.run(agent.run())
    except ScoError as err:
        for line in err.lines():
            print(f"sco-agent: error: {line}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        return 130


async def _kube_preflight(cfg: config.AgentConfig) -> list[str]:
    """Whether the API server knows this node and lets the credential patch it (a server-side dry run)."""
    from sco.agent.kube.drain import KubePath
    from sco.schedulers.kube import KubeClient, KubeConfigError

    try:
        kube = KubeClient(KubePath.credentials(cfg), timeout=2.0, max_connections=1)
    except (KubeConfigError, OSError, ValueError) as e:
        return [f"credentials: {e}"]
    try:
        return await kube.preflight(cfg.node)
    finally:
        await kube.close()


if __name__ == "__main__":
    sys.exit(main())
