# Shared option documentation for modules that sign bundles.
from __future__ import annotations


class ModuleDocFragment:
    DOCUMENTATION = r"""
options:
  signing_keys:
    description:
      - Ed25519 private key files (C(sco keygen)); each signs the bundle.
      - Give the new and the old key during a rotation, so nodes that trust either accept it.
    type: list
    elements: path
    required: true
"""
