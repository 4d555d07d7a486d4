"""`make release VERSION=x.y.z`: set the release's version and write the collection's CHANGELOG.rst.

    python scripts/release.py X.Y.Z [--root DIR] [--summary TEXT]

The version's one place is pyproject.toml (the package reads it through importlib.metadata). The collection cannot
read it, so the release writes the same literal where the collection needs one: galaxy.yml, the modules' release
check (plugins/module_utils/product.py), the execution environment's requirements.txt and role hall's sco_version
(tests/test_release.py checks they agree). Then `antsibull-changelog release` turns the unreleased fragments, plus a
release summary written here, into changelogs/changelog.yaml's entry and CHANGELOG.rst (the fragments go).
Commit the result, tag it, and run scripts/setup.sh (the venv's installed metadata still names the old version).
--root runs it on a copy (a directory with pyproject.toml and collections/); the tests do.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
COLL = Path("collections", "ansible_collections", "sco", "orchestrator")
DIST = "spot-capacity-orchestrator"
SEMVER = re.compile(r"^\d+\.\d+\.\d+$")  # Galaxy's versions are semantic; this subset is also PEP 440's


def places(root: Path) -> list[tuple[Path, str, str]]:
    """(file, pattern of the one line holding the version, that line with {v}) for every literal of it."""
    c = root / COLL
    return [
        (root / "pyproject.toml", r'^version = "[^"]*"$', 'version = "{v}"'),
        (c / "galaxy.yml", r"^version: .*$", "version: {v}"),
        (c / "plugins/module_utils/product.py", r'^COLLECTION_VERSION = "[^"]*"$', 'COLLECTION_VERSION = "{v}"'),
        (c / "requirements.txt", rf"^{re.escape(DIST)}\[control\]==\S+$", DIST + "[control]=={v}"),
        (c / "roles/hall/defaults/main.yml", r"^sco_version: .*$", "sco_version: {v}"),
        (c / "roles/hall/vars/main.yml", r"^sco_collection_version: .*$", "sco_collection_version: {v}"),
    ]


def released(coll: Path) -> list[Version]:
    data = yaml.safe_load((coll / "changelogs" / "changelog.yaml").read_text()) or {}
    return sorted(Version(str(v)) for v in data.get("releases") or {})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("version", help="X.Y.Z, above every release in changelogs/changelog.yaml")
    p.add_argument("--root", type=Path, default=REPO, help="the tree to release (default: this checkout)")
    p.add_argument("--summary", help="the release summary (default: one line naming the version)")
    args = p.parse_args(argv)
    version: str = args.version
    root: Path = args.root.resolve()
    coll = root / COLL
    if not SEMVER.match(version):
        p.error(f"{version}: expected X.Y.Z")
    last = released(coll)
    if last and Version(version) <= last[-1]:
        p.error(f"{version}: not above the last release, {last[-1]} (changelogs/changelog.yaml)")
    current = tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]

    for path, pattern, line in places(root):
        text = path.read_text()
        new, n = re.subn(pattern, line.format(v=version), text, flags=re.M)
        if n != 1:  # a second copy, or none: the tests' agreement check would not hold after this
            sys.exit(f"release: {path}: {n} lines match {pattern!r}, expected 1")
        path.write_text(new)
        print(f"release: {path.relative_to(root)}: {version}")

    # antsibull-changelog asks for a release summary (prelude) of each release; safe_dump quotes what YAML would
    # otherwise misread (a ': ' in a plain scalar)
    summary = args.summary or f"Release {version} of sco.orchestrator and {DIST} (the same version)."
    fragment = coll / "changelogs" / "fragments" / f"{version}.yml"
    fragment.write_text(yaml.safe_dump({"release_summary": summary}, sort_keys=False, width=1000))

    # ansible-doc (which antsibull-changelog runs for the plugins' version_added) is this Python's
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    tool = Path(sys.executable).parent / "antsibull-changelog"
    subprocess.run([str(tool), "release", "--version", version], cwd=coll, env=env, check=True, timeout=600)
    print(f"release: {current} -> {version}; {(coll / 'CHANGELOG.rst').relative_to(root)} written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
