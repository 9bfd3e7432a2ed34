"""``BUCKETRL_RELAY_*`` settings of the regional relay."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class RelaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BUCKETRL_RELAY_", extra="ignore")

    upstream_url: str = Field(..., description="The home proxy's base URL (BUCKETRL_RELAY_UPSTREAM_URL).")
    cache_dir: Path = Field(Path("relay-cache"), description="Adapter cache (BUCKETRL_RELAY_CACHE_DIR).")
    host: str = Field("127.0.0.1", description="Bind address (BUCKETRL_RELAY_HOST).")
    port: int = Field(8001, ge=1, le=65535, description="Port (BUCKETRL_RELAY_PORT).")
    connect_timeout_s: float = Field(10.0, gt=0, description="Connecting to the home proxy.")
    max_connections: int = Field(1024, ge=1, description="Upstream connections (each long-poll holds one).")
    log_level: str = Field("info", description="uvicorn log level (BUCKETRL_RELAY_LOG_LEVEL).")

    @field_validator("upstream_url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"upstream URL must start with http:// or https://, got {v!r}")
        return v.rstrip("/")
