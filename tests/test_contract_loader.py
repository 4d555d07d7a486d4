"""The compiler's YAML loader: exactly SafeLoader's result on what a contract repository holds, duplicate keys
refused (PyYAML keeps the last one silently), and faster than SafeLoader (the hot path of a 10,000-contract
compile: `make bench BENCH=contracts` compares it with a C-YAML parse of the same files)."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from sco.contract.compiler import _Loader

SAME = [
    "a: 1\nb: 0123\nc: 0x1f\nd: 1_000\ne: +5\nf: -3\ng: 3.5\nh: .inf\ni: yes\nj: ~\nk: null\nl: 2001-12-14\n",
    "m: '07'\nn: [1, 2, {x: y}]\nx: 0\ny: 00\nz: 10\nw: 1e3\nv: 190:20:30\nu: !!str 5\n",
    "- &s {a: [1, 2]}\n- *s\n- &t [x]\n- *t\n",
    "r: &r [1, *r]\n",
    "1: a\n'1': b\n!!str 12: x\n12: y\nfalse: t\n",
    "t: !!binary aGVsbG8=\nset: !!set {a, b}\nom: !!omap [a: 1, b: 2]\n",
    "---\na: 1\n---\n---\n[1, 2]\n--- plain\n",
    "key: |\n  multi\n  line\nfold: >\n  folded\n  text\n",
    "a: True\nb: OFF\nc: oN\nd: yEs\ne: Yes\nf: NO\ng: 0\nh: 7\ni: \u0663\nj: 12:30\nk: 1_0\nl: !!bool yes\n",
    "m: !!int 12\nn: 0o7\no: 09\np: 1\u0663\nq: !!bool True\nr: Off\ns: n\nt: y\nu: ON\n",
]


@pytest.mark.parametrize("doc", SAME)
def test_the_loader_builds_what_safeloader_builds(doc: str) -> None:
    ref = list(yaml.load_all(doc, Loader=yaml.CSafeLoader))
    got = list(yaml.load_all(doc, Loader=_Loader))
    assert repr(got) == repr(ref)
    assert [type(x) for x in got] == [type(x) for x in ref]


def test_aliases_are_shared_as_safeloader_shares_them() -> None:
    doc = yaml.load("- &s {a: 1}\n- *s\n", Loader=_Loader)
    assert doc[0] is doc[1]


@pytest.mark.parametrize(
    ("doc", "key"),
    [("a: 1\na: 2\n", "'a'"), ("a: {b: 1, b: 2}\n", "'b'"), ("- {1: x, 1: y}\n", "1"), ("a: 1\n? a\n: 2\n", "'a'")],
)
def test_duplicate_keys_are_refused(doc: str, key: str) -> None:
    with pytest.raises(yaml.constructor.ConstructorError, match=f"duplicate key {key}"):
        list(yaml.load_all(doc, Loader=_Loader))


def test_unhashable_keys_get_pyyamls_error() -> None:
    with pytest.raises(yaml.constructor.ConstructorError, match="found unhashable key"):
        list(yaml.load_all("? [1, 2]\n: x\n", Loader=_Loader))


@given(st.text(alphabet="0123456789+-._:eExXoObByYnNtTfFrRuUlLsS~\u0663 ", min_size=1, max_size=8))
def test_any_short_scalar_is_what_safeloader_makes_of_it(value: str) -> None:
    """The resolver tells decimal integers and booleans apart without PyYAML's regular expressions;
    whatever a plain scalar spells, the value (or the error) is SafeLoader's."""
    doc = f"k: {value}\n"
    try:
        ref: object = yaml.load(doc, Loader=yaml.CSafeLoader)
    except yaml.YAMLError as e:
        ref = type(e)
    try:
        got: object = yaml.load(doc, Loader=_Loader)
    except yaml.YAMLError as e:
        got = type(e)
    assert repr(got) == repr(ref) and type(got) is type(ref)
