"""Config, state and key problems: one line and the same exit code at ``check-config`` as
at ``run`` (5 configuration or state, 4 a key file), never a traceback; a serial past the bound refused; a
refused cached bundle named with its reason at start."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sco.agent.bundle_cache import BundleCache
from sco.contract.bundle import MAX_SERIAL, Bundle
from sco.contract.compiler import compile_repo
from sco.contract.signing import Keyring, PrivateKey, generate, sign, write_keypair
from sco.errors import BundleError, ContractError
from tests.harness import BIN, sample_repo

AGENT = str(BIN / "sco-agent")
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


@pytest.fixture
def root() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="sco-state-"))  # not under pytest's 0700 tmp: another user must reach it
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _config(root: Path, key: PrivateKey, trust: str = "trusted") -> Path:
    (root / trust).mkdir(exist_ok=True)
    write_keypair(key, root / "k.key", root / "trusted" / "k.pub")
    for d in ("state", "state/spool", "state/bundle"):
        (root / d).mkdir(exist_ok=True)
        (root / d).chmod(0o777)
    cfg = root / f"agent-{trust}.toml"
    cfg.write_text(
        f'[agent]\nhall = "local"\nnode = "n1"\nscheduler = "slurm"\nstate_dir = "{root}/state"\n'
        f'trust_dir = "{root}/{trust}"\nnats_url = "nats://127.0.0.1:9"\ncheckpoint_socket = ""\n'
    )
    cfg.chmod(0o644)
    return cfg


def _run(argv: list[str], timeout: float = 20) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def node_agent(node_wheelhouse: Path) -> Iterator[str]:
    """The agent as a node installs it, where another user can read it: a checkout may sit in a 0700 directory
    (CI's mktemp -d), out of that user's reach."""
    from tests.node_install import install_venv

    d = Path(tempfile.mkdtemp(prefix="sco-agent-venv-"))
    d.chmod(0o755)
    yield str(install_venv(node_wheelhouse, d / "venv") / "bin" / "sco-agent")
    shutil.rmtree(d, ignore_errors=True)


def _unreadable_spool(root: Path) -> str:
    spool = root / "state" / "spool" / "events.spool"
    spool.write_bytes(b"")
    spool.chmod(0o600)  # root's: the agent runs as another user
    return f"{spool}: this user (uid 65534) may not read and write it"


def _unreadable_state_dir(root: Path) -> str:
    (root / "state").chmod(0o700)  # root's: nothing inside can even be looked at (was a traceback at both)
    return f"{root / 'state'}: this user (uid 65534) may not use it"


def _bundle_file_a_directory(root: Path) -> str:
    (root / "state" / "bundle" / "bundle.json").mkdir()  # check-config said ok, run exit 5
    return f"{root / 'state' / 'bundle' / 'bundle.json'}: expected a file"


@pytest.mark.parametrize("spoil", [_unreadable_spool, _unreadable_state_dir, _bundle_file_a_directory])
def test_a_state_problem_is_one_line_and_exit_5_at_both(
    root: Path, key: PrivateKey, node_agent: str, spoil: Callable[[Path], str]
) -> None:
    cfg = _config(root, key)
    said = spoil(root)
    for cmd in ("check-config", "run"):
        p = _run([*NOBODY, node_agent, cmd, "--config", str(cfg)])
        assert p.returncode == 5, (cmd, p.stderr)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in p.stderr, (cmd, p.stderr)
        assert said in lines[0], (cmd, lines[0])


def test_a_trust_dir_this_user_cannot_read_is_named_so(root: Path, key: PrivateKey, node_agent: str) -> None:
    """It was "holds no *.pub key" (glob finds nothing where it may not look): the fix is a chmod, not a key."""
    cfg = _config(root, key)
    (root / "trusted").chmod(0o700)
    for cmd in ("check-config", "run"):
        p = _run([*NOBODY, node_agent, cmd, "--config", str(cfg)])
        assert p.returncode == 5 and "Traceback" not in p.stderr, (cmd, p.stderr)
        assert f"{root / 'trusted'}: this user (uid 65534) may not read it" in p.stderr, (cmd, p.stderr)


def test_a_corrupt_trusted_key_is_exit_4_at_check_config_as_at_run(root: Path, key: PrivateKey) -> None:
    cfg = _config(root, key)
    (root / "trusted" / "zz-broken.pub").write_text("not a key\n")
    for cmd in ("check-config", "run"):
        p = _run([AGENT, cmd, "--config", str(cfg)])
        assert p.returncode == 4, (cmd, p.returncode, p.stderr)
        assert "zz-broken.pub: not a key file" in p.stderr and "Traceback" not in p.stderr


def test_a_refused_cached_bundle_is_named_with_its_reason(root: Path, key: PrivateKey) -> None:
    cfg = _config(root, key)
    (root / "state" / "bundle" / "bundle.json").write_bytes(sign(compile_repo(sample_repo()), [generate()]))
    p = subprocess.Popen([AGENT, "run", "--config", str(cfg)], stderr=subprocess.PIPE, text=True)
    try:
        end, seen = time.monotonic() + 15, ""
        assert p.stderr is not None
        while time.monotonic() < end and "every NATS notice is refused" not in seen:
            seen += p.stderr.readline()
    finally:
        p.kill()
        p.wait()
    assert "is refused (cached bundle does not verify:" in seen and "no bundle cached" not in seen, seen


def test_a_serial_past_the_bound_is_refused_and_locks_nobody_out(tmp_path: Path, key: PrivateKey) -> None:
    keyring = Keyring([key.public])
    cache = BundleCache(tmp_path / "cache", keyring)
    huge = sign({**compile_repo(sample_repo()), "serial": 10**40}, [key])
    with pytest.raises(BundleError) as refused:
        Bundle.from_bytes(huge, keyring)
    assert any("serial: expected an integer from 1 to 9007199254740991" in line for line in refused.value.lines())
    assert cache.offer(huge).outcome == "refused"
    assert cache.offer(sign(compile_repo(sample_repo(), serial=2), [key])).outcome == "accepted"
    assert Bundle.from_bytes(sign(compile_repo(sample_repo(), serial=MAX_SERIAL), [key]), keyring).serial == MAX_SERIAL
    with pytest.raises(ContractError, match="--serial"):
        compile_repo(sample_repo(), serial=MAX_SERIAL + 1)


def _user_seed() -> bytes:
    import nkeys

    return bytes(nkeys.encode_seed(b"\x02" * 32, nkeys.PREFIX_BYTE_USER))


def _seed_garbage(seed: Path) -> str:
    seed.write_text("garbage\n")
    seed.chmod(0o600)
    return f"{seed}: not an nkey seed"


def _seed_of_an_account(seed: Path) -> str:
    import nkeys

    seed.write_bytes(bytes(nkeys.encode_seed(b"\x02" * 32, nkeys.PREFIX_BYTE_ACCOUNT)) + b"\n")
    seed.chmod(0o600)
    return f"{seed}: an account seed; the agent connects as a user (SU...)"


def _seed_readable_by_all(seed: Path) -> str:
    seed.write_bytes(_user_seed() + b"\n")
    seed.chmod(0o644)
    return f"{seed}: the nkey seed is readable by group or others (chmod 600 it)"


def _seed_dev_zero(seed: Path) -> str:
    seed.symlink_to("/dev/zero")
    return f"{seed}: not a regular file"


@pytest.mark.parametrize("spoil", [_seed_garbage, _seed_of_an_account, _seed_readable_by_all, _seed_dev_zero])
def test_an_unusable_nkey_seed_is_one_line_and_exit_5_at_both(
    root: Path, key: PrivateKey, spoil: Callable[[Path], str]
) -> None:
    """Review 2, D4: a garbage seed, an account seed (SA...) and a seed everyone may read passed check-config,
    and run exited 0 after ``task nats failed`` and nkeys.ErrInvalidSeed's traceback."""
    cfg = _config(root, key)
    said = spoil(root / "s.nk")
    cfg.write_text(cfg.read_text() + f'nats_nkey_seed_file = "{root}/s.nk"\nmetrics_listen = ""\n')
    for cmd in ("check-config", "run"):
        p = _run([AGENT, cmd, "--config", str(cfg)])
        assert p.returncode == 5, (cmd, p.returncode, p.stderr)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in p.stderr, (cmd, p.stderr)
        assert "agent.nats_nkey_seed_file" in lines[0] and said in lines[0], (cmd, lines[0])


def test_a_user_seed_of_its_own_passes(root: Path, key: PrivateKey) -> None:
    """The check refuses only what nats-py would: a user seed, 0600, with the newline the role writes."""
    cfg = _config(root, key)
    (root / "s.nk").write_bytes(_user_seed() + b"\n")
    (root / "s.nk").chmod(0o600)
    cfg.write_text(cfg.read_text() + f'nats_nkey_seed_file = "{root}/s.nk"\n')
    p = _run([AGENT, "check-config", "--config", str(cfg)])
    assert p.returncode == 0 and p.stdout.endswith("ok (node n1, hall local, slurm)\n"), (p.stdout, p.stderr)


def test_an_unparseable_nats_url_is_one_line_and_exit_5_at_both(root: Path, key: PrivateKey) -> None:
    """Review 2, D5: ``nats://[::1`` was exit 1 and ``ValueError: Invalid IPv6 URL`` at both."""
    cfg = _config(root, key)
    cfg.write_text(cfg.read_text().replace('"nats://127.0.0.1:9"', '"nats://[::1"'))
    for cmd in ("check-config", "run"):
        p = _run([AGENT, cmd, "--config", str(cfg)])
        assert p.returncode == 5, (cmd, p.returncode, p.stderr)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in p.stderr, (cmd, p.stderr)
        assert "agent.nats_url: 'nats://[::1' is not a nats:// URL" in lines[0], (cmd, lines[0])


def test_a_failed_root_task_makes_run_exit_non_zero(
    root: Path, key: PrivateKey, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 2, D4: a root task that raised stopped the agent and run returned 0, so systemd's
    Restart=on-failure never restarted it. The fault is injected into the real agent's NATS task."""
    import asyncio

    from sco.agent import config
    from sco.agent.daemon import Agent
    from sco.agent.relay import RelayLink

    cfg_path = _config(root, key)
    cfg_path.write_text(cfg_path.read_text() + 'metrics_listen = ""\n')

    async def broken(self: RelayLink, stop: asyncio.Event) -> None:
        raise RuntimeError("injected: the NATS task failed")

    monkeypatch.setattr(RelayLink, "run", broken)
    agent = Agent(config.load(cfg_path, env={}))

    async def run() -> int:
        return await asyncio.wait_for(agent.run(), 30)

    assert asyncio.run(run()) == 1
    assert agent.failed_tasks == ["nats"]


def _key_fifo(path: Path) -> str:
    os.mkfifo(path)
    return f"{path}: not a key file (not a regular file)"


def _key_dev_zero(path: Path) -> str:
    path.symlink_to("/dev/zero")
    return f"{path}: not a key file (not a regular file)"


def _key_huge(path: Path) -> str:
    with path.open("wb") as f:
        f.truncate(200_000_000)  # sparse: 200 MB that cost no disk
    return f"{path}: not a key file (200000000 bytes)"


@pytest.mark.parametrize("spoil", [_key_fifo, _key_dev_zero, _key_huge])
def test_a_trusted_key_that_is_no_file_is_refused_before_it_is_read(
    root: Path, key: PrivateKey, spoil: Callable[[Path], str]
) -> None:
    """Review 2: a FIFO or /dev/zero named trusted/*.pub hung check-config and run; a 200 MB one was read whole."""
    cfg = _config(root, key)
    said = spoil(root / "trusted" / "zz.pub")
    for cmd in ("check-config", "run"):
        p = _run([AGENT, cmd, "--config", str(cfg)])
        assert p.returncode == 4, (cmd, p.returncode, p.stderr)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in p.stderr, (cmd, p.stderr)
        assert said in lines[0], (cmd, lines[0])


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_an_agent_config_that_is_no_file_is_refused_before_it_is_read(root: Path, key: PrivateKey, kind: str) -> None:
    """Review 2: the same as --config hung check-config and run."""
    cfg = _config(root, key)
    cfg.unlink()
    if kind == "fifo":
        os.mkfifo(cfg)
    else:
        cfg.symlink_to("/dev/zero")
    for cmd in ("check-config", "run"):
        p = _run([AGENT, cmd, "--config", str(cfg)])
        assert p.returncode == 5, (cmd, p.returncode, p.stderr)
        assert p.stderr == f"sco-agent: error: {cfg}: not a regular file\n", (cmd, p.stderr)
