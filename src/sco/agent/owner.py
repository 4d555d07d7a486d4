"""Whose process is on the checkpoint socket: the pod or Slurm job a client runs in, and that one's contract.

The kernel says which process connected (SO_PEERCRED's pid) and which cgroup it is in; the scheduler says what
runs in that cgroup on this node; the bundle says which contract covers it. A client's own word on its contract
is checked against that, never taken (checkpoint.CheckpointServer refuses a mismatch).

- Kubernetes: kubelet puts every container of a pod under a cgroup named for the pod's UID, with the cgroupfs
  driver ``/kubepods/<qos>/pod<uid>/<container>`` and with the systemd one
  ``/kubepods.slice/kubepods-<qos>.slice/kubepods-<qos>-pod<uid_with_underscores>.slice/...``, both under
  kubelet's ``--cgroup-root`` (``kube_cgroup_root``, "/" by default; nothing else counts: a user may name cgroups
  as it likes in a subtree delegated to it); the UID is matched to a pod the API server has bound to this node.
- Slurm: ``job_<id>`` in the cgroup path slurmstepd makes (proctrack/cgroup), else the root-owned slurmstepd the
  process descends from (proctrack/linuxproc); the job must be running on this node, as the process's own user.
"""

from __future__ import annotations

import pwd
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sco.agent.budget import KubeBudgets, SlurmBudgets
from sco.agent.checkpoint import NotAWorkload, Owner, OwnerUnknown, slurm_job_bound
from sco.contract.bundle import Bundle

if TYPE_CHECKING:
    from sco.schedulers.kube import KubeClient
    from sco.schedulers.slurm import Job, SlurmClient

_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"


def pod_cgroup(root: str = "/") -> re.Pattern[str]:
    """The cgroup path of a pod's processes under kubelet's cgroup root; group 1 the pod's UID."""
    base = re.escape(root.rstrip("/"))
    return re.compile(rf"^\d+:[^:\n]*:{base}/kubepods[^\n]*?[/-]pod({_UID})(?:\.slice)?(?:/|$)", re.M)


def pod_uid_of(pid: int, proc: Path = Path("/proc"), pattern: re.Pattern[str] | None = None) -> str | None:
    """The UID of the pod a process runs in, from its cgroup path (None: not in a pod's cgroup, or gone)."""
    if pid <= 0:
        return None
    try:
        m = (pattern or pod_cgroup()).search((proc / str(pid) / "cgroup").read_text())
    except (OSError, ValueError):
        return None
    return m.group(1).replace("_", "-") if m else None


class KubeOwners:
    """pid -> its pod on this node and the pod's contract (one list of the node's pods a registration)."""

    def __init__(
        self,
        kube: KubeClient,
        node: str,
        bundle: Callable[[], Bundle | None],
        timeout: float,
        cgroup_root: str = "/",
        proc: Path = Path("/proc"),
    ) -> None:
        self.kube, self.node, self.bundle, self.timeout, self.proc = kube, node, bundle, timeout, proc
        self.cgroup_root, self.pattern = cgroup_root, pod_cgroup(cgroup_root)
        self._known: dict[str, dict[str, Any]] = {}  # the node's pods at the last list that answered, by UID

    async def __call__(self, pid: int, peer_uid: int) -> Owner:
        uid = pod_uid_of(pid, self.proc, self.pattern)
        if uid is None:
            where = self.cgroup_root.rstrip("/") + "/kubepods"
            raise NotAWorkload(f"pid {pid} is in no pod's cgroup (under {where})")
        try:
            pods, _ = await self.kube.pods_on_node(self.node, timeout=self.timeout)
            self._known = {str((p.get("metadata") or {}).get("uid")): p for p in pods}
        except Exception as e:  # any failure to ask (timeout, 5xx, refused): not verified, not a verdict
            # a pod the API bound here at its last answer is still this one (a UID is never reused): a workload
            # registering while the API is silent (the fallback path's drain) is not turned away for it
            if uid not in self._known:
                why = f"{type(e).__name__}: {e}"
                raise OwnerUnknown(f"the pods of node {self.node} could not be listed ({why})") from None
        pod = self._known.get(uid)
        if pod is not None:
            md = pod.get("metadata") or {}
            b = KubeBudgets(self.bundle()).contract_for(pod)
            return Owner("pod", f"{md.get('namespace')}/{md.get('name')}", b.contract if b else None)
        raise NotAWorkload(f"pid {pid} is in pod {uid}'s cgroup, and no such pod is bound to node {self.node}")


class SlurmOwners:
    """pid -> its Slurm job running on this node and the job's contract (one squeue a registration)."""

    def __init__(
        self,
        slurm: SlurmClient,
        node: str,
        bundle: Callable[[], Bundle | None],
        timeout: float,
        proc: Path = Path("/proc"),
    ) -> None:
        self.slurm, self.node, self.bundle, self.timeout, self.proc = slurm, node, bundle, timeout, proc
        self._known: dict[int, Job] = {}  # the node's jobs at the last squeue that answered

    async def __call__(self, pid: int, peer_uid: int) -> Owner:
        jid = slurm_job_bound(pid, self.proc)
        if jid is None:
            raise NotAWorkload(f"pid {pid} is in no Slurm job (no job_<id> cgroup, no slurmstepd it descends from)")
        try:
            self._known = {j.id: j for j in await self.slurm.jobs_on_node(self.node)}
        except Exception as e:  # slurmctld silent or refusing: not verified, not a verdict
            if jid not in self._known:  # a job it listed here at its last answer is still this one
                why = f"{type(e).__name__}: {e}"
                raise OwnerUnknown(f"the jobs on node {self.node} could not be listed ({why})") from None
        job = self._known.get(jid)
        if job is not None:
            if not _is_user(peer_uid, job.user):
                raise NotAWorkload(f"pid {pid} runs as uid {peer_uid}, and job {jid} is {job.user}'s")
            b, *_ = SlurmBudgets(self.bundle()).for_job(job.account, job.partition, job.comment, 0.0)
            return Owner("job", str(jid), b.contract if b else None, job=jid)
        raise NotAWorkload(f"pid {pid} is in job {jid}, which is not running on node {self.node}")


def _is_user(uid: int, name: str) -> bool:
    try:
        return pwd.getpwnam(name).pw_uid == uid
    except KeyError:  # squeue prints a uid it has no name for as the number
        return name == str(uid)
