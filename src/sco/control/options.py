"""Each control-loop step's options, parsed once from the module's arguments into one typed object.

The modules' argument specs (``module_utils/sco_control.py``) check types; these classes turn the checked dict
into what the steps read, and refuse what a type cannot say (a plan that is not the plan module's result, a
negative concurrency), naming the option.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from sco._nats import auth_options
from sco.control.inputs import PlanDocument, parse
from sco.errors import ConfigError, Problem

Params = Mapping[str, Any]


def _result(value: Any, key: str, option: str) -> dict[str, Any]:
    """A module's whole registered result or just its ``key`` part (``plan: "{{ sco_plan }}"`` or ``.plan``)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{option}: expected the {key} module's result (a mapping), not {type(value).__name__}")
    inner = value.get(key)
    return dict(inner) if isinstance(inner, Mapping) else dict(value)


def _number(params: Params, key: str, default: float, said: str | None = None) -> float:
    """``params[key]`` as a float (``default`` when absent), named ``said`` (how the caller spells the option)."""
    v = params.get(key)
    if v is None:
        return default
    try:
        return float(v)
    except (TypeError, ValueError):
        raise ConfigError(f"{said or key}: {v!r} is not a number") from None


def _positive(params: Params, key: str, default: float) -> float:
    f = _number(params, key, default)
    if not f > 0 or f != f or f == float("inf"):
        raise ConfigError(f"{key}: must be a finite number above 0, not {params.get(key)!r}")
    return f


@dataclass(frozen=True)
class CloudOptions:
    """openstack.cloud-style credentials: a clouds.yaml name or dict, or auth; and a deadline on every call."""

    cloud: Any = None
    auth: Mapping[str, Any] | None = None
    auth_type: str | None = None
    region_name: str | None = None
    interface: str | None = None
    validate_certs: bool | None = None
    ca_cert: str | None = None
    api_timeout: float = 60.0

    @classmethod
    def from_params(cls, p: Params) -> CloudOptions:
        return cls(
            cloud=p.get("cloud"),
            auth=p.get("auth"),
            auth_type=p.get("auth_type"),
            region_name=p.get("region_name"),
            interface=p.get("interface"),
            validate_certs=p.get("validate_certs"),
            ca_cert=p.get("ca_cert"),
            api_timeout=_positive(p, "api_timeout", 60.0),
        )

    @property
    def given(self) -> bool:
        """Whether any cloud is named: an option, or the OS_* variables openstacksdk reads."""
        return bool(self.cloud or self.auth or os.environ.get("OS_CLOUD") or os.environ.get("OS_AUTH_URL"))

    def connect(self) -> Any:
        kw: dict[str, Any] = {}
        if isinstance(self.cloud, Mapping):
            kw.update(self.cloud)
        elif self.cloud:
            kw["cloud"] = str(self.cloud)
        if self.auth:
            kw["auth"] = dict(self.auth)
        for opt, sdk in (("auth_type", "auth_type"), ("region_name", "region_name"), ("ca_cert", "cacert")):
            if getattr(self, opt):
                kw[sdk] = getattr(self, opt)
        if self.interface:
            kw["interface"] = self.interface
        if self.validate_certs is not None:
            kw["verify"] = bool(self.validate_certs)
        from sco.provider.cloud import connect

        kw.setdefault("api_timeout", self.api_timeout)  # no call waits for ever on a silent cloud
        return connect(**kw)


@dataclass(frozen=True)
class HallOptions:
    hall: str
    state_dsn: str | None = None
    bundle: str | None = None
    trust: tuple[str, ...] = ()
    trust_dir: str | None = None
    run_id: int | None = None

    @classmethod
    def from_params(cls, p: Params) -> HallOptions:
        return cls(
            hall=str(p.get("hall") or ""),
            state_dsn=p.get("state_dsn"),
            bundle=p.get("bundle"),
            trust=tuple(str(t) for t in p.get("trust") or ()),
            trust_dir=p.get("trust_dir"),
            run_id=p.get("run_id"),
        )


@dataclass(frozen=True)
class DemandOptions:
    hall: HallOptions
    kubernetes: Mapping[str, Any] = field(default_factory=dict)
    slurm: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_params(cls, p: Params) -> DemandOptions:
        return cls(HallOptions.from_params(p), dict(p.get("kubernetes") or {}), dict(p.get("slurm") or {}))


@dataclass(frozen=True)
class ReconcileOptions:
    hall: HallOptions
    cloud: CloudOptions
    concurrency: int = 8
    lock_wait_s: float = 0.0

    @classmethod
    def from_params(cls, p: Params) -> ReconcileOptions:
        return cls(
            HallOptions.from_params(p),
            CloudOptions.from_params(p),
            int(_positive(p, "concurrency", 8)),
            float(p.get("lock_wait") or 0.0),
        )


@dataclass(frozen=True)
class PlanOptions:
    hall: HallOptions
    cloud: CloudOptions
    document: PlanDocument
    """Pools, settings, reservations, the fleet override and the demand, checked (``sco.control.inputs``)."""
    raw_document: Mapping[str, Any]
    reservations_from: str = "options"
    fleet_given: bool = False
    """A ``fleet`` option overrides the fleet state (tests, what-if plans)."""

    @classmethod
    def from_params(cls, p: Params) -> PlanOptions:
        demand = p.get("demand") or {}
        doc: dict[str, Any] = {
            "pools": p.get("pools") or [],
            "settings": p.get("settings") or {},
            "reservations": p.get("reservations") or [],
            "demand": demand.get("report", demand) if isinstance(demand, Mapping) else demand,
        }
        if p.get("now") is not None:
            doc["now"] = p["now"]
        if p.get("fleet") is not None:
            doc["fleet"] = p["fleet"]
        return cls(
            HallOptions.from_params(p),
            CloudOptions.from_params(p),
            parse(doc, "module options"),
            doc,
            str(p.get("reservations_from") or "options"),
            p.get("fleet") is not None,
        )


def _amount(value: Any, where: str) -> Decimal:
    try:
        d = Decimal(str(value if value is not None else 0))
    except ArithmeticError:
        raise ConfigError(f"{where}: {value!r} is not an amount of money such as 250.00") from None
    if not d.is_finite() or d < 0:
        raise ConfigError(f"{where}: must be a finite amount of at least 0, not {value!r}")
    return d


@dataclass(frozen=True)
class ArbitrateOptions:
    plan: PlanOptions
    plan_doc: Mapping[str, Any]
    ceiling_per_hour: Decimal

    @classmethod
    def from_params(cls, p: Params) -> ArbitrateOptions:
        return cls(
            PlanOptions.from_params(p),
            _result(p.get("plan"), "plan", "plan"),
            _amount(p.get("ceiling_per_hour"), "ceiling_per_hour"),
        )


@dataclass(frozen=True)
class AcquireOptions:
    plan: PlanOptions
    plan_doc: Mapping[str, Any]
    arbitration_doc: Mapping[str, Any]
    signing_keys: tuple[str, ...] = ()
    node_env: Mapping[str, str] = field(default_factory=dict)
    concurrency: int = 8
    relay_ca: str = ""
    """The relays' CA (PEM text, read from relay_ca_file): each new instance's user-data carries it."""
    launch_delegation: str = ""
    """The hall root's delegation (a file) for the one launch key in signing_keys: each subset carries it."""
    distributor_ca: str = ""
    """The distributor's CA (PEM text, read from distributor_ca_file): each new instance's user-data carries it."""
    enrol_ca: str = ""
    """An https enrolment service's CA (PEM text, read from enrol_ca_file): each new instance's user-data carries it."""

    @classmethod
    def from_params(cls, p: Params) -> AcquireOptions:
        # the acquirer plans nothing: the pools' configuration is read, no demand or fleet
        base = PlanOptions.from_params({**p, "demand": {}, "fleet": []})
        relay_ca, distributor_ca = _text_file(p, "relay_ca_file"), _text_file(p, "distributor_ca_file")
        return cls(
            base,
            _result(p.get("plan"), "plan", "plan"),
            _result(p.get("arbitration"), "arbitration", "arbitration"),
            tuple(str(k) for k in p.get("signing_keys") or ()),
            {str(k): str(v) for k, v in (p.get("node_env") or {}).items()},
            int(_positive(p, "concurrency", 8)),
            relay_ca,
            str(p.get("launch_delegation") or ""),
            distributor_ca,
            _text_file(p, "enrol_ca_file"),
        )


def _text_file(p: Params, name: str) -> str:
    """The text of the file parameter ``name`` names ("" when none is named)."""
    if not p.get(name):
        return ""
    try:
        return Path(str(p[name])).read_text()
    except OSError as e:
        raise ConfigError(f"{name}: {p[name]}: {e.strerror or e}") from None


@dataclass(frozen=True)
class ReclaimOptions:
    """The reclaim step's options, one type for ``sco reclaim`` and the collection's reclaim module: which nodes,
    the notice window, the relay and its identity, the notice keys, the run's limits.

    Both parse into it (``from_params``) and so refuse the same values with the same line; each line names the
    option as its caller spells it (``said``: the module's key, or the CLI's flag), nothing else differs. What the
    provider's run reads (``sco.provider.reclaim_job.ReclaimSettings``) is made from it by ``settings`` alone."""

    hall: HallOptions
    cloud: CloudOptions
    nodes: tuple[str, ...] = ()
    window: float = 120.0
    before_leases: bool = False
    lease_lookahead: float = 60.0
    """With before_leases: how much further than a window to look (at least the loop's period, so each lease is
    seen a whole window before it starts by one run or the one before)."""
    nats_url: str | None = None
    nats_auth: Mapping[str, Any] = field(default_factory=dict)
    notice_keys: tuple[str, ...] = ()
    lock_wait: float = 0.0
    wait: bool = True
    retry_for: float = 120.0
    finish: bool = False
    """Also finish the hall's reclaims under way (noticed by a run that stopped before T): delete each at its T."""
    call_timeout: float = 30.0
    """Each OpenStack call's deadline around its thread (the connection's own is ``cloud.api_timeout``)."""
    reconnect_for: float = 90.0
    """A fleet state lost mid-run (a Patroni failover) is connected to again, its lock retaken, for this long."""
    names: Mapping[str, str] = field(default_factory=dict, compare=False)
    """How the caller spells each option in its lines (the CLI's flags); the module's key where absent."""

    def said(self, key: str) -> str:
        return self.names.get(key, key)

    @classmethod
    def from_params(cls, p: Params, names: Mapping[str, str] | None = None) -> ReclaimOptions:
        from sco.contract.notice import subject_name_problem
        from sco.provider.reclaim_job import limit_problems  # (psycopg behind it: only for this step)
        from sco.provider.reclaimer import window_problem

        names = dict(names or {})

        def said(key: str) -> str:
            return names.get(key, key)

        window = p.get("window", 120)
        try:
            window_s = float(window)
        except (TypeError, ValueError):
            raise ConfigError(f"{said('window')}: {window!r} is not a number of seconds") from None
        limits = {
            key: _number(p, key, default, said(key))
            for key, default in (
                ("retry_for", 120.0),
                ("call_timeout", 30.0),
                ("lock_wait", 0.0),
                ("reconnect_for", 90.0),
            )
        }
        hall, nodes = str(p.get("hall") or ""), tuple(str(n) for n in p.get("nodes") or ())
        bad = limit_problems(names, **limits)  # the run's own rule, in check mode too
        bad += [
            m
            for m in (
                subject_name_problem(said("hall"), hall),
                *(subject_name_problem(said("nodes"), n) for n in nodes),
            )
            if m
        ]
        # a run that notices; finishing alone keeps each instance's recorded T
        noticing = bool(nodes or p.get("before_leases"))
        if noticing and (problem := window_problem(said("window"), window_s)) is not None:
            bad.append(problem)
        lookahead = _number(p, "lease_lookahead", 60.0, said("lease_lookahead"))
        if not 0 <= lookahead < float("inf"):
            bad.append(
                f"{said('lease_lookahead')}: must be a finite number of 0 or more, not {p.get('lease_lookahead')!r}"
            )
        if bad:
            raise refused(bad)
        keys = tuple(str(k) for k in p.get("notice_keys") or ()) or (
            (os.environ["SCO_NOTICE_KEY"],) if os.environ.get("SCO_NOTICE_KEY") else ()
        )
        return cls(
            hall=HallOptions.from_params(p),
            cloud=CloudOptions.from_params(p),
            nodes=nodes,
            window=window_s,
            before_leases=bool(p.get("before_leases")),
            lease_lookahead=lookahead,
            nats_url=str(p["nats_url"]) if p.get("nats_url") else None,
            nats_auth=nats_auth(p, said),
            notice_keys=keys,
            wait=bool(p.get("wait", True)),
            finish=bool(p.get("finish")),
            names=names,
            **limits,
        )

    @property
    def nats_servers(self) -> list[str]:
        return [s.strip() for s in (self.nats_url or "").split(",") if s.strip()]

    def check_window(self, floor: Any) -> None:
        """The window against the hall's drain floor (its bundle's largest drain budget plus margins), when known."""
        from sco.provider.reclaimer import window_problem

        if (problem := window_problem(self.said("window"), self.window, floor)) is not None:
            raise ConfigError(problem)

    def check_noticing(self) -> None:
        """What a run that sends notices needs: the relay, and a key the agents trust."""
        bad = []
        if not self.nats_url:
            bad.append(f"{self.said('nats_url')}: no notice relay given (the hall's relay the notices go out on)")
        if not self.notice_keys:
            bad.append(
                f"{self.said('notice_keys')}: no notice signing key given (nor $SCO_NOTICE_KEY): agents refuse"
                " unsigned notices"
            )
        if bad:
            raise refused(bad)

    def settings(self, *, nodes: tuple[str, ...], dsn: str, floor: Any, wait: bool) -> Any:
        """The provider's run (``sco.provider.reclaim_job.reclaim``) as these options say, for ``nodes``."""
        from sco.contract.signing import load_private
        from sco.provider.reclaim_job import ReclaimSettings

        return ReclaimSettings(
            hall=self.hall.hall, nodes=nodes, window_s=self.window, nats_url=self.nats_url or "",
            signing_keys=[load_private(Path(k)) for k in self.notice_keys], dsn=dsn, nats_auth=dict(self.nats_auth),
            lock_wait_s=self.lock_wait, wait=wait, floor=floor, retry_for_s=self.retry_for,
            call_timeout_s=self.call_timeout, before_leases=self.before_leases, lease_lookahead_s=self.lease_lookahead,
            reconnect_for_s=self.reconnect_for,
        )  # fmt: skip


def refused(lines: list[str]) -> ConfigError:
    """Several problems as one error, a line each where the CLI prints them (each line begins with its option)."""
    return ConfigError(
        "; ".join(lines), [Problem(where, "", message) for where, message in (x.split(": ", 1) for x in lines)]
    )


def nats_auth(p: Params, said: Any = str) -> dict[str, Any]:
    """The reclaimer's relay identity (nats_creds, nats_nkey_seed, nats_token, or nats_user and nats_password) and
    the CA the relay's certificate must chain to (nats_ca_file) for sco._nats.connect; ``said`` spells an option as
    the caller does."""
    ca = p.get("nats_ca_file")
    if ca and not (os.access(Path(str(ca)), os.R_OK) and Path(str(ca)).is_file()):
        raise ConfigError(f"{said('nats_ca_file')}: {ca}: no readable CA certificate file there")
    seed = p.get("nats_nkey_seed")
    if seed and not p.get("nats_creds"):
        path = Path(str(seed))
        if not os.access(path, os.R_OK) or not path.is_file():  # nats-py would only say the relay is unreachable
            raise ConfigError(f"{said('nats_nkey_seed')}: {path}: no readable nkey seed file there")
    return auth_options(
        creds_file=str(p["nats_creds"]) if p.get("nats_creds") else None,
        nkey_seed_file=str(seed) if seed else None,
        token=str(p["nats_token"]) if p.get("nats_token") else None,
        user=str(p["nats_user"]) if p.get("nats_user") else None,
        password=str(p.get("nats_password") or ""),
        ca_file=str(p["nats_ca_file"]) if p.get("nats_ca_file") else None,
    )


PARSERS: dict[str, Any] = {
    "demand": DemandOptions,
    "reconcile": ReconcileOptions,
    "plan": PlanOptions,
    "arbitrate": ArbitrateOptions,
    "acquire": AcquireOptions,
    "reclaim": ReclaimOptions,
}


def hall_of(opts: Any) -> HallOptions:
    """The hall options of any step's options (arbitrate and acquire hold them in their plan options)."""
    h = getattr(opts, "hall", None)
    return h if isinstance(h, HallOptions) else hall_of(opts.plan)


def parse_options(step: str, params: Params) -> Any:
    return PARSERS[step].from_params(params)
