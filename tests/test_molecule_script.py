"""scripts/molecule.sh run from two checkouts at once (a worktree and the CI clone on one machine).

A scenario's namespaces and /var/tmp/sco-molecule/<scenario>* paths are fixed by its name, so the second run of a
scenario must wait for the first: before, it deleted the first's controller venv mid-run (scenario local failed its
idempotence step). The script itself is real; `molecule` is a small program in a throwaway VENV that stands for the
scenario's run (the real one takes ten minutes and the test hosts) and checks its controller lives throughout.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BASE = Path("/var/tmp/sco-molecule")

# the scenario's run: makes its controller, holds it a while, fails if someone removed it meanwhile
MOLECULE = """#!/usr/bin/env bash
set -eu
s=$3
ctl=/var/tmp/sco-molecule/$s-controller
mkdir -p "$ctl" && echo "$PWD" >"$ctl/owner"
sleep 1.5
[ "$(cat "$ctl/owner" 2>/dev/null)" = "$PWD" ] || { echo "controller of $s removed or taken mid-run" >&2; exit 1; }
"""
PYTHON = """#!/usr/bin/env bash
mkdir -p "$PWD/.work/wheelhouse" && echo "$PWD/.work/wheelhouse"
"""


def _checkout(root: Path, scenario: str) -> Path:
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "molecule.sh", root / "scripts" / "molecule.sh")
    (root / "molecule" / scenario).mkdir(parents=True)
    (root / "molecule" / scenario / "molecule.yml").write_text("---\n")
    bin_ = root / "venv" / "bin"
    bin_.mkdir(parents=True)
    for name, text in (("molecule", MOLECULE), ("python", PYTHON)):
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    return root


def test_two_checkouts_running_one_scenario_take_turns(tmp_path: Path) -> None:
    scenario = f"locktest-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "VENV": "venv", "MOLECULE_JOBS": "1"}
    checkouts = [_checkout(tmp_path / n, scenario) for n in ("worktree", "ci-clone")]
    try:
        runs = [
            subprocess.Popen(["bash", "scripts/molecule.sh"], cwd=c, env=env, stdout=subprocess.PIPE, text=True)
            for c in checkouts
        ]
        outs = [r.communicate(timeout=60)[0] for r in runs]
        for r, out in zip(runs, outs, strict=True):
            assert r.returncode == 0, out
            assert f"scenario {scenario} passed" in out, out
    finally:
        shutil.rmtree(BASE / f"{scenario}-controller", ignore_errors=True)
        (BASE / f".{scenario}.lock").unlink(missing_ok=True)


def test_a_lock_held_too_long_fails_the_scenario_by_name(tmp_path: Path) -> None:
    scenario = f"locktest-{uuid.uuid4().hex[:8]}"
    checkout = _checkout(tmp_path / "worktree", scenario)
    BASE.mkdir(parents=True, exist_ok=True)
    lock = BASE / f".{scenario}.lock"
    holder = subprocess.Popen(["flock", str(lock), "sleep", "30"], start_new_session=True)
    try:
        while subprocess.run(["flock", "-n", str(lock), "true"]).returncode == 0:  # until the holder has it
            time.sleep(0.05)
        env = {**os.environ, "VENV": "venv", "MOLECULE_JOBS": "1", "MOLECULE_LOCK_WAIT": "1"}
        r = subprocess.run(
            ["bash", "scripts/molecule.sh"], cwd=checkout, env=env, capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 1, r.stdout + r.stderr
        assert f"scenario {scenario} failed (another checkout held {lock} for 1 s)" in r.stdout, r.stdout
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
        lock.unlink(missing_ok=True)


def test_an_opt_in_scenario_runs_only_when_named(tmp_path: Path) -> None:
    """make molecule (no name: CI) leaves out a scenario with an `opt-in` file and says why; named, it runs."""
    every, opt_in = (f"locktest-{uuid.uuid4().hex[:8]}" for _ in range(2))
    checkout = _checkout(tmp_path / "worktree", every)
    (checkout / "molecule" / opt_in).mkdir()
    (checkout / "molecule" / opt_in / "molecule.yml").write_text("---\n")
    (checkout / "molecule" / opt_in / "opt-in").write_text("too long for CI\n")
    env = {**os.environ, "VENV": "venv", "MOLECULE_JOBS": "1"}
    try:
        r = subprocess.run(
            ["bash", "scripts/molecule.sh"], cwd=checkout, env=env, capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"scenario {every} passed" in r.stdout, r.stdout
        assert f"scenario {opt_in} left out (opt-in, run it by name: too long for CI)" in r.stdout, r.stdout
        assert f"scenario {opt_in} passed" not in r.stdout, r.stdout
        named = subprocess.run(
            ["bash", "scripts/molecule.sh", opt_in], cwd=checkout, env=env, capture_output=True, text=True, timeout=60
        )
        assert named.returncode == 0 and f"scenario {opt_in} passed" in named.stdout, named.stdout + named.stderr
    finally:
        for s in (every, opt_in):
            shutil.rmtree(BASE / f"{s}-controller", ignore_errors=True)
            (BASE / f".{s}.lock").unlink(missing_ok=True)
