"""The product as a node gets it: a wheelhouse of the runtime wheel without extras, pinned by agent/constraints.txt,
installed offline into a fresh venv. Used by the packaging tests, the role tests and the footprint benchmark."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from sco_devkit.wheels import source_tree_build

REPO = Path(__file__).resolve().parents[1]
CONSTRAINTS = REPO / "agent" / "constraints.txt"


def build_wheelhouse(dest: Path) -> Path:
    """``pip wheel -c agent/constraints.txt .``: the product's wheel, its base dependencies at their pins."""
    dest.mkdir(parents=True, exist_ok=True)
    # build/ emptied and one build at a time in this checkout (each pytest worker makes its session's wheelhouse)
    with source_tree_build(REPO):
        subprocess.run(
            # no build isolation: setuptools is in this venv, and an isolated build fetches it again each time (~30 s)
            [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-build-isolation", "--constraint", str(CONSTRAINTS),
             "--wheel-dir", str(dest), str(REPO)],
            check=True, timeout=600, capture_output=True,
        )  # fmt: skip
    return dest


def install_venv(wheelhouse: Path, dest: Path, python: str = sys.executable) -> Path:
    """A fresh venv holding only what the wheelhouse gives a node (``--no-index``: nothing from elsewhere), on
    ``python`` (the system's for an agent another user runs: a test machine's own may sit under a 0700 home)."""
    shutil.rmtree(dest, ignore_errors=True)
    # no pip inside (ensurepip alone takes ~40 s on a loaded machine): this venv's pip installs into it, and the venv
    # then holds exactly the product's closure
    subprocess.run([python, "-m", "venv", "--without-pip", str(dest)], check=True, timeout=120)
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(dest / "bin" / "python"), "install", "--quiet", "--no-index",
         "--find-links", str(wheelhouse), "--disable-pip-version-check", "spot-capacity-orchestrator"],
        check=True, timeout=300, capture_output=True,
        # a PYTHONPATH naming a checkout's src/ (a worktree's tests) shows pip its egg-info: "already installed"
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )  # fmt: skip
    return dest


def pins() -> dict[str, str]:
    """agent/constraints.txt as {normalised name: version}."""
    out = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            out[normalise(name)] = version.strip()
    return out


def normalise(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(".", "-")
