"""Role sco.orchestrator.kyverno_policies through real ansible-playbook runs (kubernetes.core from the PyPI
``ansible`` package). No Kubernetes API server can run here, so what is exercised for real is the part that
needs none: the settings check and the preflight, which must say plainly when the cluster cannot be reached,
in check mode too, and apply nothing. The objects it applies are the ones tests/test_kyverno.py validates."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from tests.harness import free_port
from tests.testhosts import REPO


def play(tmp: Path, extravars: dict[str, Any], check: bool = False) -> tuple[int, str]:
    import ansible_runner

    pdd = tmp / f"runner-{len(list(tmp.glob('runner-*')))}"
    (pdd / "project").mkdir(parents=True)
    (pdd / "project" / "kyverno_policies.yml").write_text((REPO / "playbooks" / "kyverno_policies.yml").read_text())
    r = ansible_runner.run(
        private_data_dir=str(pdd),
        playbook="kyverno_policies.yml",
        inventory={"all": {"hosts": {"localhost": {"ansible_python_interpreter": sys.executable}}}},
        extravars=extravars,
        cmdline="--check" if check else None,
        quiet=True,
        envvars={
            "ANSIBLE_COLLECTIONS_PATH": str(REPO / "collections"),
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
            "ANSIBLE_NOCOLOR": "1",
        },
    )
    return r.rc, r.stdout.read()


def test_check_mode_against_an_unreachable_cluster_says_so(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    rc, out = play(tmp_path, {"kyverno_policies_host": url, "kyverno_policies_api_key": "t"}, check=True)
    assert rc != 0, out
    assert f"kyverno_policies: cannot reach the Kubernetes API ({url})" in out
    assert "Check mode could not compare anything, so it cannot say what would change" in out
    assert "Apply the agent's identity" not in out  # stopped before any apply task


def test_real_run_against_an_unreachable_cluster_applies_nothing(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    rc, out = play(tmp_path, {"kyverno_policies_host": url})
    assert rc != 0
    assert "cannot reach the Kubernetes API" in out and "Nothing was applied" in out
    assert "Check mode could not" not in out


def test_bad_settings_fail_before_anything(tmp_path: Path) -> None:
    rc, out = play(tmp_path, {"kyverno_policies_host": "http://x", "kyverno_policies_kubeconfig": "/k"}, check=True)
    assert rc != 0 and "give either kyverno_policies_kubeconfig or kyverno_policies_host, not both" in out
    rc, out = play(tmp_path, {"kyverno_policies_state": "gone"}, check=True)
    assert rc != 0 and "kyverno_policies_state" in out
