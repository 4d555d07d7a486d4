"""constraints/control.txt: the exact versions a controller and the execution environment install.

``spot-capacity-orchestrator[control]`` names open ranges (openstacksdk>=4.0, kubernetes>=29, boto3 unbounded), so
two builds a week apart got different packages. The pins are what this checkout's venv resolved and was tested with:
the closure of the roots below, walked through the installed distributions' metadata (markers evaluated for this
Python), each at its installed version. Nothing is fetched, so the file is the same on every run over the same venv.

    python -m sco_devkit.constraints            write constraints/control.txt and its copy (make constraints)
    python -m sco_devkit.constraints --check    exit 1 unless both are what the venv resolves

Used by `make collection` (the wheelhouse, scripts/collection.py) and `make ee` (ee/execution-environment.yml gives
it to every pip of the build as PIP_CONSTRAINT); scripts/setup.sh installs the venv with it, so the tests run what
ships. agent/constraints.txt, the node's, is the base install's part of the same set. The collection carries a copy
(COLLECTION_FILE) for the hosts that install from the index.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
FILE = REPO / "constraints" / "control.txt"
# The same pins in the collection: a host that installs from the index (no wheelhouse) gets them as pip's --constraint
# (role node_agent's tasks/release_check.yml), so its dependencies are the tested ones, not the newest in the range.
COLLECTION_FILE = REPO / "collections/ansible_collections/sco/orchestrator/roles/node_agent/files/constraints.txt"
PRODUCT = "spot-capacity-orchestrator"
# The product with the control extra (what the collection's requirements.txt asks for), and what
# ee/execution-environment.yml installs besides it (its ansible_core, ansible_runner and python dependencies).
ROOTS = (f"{PRODUCT}[control]", "ansible-core", "ansible-runner", "nats-py")

HEADER = """\
# The exact versions a control host and the execution environment install: the closure of
# {roots},
# resolved in the venv the tests ran in. Written by `make constraints` (python -m sco_devkit.constraints); a test
# checks it is that closure at those versions. Used by `make collection` (the wheelhouse) and `make ee`
# (PIP_CONSTRAINT in every stage), and by the collection's roles on hosts without a wheelhouse (pip --constraint);
# agent/constraints.txt (the node's) agrees with it.
"""


def product_requirements() -> list[str]:
    """pyproject.toml's dependencies and extras as metadata writes them (each extra's with its marker)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra, deps in project.get("optional-dependencies", {}).items():
        reqs += [f"{d}; extra == '{extra}'" for d in deps]
    return reqs


def closure(roots: tuple[str, ...] = ROOTS) -> dict[str, str]:
    """{canonical name: installed version} of every distribution the roots need here, roots included, the product
    itself left out (it is built from the checkout)."""
    base_env = {k: str(v) for k, v in default_environment().items()}
    seen: dict[str, set[str]] = {}  # name -> the extras already walked
    found: dict[str, str] = {}
    todo = [Requirement(r) for r in roots]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        extras = set(req.extras)
        if name in seen and extras <= seen[name]:
            continue
        seen.setdefault(name, set()).update(extras)
        if name == PRODUCT:  # from pyproject.toml: an editable install's metadata is that of its last pip install
            found[name] = "checkout"
            requires = product_requirements()
        else:
            try:
                dist = metadata.distribution(name)
            except metadata.PackageNotFoundError:
                raise SystemExit(f"constraints: {req} is needed but not installed: bash scripts/setup.sh") from None
            found[name] = dist.version
            requires = dist.requires or []
        for line in requires:
            dep = Requirement(line)
            # a dependency counts when its marker holds without an extra or with one the requirement asked for
            if dep.marker is None or any(
                dep.marker.evaluate({**base_env, "extra": e}) for e in ("", *sorted(seen[name]))
            ):
                todo.append(dep)
    found.pop(PRODUCT, None)
    return found


def render(pins: dict[str, str]) -> str:
    lines = [f"{metadata.distribution(n).metadata['Name']}=={v}" for n, v in sorted(pins.items())]
    return HEADER.format(roots=", ".join(ROOTS)) + "\n".join(lines) + "\n"


def read(path: Path = FILE) -> dict[str, str]:
    """A constraints file as {canonical name: version}; a line that is not name==version is an error."""
    pins: dict[str, str] = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not version or any(c in version for c in "<>=!~*, ;"):
            raise ValueError(f"{path}:{n}: {raw!r} is not an exact pin (name==version)")
        pins[canonicalize_name(name)] = version
    return pins


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--check", action="store_true", help="exit 1 unless the file is what the venv resolves")
    p.add_argument("--out", type=Path, default=FILE)
    args = p.parse_args(argv)
    text = render(closure())
    outs = [args.out, COLLECTION_FILE] if args.out == FILE else [args.out]
    if args.check:
        stale = [o for o in outs if not o.is_file() or o.read_text() != text]
        for o in stale:
            print(f"constraints: {o} is not what this venv resolves: make constraints", file=sys.stderr)
        return 1 if stale else 0
    for o in outs:
        o.parent.mkdir(parents=True, exist_ok=True)
        o.write_text(text)
        print(f"constraints: {o} ({len(text.splitlines()) - HEADER.count(chr(10))} pins)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
