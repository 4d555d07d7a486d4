"""The drain-path factory: the one place that asks which scheduler this node runs beside.

It builds the scheduler's client and drain path once at start, and hands the agent a :class:`NodeScheduler`:
the path, whether the node is back in service, and the credential the agent keeps (Kubernetes' token file and
its renewal). Only the chosen scheduler's modules are imported (the other's cost the agent's 40 MiB nothing).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sco.agent.bundle_cache import BundleCache
from sco.agent.checkpoint import CheckpointServer, OwnerFn
from sco.agent.config import AgentConfig
from sco.agent.drain import DrainPath
from sco.agent.metrics import token_expiry
from sco.agent.spool import Spool
from sco.errors import ConfigError

if TYPE_CHECKING:
    from sco.agent.kube.credential import TokenRenewer


@dataclass
class NodeScheduler:
    path: DrainPath
    back_in_service: Callable[[], Awaitable[bool]]
    """Untainted and schedulable again (Kubernetes), or no longer DRAIN (Slurm): a later notice drains again."""
    token_file: Path | None = None
    """The bearer token file the API client reads (Kubernetes), for its expiry in the metrics and status."""
    renewer: TokenRenewer | None = None
    """The bound token's renewal, when the agent renews it (a root task of its own)."""
    signature: Callable[[], Any] = lambda: None
    """Changes when the credential file does: the preflight checks a rotated credential at once."""
    owner_of: OwnerFn | None = None
    """pid -> the pod or job it runs in and that one's contract: what a checkpoint registration is bound to."""

    def credential_state(self) -> dict[str, Any] | None:
        """For ``scheduler.json``: the token file, its expiry and its renewal."""
        if self.token_file is None:
            return None
        out: dict[str, Any] = {"token_file": str(self.token_file), "expiry": token_expiry(self.token_file)}
        if self.renewer is not None:
            out.update(self.renewer.state())
        return out


def node_scheduler(
    cfg: AgentConfig,
    *,
    spool: Spool,
    cache: BundleCache,
    checkpoint: CheckpointServer | None,
    api_timeout: float,
    on_credential_change: Callable[[], None],
) -> NodeScheduler:
    if cfg.scheduler == "slurm":
        return _slurm(cfg, spool, cache, checkpoint, api_timeout)
    return _kubernetes(cfg, spool, cache, checkpoint, api_timeout, on_credential_change)


def _slurm(
    cfg: AgentConfig, spool: Spool, cache: BundleCache, checkpoint: CheckpointServer | None, api_timeout: float
) -> NodeScheduler:
    from sco.agent.owner import SlurmOwners
    from sco.agent.slurm.drain import SlurmPath
    from sco.schedulers.slurm import SlurmClient

    slurm = SlurmClient(slurm_conf=cfg.slurm_conf, bin_dir=cfg.slurm_bin_dir, timeout=api_timeout)
    path = SlurmPath(
        slurm=slurm,
        spool=spool,
        bundle=lambda: cache.bundle,
        node=cfg.node,
        slurmd_spool_dir=Path(cfg.slurmd_spool_dir.replace("%n", cfg.node)),
        cgroup_root=Path(cfg.cgroup_root),
        checkpoint=checkpoint,
    )

    async def back_in_service() -> bool:
        state = await slurm.node_state(cfg.node)
        return "DRAIN" not in state.upper()

    owners = SlurmOwners(slurm, cfg.node, lambda: cache.bundle, api_timeout)
    return NodeScheduler(path, back_in_service, owner_of=owners)


def _kubernetes(
    cfg: AgentConfig,
    spool: Spool,
    cache: BundleCache,
    checkpoint: CheckpointServer | None,
    api_timeout: float,
    on_credential_change: Callable[[], None],
) -> NodeScheduler:
    from sco.agent.inhibit import Logind
    from sco.agent.kube.drain import KubePath
    from sco.agent.kube.node import KubeNodePath
    from sco.agent.owner import KubeOwners
    from sco.schedulers.kube import KubeClient, KubeConfigError

    try:
        kube = KubeClient(KubePath.credentials(cfg), timeout=api_timeout, max_connections=cfg.evict_concurrency)
    except (KubeConfigError, OSError) as e:  # no CA for https, an unreadable kubeconfig
        raise ConfigError(f"kubernetes credentials: {e}") from None
    renewer = None
    if cfg.kube_token_file and cfg.kube_token_renew and not (cfg.kube_in_cluster or cfg.kube_kubeconfig):
        # in-cluster and kubeconfig tokens are kubelet's or a person's to renew; the agent's own file is its
        from sco.agent.kube.credential import TokenRenewer

        renewer = TokenRenewer(
            kube,
            Path(cfg.kube_token_file),
            cfg.node,
            spool,
            timeout=max(2.0, api_timeout),
            on_change=on_credential_change,
        )
    # Spark executors first, a driver last; around a silent API server, logind and kubelet (kube.node).
    path = KubeNodePath(
        kube=kube,
        spool=spool,
        bundle=lambda: cache.bundle,
        node=cfg.node,
        taint_key=cfg.taint_key,
        api_timeout=api_timeout,
        logind=Logind(cfg.logind_bus),
        checkpoint=checkpoint,
        shutdown=cfg.kube_fallback,
    )

    async def back_in_service() -> bool:
        node = await kube.get_node(cfg.node)
        spec = node.get("spec", {})
        tainted = any(t.get("key") == cfg.taint_key for t in spec.get("taints") or [])
        return not tainted and not spec.get("unschedulable")

    owners = KubeOwners(kube, cfg.node, lambda: cache.bundle, max(2.0, api_timeout), cfg.kube_cgroup_root)
    return NodeScheduler(
        path,
        back_in_service,
        token_file=kube.creds.token_file,
        renewer=renewer,
        signature=kube.token_file_signature,
        owner_of=owners,
    )
