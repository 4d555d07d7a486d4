"""Running the ``sco`` command and the collection's modules as their users do (real processes), and the shape every
bad input must have: one line naming what and where, the README's exit code, no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

SCO = [sys.executable, "-m", "sco.cli"]
COLLECTION = Path(__file__).parent.parent / "collections"


def sco(*args: str | Path, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SCO, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env)


def one_line_error(p: subprocess.CompletedProcess[str], code: int, *needles: str) -> None:
    assert "Traceback" not in p.stderr, p.stderr
    assert p.returncode == code, (p.returncode, p.stdout, p.stderr)
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("sco: error: "), p.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def run_module(name: str, args: dict[str, Any], tmp_path: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """A module of the collection as Ansible runs it (its args in a file), its JSON answer."""
    module = COLLECTION / f"ansible_collections/sco/orchestrator/plugins/modules/{name}.py"
    argf = tmp_path / f"{name}-args.json"
    argf.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": args}))
    # the collection first, then whatever the run gives (a worktree's src)
    path = os.pathsep.join(x for x in (str(COLLECTION), os.environ.get("PYTHONPATH", "")) if x)
    env = {**os.environ, **(env or {}), "PYTHONPATH": path}
    p = subprocess.run([sys.executable, str(module), str(argf)], capture_output=True, text=True, env=env, timeout=60)
    return dict(json.loads(p.stdout))


def no_traceback(p: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in p.stderr, p.stderr
