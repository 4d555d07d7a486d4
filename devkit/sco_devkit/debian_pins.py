"""constraints/ee-debian.txt: the exact Debian packages of the execution environment `make ee` builds.

constraints/control.txt pins what pip installs; the Debian packages (the base's, and python3.11, python3-pip,
openssh-client, git that the build installs with apt) came from the mirror as each build found it, so a point release
between two builds changed the image. This file is what the image held when it was last written (every package,
``name version architecture``, as ``dpkg-query -W`` lists them). scripts/ee.sh gives the build an apt preferences file
made from it (each package held at its version, Pin-Priority 1001: apt installs that version, up or down) and, after
the build, compares the image's packages with it: any package added, gone or at another version fails the build.
A version the mirror no longer serves (Debian keeps only a release's latest) is then such a drift: rewrite the file
on purpose, or point the build at a snapshot mirror (snapshot.debian.org) that still has it.

    python -m sco_devkit.debian_pins preferences          apt preferences from the file, on stdout
    python -m sco_devkit.debian_pins check  DPKG_LIST      exit 1 with the drift unless the list is the file's
    python -m sco_devkit.debian_pins write  DPKG_LIST      write the file from an image's list (EE_DEBIAN_PINS=write)

DPKG_LIST: lines ``name version architecture`` (``dpkg-query -W -f='${Package} ${Version} ${Architecture}\\n'``), or
`make ee`'s .work/ee/packages.txt, whose ``## dpkg`` section is that.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FILE = REPO / "constraints" / "ee-debian.txt"

HEADER = """\
# The exact Debian packages of the execution environment `make ee` builds on its Debian base (every package of the
# image: name version architecture). scripts/ee.sh holds apt to these versions during the build (an apt preferences
# file, Pin-Priority 1001) and fails when the image differs from this list (a package added, gone or at another
# version). Written from a built image by `EE_DEBIAN_PINS=write make ee` (python -m sco_devkit.debian_pins write);
# rewrite it on purpose only (a Debian point release, a package added to bindep.txt), and say so in the commit.
"""

# Debian policy: a package name is lower case letters, digits and + - . (at least two characters, starting with an
# alphanumeric); a version has no white space; an architecture is a word (amd64, all, ...)
_LINE = re.compile(r"([a-z0-9][a-z0-9+.-]+) (\S+) ([a-z0-9-]+)")


class PinsError(Exception):
    """A pins file or a package list that cannot be read: says where and what."""


def parse(text: str, where: str) -> dict[tuple[str, str], str]:
    """``(name, architecture) -> version`` from lines ``name version architecture`` (comments and blank lines
    skipped; a ``## dpkg`` section is taken alone when the text has one, as .work/ee/packages.txt does)."""
    if "## dpkg\n" in text:
        text = text.split("## dpkg\n", 1)[1].split("\n## ", 1)[0]
    out: dict[tuple[str, str], str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _LINE.fullmatch(line)
        if not m:
            raise PinsError(f"{where}:{n}: expected 'name version architecture', got {raw!r}")
        name, version, arch = m.groups()
        if (name, arch) in out:
            raise PinsError(f"{where}:{n}: {name} ({arch}) listed twice")
        out[(name, arch)] = version
    if not out:
        raise PinsError(f"{where}: no package listed")
    return out


def drift(pins: dict[tuple[str, str], str], image: dict[tuple[str, str], str]) -> list[str]:
    """What differs, one line a package: pinned but not in the image, in the image but not pinned, another version."""
    lines = []
    for key in sorted(pins.keys() | image.keys()):
        name, arch = key
        want, got = pins.get(key), image.get(key)
        if want == got:
            continue
        if got is None:
            lines.append(f"{name} ({arch}): pinned {want}, not in the image")
        elif want is None:
            lines.append(f"{name} ({arch}): {got} in the image, not pinned")
        else:
            lines.append(f"{name} ({arch}): {got} in the image, pinned {want}")
    return lines


def preferences(pins: dict[tuple[str, str], str]) -> str:
    """apt_preferences(5) holding every pinned package at its version (1001: installed even as a downgrade).
    Architecture-qualified (name:arch) so that a package pinned for one architecture leaves the other alone."""
    stanzas = [
        f"Package: {name}:{arch}\nPin: version {version}\nPin-Priority: 1001\n"
        if arch != "all"
        else f"Package: {name}\nPin: version {version}\nPin-Priority: 1001\n"
        for (name, arch), version in sorted(pins.items())
    ]
    return "# constraints/ee-debian.txt (python -m sco_devkit.debian_pins preferences)\n\n" + "\n".join(stanzas)


def render(image: dict[tuple[str, str], str]) -> str:
    return HEADER + "".join(f"{name} {version} {arch}\n" for (name, arch), version in sorted(image.items()))


def _read(path: Path, what: str) -> str:
    try:
        return path.read_text()
    except OSError as e:
        raise PinsError(f"{what} {path}: {e.strerror}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sco_devkit.debian_pins", description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["preferences", "check", "write"])
    p.add_argument("dpkg_list", nargs="?", type=Path, help="the image's dpkg-query -W list (check, write)")
    p.add_argument("--file", type=Path, default=FILE, help=f"the pins file (default {FILE.relative_to(REPO)})")
    a = p.parse_args(argv)
    if a.command != "preferences" and a.dpkg_list is None:
        p.error(f"{a.command} needs DPKG_LIST (the image's package list)")
    try:
        if a.command == "write":
            image = parse(_read(a.dpkg_list, "package list"), str(a.dpkg_list))
            a.file.write_text(render(image))
            print(f"debian_pins: wrote {a.file} ({len(image)} packages)")
            return 0
        pins = parse(_read(a.file, "pins file"), str(a.file))
        if a.command == "preferences":
            sys.stdout.write(preferences(pins))
            return 0
        bad = drift(pins, parse(_read(a.dpkg_list, "package list"), str(a.dpkg_list)))
    except PinsError as e:
        print(f"debian_pins: {e}", file=sys.stderr)
        return 2
    for line in bad:
        print(f"debian_pins: drift: {line}", file=sys.stderr)
    if bad:
        print(f"debian_pins: {len(bad)} packages differ from {a.file} (rewrite it on purpose: EE_DEBIAN_PINS=write)",
              file=sys.stderr)  # fmt: skip
        return 1
    print(f"debian_pins: the image's {len(pins)} Debian packages are {a.file}'s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
