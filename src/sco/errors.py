"""One exception tree for the whole project.

Errors carry a list of problems, each naming where it is (file and field path); the CLI edge turns
them into one line each and a non-zero exit. Nothing below the CLI prints or exits.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One thing wrong with one input, located precisely enough to fix it."""

    where: str  # e.g. "contracts/etl.yaml" or "bundle.json"
    field: str  # dotted path inside it, e.g. "spec.drainBudgetSeconds"; "" for the whole input
    message: str

    def __str__(self) -> str:
        loc = f"{self.where}: {self.field}" if self.field else self.where
        return f"{loc}: {self.message}"


class ScoError(Exception):
    """Base of every error the project raises on purpose."""

    exit_code = 1

    def __init__(self, message: str, problems: list[Problem] | None = None) -> None:
        super().__init__(message)
        self.problems: list[Problem] = list(problems or [])

    def lines(self) -> list[str]:
        return [str(p) for p in self.problems] or [str(self)]


class ContractError(ScoError):
    """The contract repository has invalid or infeasible contracts."""

    # 13, not 2: argparse exits 2 for a usage error, and a script telling a wrong flag from a wrong contract
    # could not (2 in the first release; the changelog's breaking changes say so). 7 to 12 are taken (README's table).
    exit_code = 13


class BundleError(ScoError):
    """A bundle is malformed, forged, untrusted or rolled back."""

    exit_code = 3


class UntrustedKeyError(BundleError):
    """No signature on the bundle is by a key the keyring trusts."""


class SignatureError(BundleError):
    """A signature by a trusted key does not match the bundle's bytes."""


class RollbackError(BundleError):
    """The bundle's serial is lower than the one already accepted."""


class NoticeAuthError(ScoError):
    """A reclaim notice is not signed by a trusted notice key (or is not a notice at all)."""

    exit_code = 3

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind  # "malformed" | "unsigned" | "untrusted" | "forged"
        self.reason = reason


class KeyFileError(ScoError):
    """A key file is missing, malformed or has unsafe permissions."""

    exit_code = 4


class ConfigError(ScoError):
    """A configuration file or flag is invalid."""

    exit_code = 5


class FetchError(ScoError):
    """The bundle could not be fetched from the distributor."""

    exit_code = 6
