"""Lookup plugin sco.orchestrator.nkey: a NATS user nkey kept in a seed file on the controller, made on first use."""

from __future__ import annotations

DOCUMENTATION = r"""
name: nkey
author: Spot Capacity Orchestrator developers (@sco-dev)
short_description: A NATS user nkey from a seed file on the controller, made on first use
description:
  - Returns the public key (C(U...)) of the user nkey whose seed is in the file named by the term, or the seed
    itself with O(part=seed). A missing file is made first (a new random seed, mode 0600, its directory 0700), as
    C(ansible.builtin.password) makes its password files; an existing one is only read.
  - The relay's configuration holds the public keys alone; the seed goes only to the client that is that user.
  - Needs the C(nkeys) Python package on the controller (a dependency of spot-capacity-orchestrator).
options:
  _terms:
    description: Path of the seed file on the controller.
    required: true
  part:
    description: What to return.
    type: str
    choices: [public, seed]
    default: public
"""

EXAMPLES = r"""
- name: The relay user's public key, for nats-server.conf
  ansible.builtin.debug:
    msg: "{{ lookup('sco.orchestrator.nkey', sco_credentials_dir ~ '/nats/reclaimer.nk') }}"
"""

RETURN = r"""
_raw:
  description: One public key (C(U...)) or seed (C(SU...)) per term.
  type: list
  elements: str
"""

import os

from ansible.errors import AnsibleError
from ansible.plugins.lookup import LookupBase

try:
    import nkeys

    HAS_NKEYS = True
except ImportError:
    HAS_NKEYS = False


def _seed(path: str) -> bytes:
    """The seed in ``path``, made (atomically, 0600) when the file is not there."""
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
        seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(seed + b"\n")
        # another run may have made it meanwhile: the first one stays, so every reader gets the same key
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    with open(path, "rb") as f:
        seed = f.read().strip()
    try:
        nkeys.from_seed(bytearray(seed))
    except Exception as e:
        raise AnsibleError(f"sco.orchestrator.nkey: {path} holds no NATS user seed ({type(e).__name__})") from None
    if not seed.startswith(b"SU"):
        raise AnsibleError(f"sco.orchestrator.nkey: {path} holds a seed of another kind than a user's (SU...)")
    return seed


class LookupModule(LookupBase):
    def run(self, terms, variables=None, **kwargs):  # type: ignore[no-untyped-def]
        if not HAS_NKEYS:
            raise AnsibleError("sco.orchestrator.nkey needs the nkeys Python package on the controller")
        self.set_options(var_options=variables, direct=kwargs)
        part = self.get_option("part")
        out = []
        for term in terms:
            seed = _seed(str(term))
            if part == "seed":
                out.append(seed.decode())
            else:
                out.append(nkeys.from_seed(bytearray(seed)).public_key.decode())
        return out
