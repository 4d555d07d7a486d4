"""The two releases scenario hall-upgrade moves a hall between, built as each commit builds them.

    python molecule/hall-upgrade/releases.py     # prints {"n": {...}, "n1": {...}} and links them (below)

Release N is commit N_COMMIT of this repository (the tree as it stood before issue 30's upgrade work, version
0.1.0): its files by `git archive`, its wheelhouse by its own `molecule/shared/hosts.py wheelhouse` (its sources,
its devkit: PYTHONPATH puts them before this checkout's editable install). Release N+1 is this checkout's tracked
files released as N1_VERSION on a copy (`scripts/release.py`, as `make release` does; the upgrade needs a version
above N's, or pip finds N's installed and keeps it), and its wheelhouse by the copy's hosts.py.

Each release also gets the controller's part: the product of that release installed alone into `site/` (no
dependencies; the controller's venv has them), which goes first on PYTHONPATH for that release's ansible-playbook
(the collection's modules check they run with the product of their release: module_utils/product.py).

Links under /var/tmp/sco-molecule/hall-upgrade/: release-n, release-n1 (the trees, with site/), wheelhouse-n,
wheelhouse-n1; and releases.json (what it printed). The trees are kept under
/var/tmp/sco-molecule/hall-upgrade-releases/ between runs (N by commit; N+1 by a hash of its files): the
scenario's own directory goes with its destroy.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BASE = Path("/var/tmp/sco-molecule")
OUT = BASE / "hall-upgrade"
KEEP = BASE / "hall-upgrade-releases"
# the last commit before issue 30's work (ba2dda0, "Reproducible builds", is its first): release 0.1.0 as a hall
# ran it then
N_COMMIT = "d68a14cc37b4e549ea4c82b441ce37daeb04ea9d"
N1_VERSION = "0.2.0"
DIST = "spot_capacity_orchestrator"


def run(argv: list[str], timeout: float, **kw: object) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)  # type: ignore[call-overload]
    if r.returncode != 0:
        tail = r.stdout[-2000:] + r.stderr[-4000:]
        raise SystemExit(f"releases: {' '.join(argv)} failed (exit {r.returncode}):\n{tail}")
    return str(r.stdout)


def wheelhouse(tree: Path) -> Path:
    """The tree's own `hosts.py wheelhouse`, with its sources and devkit first on the path."""
    env = {**os.environ, "PYTHONPATH": f"{tree / 'src'}:{tree / 'devkit'}:{tree}"}
    out = run([sys.executable, str(tree / "molecule" / "shared" / "hosts.py"), "wheelhouse"], 1800, env=env, cwd=tree)
    return Path(out.strip().splitlines()[-1])


def controller_site(tree: Path, wheels: Path, version: str) -> Path:
    """The release's product alone (no dependencies) in tree/site, for its ansible-playbook's PYTHONPATH."""
    site = tree / "site"
    if not any(site.glob(f"{DIST}-{version}.dist-info")):
        shutil.rmtree(site, ignore_errors=True)
        wheel = next(wheels.glob(f"{DIST}-{version}-*.whl"))
        run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
             "--no-compile", "--target", str(site), str(wheel)], 300)  # fmt: skip
    return site


def release_n() -> dict[str, str]:
    tree = KEEP / f"n-{N_COMMIT[:12]}"
    if not (tree / "pyproject.toml").is_file():
        tmp = tree.with_suffix(".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", N_COMMIT], capture_output=True, timeout=120)
        if archive.returncode != 0:
            raise SystemExit(f"releases: git archive {N_COMMIT} failed: {archive.stderr.decode()[-2000:]}")
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive.stdout, check=True, timeout=120)
        tmp.rename(tree)
    wheels = wheelhouse(tree)
    version = run([sys.executable, "-c", "import tomllib,sys; print(tomllib.load(open(sys.argv[1], 'rb'))"
                   "['project']['version'])", str(tree / "pyproject.toml")], 30).strip()  # fmt: skip
    controller_site(tree, wheels, version)
    return {"tree": str(tree), "wheelhouse": str(wheels), "version": version, "commit": N_COMMIT}


def release_n1() -> dict[str, str]:
    files = run(["git", "-C", str(REPO), "ls-files", "-z"], 60).split("\0")
    files = [f for f in files if f and (REPO / f).is_file()]
    h = hashlib.sha256(N1_VERSION.encode())
    for f in sorted(files):
        h.update(f.encode() + b"\0" + (REPO / f).read_bytes())
    tree = KEEP / f"n1-{h.hexdigest()[:12]}"
    if not (tree / "pyproject.toml").is_file():
        tmp = tree.with_suffix(".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        for f in files:
            dst = tmp / f
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, dst, follow_symlinks=False)
        run([sys.executable, str(tmp / "scripts" / "release.py"), N1_VERSION, "--root", str(tmp)], 600)
        tmp.rename(tree)
    for old in KEEP.glob("n1-*"):  # earlier checkouts' copies
        if old != tree and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
    wheels = wheelhouse(tree)
    controller_site(tree, wheels, N1_VERSION)
    return {"tree": str(tree), "wheelhouse": str(wheels), "version": N1_VERSION}


def link(name: str, target: str) -> None:
    tmp = OUT / f".{name}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    os.replace(tmp, OUT / name)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    out = {"n": release_n(), "n1": release_n1()}
    for key, suffix in (("n", "n"), ("n1", "n1")):
        link(f"release-{suffix}", out[key]["tree"])
        link(f"wheelhouse-{suffix}", out[key]["wheelhouse"])
    (OUT / "releases.json").write_text(json.dumps(out, indent=2) + "\n")  # what verify reads
    print(json.dumps(out))


if __name__ == "__main__":
    main()
