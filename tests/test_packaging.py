"""What each install gets: the runtime wheel carries the product only (the test support is the
repository's own distribution, devkit/), a node installs it without extras and so without pydantic and PyYAML,
agent/constraints.txt pins exactly what the node's wheelhouse holds, and a command that needs an extra says which."""

from __future__ import annotations

import subprocess
import tomllib
import zipfile
from pathlib import Path

from sco.contract.signing import generate, write_keypair
from tests.cli_run import sco
from tests.conftest import SAMPLE
from tests.node_install import REPO, normalise, pins


def run(venv: Path, *argv: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(venv / "bin" / str(argv[0])), *map(str, argv[1:])], capture_output=True, text=True, timeout=60
    )


def test_the_runtime_wheel_ships_the_product_only(node_wheelhouse: Path) -> None:
    (wheel,) = node_wheelhouse.glob("spot_capacity_orchestrator-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    # the product and its workloads layer (sco_workloads: torch only through the `dcp` extra); no test support
    assert tops == {"sco", "sco_workloads"}, tops
    for support in ("sco/standins/", "sco/devcluster/", "sco/demo.py", "sco_devkit/"):
        assert not [n for n in names if n.startswith(support)], support
    assert "sco/samples/local/hall.yaml" in names and any(n.startswith("sco/state/migrations/") for n in names)
    # every module it ships is in the tree: setuptools' build/ kept modules moved since (kube_drain.py, retry.py)
    stale = [n for n in names if n.endswith(".py") and not (REPO / "src" / n).is_file()]
    assert not stale, stale
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    base = [
        x.split(":", 1)[1].strip() for x in meta.splitlines() if x.startswith("Requires-Dist:") and "extra ==" not in x
    ]
    assert not [r for r in base if normalise(r).startswith(("pydantic", "pyyaml"))], base


def test_the_constraints_pin_exactly_what_the_node_wheelhouse_holds(node_wheelhouse: Path) -> None:
    held = {}
    for w in node_wheelhouse.glob("*.whl"):
        name, version = w.name.split("-")[:2]
        held[normalise(name)] = version
    held.pop("spot-capacity-orchestrator")
    assert held == pins(), (held, pins())
    # every base requirement of pyproject.toml is pinned (a new one without a pin would float on nodes)
    base = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    for req in base:
        name = normalise(req.split(">")[0].split("=")[0].split("<")[0].split("[")[0])
        assert name in pins(), f"agent/constraints.txt does not pin {name}"


def test_a_node_install_runs_the_agent_without_pydantic_or_yaml(node_venv: Path, tmp_path: Path) -> None:
    for module in ("pydantic", "yaml", "psycopg", "openstack", "kubernetes"):
        p = run(node_venv, "python", "-c", f"import {module}")
        assert p.returncode != 0 and "ModuleNotFoundError" in p.stderr, (module, p.stdout, p.stderr)
    # the agent: its sample config, then a real one checked with every import of `run` loaded
    sample = run(node_venv, "sco-agent", "sample-config")
    assert sample.returncode == 0 and "[agent]" in sample.stdout, sample.stderr
    trust = tmp_path / "trusted"
    trust.mkdir()
    key = generate()
    write_keypair(key, tmp_path / "k.key", trust / "k.pub")
    cfg = tmp_path / "agent.toml"
    cfg.write_text(
        f'[agent]\nhall = "local"\nnode = "n1"\nkube_url = "http://127.0.0.1:1"\n'
        f'trust_dir = "{trust}"\nstate_dir = "{tmp_path / "state"}"\n'
    )
    p = run(node_venv, "sco-agent", "check-config", "--config", cfg)
    assert p.returncode == 0 and "node n1" in p.stdout, p.stdout + p.stderr
    p = run(node_venv, "python", "-c", "import sco.agent.daemon, sco.agent.kube.fallback, sco.agent.slurm.drain")
    assert p.returncode == 0, p.stderr
    # node-side commands of `sco`: the bundle a control host compiled, verified and rendered for Slurm here
    bundle = tmp_path / "bundle.json"
    assert sco("contract", "compile", SAMPLE, "-o", bundle, "--signing-key", tmp_path / "k.key").returncode == 0
    p = run(node_venv, "sco", "contract", "verify", bundle, "--trust", trust / "k.pub")
    assert p.returncode == 0 and ": ok: hall local" in p.stdout, p.stderr
    (tmp_path / "slurm").mkdir()  # /etc/slurm on the controller
    p = run(node_venv, "sco", "slurm", "render-contracts", bundle, "--trust", trust / "k.pub", "--out-dir",
            tmp_path / "slurm", "--reclaimable-partition", "spot")  # fmt: skip
    assert p.returncode == 0 and "(written)" in p.stdout, p.stderr


def test_a_command_that_needs_an_extra_names_it(node_venv: Path, tmp_path: Path) -> None:
    write_keypair(generate(), tmp_path / "k.key", tmp_path / "k.pub")
    p = run(node_venv, "sco", "contract", "compile", SAMPLE, "-o", tmp_path / "b.json", "--signing-key",
            tmp_path / "k.key")  # fmt: skip
    assert p.returncode == 5 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip() == (
        "sco: error: sco contract compile needs PyYAML, which this install lacks: "
        "pip install 'spot-capacity-orchestrator[contract]'"
    ), p.stderr
    assert not (tmp_path / "b.json").exists()
    p = run(node_venv, "sco", "db", "migrate", "--dsn", "host=/nonexist")
    assert p.returncode == 5 and "spot-capacity-orchestrator[control]" in p.stderr, p.stderr
