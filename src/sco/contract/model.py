"""Contract and hall-policy files as people write them (pydantic v2, ``extra="forbid"``).

Stage one of two: these models check shape and single-file rules only and do no I/O. The compiler
(``sco.contract.compiler``) resolves them into the bundle payload and checks cross-contract feasibility.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator
from pydantic.alias_generators import to_camel

API_VERSION = "sco.dev/v1"

NonEmptyStr = Annotated[str, Field(min_length=1)]
# DNS-1123 label: contract names end up in Kubernetes labels, Slurm job fields and NATS subjects.
Name = Annotated[str, Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")]
# strict: YAML's true/false are not numbers (a budget of `true` must not become 1 s), nor are "30" or 30.5.
PositiveInt = Annotated[int, Field(gt=0, strict=True)]
NonNegativeInt = Annotated[int, Field(ge=0, strict=True)]
HOUR = 3600
_LABEL_KEY = re.compile(r"^([a-z0-9.-]+/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_SIGNAL = re.compile(r"^(SIG)?[A-Z0-9]+$")


class Strict(BaseModel):
    """Base for every model that reads a file a person wrote: unknown fields are errors."""

    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True)


class Metadata(Strict):
    name: Name
    description: str = ""
    owner: str = ""
    """Team or person to call about this workload."""


class KubernetesSelector(Strict):
    namespace: Name
    match_labels: dict[str, str] = Field(default_factory=dict)
    """Pods carrying all of these labels (an empty map selects the whole namespace)."""

    @field_validator("match_labels")
    @classmethod
    def _keys(cls, v: dict[str, str]) -> dict[str, str]:
        for key in v:
            if not _LABEL_KEY.match(key):
                raise ValueError(f"{key!r} is not a valid label key")
        return v


class SlurmSelector(Strict):
    account: Name
    partitions: list[NonEmptyStr] = Field(default_factory=list)
    """Partitions the account's jobs may run in under this contract; empty means all."""


# A key prefix in the contract's own bucket: no leading slash, ends with "/" (no "..": a validator).
_PREFIX = r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,199}/$"


class CheckpointStore(Strict):
    """Where the workload's checkpoints go: its own bucket and S3 user on the hall's store (role
    ``checkpoint_store``), the user's access scoped to this prefix."""

    prefix: Annotated[str, Field(pattern=_PREFIX)]
    size_mib: Annotated[PositiveInt, Field(le=10_000_000)] = Field(alias="sizeMiB")
    """The size of one checkpoint: with the hall's measured store throughput, what a save takes."""
    keep: Annotated[PositiveInt, Field(le=1000)] = 3
    """Complete checkpoints kept (older ones are deleted after each save)."""

    @field_validator("prefix")
    @classmethod
    def _no_dotdot(cls, v: str) -> str:
        if ".." in v or "//" in v:
            raise ValueError(f"{v!r}: a prefix has no '..' and no empty segment")
        return v


class Checkpoint(Strict):
    mode: Literal["signal", "none"]
    """signal: the agent signals the workload and waits for its acknowledgement on the agent socket."""
    signal: str = "USR1"
    ack_socket: bool = True
    """Wait for the workload's acknowledgement on the checkpoint socket, not only for its exit."""
    store: CheckpointStore | None = None

    @field_validator("signal")
    @classmethod
    def _signal(cls, v: str) -> str:
        if not _SIGNAL.match(v):
            raise ValueError(f"{v!r} is not a signal name such as USR1 or TERM")
        return v.removeprefix("SIG")


class Requeue(Strict):
    policy: Literal["always", "on-checkpoint", "never"]
    max_requeues: Annotated[NonNegativeInt, Field(le=1000)] = 3


class Fallback(Strict):
    on_demand: bool = False
    """May the control plane place this workload on on-demand capacity when spot is short."""
    spend_cap_per_hour: Annotated[Decimal, Field(ge=0, max_digits=12, decimal_places=2)] = Decimal(0)
    """Most the fallback may spend per hour on this workload, in the hall's currency."""

    @model_validator(mode="after")
    def _cap(self) -> Fallback:
        if self.on_demand and self.spend_cap_per_hour == 0:
            raise ValueError("onDemand fallback needs a spendCapPerHour above 0")
        return self


class Capacity(Strict):
    vcpus: NonNegativeInt = 0
    memory_gib: NonNegativeInt = Field(0, alias="memoryGiB")


class SparkOptions(Strict):
    decommission: bool
    """Executor decommissioning with shuffle and cached-block migration (seed view 19)."""
    fallback_storage_path: str = ""


NAMESPACE_SELECTOR = "namespace-selector"
ACCOUNT_SELECTOR = "account-selector"
SELECTOR_TAGS = frozenset({NAMESPACE_SELECTOR, ACCOUNT_SELECTOR})


def _selector_kind(v: object) -> str:
    # Pick the selector model from its keys so errors name the fields of the one meant.
    if isinstance(v, dict) and "account" in v:
        return ACCOUNT_SELECTOR
    if isinstance(v, SlurmSelector):
        return ACCOUNT_SELECTOR
    return NAMESPACE_SELECTOR


class ContractSpec(Strict):
    scheduler: Literal["kubernetes", "spark", "slurm"]
    selector: Annotated[
        Annotated[KubernetesSelector, Tag(NAMESPACE_SELECTOR)] | Annotated[SlurmSelector, Tag(ACCOUNT_SELECTOR)],
        Discriminator(_selector_kind),
    ]
    tier: Literal[1, 2, 3]
    """1: a floor on committed/reserved capacity; 2: reclaimable, preferred; 3: reclaimable only."""
    drain_budget_seconds: Annotated[PositiveInt, Field(le=HOUR)]
    """Seconds the workload may take to drain once a notice arrives (the eviction grace)."""
    final_write_seconds: Annotated[NonNegativeInt, Field(le=HOUR)] = 0
    """Seconds its checkpoint or preStop needs for the final write, after the drain budget."""
    checkpoint: Checkpoint
    requeue: Requeue
    fallback: Fallback = Field(default_factory=Fallback)
    floor: Capacity | None = None
    """Tier 1 only: the capacity held for this workload on reserved instances."""
    spark: SparkOptions | None = None

    @field_validator("tier", mode="before")
    @classmethod
    def _tier_not_bool(cls, v: object) -> object:
        if isinstance(v, bool):  # True == 1 would pass the Literal
            raise ValueError("expected 1, 2 or 3, not a boolean")
        return v

    @model_validator(mode="after")
    def _by_scheduler(self) -> ContractSpec:
        wants_slurm = self.scheduler == "slurm"
        if wants_slurm != isinstance(self.selector, SlurmSelector):
            need = "account (and partitions)" if wants_slurm else "namespace (and matchLabels)"
            raise ValueError(f"a {self.scheduler} contract's selector needs {need}")
        if self.tier == 1 and self.floor is None:
            raise ValueError("tier 1 contracts need a floor (the reserved capacity they hold)")
        if self.tier != 1 and self.floor is not None:
            raise ValueError("only tier 1 contracts hold a floor")
        if self.spark is not None and self.scheduler != "spark":
            raise ValueError("spark options are only for spark contracts")
        return self


class Contract(Strict):
    api_version: Literal["sco.dev/v1"]
    kind: Literal["WorkloadContract"]
    metadata: Metadata
    spec: ContractSpec


class NoticeKey(Strict):
    """A public key the hall's reclaimer signs notices with (``sco keygen --for notice`` prints this entry)."""

    keyid: Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]
    public: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]

    @model_validator(mode="after")
    def _matches(self) -> NoticeKey:
        from nacl.signing import VerifyKey

        from sco.contract.signing import key_id

        if key_id(VerifyKey(bytes.fromhex(self.public))) != self.keyid:
            raise ValueError("keyid does not match the public key")
        return self


class HallCheckpointStore(Strict):
    endpoint: Annotated[str, Field(pattern=r"^https?://[^\s/]+(/\S*)?$")]
    """The S3 endpoint workloads write checkpoints to (the RGW)."""
    throughput_mib_per_second: Annotated[PositiveInt, Field(le=1_000_000)] = Field(alias="throughputMiBPerSecond")
    """Measured save throughput of one workload to the store (``make bench BENCH=workload_dcp``: DCP save MiB/s)."""


class HallPolicySpec(Strict):
    # Ranges: values outside them are typos or would make the agent busy-loop (a 0 s poll) or wait forever.
    notice_window_seconds: Annotated[PositiveInt, Field(ge=10, le=HOUR)] = 120
    """From the reclaim notice (T) to the instance being gone (T+120 s in production)."""
    safety_margin_seconds: Annotated[NonNegativeInt, Field(le=600)] = 10
    """Kept free at the end of the window for the drain verifier and the final event."""
    first_action_seconds: Annotated[PositiveInt, Field(le=60)] = 2
    """The first drain action must land this soon after the notice (seed view 19)."""
    scheduler_api_timeout_ms: Annotated[PositiveInt, Field(ge=10, le=60_000)] = 800
    """Past this the agent stops asking the scheduler and drains around it."""
    metadata_poll_seconds: Annotated[PositiveInt, Field(le=300)] = 5
    bundle_refresh_seconds: Annotated[PositiveInt, Field(ge=5, le=86_400)] = 60
    bundle_lifetime_seconds: Annotated[PositiveInt, Field(ge=HOUR, le=90 * 24 * HOUR)] | None = None
    """How long a signed bundle stays fresh (its ``expiresAt``); unset: 7 days (sco.contract.compiler). The signer
    re-dates an unchanged bundle once less than half of it is left, so re-signing at least that often keeps nodes
    fresh and rides out a distributor outage of half of it."""
    reserved_capacity: Capacity = Field(default_factory=Capacity)
    """Committed/reserved capacity behind the tier-1 floors."""
    checkpoint_store: HallCheckpointStore | None = None
    """The hall's checkpoint store (Ceph RGW), with its measured throughput."""
    notice_keys: list[NoticeKey] = Field(default_factory=list, max_length=16)
    """Keys whose signature a node accepts on a NATS notice (the metadata channel is the cloud's own path)."""

    @model_validator(mode="after")
    def _margin(self) -> HallPolicySpec:
        if self.safety_margin_seconds >= self.notice_window_seconds:
            raise ValueError("safetyMarginSeconds must be below noticeWindowSeconds")
        if self.scheduler_api_timeout_ms >= self.first_action_seconds * 1000:
            raise ValueError("schedulerApiTimeoutMs must be below firstActionSeconds")
        return self


class HallPolicy(Strict):
    api_version: Literal["sco.dev/v1"]
    kind: Literal["HallPolicy"]
    metadata: Metadata
    spec: HallPolicySpec = Field(default_factory=HallPolicySpec)
