"""`make collection`: what an air-gapped controller needs to deploy a hall, in one directory (default dist/):

    sco-orchestrator-<version>.tar.gz       the collection artifact (roles, modules, playbooks, hall defaults)
    <ns>-<name>-<version>.tar.gz            every collection galaxy.yml depends on, from PyPI's `ansible` package
                                            installed here (Galaxy is out of reach)
    requirements.yml                        the three artifacts, for one offline install:
                                              ansible-galaxy collection install --offline -r dist/requirements.yml
    wheelhouse/                             spot-capacity-orchestrator[control] and its dependencies as wheels: the
                                            controller's `pip install --no-index --find-links`, and sco_wheelhouse
                                            for the hosts (nodes install only what the agent needs from it)

    python scripts/collection.py [--out DIR] [--no-wheelhouse]

The wheelhouse holds exactly the versions constraints/control.txt pins (what the execution environment installs);
it is rebuilt only when pyproject.toml, those pins or src/ changed (a stamp file holds their hash).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import yaml
from packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parents[1]
CONSTRAINTS = REPO / "constraints" / "control.txt"
COLL = REPO / "collections" / "ansible_collections" / "sco" / "orchestrator"
BIN = Path(sys.executable).parent


def fail(msg: str) -> None:
    sys.exit(f"collection: {msg}")


def build(tree: Path, out: Path) -> Path:
    """ansible-galaxy collection build of a source tree (galaxy.yml) into out; the artifact's path."""
    info = yaml.safe_load((tree / "galaxy.yml").read_text())
    subprocess.run(
        [str(BIN / "ansible-galaxy"), "collection", "build", str(tree), "--output-path", str(out), "--force"],
        check=True,
        stdout=subprocess.DEVNULL,
        timeout=300,
    )
    return out / f"{info['namespace']}-{info['name']}-{info['version']}.tar.gz"


def installed(name: str) -> Path:
    """Where the `ansible` package (or any collection path of this Python) has collection ns.name."""
    import ansible_collections

    ns, coll = name.split(".")
    for p in ansible_collections.__path__:
        d = Path(p) / ns / coll
        if (d / "MANIFEST.json").is_file():
            return d
    fail(f"{name} is not installed here: pip install ansible (its collections are what the tests run with)")
    raise AssertionError  # unreachable


def dependency(name: str, wanted: str, out: Path) -> Path:
    """An artifact of an installed collection, rebuilt from its files with a galaxy.yml made from its MANIFEST.json
    (the `ansible` package leaves out some files its FILES.json lists, so the directory cannot be packed as is)."""
    src = installed(name)
    info = json.loads((src / "MANIFEST.json").read_text())["collection_info"]
    if info["version"] not in SpecifierSet(wanted):
        fail(f"{name} {info['version']} in {src} is not {wanted} (galaxy.yml dependencies)")
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / name
        shutil.copytree(src, tree, ignore=shutil.ignore_patterns("__pycache__", "MANIFEST.json", "FILES.json"))
        (tree / "galaxy.yml").write_text(yaml.safe_dump({k: v for k, v in info.items() if v is not None}))
        return build(tree, out)


def sources_hash() -> str:
    h = hashlib.sha256()
    for p in sorted([REPO / "pyproject.toml", CONSTRAINTS, Path(__file__).resolve(), *(REPO / "src").rglob("*")]):
        if p.is_file() and "__pycache__" not in p.parts and ".egg-info" not in str(p):
            h.update(str(p.relative_to(REPO)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def wheelhouse(out: Path) -> None:
    """The product with the control extra (what any role installs anywhere) and every dependency, as wheels."""
    stamp = out / ".sources"
    digest = sources_hash()
    if stamp.is_file() and stamp.read_text() == digest:
        return
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    # at the pinned versions, the ones this checkout was tested with (unpinned, pip backtracks for 10+ minutes, and
    # two builds a week apart differ)
    from sco_devkit import wheels

    # ansible-core: role control_loop installs it beside the control extra on the control hosts (ansible-runner
    # runs its ansible-playbook)
    wheels.build(partial, f"{REPO}[control]", "ansible-core", timeout=1200, constraints=CONSTRAINTS)
    (partial / ".sources").write_text(digest)
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "dist")
    p.add_argument("--no-wheelhouse", action="store_true", help="the collections only")
    args = p.parse_args()
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    galaxy = yaml.safe_load((COLL / "galaxy.yml").read_text())
    for old in out.glob("*.tar.gz"):
        old.unlink()
    artifacts = [build(COLL, out)]
    for name, wanted in sorted((galaxy.get("dependencies") or {}).items()):
        artifacts.append(dependency(name, str(wanted), out))
    # names relative to this file's directory: ansible-galaxy reads type: file paths from the working directory,
    # so the documented command runs from the parent of dist/ or with absolute paths (written here)
    req = {"collections": [{"name": str(a), "type": "file"} for a in artifacts]}
    (out / "requirements.yml").write_text(
        "# ansible-galaxy collection install --offline -r requirements.yml  (written by make collection)\n"
        + yaml.safe_dump(req, sort_keys=False)
    )
    for a in artifacts:
        with tarfile.open(a) as t:
            info = json.load(t.extractfile("MANIFEST.json"))["collection_info"]  # type: ignore[arg-type]
        print(f"collection: {a.name} ({info['namespace']}.{info['name']} {info['version']})")
    if not args.no_wheelhouse:
        wheelhouse(out / "wheelhouse")
        print(f"collection: {out / 'wheelhouse'} ({len(list((out / 'wheelhouse').glob('*.whl')))} wheels)")


if __name__ == "__main__":
    main()
