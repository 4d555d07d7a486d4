"""The one unit the control plane plans in.

**1 SCO unit = 1 vCPU = 4 GiB of memory = 1/8 of a GPU**, and a request or a flavour counts as its *dominant*
resource: ``units = max(vCPUs, GiB / 4, 8 x GPUs)``. A pod asking for 1 CPU and 16 GiB is 4 units, because it
takes a quarter of a 4-vCPU, 16-GiB slice whatever CPU it leaves free. Flavours are measured the same way, so a
pool's instance of 8 vCPUs and 32 GiB offers 8 units.

Units are carried as integers in thousandths (``milli-units``): integer sums are associative, so a plan does not
depend on the order in which demand was added up (floats would). A request with no resources at all still needs
room on a node: it counts as ``MIN_REQUEST_MILLI``.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

MILLI = 1000
GIB = 1024**3
MEMORY_PER_UNIT = 4 * GIB
GPU_UNITS = 8
MIN_REQUEST_MILLI = 100

UNIT_DOC = "1 unit = 1 vCPU = 4 GiB memory = 1/8 GPU (dominant resource), carried in milli-units"


def units_milli(cpu_milli: int, memory_bytes: int, gpus: int = 0) -> int:
    """Milli-units of a request or flavour: its dominant resource, rounded up."""
    mem = -(-memory_bytes * MILLI // MEMORY_PER_UNIT)  # ceiling division, integers only
    return max(cpu_milli, mem, gpus * GPU_UNITS * MILLI)


def request_milli(cpu_milli: int, memory_bytes: int, gpus: int = 0) -> int:
    """A workload's request in milli-units, never below ``MIN_REQUEST_MILLI``."""
    return max(MIN_REQUEST_MILLI, units_milli(cpu_milli, memory_bytes, gpus))


def flavor_milli(vcpus: int, ram_mib: int, gpus: int = 0) -> int:
    return units_milli(vcpus * MILLI, ram_mib * 1024 * 1024, gpus)


def fmt(milli: int) -> str:
    """Milli-units as a short decimal ("12.5")."""
    whole, frac = divmod(milli, MILLI)
    return f"{whole}.{frac:03d}".rstrip("0").rstrip(".") if frac else str(whole)


# Kubernetes resource.Quantity suffixes (apimachinery pkg/api/resource): binary and decimal SI.
_SUFFIX = {
    "Ki": Decimal(1024),
    "Mi": Decimal(1024**2),
    "Gi": Decimal(1024**3),
    "Ti": Decimal(1024**4),
    "Pi": Decimal(1024**5),
    "Ei": Decimal(1024**6),
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|)$")


def quantity(value: object) -> Decimal:
    """A Kubernetes quantity ("500m", "1.5Gi", "2", 4) as a Decimal; ValueError names the bad text."""
    text = str(value).strip()
    m = _QUANTITY.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a Kubernetes quantity")
    try:
        number = Decimal(m.group(1))
    except InvalidOperation:
        raise ValueError(f"{text!r} is not a Kubernetes quantity") from None
    if number < 0:
        raise ValueError(f"{text!r} is negative")
    return number * _SUFFIX[m.group(2)]


def slurm_memory_bytes(text: str) -> int:
    """Slurm's memory figures ("3000M", "2G", "512K", "100"; megabytes without a suffix)."""
    text = text.strip()
    scale = {"K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
    if text and text[-1] in scale:
        return int(Decimal(text[:-1]) * scale[text[-1]])
    return int(Decimal(text) * 1024**2)
