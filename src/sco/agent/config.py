"""Agent settings: a TOML file (``[agent]`` table), each key overridable by ``SCO_AGENT_<KEY>``.

Checked at start: every problem is listed at once (``sco-agent --check-config`` prints them) and the agent
refuses to start with any. No pydantic here: it would cost the agent ~10 MiB of its 40 MiB budget.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import socket
import tempfile
import tomllib
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sco._redact import strip_userinfo
from sco.errors import ConfigError, Problem

_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
# A Kubernetes qualified name (taint keys): [DNS-subdomain prefix "/"] name of at most 63 characters. The API answers
# 422 to anything else, and the taint patch also carries the cordon: a bad key would leave the node schedulable.
_QUALIFIED_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def taint_key_problem(key: str) -> str | None:
    prefix, _, name = key.rpartition("/")
    if (
        "/" in prefix
        or not _QUALIFIED_NAME.match(name)
        or (prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)))
    ):
        return f"{key!r} is not a valid taint key ([DNS subdomain/]name, name at most 63 of A-Z a-z 0-9 - _ .)"
    return None


@dataclass(frozen=True)
class AgentConfig:
    hall: str = ""
    """Hall (site) this node belongs to; must match the bundle's hall."""
    node: str = ""
    """This node's name in the scheduler (Kubernetes node name or Slurm NodeName); unset: the short hostname
    (set but empty is refused: a template that rendered nothing must not drain some other name)."""
    scheduler: str = "kubernetes"
    """kubernetes | slurm: which drain path the node takes."""
    state_dir: Path = Path("/var/lib/sco")
    """Spool (state_dir/spool) and bundle cache (state_dir/bundle) live here."""
    trust_dir: Path = Path("/etc/sco/trusted")
    """Public keys (*.pub) the bundle must be signed by."""
    bundle_url: str = ""
    """Distributor URL of the hall's bundle; empty: only the bundle cloud-init wrote is used."""
    bundle_ca_file: str = ""
    """The hall's CA (PEM) an https distributor's certificate must chain to (a deployed hall's distributor speaks
    TLS only); empty: the system's trust store."""
    nats_url: str = "nats://127.0.0.1:4222"
    """Notice relay and event sink; several URLs comma-separated."""
    nats_user: str = ""
    """The node's own NATS identity, so the relay's permissions apply (subscribe to its notice subject,
    publish to its events subject): user and password, a token, an nkey seed file or a creds file."""
    nats_password: str = ""
    nats_token: str = ""
    nats_nkey_seed_file: str = ""
    nats_creds_file: str = ""
    nats_ca_file: str = ""
    """The hall's CA (PEM) the relay's TLS certificate must chain to (the hall's relays speak TLS only); empty: the
    system's trust store."""
    enrol_token: str = ""
    """A one-time enrolment token (the acquirer writes it into agent.env at launch): with enrol_url, an agent whose
    nats_creds_file does not exist yet exchanges it at start for its relay identity (the creds file, from a key
    made here) and its Kubernetes token (kube_token_file). Unset nats_creds_file / kube_token_file then default to
    state_dir/nats.creds and state_dir/kube-token."""
    enrol_url: str = ""
    """The hall's enrolment service (http(s)://host:port); see enrol_token."""
    enrol_ca_file: str = ""
    """The CA (PEM) an https enrolment service's certificate must chain to (the hall's; the acquirer writes it with
    the user-data); empty: the system's trust store."""
    notice_subject: str = "sco.notice.{hall}.{node}"
    events_subject: str = "sco.events.{hall}.{node}"
    heartbeat_subject: str = "sco.heartbeat.{hall}.{node}"
    heartbeat_seconds: float = 30.0
    """How often the agent says it is alive on heartbeat_subject (a stream keeps the last per node, the control
    loop reads them: sco hall status lists agents not heard); 0: never."""
    metadata_url: str = "http://169.254.169.254/openstack/latest/meta_data.json"
    """Instance metadata polled for a reclaim notice; empty disables the poll."""
    kube_url: str = ""
    """Kubernetes API server URL (kubernetes scheduler)."""
    kube_token_file: str = ""
    """Bearer token file, read again once it changed (a stat before each request), every minute and after a 401."""
    kube_token_renew: int = 1
    """1: renew the service-account token in kube_token_file through TokenRequest once 80% of its lifetime has
    passed, bound to this node (sco.agent.kube.credential); 0: something else rewrites the file."""
    kube_ca_file: str = ""
    """The cluster's CA (PEM); "system" trusts the system store. Required with an https kube_url."""
    kube_kubeconfig: str = ""
    """A kubeconfig (current context: server, CA, token / tokenFile, client certificate) instead of the above."""
    kube_in_cluster: int = 0
    """1: find the API server as a pod does (KUBERNETES_SERVICE_HOST/PORT, the service account's token and CA)."""
    taint_key: str = "sco.dev/reclaim"
    slurm_conf: str = ""
    """slurm.conf for the Slurm commands (SLURM_CONF); empty: the commands' default."""
    slurm_bin_dir: str = ""
    """Where scontrol, scancel and squeue are; empty: $PATH."""
    slurmd_spool_dir: str = "/var/spool/slurmd"
    """This node's SlurmdSpoolDir (%n expanded): its step sockets name the jobs when slurmctld is away."""
    cgroup_root: str = "/sys/fs/cgroup"
    spool_max_bytes: int = 64 * 1024 * 1024
    spool_sync_interval: float = 1.0
    """Longest a routine event stays written but not fdatasync'ed (critical ones are synced at once)."""
    evict_concurrency: int = 16
    """Parallel connections to the API server during a drain."""
    bundle_max_bytes: int = 32 * 1024 * 1024
    """Largest bundle response accepted (the largest bundle measured is ~4 MiB); larger is refused."""
    bundle_fetch_deadline_seconds: float = 30.0
    """One bundle request, connect to last byte; a slower answer is refused and the last good bundle kept."""
    metadata_max_bytes: int = 1024 * 1024
    """Largest instance-metadata response accepted."""
    rearm_check_seconds: float = 5.0
    """After a drain, how often the agent checks whether the node was put back in service (untainted or
    resumed); until then further notices are counted, not drained again."""
    # Overrides of the hall policy in the bundle (tests use short windows); 0 means "from the bundle".
    notice_window_seconds: float = 0
    safety_margin_seconds: float = -1
    metadata_poll_seconds: float = 0
    bundle_refresh_seconds: float = 0
    scheduler_api_timeout_ms: int = 0
    log_level: str = "info"
    kube_fallback: str = "poweroff"
    """Around a silent API server (800 ms): poweroff = take a logind delay inhibitor and power off, so kubelet's
    graceful node shutdown terminates pods by priority; wait = take the inhibitor and wait for the provider's
    shutdown; off = keep retrying the API (no fallback)."""
    logind_bus: str = "unix:path=/run/dbus/system_bus_socket"
    """D-Bus address of the system bus logind is on."""
    metrics_listen: str = "127.0.0.1:9469"
    """host:port of the Prometheus /metrics endpoint (docs/METRICS.md); empty: off. Loopback by default (a
    node-local scraper or a proxy); the node's own address to let a hall Prometheus scrape it directly."""
    metrics_tls_cert_file: str = ""
    metrics_tls_key_file: str = ""
    """/metrics over TLS only, with this certificate (PEM, the hall's CA signed it) and key; read again when they
    change. Both or neither; empty: plain HTTP."""
    preflight_seconds: float = 300.0
    """How often the preflight (node known, credential may patch it and list its pods) runs again; it also
    runs at once whenever the credential file changes."""
    metrics_probe_seconds: float = 60.0
    """How often the agent reads its node from the scheduler API for sco_agent_scheduler_api_up."""
    checkpoint_socket: str = "/run/sco/checkpoint.sock"
    """Unix socket workloads register on to be told of a notice (agent/CHECKPOINT-PROTOCOL.md); empty: none.
    Pods reach it by mounting its directory as a hostPath."""
    checkpoint_group: str = ""
    """The group the checkpoint socket is given (mode 0660): the workloads' users are its members, pods run with
    it as a supplemental group. Empty: the agent's own group (only its own user and group connect)."""
    checkpoint_max_per_uid: int = 128
    """Registrations one uid may hold at once (of the node's 1,024): one user cannot fill the slots."""
    kube_cgroup_root: str = "/"
    """kubelet's --cgroup-root: a checkpoint client is a pod's when its cgroup is under <root>/kubepods."""

    @property
    def enrols(self) -> bool:
        """Whether this agent may enrol (token and URL given); it does so while its creds file does not exist."""
        return bool(self.enrol_token and self.enrol_url)

    @property
    def spool_dir(self) -> Path:
        return self.state_dir / "spool"

    @property
    def bundle_dir(self) -> Path:
        return self.state_dir / "bundle"

    def subject(self, template: str) -> str:
        return template.format(hall=self.hall, node=self.node)

    @property
    def inbox_prefix(self) -> str:
        """Where this node takes NATS replies: _INBOX.<hall>.<node>, dots made '_' so the node is one token (the
        relay grants node "a" _INBOX.<hall>.a.>, which must not reach node "a.b"'s inbox). The notice_relay
        role's template makes the same names."""
        return f"_INBOX.{self.hall.replace('.', '_')}.{self.node.replace('.', '_')}"


def _coerce(f: dataclasses.Field[Any], value: Any, where: str, problems: list[Problem]) -> Any:
    typ = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    try:
        if typ == "Path":
            return Path(str(value))
        if typ == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError  # 2.5 connections is a typo, not 2
            return int(value)
        if typ == "float":
            if isinstance(value, bool):
                raise ValueError
            f_value = float(value)
            if not math.isfinite(f_value):
                raise ValueError
            return f_value
        if not isinstance(value, str):
            raise ValueError
        return value
    except (TypeError, ValueError, OverflowError):
        problems.append(
            Problem(
                where,
                f"agent.{f.name}" if where != "environment" else f"SCO_AGENT_{f.name.upper()}",
                f"expected {typ}, got {value!r}",
            )
        )
        return f.default


MAX_CONFIG_BYTES = 1 << 20  # agent.toml is a few KiB


def _read_config(path: Path) -> bytes:
    """The file's bytes; a FIFO or /dev/zero (which hung check-config and run) or an absurd size is refused first."""
    import stat

    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{path}: not a regular file")
        if st.st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: {st.st_size} bytes, more than an agent configuration ({MAX_CONFIG_BYTES})")
        return f.read(MAX_CONFIG_BYTES + 1)


def load(path: Path | None, env: dict[str, str] | None = None) -> AgentConfig:
    """Read the file and the environment; raise ConfigError listing every problem."""
    env = dict(os.environ) if env is None else env
    problems: list[Problem] = []
    raw: dict[str, Any] = {}
    where = str(path) if path else "environment"
    if path is not None:
        try:
            doc = tomllib.loads(_read_config(Path(path)).decode("utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such file") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}): TOML files are UTF-8") from None
        except OSError as e:
            raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None
        unknown_tables = set(doc) - {"agent"}
        for t in sorted(unknown_tables):
            problems.append(Problem(where, t, "unknown table (expected [agent])"))
        table = doc.get("agent", {})
        if not isinstance(table, dict):
            kind = "an array of tables ([[agent]])" if isinstance(table, list) else f"{type(table).__name__}"
            raise ConfigError(f"{path}: agent: expected one [agent] table, got {kind}")
        raw = dict(table)
    fields = {f.name: f for f in dataclasses.fields(AgentConfig)}
    for key in sorted(set(raw) - set(fields)):
        problems.append(Problem(where, f"agent.{key}", "unknown setting"))
    values: dict[str, Any] = {}
    for name, f in fields.items():
        env_key = f"SCO_AGENT_{name.upper()}"
        if env_key in env:
            values[name] = _coerce(f, env[env_key], "environment", problems)
        elif name in raw:
            values[name] = _coerce(f, raw[name], where, problems)
    if "node" not in values:
        values["node"] = socket.gethostname().split(".")[0].lower()
    elif values["node"] == "":
        named = ("environment", "SCO_AGENT_NODE") if "SCO_AGENT_NODE" in env else (where, "agent.node")
        problems.append(Problem(*named, "set but empty: give this node's scheduler name, or unset it for the hostname"))
        values["node"] = "unset"  # reported above; keeps the cross-field checks from repeating it
    cfg = enrolment_defaults(AgentConfig(**values))
    problems += check(cfg, where)
    if problems:
        raise ConfigError(f"{len(problems)} problem(s) in the agent configuration", problems)
    return cfg


def enrolment_defaults(cfg: AgentConfig) -> AgentConfig:
    """An enrolling agent's credential files: where enrolment writes them, unless the configuration names them."""
    if not cfg.enrols:
        return cfg
    more: dict[str, Any] = {}
    others = (cfg.nats_user, cfg.nats_token, cfg.nats_nkey_seed_file)
    if not cfg.nats_creds_file and not any(others):
        more["nats_creds_file"] = str(cfg.state_dir / "nats.creds")
    if cfg.scheduler == "kubernetes" and not (cfg.kube_token_file or cfg.kube_kubeconfig or cfg.kube_in_cluster):
        more["kube_token_file"] = str(cfg.state_dir / "kube-token")
    return dataclasses.replace(cfg, **more) if more else cfg


# SCO_AGENT_* variables that are not settings but are read by the agent's commands.
_OTHER_ENV = frozenset({"SCO_AGENT_CONFIG"})


def unknown_env(env: dict[str, str] | None = None) -> list[str]:
    """SCO_AGENT_* variables that name no setting (SCO_AGENT_NATSURL for SCO_AGENT_NATS_URL): ignored, so a typo
    would silently keep the file's value; the agent warns about each at start and in check-config."""
    env = dict(os.environ) if env is None else env
    known = {f"SCO_AGENT_{f.name.upper()}" for f in dataclasses.fields(AgentConfig)} | _OTHER_ENV
    return sorted(k for k in env if k.startswith("SCO_AGENT_") and k not in known)


def _url(value: str, schemes: tuple[str, ...]) -> bool:
    try:
        u = urllib.parse.urlsplit(value)  # "nats://[::1" raises ValueError (Invalid IPv6 URL)
        u.port  # noqa: B018 - a port such as "abc" or 99999 raises ValueError
    except ValueError:
        return False
    return u.scheme in schemes and bool(u.hostname)


def check(cfg: AgentConfig, where: str = "config") -> list[Problem]:
    """Cross-field checks: errors at start-up, not surprises during a drain."""
    p: list[Problem] = []
    if not _NAME.match(cfg.hall):
        p.append(Problem(where, "agent.hall", f"expected a DNS-style name, got {cfg.hall!r}"))
    if not _NAME.match(cfg.node):
        p.append(Problem(where, "agent.node", f"expected a DNS-style name, got {cfg.node!r}"))
    if (tk := taint_key_problem(cfg.taint_key)) is not None:
        p.append(Problem(where, "agent.taint_key", tk))
    if cfg.scheduler not in ("kubernetes", "slurm"):
        p.append(Problem(where, "agent.scheduler", f"expected kubernetes or slurm, got {cfg.scheduler!r}"))
    direct = cfg.scheduler == "kubernetes" and not cfg.kube_kubeconfig and not cfg.kube_in_cluster
    if direct and not _url(cfg.kube_url, ("http", "https")):
        p.append(Problem(where, "agent.kube_url", "the kubernetes scheduler needs an http(s) API server URL"))
    if direct and cfg.kube_url.startswith("https:") and not cfg.kube_ca_file:
        p.append(
            Problem(
                where, "agent.kube_ca_file", 'https needs the cluster\'s CA file (or "system" for the system store)'
            )
        )
    if cfg.kube_kubeconfig and not Path(cfg.kube_kubeconfig).is_file():
        p.append(Problem(where, "agent.kube_kubeconfig", f"{cfg.kube_kubeconfig}: no such file"))
    for u in filter(None, cfg.nats_url.split(",")):
        if not _url(u.strip(), ("nats", "tls")):
            p.append(Problem(where, "agent.nats_url", f"{strip_userinfo(u.strip())!r} is not a nats:// URL"))
    if cfg.metadata_url and not _url(cfg.metadata_url, ("http", "https")):
        p.append(Problem(where, "agent.metadata_url", f"{cfg.metadata_url!r} is not an http(s) URL"))
    if cfg.enrol_url and not _url(cfg.enrol_url, ("http", "https")):
        p.append(Problem(where, "agent.enrol_url", f"{cfg.enrol_url!r} is not an http(s) URL"))
    if bool(cfg.enrol_token) != bool(cfg.enrol_url):
        p.append(Problem(where, "agent.enrol_token", "enrolment needs both enrol_token and enrol_url"))
    if cfg.enrols and not cfg.nats_creds_file:
        p.append(Problem(where, "agent.enrol_token", "enrolment writes a creds file: it needs nats_creds_file"))
    if cfg.enrols and not cfg.metadata_url:
        p.append(Problem(where, "agent.enrol_token", "enrolment names the instance from metadata_url: set it"))
    if cfg.bundle_url and not _url(cfg.bundle_url, ("http", "https")):
        p.append(Problem(where, "agent.bundle_url", f"{cfg.bundle_url!r} is not an http(s) URL"))
    p += _check_tls_files(cfg, where)
    if cfg.scheduler == "slurm" and cfg.slurm_conf and not Path(cfg.slurm_conf).is_file():
        p.append(Problem(where, "agent.slurm_conf", f"{cfg.slurm_conf}: no such file"))
    if cfg.spool_max_bytes < 64 * 1024:
        p.append(Problem(where, "agent.spool_max_bytes", "must be at least 65536"))
    if not 1 <= cfg.evict_concurrency <= 256:
        p.append(Problem(where, "agent.evict_concurrency", "must be between 1 and 256"))
    if cfg.kube_fallback not in ("poweroff", "wait", "off"):
        p.append(Problem(where, "agent.kube_fallback", f"expected poweroff, wait or off, got {cfg.kube_fallback!r}"))
    if not cfg.logind_bus.startswith(("unix:path=", "unix:abstract=")):
        p.append(Problem(where, "agent.logind_bus", f"expected a unix:path=... D-Bus address, got {cfg.logind_bus!r}"))
    if cfg.metrics_listen:
        from sco.agent.metrics import parse_listen

        try:
            parse_listen(cfg.metrics_listen)
        except ValueError as e:
            p.append(Problem(where, "agent.metrics_listen", f"{e} (empty turns the endpoint off)"))
    if cfg.checkpoint_socket and len(cfg.checkpoint_socket.encode()) > 107:
        p.append(Problem(where, "agent.checkpoint_socket", "a Unix socket path must be at most 107 bytes"))
    # checkpoint_group is not looked up here: role node_agent checks the config before it makes the group (check
    # mode makes none); a group the node lacks is said when the socket is made (checkpoint.unavailable).
    if not cfg.kube_cgroup_root.startswith("/"):
        got = cfg.kube_cgroup_root
        p.append(Problem(where, "agent.kube_cgroup_root", f"expected an absolute cgroup path, got {got!r}"))
    if not 1 <= cfg.checkpoint_max_per_uid <= 1024:
        p.append(Problem(where, "agent.checkpoint_max_per_uid", "expected 1 to 1024"))
    # Intervals: 0 means "from the bundle"; anything else near 0 (or negative) would be a busy loop.
    for name, lo, hi in (
        ("metadata_poll_seconds", 0.5, 300),
        ("bundle_refresh_seconds", 1, 86_400),
        ("notice_window_seconds", 10, 3600),
        ("scheduler_api_timeout_ms", 10, 60_000),
    ):
        v = getattr(cfg, name)
        if v != 0 and not lo <= v <= hi:
            p.append(Problem(where, f"agent.{name}", f"expected 0 (from the bundle) or {lo} to {hi}, got {v}"))
    if cfg.safety_margin_seconds != -1 and not 0 <= cfg.safety_margin_seconds <= 600:
        p.append(Problem(where, "agent.safety_margin_seconds", "expected -1 (from the bundle) or 0 to 600"))
    if not 0.05 <= cfg.rearm_check_seconds <= 300:
        p.append(Problem(where, "agent.rearm_check_seconds", "expected 0.05 to 300 seconds"))
    if cfg.kube_token_renew not in (0, 1):
        p.append(Problem(where, "agent.kube_token_renew", f"expected 0 or 1, got {cfg.kube_token_renew}"))
    if not 1 <= cfg.preflight_seconds <= 86400:
        p.append(Problem(where, "agent.preflight_seconds", "expected 1 to 86400 seconds"))
    if not 1 <= cfg.metrics_probe_seconds <= 3600:
        p.append(Problem(where, "agent.metrics_probe_seconds", "expected 1 to 3600 seconds"))
    if cfg.heartbeat_seconds != 0 and not 1 <= cfg.heartbeat_seconds <= 3600:
        p.append(
            Problem(where, "agent.heartbeat_seconds", f"expected 0 (off) or 1 to 3600, got {cfg.heartbeat_seconds}")
        )
    if not 0.01 <= cfg.spool_sync_interval <= 60:
        p.append(Problem(where, "agent.spool_sync_interval", "expected 0.01 to 60 seconds"))
    if not 1.0 <= cfg.bundle_fetch_deadline_seconds <= 600:
        p.append(Problem(where, "agent.bundle_fetch_deadline_seconds", "expected 1 to 600 seconds"))
    if not 64 * 1024 <= cfg.bundle_max_bytes <= 1 << 30:
        p.append(Problem(where, "agent.bundle_max_bytes", "expected 65536 to 1 GiB"))
    if not 4096 <= cfg.metadata_max_bytes <= 64 << 20:
        p.append(Problem(where, "agent.metadata_max_bytes", "expected 4096 to 64 MiB"))
    p += _check_nats_auth(cfg, where)
    p += _check_state_dir(cfg, where)
    if cfg.log_level not in ("debug", "info", "warning", "error"):
        p.append(Problem(where, "agent.log_level", "expected debug, info, warning or error"))
    if cfg.trust_dir.is_dir() and not os.access(cfg.trust_dir, os.R_OK | os.X_OK):
        # glob finds nothing in a directory it may not read: say so, not "holds no key"
        p.append(Problem(where, "agent.trust_dir", f"{cfg.trust_dir}: this user (uid {os.geteuid()}) may not read it"))
    elif not cfg.trust_dir.is_dir() or not any(cfg.trust_dir.glob("*.pub")):
        p.append(Problem(where, "agent.trust_dir", f"{cfg.trust_dir} holds no *.pub key: no bundle could verify"))
    for name in ("kube_token_file", "kube_ca_file"):
        value = getattr(cfg, name)
        if name == "kube_token_file" and cfg.enrols and value and not Path(value).exists():
            continue  # enrolment writes it (or, with no Kubernetes at the service, nothing: the renewer says so)
        if value and not (name == "kube_ca_file" and value == "system") and not Path(value).is_file():
            p.append(Problem(where, f"agent.{name}", f"{value}: no such file"))
    for name in ("notice_subject", "events_subject"):
        template = getattr(cfg, name)
        try:
            subject = cfg.subject(template)
        except (KeyError, IndexError, ValueError) as e:
            p.append(Problem(where, f"agent.{name}", f"unknown placeholder {e}"))
            continue
        # The node's own subject only: a wildcard would take (or send) other nodes' notices or events.
        if "{node}" not in template or any(c in subject for c in "*> \t"):
            p.append(Problem(where, f"agent.{name}", "must name this node ({node}) and hold no wildcard"))
    return p


def _check_tls_files(cfg: AgentConfig, where: str) -> list[Problem]:
    """The distributor's CA and the metrics endpoint's certificate and key: there, and loading (check-config says
    so now, not a failed fetch or a missing endpoint later)."""
    from sco._tls import ServerTls, TlsSettingError, client_context

    p: list[Problem] = []
    for name in ("bundle_ca_file", "enrol_ca_file"):
        if getattr(cfg, name):
            try:
                client_context(getattr(cfg, name))
            except TlsSettingError as e:
                p.append(Problem(where, f"agent.{name}", str(e)))
    if bool(cfg.metrics_tls_cert_file) != bool(cfg.metrics_tls_key_file):
        p.append(Problem(where, "agent.metrics_tls_cert_file", "give both it and metrics_tls_key_file, or neither"))
    elif cfg.metrics_tls_cert_file:
        try:
            ServerTls(cfg.metrics_tls_cert_file, cfg.metrics_tls_key_file)
        except TlsSettingError as e:
            p.append(Problem(where, "agent.metrics_tls_cert_file", str(e)))
    return p


def _check_nats_auth(cfg: AgentConfig, where: str) -> list[Problem]:
    p: list[Problem] = []
    methods = [
        m
        for m, on in (
            ("nats_user", bool(cfg.nats_user)),
            ("nats_token", bool(cfg.nats_token)),
            ("nats_nkey_seed_file", bool(cfg.nats_nkey_seed_file)),
            ("nats_creds_file", bool(cfg.nats_creds_file)),
        )
        if on
    ]
    if len(methods) > 1:
        p.append(Problem(where, "agent.nats_user", f"give one NATS identity, not {', '.join(methods)}"))
    if cfg.nats_password and not cfg.nats_user:
        p.append(Problem(where, "agent.nats_password", "a password needs nats_user"))
    for name in ("nats_nkey_seed_file", "nats_creds_file", "nats_ca_file"):
        value = getattr(cfg, name)
        if name == "nats_creds_file" and cfg.enrols and not Path(value or "-").exists():
            continue  # enrolment writes it
        if value and not Path(value).is_file():
            kind = "not a regular file" if Path(value).exists() else "no such file"
            p.append(Problem(where, f"agent.{name}", f"{value}: {kind}"))
        elif value and name == "nats_nkey_seed_file" and (problem := nkey_seed_problem(Path(value))):
            p.append(Problem(where, f"agent.{name}", problem))
    return p


MAX_SEED_FILE_BYTES = 4096  # a user seed is 58 characters; anything far larger is not one


def nkey_seed_problem(path: Path) -> str | None:
    """Why ``path`` cannot be the node's nkey seed, as nats-py reads it (the file's bytes, stripped): found here,
    not as ``nkeys.ErrInvalidSeed`` in the NATS task once the agent runs."""
    import stat

    import nkeys  # type: ignore[import-untyped]  # no stubs, no py.typed

    try:
        # O_NONBLOCK: a FIFO swapped in since the caller's is_file() must not hang check-config
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                return f"{path}: not a regular file"
            if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):  # as for the signing keys (sco.contract.signing)
                return f"{path}: the nkey seed is readable by group or others (chmod 600 it)"
            if st.st_size > MAX_SEED_FILE_BYTES:
                return f"{path}: {st.st_size} bytes, not an nkey seed"
            data = bytearray(f.read(MAX_SEED_FILE_BYTES).strip())
    except OSError as e:
        return f"{path}: cannot read: {e.strerror or e}"
    try:
        prefix, _ = nkeys.decode_seed(data)
        nkeys.from_seed(data).wipe()
    except Exception:  # nkeys.ErrInvalidSeed, ErrInvalidPrefixByte, or nacl's refusal of the key bytes
        return f"{path}: not an nkey seed (expected one line SU..., as nsc or nk -gen user writes it)"
    if prefix != nkeys.PREFIX_BYTE_USER:
        kind = {nkeys.PREFIX_BYTE_ACCOUNT: "an account", nkeys.PREFIX_BYTE_OPERATOR: "an operator"}.get(
            prefix, "not a user"
        )
        return f"{path}: {kind} seed; the agent connects as a user (SU...)"
    return None


def _check_state_dir(cfg: AgentConfig, where: str) -> list[Problem]:
    """The spool must be writable with room for its bound: found now, not as a traceback at the first notice."""
    try:
        return _state_dir_problems(cfg, where)
    except OSError as e:  # a directory on the way this user may not search: one line, as run gives
        return [Problem(where, "agent.state_dir", f"{e.filename or cfg.state_dir}: {e.strerror or e}")]


def _state_dir_problems(cfg: AgentConfig, where: str) -> list[Problem]:
    from sco.agent.bundle_cache import BUNDLE_FILE, STATE_FILE
    from sco.agent.spool import CURSOR_FILE, ID_FILE, SPOOL_FILE

    d = cfg.state_dir
    existing = d
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return [Problem(where, "agent.state_dir", f"{existing} is not a directory")]
    files = {d / "spool": (SPOOL_FILE, CURSOR_FILE, ID_FILE), d / "bundle": (BUNDLE_FILE, STATE_FILE)}
    # Everything already there must be this user's to read and write (a state dir left by another user, or by
    # root, is found now: run would stop with the same line). The state dir itself first: what is inside it
    # cannot even be looked at without it.
    for sub in (d, d / "spool", d / "bundle"):
        if not sub.exists():
            continue
        if not sub.is_dir():
            return [Problem(where, "agent.state_dir", f"{sub} is not a directory")]
        # the state dir itself need only be searchable here: whether it takes writes is probed below, and a
        # read-only mount is named so, not "may not use it"
        if not os.access(sub, os.R_OK | os.X_OK if sub == d else os.R_OK | os.W_OK | os.X_OK):
            return [Problem(where, "agent.state_dir", f"{sub}: this user (uid {os.geteuid()}) may not use it")]
        if sub == d:
            continue
        try:
            entries = sorted(sub.iterdir())
        except OSError as e:
            return [Problem(where, "agent.state_dir", f"{sub}: cannot list: {e.strerror or e}")]
        for f in entries:
            if f.name in files[sub] and not f.is_file():
                return [
                    Problem(where, "agent.state_dir", f"{f}: expected a file (the agent's own), found another kind")
                ]
            if f.is_file() and not os.access(f, os.R_OK | os.W_OK):
                return [
                    Problem(where, "agent.state_dir", f"{f}: this user (uid {os.geteuid()}) may not read and write it")
                ]
    probe_dir = next((x for x in (d / "spool", d, existing) if x.is_dir()), existing)
    try:
        with tempfile.TemporaryFile(dir=probe_dir):
            pass
    except OSError as e:
        return [Problem(where, "agent.state_dir", f"{probe_dir} is not writable: {e.strerror or e}")]
    st = os.statvfs(probe_dir)
    free = st.f_bavail * st.f_frsize
    with contextlib.suppress(OSError):
        free += (d / "spool" / "events.spool").stat().st_size  # the spool's own bytes count as room
    if free < cfg.spool_max_bytes:
        return [
            Problem(
                where,
                "agent.state_dir",
                f"{probe_dir} has {free // 1024} KiB free, less than the spool bound "
                f"(spool_max_bytes {cfg.spool_max_bytes // 1024} KiB)",
            )
        ]
    return []


SAMPLE = """\
# /etc/sco/agent.toml: the node agent's settings. Every key can be overridden by SCO_AGENT_<KEY>.
[agent]
hall = "local"
node = "node-1"
scheduler = "kubernetes"            # kubernetes | slurm
state_dir = "/var/lib/sco"          # spool/ and bundle/ live here
trust_dir = "/etc/sco/trusted"      # *.pub keys the bundle must be signed by
bundle_url = "http://127.0.0.1:8470/v1/halls/local/bundle.json"
bundle_ca_file = ""                 # the hall's CA an https distributor's certificate must chain to
nats_url = "nats://127.0.0.1:4222"
# The node's own NATS identity (one of): nats_user + nats_password, nats_token, nats_nkey_seed_file, nats_creds_file
nats_creds_file = ""                # e.g. /etc/sco/nats/node-1.creds
nats_ca_file = ""                   # the hall's CA the relay's certificate must chain to, e.g. /etc/sco/nats/ca.crt
metadata_url = "http://169.254.169.254/openstack/latest/meta_data.json"
# enrol_token / enrol_url / enrol_ca_file: written into agent.env by the acquirer at launch (SCO_AGENT_ENROL_*)
kube_url = "https://127.0.0.1:6443"
kube_token_file = ""                # e.g. /var/lib/sco/kube-token: a node-bound token, its own node only (renewed)
kube_token_renew = 1                # renew that token (TokenRequest, bound to this node) at 80% of its life
kube_ca_file = ""                   # the cluster's CA; "system" for the system store (required with https)
# kube_kubeconfig = "/etc/sco/kubeconfig"   # or: a kubeconfig's current context
# kube_in_cluster = 1                       # or: KUBERNETES_SERVICE_HOST/PORT and the service account
taint_key = "sco.dev/reclaim"
spool_max_bytes = 67108864          # 64 MiB
kube_fallback = "poweroff"          # API silent 800 ms: logind inhibitor + kubelet graceful node shutdown
checkpoint_socket = "/run/sco/checkpoint.sock"  # workloads register here (pods: hostPath /run/sco); "" disables
checkpoint_group = ""               # socket mode 0660 with this group (the workloads' users); "": the agent's own
checkpoint_max_per_uid = 128        # registrations one uid may hold at once (of 1,024)
metrics_listen = "127.0.0.1:9469"  # Prometheus /metrics (docs/METRICS.md); "" turns it off
metrics_tls_cert_file = ""          # /metrics over TLS only: a certificate the hall's CA signed, and its key
metrics_tls_key_file = ""
bundle_max_bytes = 33554432         # larger bundle responses are refused (the last good bundle stays)
bundle_fetch_deadline_seconds = 30  # one bundle request, connect to last byte
"""

__all__ = ["SAMPLE", "AgentConfig", "check", "load", "unknown_env"]
