"""scripts/openstack/setup.sh installs into a venv that worktrees share (a symlink): it must leave an installed
venv alone unless the requirements changed - a fresh checkout's newer file time is no change (pip reinstalling
keystoneauth1 under other worktrees' running clouds made nova-metadata answer 500)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(root: Path, venv: Path) -> list[str]:
    log = venv / "calls"
    log.unlink(missing_ok=True)
    subprocess.run(
        ["bash", "scripts/openstack/setup.sh"],
        cwd=root, env={**os.environ, "SCO_OPENSTACK_VENV": str(venv)}, check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return [c for c in log.read_text().splitlines() if "pip install" in c] if log.exists() else []


def test_a_newer_requirements_file_with_the_same_content_installs_nothing(tmp_path: Path) -> None:
    root = tmp_path / "checkout"
    (root / "scripts" / "openstack").mkdir(parents=True)
    for f in ("setup.sh", "requirements.txt"):
        shutil.copy(REPO / "scripts" / "openstack" / f, root / "scripts" / "openstack" / f)
    venv = tmp_path / "shared-venv"
    (venv / "bin").mkdir(parents=True)
    # the venv's python only says what it was asked to do
    (venv / "bin" / "python").write_text(f'#!/bin/sh\necho "$*" >> {venv}/calls\n')
    (venv / "bin" / "python").chmod(0o755)
    assert len(_run(root, venv)) == 2  # no stamp: pip, then the requirements
    assert _run(root, venv) == []
    # another worktree's checkout: the same requirements, written later
    reqs = root / "scripts" / "openstack" / "requirements.txt"
    later = time.time() + 60
    os.utime(reqs, (later, later))
    assert _run(root, venv) == []
    # a changed requirement installs again
    reqs.write_text(reqs.read_text() + "\n# changed\n")
    assert len(_run(root, venv)) == 2
