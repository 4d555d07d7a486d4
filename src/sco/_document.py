"""The one reader of a JSON-or-YAML document a person or a playbook wrote: planning inputs, the acquire step's
options, a kubeconfig.

JSON is read as JSON (what modules and scripts write; PyYAML's loader took 90% of a 5k-node plan), anything else as
YAML, with libyaml's loader when there is one. A document that only looks like JSON (a YAML flow mapping such as
``{pools: []}``) is read as YAML unless its name ends in ``.json``. PyYAML is imported only for YAML, so the agent's
import path stays lean. Every error names the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sco.errors import ConfigError


def load_document(raw: bytes, where: str, *, what: str = "document", error: type[Exception] = ConfigError) -> Any:
    """``raw`` parsed; ``error`` (a ConfigError unless said) naming ``where`` when it is neither JSON nor YAML or is
    nested too deeply to read (``what`` says what it should have been)."""
    deep = f"{where}: not a {what}: nested too deeply"
    if where.endswith(".json") or raw.lstrip()[:1] in (b"{", b"["):
        try:
            return json.loads(raw)
        except RecursionError:
            raise error(deep) from None
        except (ValueError, UnicodeDecodeError) as e:
            if where.endswith(".json"):
                raise error(f"{where}: not JSON: {e}") from None
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        return yaml.load(raw, Loader=loader)
    except RecursionError:
        raise error(deep) from None
    except yaml.YAMLError as e:
        raise error(f"{where}: not YAML/JSON: {e}") from None


def read_document(path: str | Path, *, what: str = "document") -> Any:
    """The document in the file ``path``; a ConfigError naming it when it cannot be read or parsed."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: {e.strerror or e}") from None
    return load_document(raw, str(path), what=what)
