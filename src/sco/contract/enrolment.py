"""The enrolment exchange's wire format, shared by the node (``sco.agent.enrol``) and the control host's service
(``sco.control.enrolment``). Standard library only.

``POST /v1/enrol`` with a JSON object::

    {"hall": ..., "node": ..., "instance_id": <the Nova server's uuid, from the node's metadata>,
     "token": <the one-time token from agent.env>, "nkey_public": <a user public key (U...) made on the node>}

and optionally ``"metrics": "<address>:<port>"`` (IPv6 in brackets), where the node's agent serves its metrics for
Prometheus (the enrolment service lists it for Prometheus's file_sd while the instance is live);

answered ``200`` with ``{"nats_user_jwt": ..., "nats_account": ..., "kube_token": <str or null>,
"kube_expires": <Unix time or null>}``, or a ``4xx``/``503`` with one line of text naming what is wrong. The node
writes its creds file itself (:func:`creds_text`): the user JWT names its public key, the seed never leaves it.
"""

from __future__ import annotations

import re
from typing import Any

PATH = "/v1/enrol"
MAX_BODY = 4096
FIELDS = ("hall", "node", "instance_id", "token", "nkey_public")
_LIMITS = {"hall": 63, "node": 63, "instance_id": 64, "token": 128, "nkey_public": 56}
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_SERVER_ID = re.compile(r"^[0-9a-fA-F-]{8,64}$")
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{16,128}$")
_USER_KEY = re.compile(r"^U[A-Z2-7]{55}$")
# The service's limits per source address (its defaults; `sco enrol serve` flags, role control_loop's variables).
# Many instances can share one address (SNAT on the way to the control host), and they boot together: the acquire
# step's Nova budget (sco.control.nova.Budget) lets a run send 120 creates at once and 10 a second after, so one
# address is let have 128 connections open at once and make 128 requests at once, then 10 a second. A flood beyond
# that is answered 429 before the fleet state sees it.
MAX_PER_ADDRESS = 128
BURST = 128
RATE_PER_S = 10.0
RETRY = 503
"""The answer that asks the node to try again later (the relay or Kubernetes away, its Node not registered yet):
the token is not used."""


class Malformed(ValueError):
    pass


def parse_request(doc: Any) -> dict[str, str]:
    """The request's fields, each checked for shape (not for truth: that is the fleet state's); raises
    :class:`Malformed` with one line naming the first field that is wrong."""
    if not isinstance(doc, dict):
        raise Malformed("expected a JSON object")
    # A field this release does not know is ignored (docs/UPGRADE.md, rule: a field N+1 adds is one N ignores): a
    # node baked with a later release still enrols with this service. The body's size is bounded (MAX_BODY).
    out: dict[str, str] = {}
    for f in FIELDS:
        v = doc.get(f)
        if not isinstance(v, str) or not v:
            raise Malformed(f"{f}: expected a non-empty string")
        if len(v) > _LIMITS[f]:
            raise Malformed(f"{f}: longer than {_LIMITS[f]} characters")
        out[f] = v
    for f, pattern in (
        ("hall", _NAME), ("node", _NAME), ("instance_id", _SERVER_ID), ("token", _TOKEN), ("nkey_public", _USER_KEY)
    ):  # fmt: skip
        if not pattern.match(out[f]):
            raise Malformed(f"{f}: not a valid value")
    if "metrics" in doc:
        out["metrics"] = parse_metrics_address(doc["metrics"])
    return out


def parse_metrics_address(v: Any) -> str:
    """``<IP address>:<port>`` (an IPv6 address in brackets), as Prometheus names a target; raises Malformed."""
    import ipaddress

    if not isinstance(v, str) or len(v) > 64:
        raise Malformed("metrics: expected a string of at most 64 characters")
    host, sep, port = v.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    try:
        ip = ipaddress.ip_address(host[1:-1] if bracketed else host)
    except ValueError:
        raise Malformed("metrics: expected <IP address>:<port>") from None
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535 or (ip.version == 6) != bracketed:
        raise Malformed("metrics: expected <IP address>:<port> (an IPv6 address in brackets)")
    if ip.is_unspecified or ip.is_multicast:
        raise Malformed("metrics: not an address a scraper can reach")
    return f"[{ip}]:{int(port)}" if ip.version == 6 else f"{ip}:{int(port)}"


def creds_text(user_jwt: str, seed: bytes) -> str:
    """A standard ``.creds`` file's text (as ``nsc`` writes it; nats-py's ``user_credentials``). Assembled where
    the seed is: on the node."""
    return (
        f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n"
        "************************* IMPORTANT *************************\n"
        "NKEY Seed printed below can be used to sign and prove identity.\n"
        "NKEYs are sensitive and should be treated as secrets.\n\n"
        f"-----BEGIN USER NKEY SEED-----\n{seed.strip().decode()}\n------END USER NKEY SEED------\n\n"
        "*************************************************************\n"
    )
