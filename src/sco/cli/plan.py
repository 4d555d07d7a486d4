"""``sco plan``: the portfolio planner, target instances per pool with every decision explained (issues 11, 17)."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from sco.cli._common import _add_trust, _env, _keyring, _read


def cmd_plan(args: argparse.Namespace) -> int:
    from sco.contract.bundle import Bundle
    from sco.control.inputs import contracts_from_bundle, parse, plan_input, read_document, references
    from sco.control.planner import plan
    from sco.errors import ConfigError

    bundle = Bundle.from_bytes(_read(args.bundle), _keyring(args), args.bundle)
    doc = parse(read_document(_read(args.input), args.input), args.input)
    contracts = contracts_from_bundle(bundle.contracts)
    if problems := references(doc, contracts, args.input):
        raise ConfigError(f"{args.input}: names what is not there", problems)
    inp = plan_input(doc, contracts, time.time(), args.input)
    result = plan(inp)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, sort_keys=True))
        return 0
    print(f"{'pool':<24} {'kind':<12} {'now':>5} {'target':>6} {'launch':>6} {'delete':>6} {'cost/h':>8}  subset")
    for x in result.pools:
        print(
            f"{x.pool:<24} {x.kind:<12} {x.current:>5} {x.target:>6} {x.launch:>6} {len(x.delete):>6} "
            f"{x.cost_per_hour!s:>8}  {','.join(x.launch_contracts)}"
        )
    for name, milli in sorted(result.shortfall_milli.items()):
        print(f"shortfall {name}: {milli / 1000:g} units (for the fallback arbiter)")
    s = result.solver
    gap = "nothing proved" if s.get("gap") is None else f"gap {s['gap']:.2%}"
    print(f"new capacity {result.cost_per_hour}/h; solver {s.get('name')} ({s.get('status')}, {gap})")
    print(f"plan {result.digest[:16]}: {'changes' if result.changed else 'unchanged'}")
    if args.explain:
        print()
        for line in result.explain():
            print(line)
    return 0


def register(sub: Any) -> None:
    x = sub.add_parser("plan", help="the portfolio planner: target instances per pool, every decision explained")
    x.add_argument("--input", required=True, metavar="FILE", help="pools, settings, reservations, fleet, demand")
    x.add_argument("--bundle", default=_env("SCO_BUNDLE"), required=_env("SCO_BUNDLE") is None, help="[$SCO_BUNDLE]")
    _add_trust(x)
    x.add_argument("--explain", action="store_true", help="print every decision with its reason")
    x.add_argument("--json", action="store_true", help="the whole plan as JSON")
    x.set_defaults(func=cmd_plan)
