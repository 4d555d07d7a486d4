"""An openstacksdk connection with a deadline on every request.

``openstack.connect`` waits for ever by default: a Keystone or a Nova that accepts the connection and never
answers hangs the caller. Every connection the product makes goes through ``connect`` here, which sets
``api_timeout`` (keystoneauth's session timeout: every request of the session, Keystone's token requests
included) unless the caller's cloud settings give one.
"""

from __future__ import annotations

from typing import Any

from sco.errors import ConfigError

API_TIMEOUT_S = 30.0


def connect(*, api_timeout: float | None = None, **kw: Any) -> Any:
    """``openstack.connect(**kw)`` with ``api_timeout`` (default API_TIMEOUT_S unless the cloud's settings have
    one); a cloud that cannot be configured is a ConfigError naming it."""
    import openstack
    import openstack.config

    if api_timeout is None:
        try:
            region = openstack.config.get_cloud_region(load_envvars=True, **kw)
            configured = region.config.get("api_timeout")
        except Exception:  # openstack.connect below says what is wrong with the settings
            configured = None
        api_timeout = float(configured) if configured else API_TIMEOUT_S
    name = kw.get("cloud") or "(from auth / OS_* variables)"
    try:
        return openstack.connect(api_timeout=api_timeout, **kw)
    except Exception as e:  # openstacksdk raises its own config errors; the message names the cloud
        raise ConfigError(f"OpenStack cloud {name}: {e}") from None
