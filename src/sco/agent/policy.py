"""The hall policy's timings as the agent uses them: from the cached bundle, each overridable in agent.toml
(tests use short windows). Read live, so a refreshed bundle's values apply from the next read."""

from __future__ import annotations

from sco.agent.bundle_cache import BundleCache
from sco.agent.config import AgentConfig


class Policy:
    def __init__(self, cfg: AgentConfig, cache: BundleCache) -> None:
        self.cfg, self.cache = cfg, cache

    def value(self, key: str, override: float, default: float) -> float:
        """``override`` when set (> 0; a margin of 0 is a setting too), else the bundle's, else ``default``."""
        if override > 0 or (key == "safetyMarginSeconds" and override >= 0):
            return float(override)
        b = self.cache.bundle
        return float(b.policy.get(key, default)) if b else default

    @property
    def window(self) -> float:
        """Notice to instance gone (T+120 s by default)."""
        return self.value("noticeWindowSeconds", self.cfg.notice_window_seconds, 120)

    @property
    def margin(self) -> float:
        return self.value("safetyMarginSeconds", self.cfg.safety_margin_seconds, 10)

    @property
    def api_timeout(self) -> float:
        """Seconds of scheduler API silence that end the API path (800 ms by default)."""
        return self.value("schedulerApiTimeoutMs", self.cfg.scheduler_api_timeout_ms, 800) / 1000

    @property
    def metadata_poll(self) -> float:
        return self.value("metadataPollSeconds", self.cfg.metadata_poll_seconds, 5)

    @property
    def bundle_refresh(self) -> float:
        return self.value("bundleRefreshSeconds", self.cfg.bundle_refresh_seconds, 60)
