"""Versions and releases: the version has one place (pyproject.toml) and the literals
the collection needs agree with it, galaxy.yml names no made-up URL, every entry point says its version, a contract
error's exit code is not argparse's usage error, and `make release` writes CHANGELOG.rst for the next version (on a
copy of the tree: the fragments here stay unreleased)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from packaging.version import Version

import sco
from sco.errors import ContractError
from tests.cli_run import sco as run_sco

REPO = Path(__file__).resolve().parents[1]
COLL_REL = Path("collections", "ansible_collections", "sco", "orchestrator")
COLL = REPO / COLL_REL
BIN = Path(sys.executable).parent
RELEASE = REPO / "scripts" / "release.py"


def project() -> dict[str, object]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]  # type: ignore[no-any-return]


def literals(root: Path) -> dict[str, str]:
    """The version wherever the collection must carry it as a literal, by file."""
    c = root / COLL_REL
    product = (c / "plugins" / "module_utils" / "product.py").read_text()
    (req,) = [x for x in (c / "requirements.txt").read_text().splitlines() if x and not x.startswith("#")]
    return {
        "pyproject.toml": tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"],
        "galaxy.yml": str(yaml.safe_load((c / "galaxy.yml").read_text())["version"]),
        "product.py": re.search(r'^COLLECTION_VERSION = "([^"]+)"$', product, re.M).group(1),  # type: ignore[union-attr]
        "requirements.txt": req.split("==", 1)[1],
        "hall defaults": str(yaml.safe_load((c / "roles/hall/defaults/main.yml").read_text())["sco_version"]),
        "hall vars": str(yaml.safe_load((c / "roles/hall/vars/main.yml").read_text())["sco_collection_version"]),
    }


def test_the_version_has_one_place_and_its_copies_agree() -> None:
    version = str(project()["version"])
    assert set(literals(REPO).values()) == {version}, literals(REPO)
    # the package reads it from the installed distribution's metadata, not from a literal of its own
    assert sco.__version__ == metadata.version("spot-capacity-orchestrator") == version
    assert not re.search(r'^__version__ = "', (REPO / "src" / "sco" / "__init__.py").read_text(), re.M)
    # nowhere else (there were 26 copies): history (version_added, the released changelog, a relay note
    # about agents before a change) and another project's pin that happens to match are the only other mentions
    allowed = {
        "pyproject.toml",
        "devkit/pyproject.toml",  # the test support's own distribution, never shipped
        "scripts/openstack/requirements.txt",  # the OpenStack services' pins, one of which may match
        f"{COLL_REL}/galaxy.yml",
        f"{COLL_REL}/plugins/module_utils/product.py",
        f"{COLL_REL}/requirements.txt",
        f"{COLL_REL}/roles/hall/defaults/main.yml",
        f"{COLL_REL}/roles/hall/vars/main.yml",
        f"{COLL_REL}/changelogs/changelog.yaml",
        f"{COLL_REL}/CHANGELOG.rst",
        f"{COLL_REL}/roles/notice_relay/README.md",
        "molecule/hall-upgrade/releases.py",  # history: the release the upgrade scenario starts from, by its commit
    }
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    stray = []
    for name in files:
        path = REPO / name
        if name in allowed or not path.is_file() or path.suffix in (".gz", ".whl", ".png"):
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if re.search(rf"(?<![\d.]){re.escape(version)}(?![\d.])", line) and "version_added:" not in line:
                stray.append(f"{name}:{n}: {line.strip()}")
    assert not stray, "\n".join(stray)


def test_galaxy_names_real_urls_or_none() -> None:
    galaxy = yaml.safe_load((COLL / "galaxy.yml").read_text())
    assert "example.invalid" not in (COLL / "galaxy.yml").read_text()
    for key in ("repository", "documentation", "homepage", "issues"):
        url = galaxy.get(key)
        if url is None:
            continue
        host = re.match(r"https://([^/]+)/", str(url))
        assert host, (key, url)
        # RFC 2606 / 6761 names are never a project's home
        assert not re.search(r"(^|\.)(example|invalid|test|localhost)$|(^|\.)example\.(com|org|net)$", host[1]), url


@pytest.mark.parametrize("script", sorted(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]))
def test_every_entry_point_says_its_version(script: str) -> None:
    p = subprocess.run([str(BIN / script), "--version"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"{script} {project()['version']}", p.stdout + p.stderr


def test_a_contract_error_exits_apart_from_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "contracts").mkdir()
    (tmp_path / "hall.yaml").write_text("not: [a hall\n")
    bad = run_sco("contract", "check", tmp_path)
    usage = run_sco("contract", "check", tmp_path, "--no-such-flag")
    assert usage.returncode == 2 and "unrecognized arguments" in usage.stderr, usage.stderr
    assert bad.returncode == ContractError.exit_code == 13, bad.stderr
    assert "13 contracts" in (REPO / "README.md").read_text()
    # the change is a breaking one for scripts that tested for 2: the changelog says so
    notes = [yaml.safe_load(f.read_text()) for f in (COLL / "changelogs" / "fragments").glob("*.yml")]
    breaking = [x for n in notes for x in (n or {}).get("breaking_changes", [])]
    assert any("13" in x and "2" in x and "contract" in x for x in breaking), breaking


def copy_tree(dst: Path) -> Path:
    """pyproject.toml and the collection, as `make release` sees them in a checkout."""
    shutil.copy2(REPO / "pyproject.toml", dst / "pyproject.toml")
    shutil.copytree(COLL, dst / COLL_REL, ignore=shutil.ignore_patterns("__pycache__", "output", ".plugin-cache.yaml"))
    return dst


def release(root: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(RELEASE), *argv, "--root", str(root)], capture_output=True, text=True, timeout=600
    )


def test_make_release_writes_the_changelog_of_the_next_version(tmp_path: Path) -> None:
    fragments_here = sorted(p.name for p in (COLL / "changelogs" / "fragments").iterdir())
    changelog_here = [(COLL / f).read_bytes() if (COLL / f).exists() else None for f in ("CHANGELOG.rst", "galaxy.yml")]
    root = copy_tree(tmp_path)
    frag = root / COLL_REL / "changelogs" / "fragments"
    unreleased = len(list(frag.glob("*.yml")))
    assert unreleased > 0

    history = yaml.safe_load((COLL / "changelogs" / "changelog.yaml").read_text())["releases"]
    last = max(map(Version, history))
    nxt = f"{last.major}.{last.minor + 1}.0"
    assert release(root, str(last)).returncode == 2  # released already (changelog.yaml)
    assert release(root, "1.0").returncode == 2
    assert literals(root)["galaxy.yml"] == str(project()["version"])  # refused before writing anything

    p = release(root, nxt)
    assert p.returncode == 0, p.stdout + p.stderr
    assert set(literals(root).values()) == {nxt}, literals(root)
    rst = (root / COLL_REL / "CHANGELOG.rst").read_text()
    for v in (nxt, *history):  # the new release and every earlier one
        assert f"v{v}\n{'=' * len(f'v{v}')}" in rst, v
    assert "Release Summary" in rst and "Breaking Changes / Porting Guide" in rst
    changes = yaml.safe_load((root / COLL_REL / "changelogs" / "changelog.yaml").read_text())["releases"][nxt]
    assert len(changes["fragments"]) == unreleased + 1  # every fragment, and the summary
    assert not list(frag.glob("*.yml"))  # released: gone from the fragments
    lint = subprocess.run(
        [str(BIN / "antsibull-changelog"), "lint-changelog-yaml", "changelogs/changelog.yaml"],
        cwd=root / COLL_REL, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert lint.returncode == 0 and not lint.stdout.strip(), lint.stdout + lint.stderr
    built = subprocess.run(
        [str(BIN / "ansible-galaxy"), "collection", "build", str(root / COLL_REL), "--output-path", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0 and (tmp_path / f"sco-orchestrator-{nxt}.tar.gz").is_file(), built.stderr
    # and this checkout is untouched
    assert sorted(p.name for p in (COLL / "changelogs" / "fragments").iterdir()) == fragments_here
    assert [(COLL / f).read_bytes() if (COLL / f).exists() else None for f in ("CHANGELOG.rst", "galaxy.yml")] == (
        changelog_here
    )
