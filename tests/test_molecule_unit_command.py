"""molecule/shared/verify.py's service_command: how every molecule scenario runs a unit's command lines on a test
host, which has no systemd as PID 1. It must hand the command what systemd would: for User=, the user's USER,
LOGNAME, HOME and SHELL from its passwd entry (systemd.exec(5)), not the SSH session's root ones (with USER=root,
ansible's `~` in the control loop's run was root's home and its first task failed); for DynamicUser=, the dynamic
user's name and no HOME or SHELL; the unit's Group=; Environment= then EnvironmentFile=, each overriding the one
before; its RuntimeDirectory given to its user; a "+" line run as root with the user's environment still.

A real test host (tests/testhosts.py: sshd in a chroot in its own network namespace, reached over SSH; copy-on-write
over the test rootfs) with units written as a role would write them. Needs root, as every test host does."""

from __future__ import annotations

import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "molecule" / "shared"))
import verify  # molecule/shared/verify.py

from tests.testhosts import TestHost, ensure_rootfs

# what each command prints (systemd's "$$" is "$"): its uid, gid and groups, the variables (UNSET when unset) and
# the owner of its runtime directory
SHOW = (
    "/bin/sh -c 'echo id=$$(id -u):$$(id -g):$$(id -G); "
    "for v in USER LOGNAME HOME SHELL GREETING RUNTIME_DIRECTORY; do eval echo $$v=\\$${$$v-UNSET}; done; "
    "stat -c dir=%U:%G $${RUNTIME_DIRECTORY:-/}'"
)

UNITS = {
    # a role's unit with its own user and group, as the control loop's
    "svc-user.service": f"""[Service]
User=svc
Group=svcgrp
Environment=GREETING=from-environment
EnvironmentFile=/etc/svc.env
RuntimeDirectory=svc
ExecStartPre=+{SHOW}
ExecStart={SHOW}
""",
    "svc-dynamic.service": f"""[Service]
DynamicUser=yes
ExecStart={SHOW}
""",
    "svc-root.service": f"""[Service]
ExecStart={SHOW}
""",
}


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestHost]:
    h = TestHost(tmp_path_factory.mktemp("unitcmd"), "unitcmd").create(image=ensure_rootfs(), overlay=True)
    try:
        # svc's own group is svc; the unit says svcgrp; its shell is not root's
        h.ssh("groupadd svcgrp && useradd --system --user-group --home-dir /var/lib/svc --shell /usr/sbin/nologin svc")
        for name, text in UNITS.items():
            (h.root / "etc" / "systemd" / "system" / name).write_text(text)
        (h.root / "etc" / "svc.env").write_text('GREETING="from the file"\n')
        yield h
    finally:
        h.destroy()


def _start(h: TestHost, unit: str, key: str = "ExecStart") -> dict[str, str]:
    """The unit's command run as the molecule scenarios run it (the line on stdin of bash over SSH), its output."""

    def run(cmd: str) -> str:
        return h.ssh("bash", "-c", shlex.quote(cmd)).stdout

    line = verify.service_command(run, unit, key)
    out = subprocess.run(
        ["ssh", *h.ssh_args(), "root@127.0.0.1", "bash", "-s"], input=line, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, f"{unit} {key}: exit {out.returncode}\n{line}\n{out.stdout}{out.stderr}"
    return dict(ln.split("=", 1) for ln in out.stdout.splitlines() if "=" in ln)


def test_a_units_user_gets_the_environment_systemd_gives_it(host: TestHost) -> None:
    uid = host.ssh("id", "-u", "svc").stdout.strip()
    svc_gid = host.ssh("id", "-g", "svc").stdout.strip()
    grp = host.ssh("getent", "group", "svcgrp").stdout.split(":")[2]

    got = _start(host, "svc-user.service")
    # the passwd entry's, not the SSH session's (root, /root, /bin/bash)
    assert (got["USER"], got["LOGNAME"], got["HOME"], got["SHELL"]) == (
        "svc", "svc", "/var/lib/svc", "/usr/sbin/nologin"
    ), got  # fmt: skip
    # Group= is the primary group; the user's own groups stay supplementary (systemd's initgroups)
    ids, gid, groups = got["id"].split(":")
    assert (ids, gid) == (uid, grp), got
    assert set(groups.split()) == {grp, svc_gid}, got
    # EnvironmentFile= overrides Environment= (systemd's order)
    assert got["GREETING"] == "from the file", got
    # the runtime directory made and given to the unit's user and group
    assert got["RUNTIME_DIRECTORY"] == "/run/svc" and got["dir"] == "svc:svcgrp", got

    # "+": run as root, the environment still the unit's user's
    pre = _start(host, "svc-user.service", "ExecStartPre")
    assert pre["id"].split(":")[:2] == ["0", "0"], pre
    assert (pre["USER"], pre["HOME"], pre["SHELL"]) == ("svc", "/var/lib/svc", "/usr/sbin/nologin"), pre


def test_a_dynamic_user_and_a_unit_without_user_get_no_session_leftovers(host: TestHost) -> None:
    got = _start(host, "svc-dynamic.service")
    # systemd 252: the dynamic user's name (the unit's), no home or shell; the harness runs it as root
    dyn = ("svc-dynamic", "svc-dynamic", "UNSET", "UNSET")
    assert (got["USER"], got["LOGNAME"], got["HOME"], got["SHELL"]) == dyn, got
    got = _start(host, "svc-root.service")
    assert (got["USER"], got["LOGNAME"], got["HOME"], got["SHELL"]) == ("UNSET",) * 4, got


def test_a_user_with_no_passwd_entry_is_refused_by_name(host: TestHost) -> None:
    unit = host.root / "etc/systemd/system/svc-nobody.service"
    unit.write_text(f"[Service]\nUser=no-such-user\nExecStart={SHOW}\n")

    def run(cmd: str) -> str:
        return host.ssh("bash", "-c", shlex.quote(cmd)).stdout

    with pytest.raises(AssertionError, match="User=no-such-user has no passwd entry"):
        verify.service_command(run, "svc-nobody.service")
