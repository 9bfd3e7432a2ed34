"""``BUCKETRL_RELAY_*`` settings of the regional relay."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from bucketrl.tls import server_pair_problem


class RelaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BUCKETRL_RELAY_", extra="ignore")

    upstream_url: str = Field(..., description="The home proxy's base URL (BUCKETRL_RELAY_UPSTREAM_URL).")
    cache_dir: Path = Field(Path("relay-cache"), description="Adapter cache (BUCKETRL_RELAY_CACHE_DIR).")
    cache_max_bytes: int = Field(
        8 << 30,
        ge=0,
        description="Adapter cache cap (BUCKETRL_RELAY_CACHE_MAX_BYTES); least recently served files go first, "
        "never one being served. 0 = no cap.",
    )
    presigned: bool = Field(
        False,
        description="Fetch adapter versions straight from an S3 bucket through the home proxy's presigned URLs "
        "(BUCKETRL_RELAY_PRESIGNED; the proxy needs BUCKETRL_PRESIGN_ADAPTERS_S, else it serves them itself).",
    )
    staging_token: str = Field(
        "",
        description="A `relay` token of the home proxy (BUCKETRL_RELAY_STAGING_TOKEN): pull each adapter upload's "
        "bytes while the trainer still sends them (staged publish), served only once committed. It reads staged "
        "bytes and nothing else. Empty: fetch a version when a caller first asks for it.",
    )
    host: str = Field("127.0.0.1", description="Bind address (BUCKETRL_RELAY_HOST).")
    port: int = Field(8001, ge=1, le=65535, description="Port (BUCKETRL_RELAY_PORT).")
    tls_cert_file: str = Field(
        "", description="PEM certificate (chain): serve HTTPS (BUCKETRL_RELAY_TLS_CERT_FILE). Needs the key."
    )
    tls_key_file: str = Field("", description="PEM private key of tls_cert_file (BUCKETRL_RELAY_TLS_KEY_FILE).")
    connect_timeout_s: float = Field(10.0, gt=0, description="Connecting to the home proxy.")
    max_connections: int = Field(1024, ge=1, description="Upstream connections (each long-poll holds one).")
    max_pending: int = Field(
        1024,
        ge=1,
        description="Requests waiting for the home proxy's answer (BUCKETRL_RELAY_MAX_PENDING; held long-polls "
        "count): beyond it, callers get a retryable 503 at once instead of piling up here.",
    )
    log_level: str = Field("info", description="uvicorn log level (BUCKETRL_RELAY_LOG_LEVEL).")

    @field_validator("upstream_url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"upstream URL must start with http:// or https://, got {v!r}")
        return v.rstrip("/")

    @model_validator(mode="after")
    def _tls_pair(self) -> RelaySettings:
        problem = server_pair_problem(
            ("BUCKETRL_RELAY_TLS_CERT_FILE", self.tls_cert_file), ("BUCKETRL_RELAY_TLS_KEY_FILE", self.tls_key_file)
        )
        if problem:
            raise ValueError(problem)
        return self
