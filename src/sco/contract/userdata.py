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
from sco.contract.signing import Delegation, PrivateKey, PublicKey, public_key_text, sign
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


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


# A launch whose delegation has less left than this is refused: its node would hold a bundle that expires within
# the hour (the node keeps it, but its budgets would be stale from its first hour).
MIN_DELEGATION_LEFT_S = 3600


def _check_delegation(d: Delegation, keys: list[PrivateKey], trusted: list[PublicKey], hall: str, now: int) -> None:
    if [k.keyid for k in keys] != [d.keyid]:
        raise ConfigError(
            f"launch delegation: it names launch key {d.keyid}, the signing keys are"
            f" {', '.join(k.keyid for k in keys) or 'none'} (give that one key)"
        )
    if d.hall != hall:
        raise ConfigError(f"launch delegation: it is for hall {d.hall!r}, the bundle is hall {hall!r}")
    if d.issuer and d.issuer not in {k.keyid for k in trusted}:
        raise ConfigError(f"launch delegation: signed by {d.issuer}, not a key the new instances trust")
    if now < d.issued_at or d.expires_at - now < MIN_DELEGATION_LEFT_S:
        raise ConfigError(
            f"launch delegation serial {d.serial} of launch key {d.keyid} is valid from {_utc(d.issued_at)} to"
            f" {_utc(d.expires_at)}: renew it on the controller (site.yml, or sco delegate) before launching"
        )


RELAY_CA_PATH = "/etc/sco/relay-ca.crt"  # as role node_agent writes it (node_agent_nats_ca)
DISTRIBUTOR_CA_PATH = "/etc/sco/distributor-ca.crt"  # as role node_agent writes it (node_agent_distributor_ca)
ENROL_CA_PATH = "/etc/sco/enrol-ca.crt"  # launched instances only: inventory nodes do not enrol


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
    delegation: Delegation | None = None,
    distributor_ca: str = "",
    enrol_ca: str = "",
) -> str:
    """The instance's user-data. Its subset bundle is dated from ``now`` (the launch) for the hall's bundle
    lifetime, not the full bundle's ``expiresAt``: the launch signs it, and a hall whose full bundle was last
    re-signed days ago must still boot nodes that take their budgets (a node never takes up an expired bundle).
    ``relay_ca``: the CA (PEM) the hall's relays' TLS certificates chain to, written to RELAY_CA_PATH and named by
    agent.env's SCO_AGENT_NATS_CA_FILE (unless the operator's node_env names another), so the new instance checks
    the relay before it enrols or sends anything. ``distributor_ca``: the CA an https distributor's certificate
    chains to, written to DISTRIBUTOR_CA_PATH and named by SCO_AGENT_BUNDLE_CA_FILE (the same way); ``enrol_ca``:
    an https enrolment service's, written to ENROL_CA_PATH and named by SCO_AGENT_ENROL_CA_FILE.
    ``delegation``: the hall root's certificate for the one key in ``signing_keys`` (the control host's launch key):
    the subset carries it, is dated inside it, and ``trusted`` must hold the root that signed it (the nodes trust
    the root, never the launch key)."""
    # each CA the instance checks a hall service against: (its text, what it is, where it goes, the setting naming it)
    cas = [(ca, what, path, env) for ca, what, path, env in (
        (relay_ca, "relay CA", RELAY_CA_PATH, "SCO_AGENT_NATS_CA_FILE"),
        (distributor_ca, "distributor CA", DISTRIBUTOR_CA_PATH, "SCO_AGENT_BUNDLE_CA_FILE"),
        (enrol_ca, "enrolment CA", ENROL_CA_PATH, "SCO_AGENT_ENROL_CA_FILE"),
    ) if ca]  # fmt: skip
    for ca, what, path, env in cas:
        if "-----BEGIN CERTIFICATE-----" not in ca:
            raise ConfigError(f"{what}: not a PEM certificate (-----BEGIN CERTIFICATE-----)")
        node_env = {env: path, **(node_env or {})}  # the operator's node_env wins
    bad = [f"{k!r}: {why}" for k, v in sorted((node_env or {}).items()) if (why := _env_problem(k, v))]
    if bad:
        raise ConfigError(f"node environment: {'; '.join(bad)}")
    payload = subset_payload(bundle, schedulers=schedulers, names=names)
    at = int(time.time() if now is None else now)
    payload["expiresAt"] = at + bundle_lifetime_s(bundle.policy)
    if delegation is not None:
        _check_delegation(delegation, signing_keys, trusted, bundle.hall, at)
        # issued at the launch, and never outliving the delegation (nodes refuse one that would)
        payload["issuedAt"] = at
        payload["expiresAt"] = min(payload["expiresAt"], delegation.expires_at)
    subset = sign(payload, signing_keys, delegation)
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
    files += [{"path": path, "permissions": "0644", "content": ca.strip() + "\n"} for ca, _, path, _ in cas]
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
