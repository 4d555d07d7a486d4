"""cloud-init user-data for a new reclaimable instance.

Carries what the node needs from its first second, before the first refresh: the trusted keys and a
signed subset bundle (hall policy plus the contracts it may run). The agent therefore never runs work
with an unknown drain budget, even if the distributor is unreachable at boot.
"""

from __future__ import annotations

import base64
import re
import time

import yaml

from sco.contract.bundle import Bundle, bundle_lifetime_s, subset_payload
from sco.contract.signing import PrivateKey, PublicKey, public_key_text, sign
from sco.errors import BundleError, ConfigError

# Nova refuses user_data above 65535 bytes once base64-encoded.
NOVA_USER_DATA_LIMIT = 65535
TRUST_DIR = "/etc/sco/trusted"
CACHE_PATH = "/var/lib/sco/bundle/bundle.json"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _env_problem(name: str, value: str) -> str | None:
    """agent.env is read line by line (systemd's EnvironmentFile=): one line per setting, nothing more."""
    if not _ENV_NAME.match(name):
        return "not an environment variable name"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        return "control characters (a newline would add a setting of its own)"
    return None


RELAY_CA_PATH = "/etc/sco/relay-ca.crt"  # as role node_agent writes it (node_agent_nats_ca)


def render(
    bundle: Bundle,
    signing_keys: list[PrivateKey],
    trusted: list[PublicKey],
    *,
    schedulers: list[str] | None = None,
    names: list[str] | None = None,
    node_env: dict[str, str] | None = None,
    now: float | None = None,
    relay_ca: str = "",
) -> str:
    """The instance's user-data. Its subset bundle is dated from ``now`` (the launch) for the hall's bundle
    lifetime, not the full bundle's ``expiresAt``: the launch signs it, and a hall whose full bundle was last
    re-signed days ago must still boot nodes that take their budgets (a node never takes up an expired bundle).
    ``relay_ca``: the CA (PEM) the hall's relays' TLS certificates chain to, written to RELAY_CA_PATH and named by
    agent.env's SCO_AGENT_NATS_CA_FILE (unless the operator's node_env names another), so the new instance checks
    the relay before it enrols or sends anything."""
    if relay_ca:
        if "-----BEGIN CERTIFICATE-----" not in relay_ca:
            raise ConfigError("relay CA: not a PEM certificate (-----BEGIN CERTIFICATE-----)")
        node_env = {"SCO_AGENT_NATS_CA_FILE": RELAY_CA_PATH, **(node_env or {})}
    bad = [f"{k!r}: {why}" for k, v in sorted((node_env or {}).items()) if (why := _env_problem(k, v))]
    if bad:
        raise ConfigError(f"node environment: {'; '.join(bad)}")
    payload = subset_payload(bundle, schedulers=schedulers, names=names)
    payload["expiresAt"] = int(time.time() if now is None else now) + bundle_lifetime_s(bundle.policy)
    subset = sign(payload, signing_keys)
    files = [
        {
            "path": f"{TRUST_DIR}/{k.keyid}.pub",
            "permissions": "0644",
            "content": public_key_text(k),
        }
        for k in trusted
    ]
    files.append(
        {
            "path": CACHE_PATH,
            "permissions": "0644",
            "encoding": "b64",
            "content": base64.b64encode(subset).decode("ascii"),
        }
    )
    if relay_ca:
        files.append({"path": RELAY_CA_PATH, "permissions": "0644", "content": relay_ca.strip() + "\n"})
    if node_env:
        files.append(
            {
                "path": "/etc/sco/agent.env",
                # a one-time enrolment token is a secret until the agent has used it: root's (systemd's) only
                "permissions": "0600" if node_env.get("SCO_AGENT_ENROL_TOKEN") else "0644",
                "content": "".join(f"{k}={v}\n" for k, v in sorted(node_env.items())),
            }
        )
    text = "#cloud-config\n" + yaml.safe_dump({"write_files": files}, sort_keys=False, width=1 << 20)
    encoded = len(base64.b64encode(text.encode()))
    if encoded > NOVA_USER_DATA_LIMIT:
        raise BundleError(
            f"user-data is {encoded} bytes base64-encoded, above Nova's limit of {NOVA_USER_DATA_LIMIT}: "
            f"narrow it with --scheduler or --contract ({len(payload['contracts'])} contracts selected)"
        )
    return text
