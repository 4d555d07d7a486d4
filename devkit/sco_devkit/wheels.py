"""Wheelhouses of the product with extras, pinned to what this checkout's venv was set up and tested with.

Unpinned, ``pip wheel .[control]`` lets the resolver backtrack through openstacksdk's, kubernetes' and
ansible-runner's history: more than 600 s of CPU here, against 15 s with pins. The pins are the running venv's own
(``pip freeze``), so a wheelhouse holds exactly the versions the tests ran with; agent/constraints.txt (the node's
pins) is the same set for the base dependencies, since setup installs the venv with it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def freeze_constraints(dest: Path, python: str = sys.executable) -> Path:
    """The venv's installed distributions as a constraints file, without editable ones (this checkout's own)."""
    out = subprocess.run(
        [python, "-m", "pip", "freeze", "--exclude-editable", "--disable-pip-version-check"],
        check=True,
        timeout=120,
        capture_output=True,
        text=True,
    ).stdout
    # a pin to a local path or URL is not a version constraint
    lines = [line for line in out.splitlines() if "==" in line and " @ " not in line]
    dest.write_text("\n".join(lines) + "\n")
    return dest


def build(dest: Path, *requirements: str, timeout: float = 900, constraints: Path | None = None) -> Path:
    """``pip wheel`` of the requirements into dest, every dependency at the venv's pins (or at those of a
    constraints file given, such as constraints/control.txt), no isolated build (the venv has setuptools; an
    isolated build fetches it again each time)."""
    dest.mkdir(parents=True, exist_ok=True)
    for req in requirements:  # a source tree: setuptools' build/ keeps modules moved since (shipped stale)
        tree = Path(req.split("[", 1)[0])
        if (tree / "pyproject.toml").is_file():
            shutil.rmtree(tree / "build", ignore_errors=True)
    pins = constraints or freeze_constraints(dest.parent / f".{dest.name}.constraints.txt")
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check", "--no-build-isolation",
         "--constraint", str(pins), "--wheel-dir", str(dest), *requirements],
        timeout=timeout, capture_output=True, text=True,
    )  # fmt: skip
    if r.returncode != 0:  # pip's own words, not a bare CalledProcessError
        raise RuntimeError(f"pip wheel {' '.join(requirements)} failed (exit {r.returncode}):\n{r.stderr[-4000:]}")
    if constraints is None:
        pins.unlink()
    return dest
