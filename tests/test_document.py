"""The one JSON-or-YAML loader (sco._document): planning inputs, the acquire step's options and a kubeconfig read
alike, and every error naming the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from sco._document import load_document, read_document
from sco.errors import ConfigError


def test_json_is_read_as_json_and_the_rest_as_yaml() -> None:
    assert load_document(b' {"n": 1e3}', "plan") == {"n": 1000.0}  # YAML 1.1 would make "1e3" a string
    assert load_document(b"x: [1, 2]\n", "plan.yaml") == {"x": [1, 2]}
    assert load_document(b"{pools: []}", "plan.yaml") == {"pools": []}  # looks like JSON, is YAML: read as YAML
    assert load_document(b"", "empty.yaml") is None


@pytest.mark.parametrize(
    "raw,where,message",
    [
        (b"x: 1", "in.json", r"^in\.json: not JSON: "),
        (b"{x: [", "in.json", r"^in\.json: not JSON: "),
        (b"x: [", "hall.yaml", r"^hall\.yaml: not YAML/JSON: "),
        (b"{x: [", "hall.yaml", r"^hall\.yaml: not YAML/JSON: "),
        (b"\xff\xfe: x", "bad.yaml", r"^bad\.yaml: not YAML/JSON: "),
        (b"[" * 100_000 + b"]" * 100_000, "deep.json", r"^deep\.json: not a document: nested too deeply$"),
    ],
)
def test_errors_name_the_file(raw: bytes, where: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_document(raw, where)


def test_what_it_should_have_been_and_the_error_type_are_the_callers() -> None:
    class KubeConfigError(Exception):
        pass

    with pytest.raises(KubeConfigError, match=r"^/etc/k\.conf: not a kubeconfig: nested too deeply$"):
        load_document(b"[" * 100_000, "/etc/k.conf", what="kubeconfig", error=KubeConfigError)
    with pytest.raises(KubeConfigError, match=r"^/etc/k\.conf: not YAML/JSON"):
        load_document(b"a: [", "/etc/k.conf", error=KubeConfigError)


def test_a_file_is_read_and_an_unreadable_one_named(tmp_path: Path) -> None:
    (tmp_path / "acquire.yaml").write_text("hall: h\n")
    assert read_document(tmp_path / "acquire.yaml") == {"hall": "h"}
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match=rf"^{missing}: No such file or directory$"):
        read_document(missing)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ConfigError, match=r"broken\.json: not JSON"):
        read_document(tmp_path / "broken.json")


def test_a_broken_kubeconfig_is_a_config_error_naming_it(tmp_path: Path) -> None:
    """It was PyYAML's own exception, which the agent's and the publisher's handlers did not take."""
    from sco.schedulers.kube import Credentials, KubeConfigError

    p = tmp_path / "kubeconfig"
    p.write_text("clusters: [\n")
    with pytest.raises(KubeConfigError, match=rf"^{p}: not YAML/JSON"):
        Credentials.from_kubeconfig(p)
