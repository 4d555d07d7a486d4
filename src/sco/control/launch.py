"""What a pool's servers are created with, and the preflight that checks it against the cloud before a launch.

A pool's ``launch`` options (beside its flavor and image) as a hall writes them::

    - name: spot-a
      flavor: m1.large            # name or id
      image: debian-12            # name or id
      launch:
        networks: [hall-net]      # names or ids; or "auto" (Nova's get-me-a-network) or "none"
        ports: []                 # pre-created ports (one server each: only for a pool of cap 1)
        securityGroups: [sco-node]
        keyName: ops
        serverGroup: {name: spot-a, policy: anti-affinity}   # found by name, created when missing
        availabilityZone: az1
        bootVolume: {sizeGiB: 20, deleteOnTermination: true}   # boot from a volume made from the image

``resolve`` turns names into ids once per run (a flavor, an image, a network is looked up once, not per create)
and returns every problem at once, each naming the pool, the option and what to change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Field

from sco.contract.model import Strict
from sco.control.nova import Meter, cloud_message

POLICIES = ("anti-affinity", "soft-anti-affinity", "affinity", "soft-affinity")


class ServerGroupSpec(Strict):
    name: Annotated[str, Field(min_length=1, max_length=255)]
    policy: Literal["anti-affinity", "soft-anti-affinity", "affinity", "soft-affinity"] = "anti-affinity"


class BootVolumeSpec(Strict):
    size_gib: Annotated[int, Field(gt=0, le=65536, alias="sizeGiB")]
    delete_on_termination: bool = True
    volume_type: str = ""


class LaunchSpec(Strict):
    networks: list[Annotated[str, Field(min_length=1)]] | Literal["auto", "none"] = "auto"
    ports: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list)
    security_groups: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list)
    key_name: str = ""
    server_group: ServerGroupSpec | None = None
    availability_zone: str = ""
    boot_volume: BootVolumeSpec | None = None


@dataclass(frozen=True)
class LaunchParams:
    """A pool's create-call arguments with every name resolved to an id."""

    flavor_id: str
    image_id: str
    networks: Any = "auto"  # "auto", "none" or [{"uuid": ...} | {"port": ...}]
    security_groups: tuple[str, ...] = ()
    key_name: str = ""
    server_group_id: str = ""
    availability_zone: str = ""
    boot_volume: BootVolumeSpec | None = None
    notes: tuple[str, ...] = field(default=())

    def create_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"flavor_id": self.flavor_id, "networks": self.networks}
        if self.boot_volume is not None:
            bdm: dict[str, Any] = {
                "boot_index": 0,
                "uuid": self.image_id,
                "source_type": "image",
                "destination_type": "volume",
                "volume_size": self.boot_volume.size_gib,
                "delete_on_termination": self.boot_volume.delete_on_termination,
            }
            if self.boot_volume.volume_type:
                bdm["volume_type"] = self.boot_volume.volume_type
            kw["block_device_mapping"] = [bdm]
        else:
            kw["image_id"] = self.image_id
        if self.security_groups:
            kw["security_groups"] = [{"name": g} for g in self.security_groups]
        if self.key_name:
            kw["key_name"] = self.key_name
        if self.server_group_id:
            kw["scheduler_hints"] = {"group": self.server_group_id}
        if self.availability_zone:
            kw["availability_zone"] = self.availability_zone
        return kw


def _pick(items: list[Any], want: str) -> list[Any]:
    """Resources whose id is ``want``, else those whose name is."""
    by_id = [i for i in items if getattr(i, "id", None) == want]
    return by_id or [i for i in items if getattr(i, "name", None) == want]


def _names(items: list[Any], n: int = 8) -> str:
    names = sorted({str(getattr(i, "name", None) or i.id) for i in items})
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "") if names else "none"


class Resolver:
    """Looks each kind of resource up once per run (one list call each), then answers every pool from that."""

    def __init__(self, cloud: Any, meter: Meter, *, check: bool = False) -> None:
        self.cloud = cloud
        self.meter = meter
        self.check = check
        self._cache: dict[str, list[Any]] = {}
        self._auto_why: str | None = None  # why Neutron cannot allocate the project a network ("": it can)

    def _all(self, kind: str) -> list[Any]:
        if kind not in self._cache:
            c = self.cloud
            fetch: Callable[[], Any] = {
                "flavor": lambda: c.compute.flavors(details=False),
                "image": lambda: c.image.images(),
                "network": lambda: c.network.networks(),
                # the networks Nova chooses from for "auto": the project's own that are up (Nova asks for
                # admin_state_up: auto-allocation may leave one half built) and the shared ones (an admin's plain
                # list holds every project's networks, and anyone's holds the external ones)
                "nova_network": lambda: [
                    *c.network.networks(project_id=c.current_project_id, is_shared=False, is_admin_state_up=True),
                    *c.network.networks(is_shared=True),
                ],
                "port": lambda: c.network.ports(),
                "security_group": lambda: c.network.security_groups(),
                "keypair": lambda: c.compute.keypairs(),
                "server_group": lambda: c.compute.server_groups(),
                "zone": lambda: c.compute.availability_zones(),
            }[kind]
            if kind in ("flavor", "keypair", "server_group", "zone"):
                self.meter.pay()  # Nova's calls are paid from the shared budget
            self._cache[kind] = list(fetch())
        return self._cache[kind]

    def resolve(
        self, where: str, flavor: str, image: str, spec: LaunchSpec, cap: int
    ) -> tuple[LaunchParams | None, list[str]]:
        problems: list[str] = []

        def one(kind: str, what: str, want: str, hint: str) -> Any:
            try:
                items = self._all(kind)
            except Exception as e:
                problems.append(f"{where}: {what}: {want!r}: the cloud did not answer the lookup: {cloud_message(e)}")
                return None
            found = _pick(items, want)
            if not found:
                problems.append(
                    f"{where}: {what}: no {kind.replace('_', ' ')} {want!r} in this cloud ({hint}: {_names(items)})"
                )
                return None
            if len(found) > 1:
                problems.append(
                    f"{where}: {what}: {len(found)} {kind.replace('_', ' ')}s are named {want!r}: give its id"
                    f" ({', '.join(sorted(f.id for f in found))})"
                )
                return None
            return found[0]

        fl = one("flavor", "flavor", flavor, "its flavors")
        im = one("image", "image", image, "its images") if image else None
        if not image:
            problems.append(f"{where}: image: give the image to boot (name or id)")
        networks: Any = spec.networks
        if spec.networks == "auto" and not spec.ports:
            seen = self._safe("nova_network", where, problems)
            if len(seen) > 1 and "nova_network" in self._cache:
                problems.append(
                    f"{where}: launch.networks: auto picks a network only when the project sees exactly one, and it"
                    f" sees {len(seen)} ({_names(seen)}): give launch.networks"
                )
            elif not seen and "nova_network" in self._cache and (why := self._auto_allocation()):
                problems.append(
                    f"{where}: launch.networks: auto: the project sees no network, and {why}: give launch.networks"
                    ' (a network\'s name or id) or "none", or have the cloud set up auto-allocation (a default'
                    " external network and subnet pool)"
                )
        if isinstance(spec.networks, list):
            nets = [one("network", f"launch.networks[{i}]", n, "its networks") for i, n in enumerate(spec.networks)]
            networks = [{"uuid": n.id} for n in nets if n is not None]
        if spec.ports:
            if cap > 1:
                problems.append(
                    f"{where}: launch.ports: a port attaches to one server and this pool's cap is {cap}:"
                    " give launch.networks instead (Nova makes a port per server)"
                )
            ports = [one("port", f"launch.ports[{i}]", p, "its ports") for i, p in enumerate(spec.ports)]
            for p in ports:
                if p is not None and (getattr(p, "device_id", None) or None):
                    problems.append(f"{where}: launch.ports: port {p.id} is attached to {p.device_id} already")
            networks = (networks if isinstance(networks, list) else []) + [{"port": p.id} for p in ports if p]
        groups = [one("security_group", f"launch.securityGroups[{i}]", g, "its security groups")
                  for i, g in enumerate(spec.security_groups)]  # fmt: skip
        if spec.key_name:
            one("keypair", "launch.keyName", spec.key_name, "the key pairs of this project")
        group_id = ""
        if spec.server_group is not None:
            group_id = self._server_group(where, spec.server_group, problems)
        if spec.availability_zone:
            zones = [
                z for z in self._safe("zone", where, problems) if getattr(z, "name", None) == spec.availability_zone
            ]
            if not zones and "zone" in self._cache:
                problems.append(
                    f"{where}: launch.availabilityZone: no zone {spec.availability_zone!r} in this cloud"
                    f" (its zones: {_names(self._cache['zone'])})"
                )
            elif zones and not (getattr(zones[0], "state", None) or {}).get("available", True):
                problems.append(f"{where}: launch.availabilityZone: zone {spec.availability_zone!r} is not available")
        if spec.boot_volume is not None and not self._has_volumes():
            problems.append(
                f"{where}: launch.bootVolume: this cloud's catalog has no block-storage (Cinder) service, so Nova"
                " cannot make a boot volume: remove bootVolume, or use a cloud with Cinder"
            )
        if problems or fl is None or im is None:
            return None, problems
        return (
            LaunchParams(
                flavor_id=fl.id,
                image_id=im.id,
                networks=networks,
                security_groups=tuple(g.id for g in groups if g is not None),
                key_name=spec.key_name,
                server_group_id=group_id,
                availability_zone=spec.availability_zone,
                boot_volume=spec.boot_volume,
            ),
            [],
        )

    def _safe(self, kind: str, where: str, problems: list[str]) -> list[Any]:
        try:
            return self._all(kind)
        except Exception as e:
            if kind == "nova_network":  # the setting it was for, as every other line of the preflight names
                problems.append(
                    f"{where}: launch.networks: auto: the cloud did not answer the network lookup: {cloud_message(e)}"
                )
            else:
                problems.append(
                    f"{where}: the cloud did not answer the {kind.replace('_', ' ')} lookup: {cloud_message(e)}"
                )
            return []

    def _auto_allocation(self) -> str:
        """Why Neutron cannot allocate this project a network, as Nova's ``auto`` asks it to when the project sees
        none ("" when it can): Neutron's dry run (GET /v2.0/auto-allocated-topology/{project}?fields=dry-run, the
        check Nova makes), once per run. Like every call here it has the connection's deadline (``api_timeout``)."""
        if self._auto_why is None:
            try:
                self.cloud.network.validate_auto_allocated_topology()
                self._auto_why = ""
            except Exception as e:
                code = getattr(e, "status_code", None)
                said = cloud_message(e)
                self._auto_why = (
                    f"Neutron cannot allocate one ({said})"  # its AutoAllocationFailure: "Deployment error: ..."
                    if code == 409
                    else f"this cloud's Neutron has no auto-allocated-topology extension ({said})"
                    if code == 404
                    else f"Neutron refused its auto-allocation check ({said})"
                    if code
                    else f"Neutron did not answer its auto-allocation check ({said})"
                )
        return self._auto_why

    def _has_volumes(self) -> bool:
        try:
            return bool(self.cloud.has_service("block-storage"))
        except Exception:
            return False

    def _server_group(self, where: str, want: ServerGroupSpec, problems: list[str]) -> str:
        found = [g for g in self._safe("server_group", where, problems) if getattr(g, "name", None) == want.name]
        if len(found) > 1:
            problems.append(f"{where}: launch.serverGroup: {len(found)} server groups are named {want.name!r}")
            return ""
        if found:
            g = found[0]
            policy = getattr(g, "policy", None) or (list(getattr(g, "policies", None) or []) or [""])[0]
            if policy != want.policy:
                problems.append(
                    f"{where}: launch.serverGroup: server group {want.name!r} ({g.id}) has policy {policy!r}, the"
                    f" pool asks {want.policy!r}: a group's policy cannot change; give another name"
                )
                return ""
            return str(g.id)
        if self.check:
            return "(would be created)"
        self.meter.pay()
        try:
            g = self.cloud.compute.create_server_group(name=want.name, policy=want.policy)
        except Exception as e:
            problems.append(f"{where}: launch.serverGroup: creating {want.name!r}: {cloud_message(e)}")
            return ""
        self._cache["server_group"].append(g)
        return str(g.id)
