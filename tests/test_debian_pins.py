"""constraints/ee-debian.txt, the execution environment's Debian packages: the list `make ee` checks the image
against (sco_devkit.debian_pins). The package lists here are this machine's own (dpkg-query -W), read as the image's
would be; the preferences are read back by the machine's apt."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sco_devkit import debian_pins

REPO = Path(__file__).resolve().parents[1]
DPKG_FORMAT = "${Package} ${Version} ${Architecture}\n"


def dpkg_list() -> str:
    out = subprocess.run(["dpkg-query", "-W", "-f", DPKG_FORMAT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sco_devkit.debian_pins", *argv], capture_output=True, text=True,
                          timeout=60, cwd=REPO)  # fmt: skip


def test_the_shipped_list_reads_and_holds_the_packages_the_build_installs() -> None:
    pins = debian_pins.parse(debian_pins.FILE.read_text(), str(debian_pins.FILE))
    # what the build installs with apt on the local Debian base (PYPKG, the collection's bindep.txt)
    names = {name for name, _ in pins}
    assert {"python3.11", "python3-pip", "openssh-client", "git"} <= names


def test_an_unchanged_image_passes_and_each_kind_of_drift_fails(tmp_path: Path) -> None:
    listed = dpkg_list()
    pins = tmp_path / "pins.txt"
    image = tmp_path / "packages.txt"
    # the image's list as `make ee` writes it: a dpkg section among others
    image.write_text(f"## pip\nfoo==1\n## dpkg\n{listed}## other\nx\n")
    assert cli("write", str(image), "--file", str(pins)).returncode == 0
    assert pins.read_text().startswith("# The exact Debian packages")
    ok = cli("check", str(image), "--file", str(pins))
    assert ok.returncode == 0, ok.stderr

    first, second, third = listed.splitlines()[:3]
    name1, version1, arch1 = first.split()
    name2, version2, arch2 = second.split()
    name3 = third.split()[0]
    moved = listed.replace(first, f"{name1} {version1}.1 {arch1}").replace(second + "\n", "")
    moved += "sco-extra 1.0-1 all\n"
    image.write_text(moved)
    bad = cli("check", str(image), "--file", str(pins))
    assert bad.returncode == 1
    drift = [ln for ln in bad.stderr.splitlines() if ln.startswith("debian_pins: drift: ")]
    assert f"debian_pins: drift: {name1} ({arch1}): {version1}.1 in the image, pinned {version1}" in drift
    assert f"debian_pins: drift: {name2} ({arch2}): pinned {version2}, not in the image" in drift
    assert "debian_pins: drift: sco-extra (all): 1.0-1 in the image, not pinned" in drift
    assert len(drift) == 3 and not any(f" {name3} " in ln for ln in drift)


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("git 1:2.39.5-0+deb12u3\n", "expected 'name version architecture'"),
        ("git 1 amd64\ngit 2 amd64\n", "git (amd64) listed twice"),
        ("# only a comment\n", "no package listed"),
    ],
)
def test_a_bad_list_is_refused_with_its_line(tmp_path: Path, text: str, said: str) -> None:
    pins = tmp_path / "pins.txt"
    pins.write_text(text)
    out = cli("check", str(tmp_path / "whatever"), "--file", str(pins))
    assert out.returncode == 2 and said in out.stderr, out.stderr
    assert cli("check", "--file", str(pins)).returncode == 2  # no list given: argparse's usage error


def test_a_missing_list_says_which_file(tmp_path: Path) -> None:
    out = cli("check", str(tmp_path / "packages.txt"))
    assert out.returncode == 2 and f"package list {tmp_path / 'packages.txt'}: No such file" in out.stderr


def test_apt_takes_the_preferences_as_pins(tmp_path: Path) -> None:
    """The machine's apt reads the preferences made from a list: every package pinned at its version, 1001."""
    pins = tmp_path / "pins.txt"
    listed = dpkg_list()
    pins.write_text(listed)
    prefs = tmp_path / "prefs"
    out = cli("preferences", "--file", str(pins))
    assert out.returncode == 0, out.stderr
    prefs.write_text(out.stdout)
    (tmp_path / "none").mkdir()  # apt reads no other preferences (the machine's own parts)
    name, version, _ = next(ln.split() for ln in listed.splitlines() if ln.startswith("dpkg "))
    policy = subprocess.run(
        ["apt-cache", "-o", f"Dir::Etc::preferences={prefs}", "-o", f"Dir::Etc::PreferencesParts={tmp_path / 'none'}",
         "policy", name],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert policy.returncode == 0 and "W:" not in policy.stderr and "E:" not in policy.stderr, policy.stderr
    # the installed version carries the pin's priority (apt's version table: " *** VERSION 1001")
    assert f"*** {version} 1001" in policy.stdout, policy.stdout
