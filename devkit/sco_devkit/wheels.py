"""Wheelhouses of the product with extras, pinned to what this checkout's venv was set up and tested with.

Unpinned, ``pip wheel .[control]`` lets the resolver backtrack through openstacksdk's, kubernetes' and
ansible-runner's history: more than 600 s of CPU here, against 15 s with pins. The pins are the running venv's own
(``pip freeze``), so a wheelhouse holds exactly the versions the tests ran with; agent/constraints.txt (the node's
pins) is the same set for the base dependencies, since setup installs the venv with it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
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


@contextlib.contextmanager
def source_tree_build(tree: Path) -> Iterator[None]:
    """setuptools' ``build/`` emptied, then one build at a time in ``tree``: its scratch is the tree's own, so two
    builds at once (pytest's workers each making a session's wheelhouse) removed and wrote it under each other ("Failed
    building wheel for spot-capacity-orchestrator", seen in a fresh-clone CI run). A machine-wide lock per tree."""
    key = hashlib.sha256(str(tree.resolve()).encode()).hexdigest()[:16]
    with open(f"/var/tmp/.sco-wheel-build-{key}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a build takes seconds to a minute; pip's own timeout bounds the holder
        try:
            # setuptools' build/ keeps modules moved since an earlier build (sco/agent/kube_drain.py after its move
            # to kube/drain.py was still shipped)
            shutil.rmtree(tree / "build", ignore_errors=True)
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build(dest: Path, *requirements: str, timeout: float = 900, constraints: Path | None = None) -> Path:
    """``pip wheel`` of the requirements into dest, every dependency at the venv's pins (or at those of a
    constraints file given, such as constraints/control.txt), no isolated build (the venv has setuptools; an
    isolated build fetches it again each time)."""
    dest.mkdir(parents=True, exist_ok=True)
    pins = constraints or freeze_constraints(dest.parent / f".{dest.name}.constraints.txt")
    trees = [t for t in (Path(req.split("[", 1)[0]) for req in requirements) if (t / "pyproject.toml").is_file()]
    with contextlib.ExitStack() as stack:
        for tree in sorted(set(trees), key=str):  # sorted: two builders of the same trees lock them in one order
            stack.enter_context(source_tree_build(tree))
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
